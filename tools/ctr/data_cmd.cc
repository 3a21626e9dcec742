// `ctr data`: the token files a training run reads, made, inspected and converted.
//
//   ctr data tokenize a.txt b.txt -o corpus.bin --eot 256    bytes of text as tokens
//   ctr data tokenize a.txt b.txt -o corpus.bin --sentencepiece m.model
//                                                            a SentencePiece model's ids
//   ctr data inspect corpus.bin                              format, counts, histogram
//   ctr data inspect mix.json --seq 256                      each sub-dataset of a manifest
//   ctr data convert corpus.bin -o corpus.npy --to npy       between formats
//
// These work on the library's token files (ctr_tokens_open, ctr_token_writer_*),
// so a file `inspect` accepts is exactly a file the loader accepts, and a file
// `tokenize` or `convert` writes is read back by the same code. Files are
// streamed in blocks, so their size is bounded by the disk, not by memory.

#include "data_cmd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctr/ctr.h"
#include "sentencepiece.h"
#include "text.h"
#include "tool_error.h"

namespace ctr_tool {


namespace {

// Tokens are moved in blocks of this many: large enough that per-call costs
// vanish, small enough to stay in cache.
constexpr int64_t kBlock = int64_t{1} << 16;

using ctr_tool::fail;

void check(ctr_status s) {
  if (s != CTR_STATUS_OK) throw ctr_tool::Error(s, ctr_last_error());
}

// An open token file (ctr_tokens), and what ctr_tokens_info says of it.
class Tokens {
 public:
  Tokens(const std::string &path, const std::string &format, int64_t dataset = -1) {
    ctr_options *o = nullptr;
    check(ctr_options_create(&o));
    std::unique_ptr<ctr_options, void (*)(ctr_options *)> owner(o, ctr_options_free);
    check(ctr_options_set_string(o, "format", format.c_str()));
    if (dataset >= 0) check(ctr_options_set_int(o, "dataset", dataset));
    check(ctr_tokens_open(path.c_str(), o, &t_));
    const char *json = nullptr;
    check(ctr_tokens_info(t_, &json));
    info_ = nlohmann::json::parse(json);
  }
  ~Tokens() { ctr_tokens_free(t_); }
  Tokens(const Tokens &) = delete;
  Tokens &operator=(const Tokens &) = delete;

  int64_t size() const { return info_.at("tokens").get<int64_t>(); }
  uint32_t max_token() const { return info_.at("max_id").get<uint32_t>(); }
  std::string kind() const { return info_.at("kind").get<std::string>(); }
  const nlohmann::json &files() const { return info_.at("files"); }
  void read(int64_t start, int64_t count, uint32_t *out) const { check(ctr_tokens_read(t_, start, count, out)); }
  // Samples at seq in a mode; a source too short for one fails.
  int64_t samples(int64_t seq, const char *mode, int64_t eot) const {
    int64_t n = 0;
    check(ctr_tokens_samples(t_, seq, mode, eot, &n));
    return n;
  }

 private:
  ctr_tokens *t_ = nullptr;
  nlohmann::json info_;
};

// Writes a token file (ctr_token_writer); removed unless finished.
class Writer {
 public:
  Writer(const std::string &path, const std::string &format, int width, int64_t count) {
    check(ctr_token_writer_create(path.c_str(), format.c_str(), width, count, &w_));
  }
  ~Writer() { ctr_token_writer_free(w_); }
  Writer(const Writer &) = delete;
  Writer &operator=(const Writer &) = delete;
  void write(const uint32_t *tokens, int64_t n) { check(ctr_token_writer_write(w_, tokens, n)); }
  void finish() { check(ctr_token_writer_finish(w_)); }

