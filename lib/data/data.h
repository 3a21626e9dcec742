// Training data: token sources, dataset manifests and the stateful, resumable loader.
//
// A TokenSource is a read-only sequence of token ids: one or more memory-mapped
// files (llm.c token files, .npy arrays, raw uint16/uint32 or raw bytes) read as
// one concatenated sequence, or the built-in synthetic corpus held in memory.
// Mapping instead of reading keeps start-up instant and memory flat for corpora
// far larger than RAM; the page cache does the buffering.
//
// A Loader cuts one or more weighted sub-datasets into samples (fixed windows, or
// windows that stay inside one document) and hands them out in a seeded
// pseudo-random order. The order is computed, never stored: each sub-dataset's
// sample indices come from a full-period linear congruential generator (LCG), and
// the choice of sub-dataset for each draw is a deterministic weighted schedule of
// the per-sub-dataset counts. So the loader's whole state is a seed plus two
// integers per sub-dataset (epoch, position). That state is what a checkpoint
// saves, and it means the same thing for any world size and any number of ranks,
// because every rank derives the same global order from it and reads only its
// own rows of each global batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ctr::data {

// Size of the built-in corpus when the caller has no reason to pick another.
inline constexpr int64_t kSyntheticDefaultBytes = int64_t{4} << 20;

// ------------------------------------------------------------------------------------------
// File formats

// llm.c token files, recognised by their first int32:
//   GPT-2:   magic 20240520, version 1, uint16 tokens
//   Llama-3: magic 20240801, version 7, uint32 tokens
// Both have a 256 x int32 little-endian header ([0] magic, [1] version, [2] token
// count, rest reserved) followed by exactly `count` little-endian tokens.
inline constexpr int32_t kLlmcMagicU16 = 20240520;
inline constexpr int32_t kLlmcVersionU16 = 1;
inline constexpr int32_t kLlmcMagicU32 = 20240801;
inline constexpr int32_t kLlmcVersionU32 = 7;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// How a file's bytes become tokens.
//   Auto   an llm.c magic -> Llmc; the .npy magic or a name ending in ".npy" -> Npy;
//          anything else -> Bytes (raw text, vocabulary 256)
//   Llmc   an llm.c token file, uint16 or uint32 by its magic
//   Npy    a 1-D little-endian uint16, uint32 or int32 NumPy array (format 1.0-3.0)
//   U16    raw little-endian uint16 tokens, no header
//   U32    raw little-endian uint32 tokens, no header
//   Bytes  each byte is a token
enum class Format { Auto, Llmc, Npy, U16, U32, Bytes };

// "auto", "llmc", "npy", "u16", "u32", "bytes".
const char *format_name(Format format);
// The inverse of format_name; nullopt for an unknown name, which the caller
// reports with format_names() in the context it knows.
std::optional<Format> format_from_name(const std::string &name);
// "auto, llmc, npy, u16, u32, bytes".
std::string format_names();

// ------------------------------------------------------------------------------------------
// TokenSource

class TokenSource {
 public:
  // Maps path read-only and reads it as `format`. Fails with CTR_STATUS_IO_ERROR
  // if the file cannot be opened or mapped, and with CTR_STATUS_DATA_ERROR naming
  // the file and the fault (truncated or bad header, unsupported .npy dtype or
  // shape, a size that is no whole number of tokens) if it is not a valid file
  // of that format.
  static std::unique_ptr<TokenSource> open(const std::string &path, Format format = Format::Auto);

  // Several files read as one sequence, in order (a shard list); each file is
  // detected on its own under Format::Auto. Windows may span a file boundary,
  // as they span document boundaries. Fails as open() for any file, and with
  // CTR_STATUS_INVALID_ARGUMENT for an empty list.
  static std::unique_ptr<TokenSource> open(const std::vector<std::string> &paths,
                                           Format format = Format::Auto);

  // What a loader over `path` reads, as one sequence: the file, or for a
  // manifest (see is_manifest) every file of every sub-dataset in order. For
  // summaries (size, largest id); the loader's weighting does not apply.
  static std::unique_ptr<TokenSource> open_spec(const std::string &path);

  // The built-in English-like corpus of exactly `bytes` bytes, a pure function
  // of seed (see tokens.cc). Fails with CTR_STATUS_INVALID_ARGUMENT if bytes < 1.
  static std::unique_ptr<TokenSource> synthetic(uint64_t seed,
                                                int64_t bytes = kSyntheticDefaultBytes);

  ~TokenSource();
  TokenSource(const TokenSource &) = delete;
  TokenSource &operator=(const TokenSource &) = delete;

  // Number of tokens.
  int64_t size() const { return size_; }

