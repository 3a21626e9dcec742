// Token sources (mapped files in several formats, shard lists, the built-in
// corpus) and the writer of token files.
//
// Files are mapped, not read: the loader touches seq + 1 tokens per sample at
// random offsets, so letting the page cache fetch exactly those pages keeps
// start-up constant and memory flat however large the corpus is. Every format is
// checked when it is opened (header, dtype, size against the token count), so a
// bad file fails at once with its name and the fault rather than as garbage
// tokens mid-run.
//
// The built-in corpus exists so that `ctr run` and the tests can train without
// any download. It is English-like text from a small probabilistic grammar: a few
// hundred words, sentence templates with agreement (a/an, plurals), dialogue
// and paragraphs. That makes it structured at every scale a byte-level model
// learns in turn — letter frequencies, spelling, word order, punctuation — so the
// loss of a small model visibly falls from ln(256) ~ 5.5 to below 2 within a few
// hundred steps (Draw::pick has the measurements), while staying far from
// memorisable (megabytes of text drawn from millions of possible sentences).
// Every random choice comes from the counter-based RNG of core/rng.h, so the
// text is a pure function of the seed.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/files.h"
#include "core/status.h"
#include "data/data.h"

namespace ctr::data {

// ------------------------------------------------------------------------------------------
// Format names

namespace {

struct FormatName {
  Format format;
  const char *name;
};
constexpr FormatName kFormatNames[] = {{Format::Auto, "auto"}, {Format::Llmc, "llmc"},
                                       {Format::Npy, "npy"},   {Format::U16, "u16"},
                                       {Format::U32, "u32"},   {Format::Bytes, "bytes"}};

}  // namespace

const char *format_name(Format format) {
  for (const auto &f : kFormatNames)
    if (f.format == format) return f.name;
  return "?";
}

std::optional<Format> format_from_name(const std::string &name) {
  for (const auto &f : kFormatNames)
    if (name == f.name) return f.format;
  return std::nullopt;
}

std::string format_names() {
  std::string list;
  for (const auto &f : kFormatNames) list += (list.empty() ? "" : ", ") + std::string(f.name);
  return list;
}

// ------------------------------------------------------------------------------------------
// Files

struct TokenSource::Memory {
  int fd = -1;                 // a token file, read with pread
  int64_t file_bytes = 0;      // its size when opened
  std::vector<uint8_t> owned;  // the synthetic corpus
  Memory() = default;
  Memory(const Memory &) = delete;
  Memory &operator=(const Memory &) = delete;
  ~Memory() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

// Headers are little-endian on disk whatever the host is.
uint32_t load_le32(const uint8_t *p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
uint16_t load_le16(const uint8_t *p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }


bool ends_with(const std::string &s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicBytes = 6;

bool has_llmc_magic(const uint8_t *bytes, int64_t n) {
  if (n < 4) return false;
  const auto magic = static_cast<int32_t>(load_le32(bytes));
  return magic == kLlmcMagicU16 || magic == kLlmcMagicU32;
}

bool has_npy_magic(const uint8_t *bytes, int64_t n) {
  return n >= static_cast<int64_t>(kNpyMagicBytes) &&
         std::memcmp(bytes, kNpyMagic, kNpyMagicBytes) == 0;
}

// Header bytes read to detect and check a file's format: enough for any .npy
// header a token array has (a few hundred bytes in practice).
constexpr int64_t kHeadBytes = 1 << 20;

// Little-endian tokens of width bytes into ids.
void decode(const uint8_t *p, int64_t n, int width, uint32_t *out) {
  if (width == 1) {
    for (int64_t k = 0; k < n; ++k) out[k] = p[k];
  } else if (width == 2) {
    for (int64_t k = 0; k < n; ++k) out[k] = load_le16(p + 2 * k);
  } else {
    for (int64_t k = 0; k < n; ++k) out[k] = load_le32(p + 4 * k);
  }
}

// n bytes at offset `at` of an open token file. A file that has become shorter
// than it was when opened (truncated or rewritten while a job reads it) is a
// data error naming it: the order of the data would silently change.
void read_file_at(int fd, int64_t file_bytes, const std::string &path, int64_t at, size_t n,
                  uint8_t *out) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, out + got, n - got, static_cast<off_t>(at + static_cast<int64_t>(got)));
    if (r < 0 && errno == EINTR) continue;
    CTR_REQUIRE(r >= 0, CTR_STATUS_IO_ERROR, "reading data file '%s': %s", path.c_str(),
                std::strerror(errno));
    if (r == 0) {
      struct stat st {};
      const long long now = ::fstat(fd, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      fail(CTR_STATUS_DATA_ERROR,
           strformat("data file '%s' changed while in use: it had %lld bytes when opened and "
                     "now has %lld, so bytes %lld..%lld cannot be read (do not truncate or "
                     "rewrite a token file while a job reads it)",
                     path.c_str(), static_cast<long long>(file_bytes), now,
                     static_cast<long long>(at), static_cast<long long>(at + static_cast<int64_t>(n))));
    }
    got += static_cast<size_t>(r);
  }
}

// Where the tokens of a file are and how wide they are.
struct Layout {
  int64_t header_bytes = 0;
  int64_t count = 0;
  int width = 1;
  std::string kind;
};

Layout llmc_layout(const std::string &path, const uint8_t *bytes, int64_t file_bytes) {
  CTR_REQUIRE(has_llmc_magic(bytes, file_bytes), CTR_STATUS_DATA_ERROR,
              "data file '%s': not an llm.c token file: it does not start with magic %d or %d",
              path.c_str(), kLlmcMagicU16, kLlmcMagicU32);
  const auto magic = static_cast<int32_t>(load_le32(bytes));
  const bool u16 = magic == kLlmcMagicU16;
  const int32_t want_version = u16 ? kLlmcVersionU16 : kLlmcVersionU32;
  const int width = u16 ? 2 : 4;
  CTR_REQUIRE(file_bytes >= kLlmcHeaderBytes, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated llm.c header: the file has %lld bytes, the header "
              "alone needs %lld",
              path.c_str(), static_cast<long long>(file_bytes),
              static_cast<long long>(kLlmcHeaderBytes));
  const auto version = static_cast<int32_t>(load_le32(bytes + 4));
  CTR_REQUIRE(version == want_version, CTR_STATUS_DATA_ERROR,
              "data file '%s': bad llm.c header version %d (magic %d needs version %d)",
              path.c_str(), version, magic, want_version);
  const int64_t count = static_cast<int32_t>(load_le32(bytes + 8));
  CTR_REQUIRE(count >= 0, CTR_STATUS_DATA_ERROR,
              "data file '%s': bad llm.c header: negative token count %lld", path.c_str(),
              static_cast<long long>(count));
  const int64_t payload = file_bytes - kLlmcHeaderBytes;
  CTR_REQUIRE(payload >= count * width, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated: the header says %lld tokens (%lld bytes) but only "
              "%lld bytes follow it",
              path.c_str(), static_cast<long long>(count), static_cast<long long>(count * width),
              static_cast<long long>(payload));
  CTR_REQUIRE(payload == count * width, CTR_STATUS_DATA_ERROR,
              "data file '%s': token count mismatch: the header says %lld tokens but %lld "
              "bytes follow it (%lld tokens of %d bytes)",
              path.c_str(), static_cast<long long>(count), static_cast<long long>(payload),
              static_cast<long long>(payload / width), width);
  return {kLlmcHeaderBytes, count, width, u16 ? "llm.c uint16" : "llm.c uint32"};
}

// The header of a .npy file is a Python dict literal, e.g.
//   {'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }
// This reads exactly the literals NumPy writes there: strings, True/False and
// tuples of integers, nothing that would need a Python evaluator.
class NpyHeader {
 public:
  struct Value {
    enum Kind { String, Bool, Tuple } kind = String;
    std::string s;
    bool b = false;
    std::vector<int64_t> t;
  };

