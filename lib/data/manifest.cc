// Dataset manifests (a JSON list of weighted sub-datasets) and opening a loader
// from what ctr_loader_create is given: a file, a manifest or nothing.
//
// A manifest is read strictly: an unknown key, a weight that is not a positive
// number or an empty file list is an error naming the manifest and the key,
// because a typo here would otherwise silently change the training mixture.

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/files.h"
#include "core/status.h"
#include "data/data.h"

namespace ctr::data {

using nlohmann::json;

// ------------------------------------------------------------------------------------------
// Manifests

bool is_manifest(const std::string &path) {
  return path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
}

Manifest read_manifest(const std::string &path) {
  std::stringstream text;
  text << read_regular_file(path, "data manifest", CTR_STATUS_IO_ERROR, size_t{64} << 20);

  const auto bad = [&](const std::string &what) {
    fail(CTR_STATUS_DATA_ERROR, strformat("data manifest '%s': %s", path.c_str(), what.c_str()));
  };
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::exception &e) {
    bad(strformat("not valid JSON: %s", e.what()));
  }
  if (!j.is_object()) bad("the top level is not a JSON object");

  Manifest m;
  m.path = path;
  Format default_format = Format::Auto;
  const auto format_of = [&](const json &v, const std::string &where) {
    if (!v.is_string()) bad(where + " is not a string");
    const auto f = format_from_name(v.get<std::string>());
    if (!f)
      bad(strformat("%s: unknown format '%s' (formats: %s)", where.c_str(),
                    v.get<std::string>().c_str(), format_names().c_str()));
    return *f;
  };
  for (const auto &[key, v] : j.items()) {
    if (key == "datasets") continue;
    if (key == "format") {
      default_format = format_of(v, "\"format\"");
    } else if (key == "mode") {
      if (!v.is_string() ||
          (v.get<std::string>() != "windows" && v.get<std::string>() != "documents"))
        bad(strformat("\"mode\" must be \"windows\" or \"documents\", got %s", v.dump().c_str()));
      m.mode = v.get<std::string>();
    } else if (key == "eot") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > UINT32_MAX)
        bad(strformat("\"eot\" must be a token id (an integer in [0, 2^32)), got %s",
                      v.dump().c_str()));
      m.eot = v.get<int64_t>();
    } else {
      bad(strformat("unknown key \"%s\" (keys: datasets, format, mode, eot)", key.c_str()));
    }
  }

  if (!j.contains("datasets")) bad("no \"datasets\" list");
  const json &ds = j["datasets"];
  if (!ds.is_array() || ds.empty()) bad("\"datasets\" must be a non-empty list");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  for (size_t i = 0; i < ds.size(); ++i) {
    const std::string where = strformat("datasets[%zu]", i);
    const json &d = ds[i];
    if (!d.is_object()) bad(where + " is not an object");
    DatasetSpec spec;
    spec.format = default_format;
    std::vector<std::string> written;
    for (const auto &[key, v] : d.items()) {
      if (key == "files") {
        if (!v.is_array() || v.empty()) bad(where + ".files must be a non-empty list of paths");
        for (const auto &file : v) {
          if (!file.is_string() || file.get<std::string>().empty())
            bad(where + ".files holds something that is not a path: " + file.dump());
          written.push_back(file.get<std::string>());
        }
      } else if (key == "weight") {
        if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0)
          bad(strformat("%s.weight must be a positive number, got %s", where.c_str(),
                        v.dump().c_str()));
        spec.weight = v.get<double>();
      } else if (key == "format") {
        spec.format = format_of(v, where + ".format");
      } else if (key == "name") {
        if (!v.is_string()) bad(where + ".name is not a string");
        spec.name = v.get<std::string>();
      } else {
        bad(strformat("unknown key \"%s\" in %s (keys: files, weight, format, name)", key.c_str(),
                      where.c_str()));
      }
    }
    if (written.empty()) bad(where + " has no \"files\"");
    for (const auto &w : written) {
      const std::filesystem::path p(w);
      spec.files.push_back(p.is_relative() && !dir.empty() ? (dir / p).string() : w);
    }
    if (spec.name.empty()) {
      // The files as the manifest writes them: shorter than resolved paths.
      for (size_t k = 0; k < written.size() && k < 3; ++k)
        spec.name += (k ? ", " : "") + written[k];
      if (written.size() > 3) spec.name += strformat(", ... (%zu files)", written.size());
    }
    m.datasets.push_back(std::move(spec));
  }
  return m;
}

// ------------------------------------------------------------------------------------------
// Opening a loader

std::unique_ptr<Loader> open_loader(const std::string &path, const OpenOptions &options) {
  std::vector<Part> parts;
  std::optional<std::string> manifest_mode;
  std::optional<int64_t> manifest_eot;
  const bool manifest =
      !path.empty() && (!options.format || *options.format == Format::Auto) && is_manifest(path);
  if (path.empty()) {
    Part p;
    p.owned = TokenSource::synthetic(options.corpus_seed, options.corpus_bytes);
    parts.push_back(std::move(p));
  } else if (manifest) {
    Manifest m = read_manifest(path);
    for (auto &d : m.datasets) {
      Part p;
      p.name = d.name;
      p.owned = TokenSource::open(d.files, d.format);
      p.weight = d.weight;
      parts.push_back(std::move(p));
    }
    manifest_mode = m.mode;
    manifest_eot = m.eot;
  } else {
    Part p;
    p.owned = TokenSource::open(path, options.format.value_or(Format::Auto));
    parts.push_back(std::move(p));
  }

  LoaderConfig config;
  config.seq = options.seq;
  config.seed = options.seed;
  if (options.mode)
    config.mode = *options.mode;
  else if (manifest_mode)
    config.mode = *manifest_mode == "documents" ? Mode::Documents : Mode::Windows;
  config.eot = options.eot ? *options.eot : manifest_eot.value_or(-1);
  CTR_REQUIRE(config.mode == Mode::Windows || config.eot >= 0, CTR_STATUS_INVALID_OPTION,
              "data loader over '%s': documents mode needs the end-of-text token id: set "
              "option 'eot'%s",
              path.empty() ? "the built-in corpus" : path.c_str(),
              manifest ? " or the manifest's \"eot\"" : "");
  return std::make_unique<Loader>(std::move(parts), config, 1);
}

}  // namespace ctr::data