  // Token i, 0 <= i < size(). Unchecked. A token of an int32 .npy file is its
  // bit pattern: a negative id reads as an id >= 2^31, which the step's input
  // check rejects with its position.
  uint32_t token(int64_t i) const {
    uint32_t t = 0;
    read(i, 1, &t);
    return t;
  }

  // Tokens [start, start + count) into out; unchecked, crosses file boundaries.
  // The loader's inner loop: one file lookup per call instead of per token.
  // Fails with CTR_STATUS_DATA_ERROR naming the file if it has become shorter
  // since it was opened, and with CTR_STATUS_IO_ERROR if reading it fails.
  void read(int64_t start, int64_t count, uint32_t *out) const;

  // Largest token id in the source (0 if empty). Scans the whole source on the
  // first call only, so opening a large file stays cheap until someone asks.
  uint32_t max_token() const;

  // The path (paths joined by ", " for a shard list), or a description of the
  // synthetic corpus; for messages.
  const std::string &name() const { return name_; }

  // "llm.c uint16", "llm.c uint32", "npy uint16", "npy uint32", "npy int32",
  // "uint16", "uint32", "bytes" or "synthetic"; for a shard list the common kind
  // and the file count ("llm.c uint16, 3 files", "mixed formats, 3 files"); for
  // open_spec of a manifest "manifest of 2 datasets in 3 files".
  const char *kind() const { return kind_.c_str(); }

  // The files of the source, in order (one entry for the synthetic corpus).
  struct File {
    std::string path;
    std::string kind;
    int64_t tokens = 0;
    int width = 1;             // bytes per token
    int64_t header_bytes = 0;  // bytes before the first token
  };
  std::vector<File> files() const;

 private:
  // An open file (read with pread, so a file truncated while in use is an
  // error naming it rather than a fault) or owned bytes; released with the last
  // shard using it.
  struct Memory;
  struct Shard {
    std::shared_ptr<const Memory> memory;
    const uint8_t *tokens = nullptr;  // first token of owned bytes; null for a file
    int64_t begin = 0;                // index of the first token in the source
    int64_t size = 0;
    int width = 1;
    File file;
  };

  TokenSource() = default;
  static Shard open_shard(const std::string &path, Format format);
  static std::unique_ptr<TokenSource> from_shards(std::vector<Shard> shards);
  const Shard &shard_of(int64_t i) const;
  // Tokens [off, off + n) of one shard into out.
  static void read_shard(const Shard &s, int64_t off, int64_t n, uint32_t *out);

  std::string name_;
  std::string kind_;
  std::vector<Shard> shards_;  // never empty
  int64_t size_ = 0;
  mutable std::once_flag max_once_;
  mutable uint32_t max_token_ = 0;
};

// ------------------------------------------------------------------------------------------
// Writing token files

// Writes a token file of `count` tokens, fed in order through write(). The file
// appears under `path` only when finish() succeeds: it is written to path.tmp
// and renamed, so a failure (an id too wide for the format, a short count, a
// full disk) never leaves a partial file, and the output may replace an input
// that is still mapped. format is Llmc, Npy, U16 or U32; width (2 or 4) picks
// the llm.c variant and the .npy dtype, and is implied by U16 and U32.
class TokenWriter {
 public:
  TokenWriter(const std::string &path, Format format, int width, int64_t count);
  ~TokenWriter();  // removes path.tmp unless finish() succeeded
  TokenWriter(const TokenWriter &) = delete;
  TokenWriter &operator=(const TokenWriter &) = delete;

  // Appends tokens. Fails with CTR_STATUS_DATA_ERROR naming the id and its
  // position if an id does not fit the width, or if more than `count` tokens
  // arrive.
  void write(const uint32_t *tokens, int64_t n);
  // Checks that exactly `count` tokens were written, flushes and renames.
  void finish();

  // The largest id a width can hold: 65535 or 4294967295.
  static uint32_t max_id(int width) { return width == 2 ? 0xffffu : 0xffffffffu; }

 private:
  void put(const void *data, size_t n);
  void flush();

  std::string path_, tmp_;
  int fd_ = -1;
  int width_;
  int64_t count_, written_ = 0;
  std::vector<uint8_t> buf_;
  bool done_ = false;
};

// ------------------------------------------------------------------------------------------
// Manifests