  NpyHeader(const std::string &path, std::string_view text) : path_(path), s_(text) {}

  std::map<std::string, Value> parse() {
    std::map<std::string, Value> out;
    space();
    expect('{');
    for (;;) {
      space();
      if (eat('}')) break;
      const std::string key = string_literal();
      space();
      expect(':');
      space();
      Value v = value();
      if (!out.emplace(key, std::move(v)).second) bad("key '" + key + "' appears twice");
      space();
      if (eat(',')) continue;
      space();
      expect('}');
      break;
    }
    space();
    if (i_ != s_.size()) bad("text after the closing '}'");
    return out;
  }

  [[noreturn]] void bad(const std::string &what) const {
    fail(CTR_STATUS_DATA_ERROR,
         strformat("data file '%s': bad .npy header: %s", path_.c_str(), what.c_str()));
  }

 private:
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  bool eat(char c) {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c))
      bad(i_ < s_.size() ? strformat("expected '%c' at offset %zu, found '%c'", c, i_, s_[i_])
                         : strformat("expected '%c' at offset %zu, found the end", c, i_));
  }
  std::string string_literal() {
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"'))
      bad(strformat("expected a quoted string at offset %zu", i_));
    const char q = s_[i_++];
    const size_t end = s_.find(q, i_);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string out(s_.substr(i_, end - i_));
    i_ = end + 1;
    return out;
  }
  int64_t integer() {
    const size_t start = i_;
    int64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (v > (INT64_MAX - 9) / 10) bad("a dimension is too large");
      v = v * 10 + (s_[i_++] - '0');
    }
    if (i_ == start) bad(strformat("expected a non-negative integer at offset %zu", start));
    eat('L');  // Python 2 long suffix, written by old NumPy versions
    return v;
  }
  Value value() {
    Value v;
    if (i_ < s_.size() && (s_[i_] == '\'' || s_[i_] == '"')) {
      v.kind = Value::String;
      v.s = string_literal();
    } else if (s_.substr(i_, 4) == "True") {
      v.kind = Value::Bool;
      v.b = true;
      i_ += 4;
    } else if (s_.substr(i_, 5) == "False") {
      v.kind = Value::Bool;
      i_ += 5;
    } else if (eat('(')) {
      v.kind = Value::Tuple;
      for (;;) {
        space();
        if (eat(')')) break;
        v.t.push_back(integer());
        space();
        if (eat(',')) continue;
        expect(')');
        break;
      }
    } else {
      bad(
          strformat("unsupported value at offset %zu (only strings, True, False and tuples "
                    "of integers are read)",
                    i_));
    }
    return v;
  }

  const std::string &path_;
  std::string_view s_;
  size_t i_ = 0;
};