 private:
  ctr_token_writer *w_ = nullptr;
};

// The largest id a width holds.
uint32_t max_id(int width) { return width == 2 ? 0xffffu : 0xffffffffu; }

// A manifest under format auto, as the library reads it: a name ending in ".json".
bool is_manifest(const std::string &path) {
  return path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
}

using ctr_tool::grouped;

// A byte as it would be written in a C string: printable ASCII as is.
std::string escaped(uint32_t t) {
  if (t == '\n') return "\\n";
  if (t == '\t') return "\\t";
  if (t == '\\') return "\\\\";
  if (t == '"') return "\\\"";
  if (t >= 32 && t < 127) return std::string(1, static_cast<char>(t));
  return ctr_tool::format("\\x%02x", t);
}


// ------------------------------------------------------------------------------------------
// inspect

// Prints what a source holds: its files, token count, largest id, a histogram
// summary and its first tokens; with eot, its documents; with seq, its samples.
void describe(const Tokens &src, int64_t seq, int64_t eot, const char *indent) {
  const nlohmann::json &files = src.files();
  if (files.size() == 1) {
    const auto &f = files[0];
    const int64_t header = f.at("header_bytes").get<int64_t>();
    const int width = f.at("width").get<int>();
    std::printf("%sformat: %s", indent, f.at("kind").get<std::string>().c_str());
    if (header > 0)
      std::printf(" (%" PRId64 "-byte header, %d-byte tokens)", header, width);
    else
      std::printf(" (%d-byte tokens)", width);
    std::printf("\n");
  } else {
    std::printf("%sfiles: %zu, read as one sequence\n", indent, files.size());
    for (const auto &f : files)
      std::printf("%s  %s: %s, %s tokens\n", indent, f.at("path").get<std::string>().c_str(),
                  f.at("kind").get<std::string>().c_str(), grouped(f.at("tokens").get<int64_t>()).c_str());
  }
  const int64_t n = src.size();
  std::printf("%stokens: %s\n", indent, grouped(n).c_str());
  if (n == 0) return;

  // The histogram, dense for the usual vocabularies (up to 32 MiB of counts)
  // and hashed beyond.
  const uint32_t max_id = src.max_token();
  std::vector<int64_t> dense;
  std::unordered_map<uint32_t, int64_t> sparse;
  const bool use_dense = max_id < (1u << 22);
  if (use_dense) dense.assign(static_cast<size_t>(max_id) + 1, 0);
  std::vector<uint32_t> block(static_cast<size_t>(kBlock));
  for (int64_t at = 0; at < n; at += kBlock) {
    const int64_t len = std::min(kBlock, n - at);
    src.read(at, len, block.data());
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t t = block[static_cast<size_t>(i)];
      if (use_dense)
        ++dense[t];
      else
        ++sparse[t];
    }
  }
  std::vector<std::pair<int64_t, uint32_t>> counts;  // (count, id)
  if (use_dense) {
    for (size_t id = 0; id < dense.size(); ++id)
      if (dense[id] > 0) counts.emplace_back(dense[id], static_cast<uint32_t>(id));
  } else {
    for (const auto &[id, c] : sparse) counts.emplace_back(c, id);
  }
  std::printf("%smax id: %u%s\n", indent, max_id,
              max_id > INT32_MAX ? " (above 2^31 - 1: negative in an int32 file; training "
                                   "rejects it)"
                                 : "");
  std::printf("%sdistinct ids: %s\n", indent, grouped(static_cast<int64_t>(counts.size())).c_str());
  const size_t top = std::min<size_t>(10, counts.size());
  std::partial_sort(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(top), counts.end(),
                    [](const auto &a, const auto &b) {
                      return a.first != b.first ? a.first > b.first : a.second < b.second;
                    });
  const bool text = max_id < 256;
  std::printf("%smost frequent:", indent);
  for (size_t i = 0; i < top; ++i) {
    std::printf(" %u", counts[i].second);
    if (text) std::printf(" '%s'", escaped(counts[i].second).c_str());
    std::printf(" (%.2f%%)%s",
                100.0 * static_cast<double>(counts[i].first) / static_cast<double>(n),
                i + 1 < top ? "," : "");
  }
  std::printf("\n");

