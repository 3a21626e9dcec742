// Parameters in and out as safetensors files, the weight format most tools read.
//
// Layout (as Hugging Face's readers expect): an unsigned little-endian 64-bit
// header length N, N bytes of JSON mapping each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end)} relative to the end of the header, then the raw
// little-endian data. Names are the graph's parameter names, so weights trained
// here load into the PyTorch module the graph was exported from.
//
// Both directions are collective on a sharded mesh: export gathers each param
// (rank 0 writes), import reads the file on every rank and keeps its own rows.

#include <cerrno>
#include <cmath>
#include <set>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "core/files.h"
#include "core/status.h"
#include "graph/ir.h"
#include "runtime/mesh.h"
#include "runtime/step.h"

using nlohmann::json;

namespace ctr {
namespace {

[[noreturn]] void st_fail(const std::string &path, const std::string &what) {
  fail(CTR_STATUS_DATA_ERROR, path + ": " + what);
}

int64_t numel(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

void export_safetensors(Step &step, const std::string &path) {
  // Gather every parameter first (collective), then rank 0 writes.
  std::vector<std::pair<std::string, std::vector<float>>> params;
  std::vector<std::vector<int64_t>> shapes;
  for (const Step::ParamInfo &p : step.params()) {
    std::vector<float> v(static_cast<size_t>(numel(p.full_shape)));
    step.get_param(p.name, v.data(), v.size());
    params.emplace_back(p.name, std::move(v));
    shapes.push_back(p.full_shape);
  }
  const Mesh &mesh = step.mesh();
  std::string err;
  if (mesh.rank == 0) {
    try {
      json header = json::object();
      uint64_t offset = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        uint64_t bytes = params[i].second.size() * 4;
        header[params[i].first] = {{"dtype", "F32"}, {"shape", shapes[i]}, {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
      }
      header["__metadata__"] = {{"format", "pt"}, {"producer", "libctr"}, {"step", std::to_string(step.count())}};
      std::string h = header.dump();
      while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // data starts 8-byte aligned
      std::string tmp = path + ".tmp";
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      if (!f) fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot write: %s", tmp.c_str(), std::strerror(errno)));
      uint64_t n = h.size();
      uint8_t le[8];
      for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(n >> (8 * i));
      f.write(reinterpret_cast<const char *>(le), 8);
      f.write(h.data(), static_cast<std::streamsize>(h.size()));
      for (const auto &p : params)
        f.write(reinterpret_cast<const char *>(p.second.data()), static_cast<std::streamsize>(p.second.size() * 4));
      f.close();
      if (!f) fail(CTR_STATUS_IO_ERROR, strformat("%s: write failed", tmp.c_str()));
      if (std::rename(tmp.c_str(), path.c_str()) != 0)
        fail(CTR_STATUS_IO_ERROR, strformat("%s: rename failed: %s", path.c_str(), std::strerror(errno)));
    } catch (const Error &e) {
      err = e.message();
    }
  }
  if (std::string agreed = mesh.first_error(err); !agreed.empty()) fail(CTR_STATUS_IO_ERROR, agreed);
}

void import_safetensors(Step &step, const std::string &path, bool allow_extra) {
  const std::vector<Step::ParamInfo> params = step.params();
  std::vector<std::pair<std::string, std::vector<float>>> values;
  std::string err;
  ctr_status code = CTR_STATUS_OK;
  try {
    ::close(open_regular_file(path, "safetensors file", CTR_STATUS_IO_ERROR));  // not a FIFO or device
    std::ifstream f(path, std::ios::binary);
    if (!f) fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot open: %s", path.c_str(), std::strerror(errno)));
    f.seekg(0, std::ios::end);
    const uint64_t size = static_cast<uint64_t>(f.tellg());
    f.seekg(0);
    uint8_t le[8];
    if (size < 8 || !f.read(reinterpret_cast<char *>(le), 8)) st_fail(path, "truncated: no header length");
    uint64_t hlen = 0;
    for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(le[i]) << (8 * i);
    if (hlen > size - 8 || hlen > (uint64_t{1} << 30))
      st_fail(path, strformat("header length %llu does not fit the file (%llu bytes)",
                              static_cast<unsigned long long>(hlen), static_cast<unsigned long long>(size)));
    std::string h(hlen, '\0');
    f.read(h.data(), static_cast<std::streamsize>(hlen));
    json header;
    try {
      header = json::parse(h);
    } catch (const std::exception &e) {
      st_fail(path, std::string("header is not valid JSON: ") + e.what());
    }
    if (!header.is_object()) st_fail(path, "header is not a JSON object");
    const uint64_t data_size = size - 8 - hlen;
    std::set<std::string> wanted;
    for (const Step::ParamInfo &p : params) wanted.insert(p.name);
    if (!allow_extra)
      for (auto it = header.begin(); it != header.end(); ++it)
        if (it.key() != "__metadata__" && !wanted.count(it.key()))
          st_fail(path, strformat("tensor '%s' is not a parameter of the graph (set allow_extra to skip it)",
                                  it.key().c_str()));
    for (const Step::ParamInfo &t : params) {
      if (!header.contains(t.name)) st_fail(path, strformat("parameter '%s' is missing", t.name.c_str()));
      const json &e = header[t.name];
      std::string dtype;
      std::vector<int64_t> shape;
      uint64_t b = 0, end = 0;
      try {
        dtype = e.at("dtype").get<std::string>();
        shape = e.at("shape").get<std::vector<int64_t>>();
        b = e.at("data_offsets").at(0).get<uint64_t>();
        end = e.at("data_offsets").at(1).get<uint64_t>();
      } catch (const std::exception &ex) {
        st_fail(path, strformat("entry '%s' is malformed: %s", t.name.c_str(), ex.what()));
      }
      const std::vector<int64_t> &want = t.full_shape;
      if (shape != want)
        st_fail(path, strformat("parameter '%s' has shape %s in the file, %s in the graph", t.name.c_str(),
                                shape_string(shape).c_str(), shape_string(want).c_str()));
      size_t esize = dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
      if (!esize) st_fail(path, strformat("parameter '%s' has dtype %s (F32, F16 and BF16 are read)", t.name.c_str(), dtype.c_str()));
      uint64_t n = static_cast<uint64_t>(numel(t.full_shape));
      if (end < b || end > data_size || end - b != n * esize)
        st_fail(path, strformat("parameter '%s' has data offsets [%llu, %llu) that do not hold %llu %s values",
                                t.name.c_str(), static_cast<unsigned long long>(b), static_cast<unsigned long long>(end),
                                static_cast<unsigned long long>(n), dtype.c_str()));
      std::vector<uint8_t> raw(end - b);
      f.seekg(static_cast<std::streamoff>(8 + hlen + b));
      if (!f.read(reinterpret_cast<char *>(raw.data()), static_cast<std::streamsize>(raw.size())))
        st_fail(path, strformat("truncated data of parameter '%s'", t.name.c_str()));
      std::vector<float> v(n);
      if (esize == 4) {
        std::memcpy(v.data(), raw.data(), raw.size());
      } else {
        for (uint64_t i = 0; i < n; ++i) {
          uint16_t x = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));
          if (dtype == "BF16") {
            uint32_t bits = static_cast<uint32_t>(x) << 16;
            std::memcpy(&v[i], &bits, 4);
          } else {
            v[i] = half_to_float(x);
          }
        }
      }
      for (uint64_t i = 0; i < n; ++i)
        if (!std::isfinite(v[i])) st_fail(path, strformat("parameter '%s' element %llu is not finite", t.name.c_str(), static_cast<unsigned long long>(i)));
      values.emplace_back(t.name, std::move(v));
    }
  } catch (const Error &e) {
    err = e.message();
    code = e.code();
  }
  if (std::string agreed = step.mesh().first_error(err); !agreed.empty())
    fail(code == CTR_STATUS_OK ? CTR_STATUS_DATA_ERROR : code, agreed);
  for (auto &[name, v] : values) step.set_param(name, v.data(), v.size());
}

}  // namespace ctr