// NPY format versions 1.0 (2-byte header length), 2.0 and 3.0 (4-byte length;
// 3.0 allows UTF-8 in the header, which only field names of structured dtypes
// use). Accepted: 1-D arrays of little-endian uint16, uint32 or int32 — the
// dtypes token ids are stored in. Anything else is refused by name rather than
// reinterpreted.
Layout npy_layout(const std::string &path, const uint8_t *bytes, int64_t file_bytes) {
  CTR_REQUIRE(has_npy_magic(bytes, file_bytes), CTR_STATUS_DATA_ERROR,
              "data file '%s': not a .npy file: it does not start with \"\\x93NUMPY\"",
              path.c_str());
  CTR_REQUIRE(file_bytes >= 10, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated .npy header: the file has only %lld bytes", path.c_str(),
              static_cast<long long>(file_bytes));
  const int major = bytes[6], minor = bytes[7];
  CTR_REQUIRE((major >= 1 && major <= 3) && minor == 0, CTR_STATUS_DATA_ERROR,
              "data file '%s': unsupported .npy format version %d.%d (supported: 1.0, 2.0, 3.0)",
              path.c_str(), major, minor);
  const int64_t prefix = major == 1 ? 10 : 12;
  CTR_REQUIRE(file_bytes >= prefix, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated .npy header: the file has only %lld bytes", path.c_str(),
              static_cast<long long>(file_bytes));
  const int64_t header_len = major == 1 ? load_le16(bytes + 8) : load_le32(bytes + 8);
  CTR_REQUIRE(prefix + header_len <= kHeadBytes, CTR_STATUS_DATA_ERROR,
              "data file '%s': a .npy header of %lld bytes is larger than a token array needs "
              "(at most %lld)",
              path.c_str(), static_cast<long long>(header_len),
              static_cast<long long>(kHeadBytes - prefix));
  CTR_REQUIRE(prefix + header_len <= file_bytes, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated .npy header: it declares %lld header bytes, the file "
              "has %lld after the prefix",
              path.c_str(), static_cast<long long>(header_len),
              static_cast<long long>(file_bytes - prefix));
  const std::string_view text(reinterpret_cast<const char *>(bytes + prefix),
                              static_cast<size_t>(header_len));
  NpyHeader header(path, text);
  if (text.empty() || text.back() != '\n') header.bad("it does not end with a newline");
  auto fields = header.parse();

  for (const auto &[key, v] : fields)
    if (key != "descr" && key != "fortran_order" && key != "shape")
      header.bad("unexpected key '" + key + "' (a .npy header has descr, fortran_order, shape)");
  for (const char *key : {"descr", "fortran_order", "shape"})
    if (!fields.count(key)) header.bad(strformat("missing key '%s'", key));
  const auto &descr = fields["descr"];
  const auto &order = fields["fortran_order"];
  const auto &shape = fields["shape"];
  if (descr.kind != NpyHeader::Value::String)
    header.bad("'descr' is not a string (structured dtypes are not token arrays)");
  if (order.kind != NpyHeader::Value::Bool) header.bad("'fortran_order' is not True or False");
  if (shape.kind != NpyHeader::Value::Tuple) header.bad("'shape' is not a tuple");

  Layout out;
  if (descr.s == "<u2") {
    out.width = 2;
    out.kind = "npy uint16";
  } else if (descr.s == "<u4") {
    out.width = 4;
    out.kind = "npy uint32";
  } else if (descr.s == "<i4") {
    out.width = 4;
    out.kind = "npy int32";
  } else {
    const bool big = !descr.s.empty() && descr.s[0] == '>';
    fail(CTR_STATUS_DATA_ERROR,
         strformat("data file '%s': unsupported .npy dtype '%s'%s: token arrays must be "
                   "little-endian uint16, uint32 or int32 ('<u2', '<u4', '<i4')",
                   path.c_str(), descr.s.c_str(), big ? " (big-endian)" : ""));
  }
  // A 1-D array has the same bytes in C and Fortran order, so fortran_order is
  // irrelevant once the shape is known to be 1-D.
  if (shape.t.size() != 1) {
    std::string dims;
    for (int64_t d : shape.t) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    fail(CTR_STATUS_DATA_ERROR,
         strformat("data file '%s': the .npy array has shape (%s), %zu-D: token arrays must be "
                   "1-D",
                   path.c_str(), dims.c_str(), shape.t.size()));
  }
  out.header_bytes = prefix + header_len;
  out.count = shape.t[0];
  const int64_t payload = file_bytes - out.header_bytes;
  CTR_REQUIRE(out.count <= payload / out.width, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated: the .npy header says %lld tokens (%lld bytes) but "
              "only %lld bytes follow it",
              path.c_str(), static_cast<long long>(out.count),
              static_cast<long long>(out.count * out.width), static_cast<long long>(payload));
  CTR_REQUIRE(payload == out.count * out.width, CTR_STATUS_DATA_ERROR,
              "data file '%s': token count mismatch: the .npy header says %lld tokens but %lld "
              "bytes follow it",
              path.c_str(), static_cast<long long>(out.count), static_cast<long long>(payload));
  return out;
}

Layout raw_layout(const std::string &path, int64_t file_bytes, int width) {
  CTR_REQUIRE(file_bytes % width == 0, CTR_STATUS_DATA_ERROR,
              "data file '%s': %lld bytes is not a whole number of %d-byte tokens (raw uint%d)",
              path.c_str(), static_cast<long long>(file_bytes), width, width * 8);
  return {0, file_bytes / width, width, width == 2 ? "uint16" : width == 4 ? "uint32" : "bytes"};
}

}  // namespace