  const int64_t first = std::min<int64_t>(16, n);
  src.read(0, first, block.data());
  std::printf("%sfirst tokens:", indent);
  for (int64_t i = 0; i < first; ++i) std::printf(" %u", block[static_cast<size_t>(i)]);
  std::printf("%s\n", first < n ? " ..." : "");
  if (text) {
    const int64_t chars = std::min<int64_t>(64, n);
    src.read(0, chars, block.data());
    std::string s;
    for (int64_t i = 0; i < chars; ++i) s += escaped(block[static_cast<size_t>(i)]);
    std::printf("%sas text: \"%s\"%s\n", indent, s.c_str(), chars < n ? " ..." : "");
  }

  if (eot >= 0) {
    const int64_t eots =
        eot <= static_cast<int64_t>(max_id)
            ? (use_dense ? dense[static_cast<size_t>(eot)] : sparse[static_cast<uint32_t>(eot)])
            : 0;
    std::printf("%send-of-text id %" PRId64 ": %s occurrences\n", indent, eot,
                grouped(eots).c_str());
  }
  if (seq > 0) {
    const auto samples = [&](const char *mode) -> std::string {
      try {
        return grouped(src.samples(seq, mode, eot));
      } catch (const ctr_tool::Error &) {
        return "0 (too short)";
      }
    };
    std::printf("%ssamples at seq %" PRId64 ": %s windows", indent, seq, samples("windows").c_str());
    if (eot >= 0) std::printf(", %s in documents mode", samples("documents").c_str());
    std::printf("\n");
  }
}

// ------------------------------------------------------------------------------------------
// Reading text files for tokenize

class InputFile {
 public:
  explicit InputFile(const std::string &path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0)
      fail(CTR_STATUS_IO_ERROR,
           ctr_tool::format("cannot open '%s': %s", path.c_str(), std::strerror(errno)));
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode))
      fail(CTR_STATUS_IO_ERROR, ctr_tool::format("'%s' is not a regular file", path.c_str()));
    size_ = static_cast<int64_t>(st.st_size);
  }
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  InputFile(const InputFile &) = delete;
  InputFile &operator=(const InputFile &) = delete;

  int64_t size() const { return size_; }
  // Reads up to n bytes; 0 at the end.
  int64_t read(uint8_t *buf, int64_t n) {
    for (;;) {
      const ssize_t got = ::read(fd_, buf, static_cast<size_t>(n));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0)
        fail(CTR_STATUS_IO_ERROR,
             ctr_tool::format("cannot read '%s': %s", path_.c_str(), std::strerror(errno)));
      return got;
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// "llm.c uint16" etc. for the summary line, as TokenSource names what it reads.
std::string written_kind(const std::string &f, int width) {
  const char *w = width == 2 ? "uint16" : "uint32";
  if (f == "llmc") return ctr_tool::format("llm.c %s", w);
  if (f == "npy") return ctr_tool::format("npy %s", w);
  return w;
}

int width_for(const std::string &f, uint32_t largest, int forced) {
  if (f == "u16") return 2;
  if (f == "u32") return 4;
  if (forced != 0) return forced;
  return largest <= 0xffffu ? 2 : 4;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// The command

struct DataCommand::Args {
  CLI::App *data = nullptr, *tokenize = nullptr, *inspect = nullptr, *convert = nullptr;

  std::vector<std::string> tok_inputs;
  std::string tok_out, tok_format = "llmc", tok_spm;
  int64_t tok_eot = -1;

  std::string in_file, in_format = "auto";
  int64_t in_seq = 0, in_eot = -1;

  std::string cv_in, cv_out, cv_to, cv_format = "auto";
  int cv_width = 0;

  int tokenize_run() const;
  int tokenize_spm_run() const;
  int inspect_run() const;
  int convert_run() const;
};

DataCommand::DataCommand(CLI::App &app) : args_(std::make_unique<Args>()) {
  Args &a = *args_;
  const std::vector<std::string> readable = {"auto", "llmc", "npy", "u16", "u32", "bytes"};
  const std::vector<std::string> writable = {"llmc", "npy", "u16", "u32"};

  a.data = app.add_subcommand("data", "Make, inspect and convert token files");
  a.data->require_subcommand(1);

  a.tokenize = a.data->add_subcommand(
      "tokenize", "Write the bytes of text files as tokens (ids 0-255), or a SentencePiece model's ids, in order");
  a.tokenize->add_option("files", a.tok_inputs, "Text files")->required();
  a.tokenize->add_option("-o,--output", a.tok_out, "Token file to write")->required();
  a.tokenize->add_option("--format", a.tok_format, "Output format")
      ->capture_default_str()
      ->check(CLI::IsMember(writable));
  a.tokenize->add_option("--eot", a.tok_eot,
                         "End-of-text id written between files (with --sentencepiece: the model's "
                         "end-of-sentence id unless given)")
      ->check(CLI::Range(int64_t{0}, int64_t{UINT32_MAX}));
  a.tokenize->add_option("--sentencepiece", a.tok_spm,
                         "SentencePiece model (spm_train's .model): each file is one document of its ids");

  a.inspect = a.data->add_subcommand(
      "inspect", "Describe a token file, or each sub-dataset of a manifest (.json)");
  a.inspect->add_option("file", a.in_file, "Token file or manifest")->required();
  a.inspect->add_option("--format", a.in_format, "How to read the file")
      ->capture_default_str()
      ->check(CLI::IsMember(readable));
  a.inspect->add_option("--seq", a.in_seq, "Also count the samples at this sequence length")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  a.inspect->add_option("--eot", a.in_eot, "End-of-text id: count documents")
      ->check(CLI::Range(int64_t{0}, int64_t{UINT32_MAX}));

  a.convert = a.data->add_subcommand("convert", "Rewrite a token file in another format");
  a.convert->add_option("input", a.cv_in, "Token file")->required();
  a.convert->add_option("-o,--output", a.cv_out, "Token file to write")->required();
  a.convert->add_option("--to", a.cv_to, "Output format")
      ->required()
      ->check(CLI::IsMember(writable));
  a.convert->add_option("--format", a.cv_format, "How to read the input")
      ->capture_default_str()
      ->check(CLI::IsMember(readable));
  a.convert
      ->add_option("--width", a.cv_width,
                   "Bytes per token for llmc and npy (default: 2 if every id fits, else 4)")
      ->check(CLI::IsMember({2, 4}));
}

DataCommand::~DataCommand() = default;

bool DataCommand::parsed() const { return args_->data->parsed(); }

int DataCommand::run() const {
  if (args_->tokenize->parsed())
    return args_->tok_spm.empty() ? args_->tokenize_run() : args_->tokenize_spm_run();
  if (args_->inspect->parsed()) return args_->inspect_run();
  if (args_->convert->parsed()) return args_->convert_run();
  return 2;
}

int DataCommand::Args::tokenize_run() const {
  const std::string &format = tok_format;
  const bool with_eot = tok_eot >= 0;
  const auto eot = static_cast<uint32_t>(with_eot ? tok_eot : 0);
  const int width = width_for(format, with_eot ? std::max<uint32_t>(255, eot) : 255, 0);
  if (with_eot && eot > max_id(width))
    fail(CTR_STATUS_INVALID_ARGUMENT,
         ctr_tool::format("--eot %u does not fit in %s tokens (at most %u)", eot, tok_format.c_str(), max_id(width)));
  if (with_eot && eot < 256)
    std::fprintf(stderr,
                 "ctr: warning: --eot %u is also a byte value: documents mode will split at "
                 "every %s byte too\n",
                 eot, escaped(eot).c_str());

  std::vector<std::unique_ptr<InputFile>> inputs;
  int64_t count = 0;
  for (const auto &p : tok_inputs) {
    inputs.push_back(std::make_unique<InputFile>(p));
    count += inputs.back()->size();
  }
  if (with_eot) count += static_cast<int64_t>(inputs.size()) - 1;

  Writer out(tok_out, format, width, count);
  std::vector<uint8_t> bytes(static_cast<size_t>(kBlock));
  std::vector<uint32_t> tokens(static_cast<size_t>(kBlock));
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (with_eot && i > 0) out.write(&eot, 1);
    int64_t total = 0;
    for (int64_t got; (got = inputs[i]->read(bytes.data(), kBlock)) > 0;) {
      for (int64_t k = 0; k < got; ++k)
        tokens[static_cast<size_t>(k)] = bytes[static_cast<size_t>(k)];
      total += got;
      if (total > inputs[i]->size())
        fail(CTR_STATUS_IO_ERROR,
             ctr_tool::format("'%s' grew while it was being read", tok_inputs[i].c_str()));
      out.write(tokens.data(), got);
    }
    if (total != inputs[i]->size())
      fail(CTR_STATUS_IO_ERROR,
           ctr_tool::format("'%s' shrank while it was being read", tok_inputs[i].c_str()));
  }
  out.finish();
  std::printf("wrote %s: %s, %s tokens from %zu file%s", tok_out.c_str(),
              written_kind(format, width).c_str(), grouped(count).c_str(), inputs.size(),
              inputs.size() == 1 ? "" : "s");
  if (with_eot && inputs.size() > 1) std::printf(" (end-of-text %u between files)", eot);
  std::printf("\n");
  return 0;
}

// Each file is one document, encoded whole: SentencePiece normalizes across
// the text (whitespace, Unicode forms), so blocks cut at arbitrary bytes would
// encode differently. The ids are held until the count the header needs is
// known, so the corpus is bounded by memory here, unlike byte tokenization.
int DataCommand::Args::tokenize_spm_run() const {
  const SentencePiece model(tok_spm);
  const int64_t eot = tok_eot >= 0 ? tok_eot : model.eos_id();
  if (eot < 0)
    fail(CTR_STATUS_INVALID_ARGUMENT,
         ctr_tool::format("--sentencepiece: the model '%s' has no end-of-sentence piece; give the end-of-text id "
                   "with --eot",
                   tok_spm.c_str()));
  const std::string &format = tok_format;
  const auto largest = static_cast<uint32_t>(std::max<int64_t>(model.vocab_size() - 1, eot));
  const int width = width_for(format, largest, 0);
  if (largest > max_id(width))
    fail(CTR_STATUS_INVALID_ARGUMENT,
         ctr_tool::format("--sentencepiece: ids up to %u do not fit in %s tokens (at most %u)", largest,
                   tok_format.c_str(), max_id(width)));

  std::vector<std::vector<uint32_t>> docs;
  int64_t count = 0;
  for (const auto &p : tok_inputs) {
    InputFile in(p);
    std::string text(static_cast<size_t>(in.size()), '\0');
    int64_t total = 0;
    for (int64_t got; total < in.size() &&
                      (got = in.read(reinterpret_cast<uint8_t *>(text.data()) + total, in.size() - total)) > 0;)
      total += got;
    if (total != in.size())
      fail(CTR_STATUS_IO_ERROR, ctr_tool::format("'%s' shrank while it was being read", p.c_str()));
    docs.push_back(model.encode(text));
    count += static_cast<int64_t>(docs.back().size());
  }
  count += static_cast<int64_t>(docs.size()) - 1;

  Writer out(tok_out, format, width, count);
  const auto eot_id = static_cast<uint32_t>(eot);
  for (size_t i = 0; i < docs.size(); ++i) {
    if (i > 0) out.write(&eot_id, 1);
    out.write(docs[i].data(), static_cast<int64_t>(docs[i].size()));
  }
  out.finish();
  std::printf("wrote %s: %s, %s tokens from %zu file%s (SentencePiece, %d pieces; end-of-text %u between "
              "files)\n",
              tok_out.c_str(), written_kind(format, width).c_str(), grouped(count).c_str(), docs.size(),
              docs.size() == 1 ? "" : "s", model.vocab_size(), eot_id);
  return 0;
}

int DataCommand::Args::inspect_run() const {
  if (in_format == "auto" && is_manifest(in_file)) {
    const char *text = nullptr;
    check(ctr_manifest_info(in_file.c_str(), &text));
    const nlohmann::json m = nlohmann::json::parse(text);
    const nlohmann::json &datasets = m.at("datasets");
    double total = 0;
    for (const auto &d : datasets) total += d.at("weight").get<double>();
    const bool has_eot = !m.at("eot").is_null();
    const int64_t eot = in_eot >= 0 ? in_eot : has_eot ? m.at("eot").get<int64_t>() : -1;
    const std::string mode = m.at("mode").is_null() ? "windows" : m.at("mode").get<std::string>();
    std::printf("manifest %s: %zu sub-dataset%s, mode %s", in_file.c_str(), datasets.size(),
                datasets.size() == 1 ? "" : "s", mode.c_str());
    if (has_eot) std::printf(", end-of-text id %" PRId64, m.at("eot").get<int64_t>());
    std::printf("\n");
    for (size_t i = 0; i < datasets.size(); ++i) {
      const auto &d = datasets[i];
      const double weight = d.at("weight").get<double>();
      std::printf("\ndataset %zu: %s\n", i, d.at("name").get<std::string>().c_str());
      std::printf("  weight: %g (%.1f%% of draws)\n", weight, 100.0 * weight / total);
      const Tokens src(in_file, "auto", static_cast<int64_t>(i));
      describe(src, in_seq, eot, "  ");
    }
    return 0;
  }
  const Tokens src(in_file, in_format);
  std::printf("%s\n", in_file.c_str());
  describe(src, in_seq, in_eot, "  ");
  return 0;
}

int DataCommand::Args::convert_run() const {
  const std::string &to = cv_to;
  if (cv_format == "auto" && is_manifest(cv_in))
    fail(CTR_STATUS_INVALID_ARGUMENT,
         ctr_tool::format("'%s' is a manifest; convert its token files one by one", cv_in.c_str()));
  if ((to == "u16" || to == "u32") && cv_width != 0)
    fail(CTR_STATUS_INVALID_ARGUMENT,
         ctr_tool::format("--width applies to llmc and npy; %s has its own width", cv_to.c_str()));
  const Tokens src(cv_in, cv_format);
  const int64_t n = src.size();
  // Only the automatic width needs the largest id up front; otherwise the ids
  // are checked as they stream past.
  const bool auto_width = (to == "llmc" || to == "npy") && cv_width == 0;
  const int width = width_for(to, auto_width ? src.max_token() : 0, cv_width);
  const uint32_t limit = std::min<uint32_t>(max_id(width), INT32_MAX);

  Writer out(cv_out, to, width, n);
  std::vector<uint32_t> block(static_cast<size_t>(kBlock));
  for (int64_t at = 0; at < n; at += kBlock) {
    const int64_t len = std::min(kBlock, n - at);
    src.read(at, len, block.data());
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t t = block[static_cast<size_t>(i)];
      if (t <= limit) continue;
      if (t > INT32_MAX)
        fail(CTR_STATUS_DATA_ERROR,
             ctr_tool::format("cannot convert '%s': the id at position %" PRId64 " (%u, or %d as int32) "
                       "is not a token id",
                       cv_in.c_str(), at + i, t, static_cast<int32_t>(t)));
      fail(CTR_STATUS_DATA_ERROR,
           ctr_tool::format("cannot convert '%s' to %s: token id %u at position %" PRId64
                     " does not fit in %d bits (at most %u)",
                     cv_in.c_str(), written_kind(to, width).c_str(), t, at + i, width * 8, limit));
    }
    out.write(block.data(), len);
  }
  out.finish();
  std::printf("wrote %s: %s, %s tokens (from %s, %s)\n", cv_out.c_str(),
              written_kind(to, width).c_str(), grouped(n).c_str(), cv_in.c_str(), src.kind().c_str());
  return 0;
}

}  // namespace ctr_tool