// A manifest is a JSON file naming weighted sub-datasets:
//   {"datasets": [{"files": ["a.bin", "b.bin"], "weight": 0.7},
//                 {"files": ["c.npy"], "weight": 0.3, "format": "npy", "name": "code"}],
//    "format": "auto", "mode": "windows", "eot": 50256}
// Every key but "datasets" and "files" is optional: "weight" defaults to 1 (only
// ratios matter), a dataset's "format" to the manifest's, that to "auto";
// "name" labels the sub-dataset in messages (default: its files). Relative file
// paths are relative to the manifest's directory. Unknown keys are an error.
struct DatasetSpec {
  std::string name;
  std::vector<std::string> files;  // resolved paths
  double weight = 1;
  Format format = Format::Auto;
};
struct Manifest {
  std::string path;
  std::vector<DatasetSpec> datasets;
  std::optional<std::string> mode;  // "windows" or "documents", checked by the loader
  std::optional<int64_t> eot;
};

// True if path names a manifest under Format::Auto: its name ends in ".json".
bool is_manifest(const std::string &path);

// Reads and checks a manifest. Fails with CTR_STATUS_IO_ERROR if it cannot be
// read and CTR_STATUS_DATA_ERROR naming the manifest and the key at fault.
Manifest read_manifest(const std::string &path);

// ------------------------------------------------------------------------------------------
// Loader

// How sources are cut into samples of seq inputs and seq targets.
//   Windows    sample w of a source is tokens [w*seq, w*seq + seq] (inputs are the
//              first seq, targets the last seq): n = (size - 1) / seq windows that
//              share only their boundary token; a shorter tail is unused.
//   Documents  the source is split at every end-of-text token (id eot) into
//              documents that share that token: each runs from one eot (or the
//              start) to the next eot (or the end), so the eot closing a document
//              is its last target and the first input of the next. A document of
//              L tokens gives L - 1 predictions, cut into ceil((L - 1) / seq)
//              samples from its start; the last one is padded with input eot and
//              target -1 (ignored by the loss). No sample crosses a document, and
//              every token after the first is a target exactly once per epoch.
//              Finding documents costs one scan of the source when the loader is
//              created and 16 bytes of memory per document.
enum class Mode { Windows, Documents };

struct LoaderConfig {
  int64_t seq = 0;    // >= 1
  uint64_t seed = 0;  // picks every permutation and the mixing phase
  Mode mode = Mode::Windows;
  int64_t eot = -1;  // the end-of-text id, required by Documents
};

// One weighted sub-dataset of a loader: a source it owns or borrows.
struct Part {
  std::string name;                          // for messages; default: the source's name
  std::unique_ptr<const TokenSource> owned;  // set to own the source
  const TokenSource *source = nullptr;       // a borrowed source; null when owned
  double weight = 1;                         // > 0; only ratios matter
};

// Where one sub-dataset's order stands: completed epochs and the samples already
// drawn from the current one (< its sample count).
struct PartState {
  uint64_t epoch = 0;
  uint64_t position = 0;
};

// Everything needed to continue a loader exactly where it stopped. It depends on
// neither the number of ranks nor rows, only on the sub-datasets and seq.
struct LoaderState {
  uint64_t seed = 0;
  std::vector<PartState> parts;  // one per sub-dataset
};

// Hands out samples (see Mode) of the sub-datasets.
//
// Order within a sub-dataset: each epoch visits all its n samples exactly once,
// in the order of a permutation drawn from (seed, sub-dataset index, epoch). The
// permutation is an LCG of full period m = the smallest power of two >= n
// (multiplier = 1 mod 4, odd increment, so Hull-Dobell guarantees every residue
// appears once per period), followed by a bijective bit-mixer on [0, m) to hide
// the LCG's regular low bits, with values >= n skipped ("cycle walking"). No
// permutation array exists, so the order costs constant memory however large
// the source (documents mode keeps only its document boundaries, see Mode);
// restoring replays the current epoch up to `position`, at most 2 * position
// integer steps.
//
// Mixing: draw t (t = 0, 1, ...) takes the sub-dataset k with the largest
// deficit W_k * (t + 1) + phase_k - c_k * S, the lowest k on ties, where W_k is
// the weight in units of 2^-30 of the total, S their sum, c_k the samples drawn
// from k so far (epoch_k * n_k + position_k) and phase_k in [0, S) drawn from the
// seed. This is smooth weighted round-robin with a seeded start: after any t
// draws each c_k is within a few units of t * W_k / S, the schedule depends only
// on the counts, so the per-sub-dataset states are the whole mixing state, and
// every sub-dataset keeps its own epochs (a small, heavily weighted one cycles
// many times while a large one is still in its first).
class Loader {
 public:
  // One borrowed source in windows mode; seq, rows >= 1. Fails with
  // CTR_STATUS_DATA_ERROR naming the source if not one sample fits.
  Loader(const TokenSource &src, int64_t seq, int64_t rows, uint64_t seed);
  Loader(const TokenSource &src, const LoaderConfig &config, int64_t rows = 1);
  // Weighted sub-datasets (at least one). Fails with CTR_STATUS_INVALID_ARGUMENT
  // for a bad config or weight, CTR_STATUS_DATA_ERROR naming the sub-dataset if
  // one has no sample.
  Loader(std::vector<Part> parts, const LoaderConfig &config, int64_t rows = 1);
  ~Loader();
  Loader(const Loader &) = delete;
  Loader &operator=(const Loader &) = delete;