TokenSource::Shard TokenSource::open_shard(const std::string &path, Format format) {
  auto memory = std::make_shared<Memory>();
  memory->fd = open_regular_file(path, "data file", CTR_STATUS_IO_ERROR);
  struct stat st;
  CTR_REQUIRE(::fstat(memory->fd, &st) == 0, CTR_STATUS_IO_ERROR,
              "cannot stat data file '%s': %s", path.c_str(), std::strerror(errno));
  CTR_REQUIRE(S_ISREG(st.st_mode), CTR_STATUS_IO_ERROR, "data file '%s' is not a regular file",
              path.c_str());
  const auto file_bytes = static_cast<int64_t>(st.st_size);
  memory->file_bytes = file_bytes;

  // The headers are read from the file's first bytes; an empty file is simply
  // a source of no tokens (when its format allows that), and the loader
  // reports it as too short by name.
  constexpr int64_t kProbeBytes = 4096;
  std::vector<uint8_t> head(static_cast<size_t>(std::min(file_bytes, kProbeBytes)));
  read_file_at(memory->fd, file_bytes, path, 0, head.size(), head.data());
  if (has_npy_magic(head.data(), static_cast<int64_t>(head.size())) && head.size() >= 12) {
    // A .npy header may be longer than the probe: read all of it (within bounds).
    const int64_t need = std::min(
        {head[6] == 1 ? 10 + int64_t{load_le16(&head[8])} : 12 + int64_t{load_le32(&head[8])},
         kHeadBytes, file_bytes});
    if (need > static_cast<int64_t>(head.size())) {
      head.resize(static_cast<size_t>(need));
      read_file_at(memory->fd, file_bytes, path, 0, head.size(), head.data());
    }
  }
  const uint8_t *bytes = head.data();

  if (format == Format::Auto) {
    if (has_llmc_magic(bytes, file_bytes))
      format = Format::Llmc;
    else if (has_npy_magic(bytes, file_bytes) || ends_with(path, ".npy"))
      format = Format::Npy;
    else
      format = Format::Bytes;
  }
  Layout layout;
  switch (format) {
    case Format::Llmc: layout = llmc_layout(path, bytes, file_bytes); break;
    case Format::Npy: layout = npy_layout(path, bytes, file_bytes); break;
    case Format::U16: layout = raw_layout(path, file_bytes, 2); break;
    case Format::U32: layout = raw_layout(path, file_bytes, 4); break;
    default: layout = raw_layout(path, file_bytes, 1); break;
  }

  Shard s;
  s.memory = std::move(memory);
  s.size = layout.count;
  s.width = layout.width;
  s.file = {path, layout.kind, layout.count, layout.width, layout.header_bytes};
  return s;
}

std::unique_ptr<TokenSource> TokenSource::from_shards(std::vector<Shard> shards) {
  CTR_CHECK(!shards.empty());
  std::unique_ptr<TokenSource> src(new TokenSource());
  int64_t at = 0;
  bool same_kind = true;
  for (auto &s : shards) {
    s.begin = at;
    at += s.size;
    same_kind = same_kind && s.file.kind == shards[0].file.kind;
    src->name_ += (src->name_.empty() ? "" : ", ") + s.file.path;
  }
  src->size_ = at;
  src->kind_ =
      shards.size() == 1
          ? shards[0].file.kind
          : strformat("%s, %zu files", same_kind ? shards[0].file.kind.c_str() : "mixed formats",
                      shards.size());
  src->shards_ = std::move(shards);
  return src;
}

std::unique_ptr<TokenSource> TokenSource::open(const std::string &path, Format format) {
  std::vector<Shard> shards;
  shards.push_back(open_shard(path, format));
  return from_shards(std::move(shards));
}

std::unique_ptr<TokenSource> TokenSource::open(const std::vector<std::string> &paths,
                                               Format format) {
  CTR_REQUIRE(!paths.empty(), CTR_STATUS_INVALID_ARGUMENT,
              "a token source needs at least one file");
  std::vector<Shard> shards;
  shards.reserve(paths.size());
  for (const auto &p : paths) shards.push_back(open_shard(p, format));
  return from_shards(std::move(shards));
}

std::unique_ptr<TokenSource> TokenSource::open_spec(const std::string &path) {
  if (!is_manifest(path)) return open(path);
  const Manifest m = read_manifest(path);
  std::vector<Shard> shards;
  for (const auto &d : m.datasets)
    for (const auto &f : d.files) shards.push_back(open_shard(f, d.format));
  auto src = from_shards(std::move(shards));
  src->name_ = path;
  src->kind_ =
      strformat("manifest of %zu datasets in %zu files", m.datasets.size(), src->shards_.size());
  return src;
}

TokenSource::~TokenSource() = default;

const TokenSource::Shard &TokenSource::shard_of(int64_t i) const {
  // The last shard whose begin is <= i; empty shards are passed over because a
  // later shard with the same begin wins.
  auto it = std::upper_bound(shards_.begin(), shards_.end(), i,
                             [](int64_t v, const Shard &s) { return v < s.begin; });
  return *(it - 1);
}

void TokenSource::read_shard(const Shard &s, int64_t off, int64_t n, uint32_t *out) {
  const auto width = static_cast<size_t>(s.width);
  if (s.tokens != nullptr) {
    decode(s.tokens + static_cast<size_t>(off) * width, n, s.width, out);
    return;
  }
  // Through a buffer of whole tokens, so a long read stays in the cache.
  constexpr int64_t kChunkBytes = 64 * 1024;
  thread_local std::vector<uint8_t> buf;
  const int64_t per = kChunkBytes / s.width;
  buf.resize(static_cast<size_t>(std::min(n, per)) * width);
  while (n > 0) {
    const int64_t k = std::min(n, per);
    read_file_at(s.memory->fd, s.memory->file_bytes, s.file.path,
                 s.file.header_bytes + off * s.width, static_cast<size_t>(k) * width, buf.data());
    decode(buf.data(), k, s.width, out);
    off += k;
    out += k;
    n -= k;
  }
}

void TokenSource::read(int64_t start, int64_t count, uint32_t *out) const {
  while (count > 0) {
    const Shard &s = shards_.size() == 1 ? shards_[0] : shard_of(start);
    const int64_t off = start - s.begin;
    const int64_t n = std::min(count, s.size - off);
    read_shard(s, off, n, out);
    out += n;
    start += n;
    count -= n;
  }
}

uint32_t TokenSource::max_token() const {
  std::call_once(max_once_, [this] {
    uint32_t m = 0;
    std::vector<uint32_t> block(size_t{1} << 16);
    for (const Shard &s : shards_) {
      for (int64_t at = 0; at < s.size; at += static_cast<int64_t>(block.size())) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(block.size()), s.size - at);
        read_shard(s, at, n, block.data());
        for (int64_t i = 0; i < n; ++i) m = std::max(m, block[static_cast<size_t>(i)]);
      }
    }
    max_token_ = m;
  });
  return max_token_;
}

std::vector<TokenSource::File> TokenSource::files() const {
  std::vector<File> out;
  for (const Shard &s : shards_) out.push_back(s.file);
  return out;
}

// ------------------------------------------------------------------------------------------
// Writing

TokenWriter::TokenWriter(const std::string &path, Format format, int width, int64_t count)
    : path_(path), tmp_(path + ".tmp"), width_(width), count_(count) {
  if (format == Format::U16) width_ = 2;
  if (format == Format::U32) width_ = 4;
  CTR_REQUIRE(format == Format::Llmc || format == Format::Npy || format == Format::U16 ||
                  format == Format::U32,
              CTR_STATUS_INVALID_ARGUMENT,
              "cannot write '%s' as format '%s' (writable: llmc, npy, u16, u32)", path.c_str(),
              format_name(format));
  CTR_REQUIRE(width_ == 2 || width_ == 4, CTR_STATUS_INVALID_ARGUMENT,
              "cannot write '%s' with %d-byte tokens (2 or 4)", path.c_str(), width_);
  CTR_REQUIRE(count >= 0, CTR_STATUS_INVALID_ARGUMENT, "cannot write '%s': negative count",
              path.c_str());
  // The llm.c header stores the count as an int32.
  CTR_REQUIRE(format != Format::Llmc || count <= INT32_MAX, CTR_STATUS_DATA_ERROR,
              "cannot write '%s' as an llm.c token file: %lld tokens do not fit its int32 "
              "count (at most %d; use npy or raw u16/u32)",
              path.c_str(), static_cast<long long>(count), INT32_MAX);

  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CTR_REQUIRE(fd_ >= 0, CTR_STATUS_IO_ERROR, "cannot create '%s': %s", tmp_.c_str(),
              std::strerror(errno));
  buf_.reserve(1 << 20);

  if (format == Format::Llmc) {
    std::vector<uint8_t> header(static_cast<size_t>(kLlmcHeaderBytes), 0);
    const auto put32 = [&](size_t at, uint32_t v) {
      for (int i = 0; i < 4; ++i) header[at + i] = static_cast<uint8_t>(v >> (8 * i));
    };
    put32(0, static_cast<uint32_t>(width_ == 2 ? kLlmcMagicU16 : kLlmcMagicU32));
    put32(4, static_cast<uint32_t>(width_ == 2 ? kLlmcVersionU16 : kLlmcVersionU32));
    put32(8, static_cast<uint32_t>(count));
    put(header.data(), header.size());
  } else if (format == Format::Npy) {
    // Version 1.0, padded with spaces to a multiple of 64 bytes and ended by a
    // newline, as numpy.save writes it.
    std::string dict = strformat("{'descr': '%s', 'fortran_order': False, 'shape': (%lld,), }",
                                 width_ == 2 ? "<u2" : "<u4", static_cast<long long>(count));
    const size_t total = (10 + dict.size() + 1 + 63) / 64 * 64;
    dict.append(total - 10 - dict.size() - 1, ' ');
    dict += '\n';
    std::string prefix(kNpyMagic, kNpyMagicBytes);
    prefix += '\x01';
    prefix += '\x00';
    prefix += static_cast<char>(dict.size() & 0xff);
    prefix += static_cast<char>(dict.size() >> 8);
    put(prefix.data(), prefix.size());
    put(dict.data(), dict.size());
  }
}

TokenWriter::~TokenWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!done_) ::unlink(tmp_.c_str());
}

void TokenWriter::put(const void *data, size_t n) {
  const auto *p = static_cast<const uint8_t *>(data);
  buf_.insert(buf_.end(), p, p + n);
  if (buf_.size() >= (1 << 20)) flush();
}

void TokenWriter::flush() {
  size_t at = 0;
  while (at < buf_.size()) {
    const ssize_t w = ::write(fd_, buf_.data() + at, buf_.size() - at);
    if (w < 0 && errno == EINTR) continue;
    CTR_REQUIRE(w > 0, CTR_STATUS_IO_ERROR, "cannot write '%s': %s", tmp_.c_str(),
                std::strerror(errno));
    at += static_cast<size_t>(w);
  }
  buf_.clear();
}