  // Fills the next `rows` samples into tokens and targets, each [rows, seq]
  // row-major int32: tokens[r, t] = window[t], targets[r, t] = window[t + 1]
  // (or the padding of documents mode). A batch may cross an epoch boundary;
  // the next epoch's permutation follows.
  void next(int32_t *tokens, int32_t *targets);

  // Advances by global_rows samples but fills only the rows samples starting at
  // first_row of them into tokens and targets ([rows, seq] each): one rank's
  // slice of a global batch. Only those rows touch the token data. Requires
  // 0 <= first_row, 0 <= rows, first_row + rows <= global_rows (unchecked).
  void next_slice(int64_t global_rows, int64_t first_row, int64_t rows, int32_t *tokens,
                  int32_t *targets);

  // The next draw, without reading any token.
  struct Draw {
    int part = 0;
    uint64_t sample = 0;
  };
  Draw next_draw();
  // The sample index of the next draw; for a single source, the window index.
  uint64_t next_window() { return next_draw().sample; }

  // Writes sample `sample` of sub-dataset `part` as one row (seq tokens, seq
  // targets). Unchecked indices. Like every call here it uses the loader's
  // scratch buffer: one thread at a time per loader.
  void fill(int part, uint64_t sample, int32_t *tokens, int32_t *targets) const;

  LoaderState state() const;
  // Continues from `state`. Fails with CTR_STATUS_DATA_ERROR, leaving the loader
  // unchanged, if the sub-dataset count differs or a position exceeds that
  // sub-dataset's sample count (a state saved for other data or another seq);
  // position == n is accepted as the start of the next epoch.
  void restore(const LoaderState &state);

  // The state as JSON, with what it must match to be restored: seq, mode, eot,
  // and per sub-dataset its name, tokens, samples and weight, plus the total
  // number of draws. The form saved in checkpoints (meta.json "loader").
  nlohmann::json state_json() const;
  // Restores state_json() output. Fails with CTR_STATUS_DATA_ERROR, leaving the
  // loader unchanged, naming what does not match: another seq, mode or eot,
  // another number of sub-datasets, or a sub-dataset with other samples, tokens
  // or weight (another manifest or other files), or a malformed state. Also
  // accepts the older single-source form {seed, epoch, position, seq}.
  void restore_json(const nlohmann::json &state);

  int parts() const { return static_cast<int>(parts_.size()); }
  // Samples per epoch of a sub-dataset.
  int64_t samples(int part = 0) const;
  const TokenSource &source(int part = 0) const;
  const std::string &part_name(int part) const;
  double weight(int part) const;
  // Tokens of all sub-datasets, and the largest id among them (scans on first use).
  int64_t tokens() const;
  uint32_t max_token() const;

  int64_t seq() const { return config_.seq; }
  int64_t rows() const { return rows_; }
  Mode mode() const { return config_.mode; }
  int64_t eot() const { return config_.eot; }

 private:
  struct PartData;

  void check_state(const LoaderState &state) const;
  void apply_state(const LoaderState &state);

  LoaderConfig config_;
  int64_t rows_;
  std::vector<std::unique_ptr<PartData>> parts_;
  uint64_t draws_ = 0;  // the sum of the per-part counts
  mutable std::vector<uint32_t> scratch_;
};

// How ctr_loader_create describes a loader: a file, a manifest, or "" for the
// built-in corpus. Unset fields come from the manifest, then the defaults.
struct OpenOptions {
  int64_t seq = 0;
  uint64_t seed = 0;
  std::optional<Format> format;  // for a single file; a manifest needs Auto
  std::optional<Mode> mode;
  std::optional<int64_t> eot;
  int64_t corpus_bytes = kSyntheticDefaultBytes;
  uint64_t corpus_seed = 0;  // which built-in corpus (another seed: other text)
};

// Opens path (a manifest under Format::Auto when is_manifest(path), else one
// file of `format`) and a loader over it, owning its sources. Fails as
// TokenSource::open, read_manifest and the Loader constructors do, and with
// CTR_STATUS_INVALID_OPTION for documents mode without an eot.
std::unique_ptr<Loader> open_loader(const std::string &path, const OpenOptions &options);

}  // namespace ctr::data