void TokenWriter::write(const uint32_t *tokens, int64_t n) {
  CTR_REQUIRE(n >= 0 && written_ + n <= count_, CTR_STATUS_DATA_ERROR,
              "writing '%s': more than the %lld tokens announced", path_.c_str(),
              static_cast<long long>(count_));
  const uint32_t limit = max_id(width_);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t t = tokens[i];
    CTR_REQUIRE(t <= limit, CTR_STATUS_DATA_ERROR,
                "writing '%s': token id %u at position %lld does not fit in %d bits (at most %u)",
                path_.c_str(), t, static_cast<long long>(written_ + i), width_ * 8, limit);
    for (int b = 0; b < width_; ++b) buf_.push_back(static_cast<uint8_t>(t >> (8 * b)));
    if (buf_.size() >= (1 << 20)) flush();
  }
  written_ += n;
}

void TokenWriter::finish() {
  CTR_REQUIRE(written_ == count_, CTR_STATUS_DATA_ERROR,
              "writing '%s': %lld tokens written, %lld announced", path_.c_str(),
              static_cast<long long>(written_), static_cast<long long>(count_));
  flush();
  CTR_REQUIRE(::fsync(fd_) == 0, CTR_STATUS_IO_ERROR, "cannot sync '%s': %s", tmp_.c_str(),
              std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  CTR_REQUIRE(rc == 0, CTR_STATUS_IO_ERROR, "cannot close '%s': %s", tmp_.c_str(),
              std::strerror(errno));
  CTR_REQUIRE(::rename(tmp_.c_str(), path_.c_str()) == 0, CTR_STATUS_IO_ERROR,
              "cannot rename '%s' to '%s': %s", tmp_.c_str(), path_.c_str(), std::strerror(errno));
  done_ = true;
}

// ------------------------------------------------------------------------------------------
// The built-in corpus

namespace {

// A word list, most frequent first. Draws are skewed towards the front (see
// Draw::pick), as word frequencies are in natural text: a core of common words
// carries most of the text and the rest forms a long tail.
struct Words {
  std::vector<std::string_view> items;
};

const Words kNames{{"Anna", "Tom", "Lucy", "Ben", "Mara", "Peter", "Rosa", "Jack", "Ella",
                    "Sam", "Nora", "Leo", "Ivy", "Otto", "Clara", "Hugo", "Maya", "Felix",
                    "Greta", "Oscar", "Iris", "Emil", "Lena", "Victor"}};

// Nouns for people and animals: things that act.
const Words kAgents{{"farmer", "child", "dog", "cat", "teacher", "baker", "girl", "boy",
                     "woman", "man", "old man", "king", "queen", "sailor", "horse", "bird",
                     "fox", "doctor", "mouse", "rabbit", "owl", "wolf", "bear", "soldier",
                     "merchant", "fisherman", "painter", "student", "goat", "duck",
                     "neighbour", "stranger", "driver", "cook", "guard", "shepherd"}};

// Nouns for objects: things that are acted on.
const Words kThings{{"basket", "letter", "book", "lamp", "key", "box", "apple", "bread",
                     "coin", "ring", "map", "boat", "cup", "chair", "door", "window", "hat",
                     "coat", "stone", "flower", "candle", "rope", "bell", "clock", "song",
                     "story", "picture", "blanket", "bottle", "ladder", "shoe", "feather",
                     "egg", "orange", "umbrella", "kettle", "mirror", "wheel", "pencil",
                     "drum", "net", "bucket", "cake", "bag", "shell", "lantern"}};

const Words kPlaces{{"market", "forest", "bridge", "garden", "river", "hill", "lake", "barn",
                     "station", "village", "school", "kitchen", "library", "harbour",
                     "field", "road", "castle", "shop", "park", "beach", "cave", "tower",
                     "mill", "farm", "city", "valley", "island", "square"}};

const Words kAdjectives{{"old", "little", "big", "small", "red", "young", "green", "dark",
                         "bright", "quiet", "happy", "tired", "heavy", "warm", "cold",
                         "blue", "strange", "gentle", "brave", "clever", "kind", "wooden",
                         "golden", "empty", "broken", "tiny", "tall", "soft", "round", "wet",
                         "sleepy", "hungry", "busy", "lonely", "shiny", "yellow", "white",
                         "funny", "angry", "early", "open", "enormous", "ugly", "ancient"}};

// Transitive verbs, past tense.
const Words kVerbsT{{"saw", "found", "carried", "opened", "took", "made", "watched",
                     "followed", "lost", "bought", "sold", "cooked", "cleaned", "fixed",
                     "pulled", "pushed", "lifted", "dropped", "held", "wanted", "loved",
                     "remembered", "visited", "caught", "fed", "washed", "painted", "hid",
                     "shared", "chased", "noticed", "brought", "gave away", "picked up",
                     "looked at", "forgot", "kept", "showed"}};

// The same kind of verbs in the base form, for "wanted to", "did ... ?" and quotes.
const Words kVerbsBase{{"see", "find", "carry", "open", "take", "make", "watch", "follow",
                        "buy", "sell", "cook", "clean", "fix", "pull", "lift", "hold",
                        "visit", "catch", "feed", "wash", "paint", "hide", "share", "keep",
                        "bring", "draw"}};

// Intransitive verbs, past tense.
const Words kVerbsI{{"walked", "ran", "slept", "laughed", "waited", "sang", "danced",
                     "smiled", "cried", "jumped", "sat", "stood", "swam", "rested",
                     "worked", "played", "listened", "shouted", "whispered", "arrived",
                     "left", "returned", "climbed", "hurried", "wandered", "stayed"}};

const Words kAdverbs{{"slowly", "quickly", "quietly", "happily", "carefully", "suddenly",
                      "softly", "loudly", "again", "together", "alone", "early", "late",
                      "for a while", "all day", "once more"}};

// Prepositions of movement or place, each followed by a place.
const Words kPreps{{"to the", "into the", "across the", "near the", "behind the",
                    "along the", "through the", "over the", "beside the", "inside the",
                    "past the", "around the", "towards the", "from the"}};

// Prepositions of place only, for sentences without movement.
const Words kWhere{{"near the", "in the", "behind the", "beside the", "inside the", "at the",
                    "outside the"}};

const Words kTimes{{"In the morning", "At night", "Later that day", "One day",
                    "After dinner", "Before sunrise", "On Sunday", "Every winter",
                    "Long ago", "The next day", "In the evening", "At noon",
                    "In the spring", "That summer", "Once upon a time", "Soon"}};

const Words kSubordinators{{"When", "After", "Before", "Because", "While", "Although",
                            "As soon as", "Since"}};

const Words kSaid{{"said", "asked", "replied", "whispered", "shouted", "called", "answered"}};

const Words kDeterminers{{"the", "a", "the", "his", "her", "their", "that", "one", "every",
                          "my", "our"}};

const Words kCounts{{"two", "three", "some", "many", "four", "five", "a few", "ten"}};

const Words kPronouns{{"he", "she", "they", "we", "I", "you"}};

// Draws from the counter-based RNG: value k of the corpus stream is a pure
// function of (seed, k), so the text depends on the seed and nothing else.
class Draw {
 public:
  explicit Draw(uint64_t seed) : seed_(seed), stream_(rng::hash_name("ctr.data.synthetic")) {}

  double uniform() { return rng::uniform(seed_, stream_, counter_++); }
  bool chance(double p) { return uniform() < p; }
  int below(int n) { return std::min(n - 1, static_cast<int>(uniform() * n)); }
  // Index floor(n * u^6): the first entry of a 40-word list comes up about half
  // the time, the last one in a few hundred draws. The exponent sets how fast a
  // model learns the text. It was chosen by training the 4-layer, 256-wide gpt
  // preset at batch 8 x 256 for 300 steps: exponent 2 leaves the loss near 2.1
  // (the character-bigram level of this grammar), 4 near 1.95, 6 reaches about
  // 1.8 at lr 3e-4 and 1.4 at lr 1e-3, while larger exponents make the text
  // visibly repetitive.
  std::string_view pick(const Words &w) {
    const double u = uniform();
    const auto n = static_cast<int>(w.items.size());
    const double skewed = u * u * u * u * u * u;
    return w.items[static_cast<size_t>(std::min(n - 1, static_cast<int>(skewed * n)))];
  }

 private:
  uint64_t seed_;
  uint64_t stream_;
  uint64_t counter_ = 0;
};

bool starts_with_vowel(std::string_view w) {
  return !w.empty() && std::strchr("aeiouAEIOU", w[0]) != nullptr;
}

// English plural of the last word of a (possibly two-word) noun.
std::string plural(std::string_view noun) {
  static const std::pair<std::string_view, std::string_view> kIrregular[] = {
      {"child", "children"}, {"man", "men"},     {"woman", "women"},
      {"mouse", "mice"},     {"wolf", "wolves"}, {"fisherman", "fishermen"},
      {"old man", "old men"}};
  for (const auto &[one, many] : kIrregular)
    if (noun == one) return std::string(many);
  std::string s(noun);
  const auto ends = [&](std::string_view t) {
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  if (ends("s") || ends("x") || ends("ch") || ends("sh")) return s + "es";
  if (ends("y") && s.size() >= 2 && std::strchr("aeiou", s[s.size() - 2]) == nullptr) {
    s.pop_back();
    return s + "ies";
  }
  return s + "s";
}

class Grammar {
 public:
  explicit Grammar(uint64_t seed) : d_(seed) {}

  // One paragraph: a few sentences and a blank line.
  void paragraph(std::string &out) {
    const int sentences = 2 + d_.below(5);
    for (int i = 0; i < sentences; ++i) {
      if (i > 0) out += ' ';
      sentence(out);
    }
    out += "\n\n";
  }

 private:
  // A noun phrase around `noun`: determiner, optional adjective, a/an agreement,
  // sometimes a count and a plural (reported through *is_plural when asked).
  std::string noun_phrase(std::string_view noun, bool *is_plural = nullptr) {
    std::string adj;
    if (d_.chance(0.45)) adj = std::string(d_.pick(kAdjectives)) + " ";
    const bool many = is_plural != nullptr && d_.chance(0.12);
    if (is_plural != nullptr) *is_plural = many;
    if (many) return std::string(d_.pick(kCounts)) + " " + adj + plural(noun);
    std::string det(d_.pick(kDeterminers));
    const std::string_view head = adj.empty() ? noun : std::string_view(adj);
    if (det == "a" && starts_with_vowel(head)) det = "an";
    return det + " " + adj + std::string(noun);
  }

  // The subject, and whether it takes "were" rather than "was".
  std::string subject(bool *were) {
    const double u = d_.uniform();
    *were = false;
    if (u < 0.3) return std::string(d_.pick(kNames));
    if (u < 0.45) {
      const std::string_view p = d_.pick(kPronouns);
      *were = p == "they" || p == "we" || p == "you";
      return std::string(p);
    }
    return noun_phrase(d_.pick(kAgents), were);
  }

  std::string object() {
    const double u = d_.uniform();
    bool many;  // objects take no verb, so either number reads well
    if (u < 0.7) return noun_phrase(d_.pick(kThings), &many);
    if (u < 0.85) return noun_phrase(d_.pick(kAgents), &many);
    return std::string(d_.pick(kNames));
  }

  std::string place(const Words &preps = kPreps) {
    std::string s = std::string(d_.pick(preps)) + " ";
    if (d_.chance(0.3)) s += std::string(d_.pick(kAdjectives)) + " ";
    return s + std::string(d_.pick(kPlaces));
  }

  // subject + predicate, without final punctuation.
  std::string clause() {
    bool were;
    const std::string subj = subject(&were);
    // "Anna saw Anna" reads wrong: an object equal to the subject becomes a thing.
    const auto other = [&] {
      std::string o = object();
      return o == subj ? noun_phrase(d_.pick(kThings)) : o;
    };
    std::string s = subj + " ";
    const double u = d_.uniform();
    if (u < 0.5) {
      s += std::string(d_.pick(kVerbsT)) + " " + other();
      if (d_.chance(0.35)) s += " " + place();
    } else if (u < 0.8) {
      s += std::string(d_.pick(kVerbsI));
      if (d_.chance(0.5)) s += " " + std::string(d_.pick(kAdverbs));
      if (d_.chance(0.5)) s += " " + place();
    } else if (u < 0.9) {
      s += "wanted to " + std::string(d_.pick(kVerbsBase)) + " " + other();
    } else {
      const auto n_adj = static_cast<int>(kAdjectives.items.size());
      const std::string_view first = d_.pick(kAdjectives);
      s += (were ? "were " : "was ") + std::string(first);
      if (d_.chance(0.5)) {
        std::string_view second = d_.pick(kAdjectives);
        if (second == first) second = kAdjectives.items[static_cast<size_t>(d_.below(n_adj))];
        if (second != first) s += " and " + std::string(second);
      }
    }
    return s;
  }

  // Something a character says, with its own closing punctuation.
  std::string quote() {
    const double u = d_.uniform();
    if (u < 0.25) return "Where is " + noun_phrase(d_.pick(kThings)) + "?";
    if (u < 0.45) return "Look at " + noun_phrase(d_.pick(kThings)) + "!";
    if (u < 0.6) return "We should go " + place() + ".";
    if (u < 0.75)
      return "Did you " + std::string(d_.pick(kVerbsBase)) + " " + object() + "?";
    if (u < 0.85) return "I am so " + std::string(d_.pick(kAdjectives)) + " today.";
    return capitalised(clause()) + ".";
  }

  static std::string capitalised(std::string s) {
    if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
    return s;
  }

  void sentence(std::string &out) {
    const double u = d_.uniform();
    std::string s;
    if (u < 0.35) {
      s = capitalised(clause()) + ".";
    } else if (u < 0.5) {
      s = std::string(d_.pick(kTimes)) + ", " + clause() + ".";
    } else if (u < 0.62) {
      static const Words kJoin{{"and", "but", "so", "and then"}};
      s = capitalised(clause()) + ", " + std::string(d_.pick(kJoin)) + " " + clause() + ".";
    } else if (u < 0.74) {
      s = std::string(d_.pick(kSubordinators)) + " " + clause() + ", " + clause() + ".";
    } else if (u < 0.92) {
      // Dialogue. Before "said" a statement's full stop becomes a comma; a
      // question or exclamation keeps its mark.
      std::string q = quote();
      const std::string who = d_.chance(0.6) ? std::string(d_.pick(kNames))
                                             : noun_phrase(d_.pick(kAgents));
      if (d_.chance(0.7)) {
        if (q.back() == '.') q.back() = ',';
        s = "\"" + q + "\" " + std::string(d_.pick(kSaid)) + " " + who + ".";
      } else {
        s = capitalised(who) + " " + std::string(d_.pick(kSaid)) + ", \"" + q + "\"";
      }
    } else {
      s = "There was " + noun_phrase(d_.pick(kAgents)) + " " + place(kWhere) + ".";
    }
    out += s;
  }

  Draw d_;
};

}  // namespace

std::unique_ptr<TokenSource> TokenSource::synthetic(uint64_t seed, int64_t bytes) {
  CTR_REQUIRE(bytes >= 1, CTR_STATUS_INVALID_ARGUMENT,
              "synthetic corpus: size must be at least 1 byte, got %lld",
              static_cast<long long>(bytes));
  std::string text;
  text.reserve(static_cast<size_t>(bytes) + 4096);
  Grammar grammar(seed);
  while (static_cast<int64_t>(text.size()) < bytes) grammar.paragraph(text);
  text.resize(static_cast<size_t>(bytes));

  auto memory = std::make_shared<Memory>();
  memory->owned.assign(text.begin(), text.end());
  std::unique_ptr<TokenSource> src(new TokenSource());
  src->name_ = strformat("synthetic corpus (seed %llu)", static_cast<unsigned long long>(seed));
  src->kind_ = "synthetic";
  src->size_ = bytes;
  Shard s;
  s.tokens = memory->owned.data();
  s.memory = std::move(memory);
  s.size = bytes;
  s.width = 1;
  s.file = {src->name_, "synthetic", bytes, 1, 0};
  src->shards_.push_back(std::move(s));
  return src;
}

}  // namespace ctr::data
