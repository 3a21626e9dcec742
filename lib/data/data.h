// Training data: token sources and the stateful, resumable loader.
//
// A TokenSource is a read-only sequence of token ids: a memory-mapped file (an
// llm.c token file, or any other file read as raw bytes) or the built-in synthetic
// corpus held in memory. Mapping instead of reading keeps start-up instant and
// memory flat for corpora far larger than RAM; the page cache does the buffering.
//
// A Loader cuts a source into non-overlapping windows and hands them out in a
// seeded pseudo-random order. The order is computed, never stored: window
// indices come from a full-period linear congruential generator (LCG), so the
// loader's whole state is three integers (seed, epoch, position). That state is
// what a checkpoint saves, and it means the same thing for any world size and
// any number of ranks, because every rank derives the same global order from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ctr::data {

// Size of the built-in corpus when the caller has no reason to pick another.
inline constexpr int64_t kSyntheticDefaultBytes = int64_t{4} << 20;

// ------------------------------------------------------------------------------------------
// TokenSource

// File formats recognised by TokenSource::open, by their first int32:
//   llm.c GPT-2 files:   magic 20240520, version 1, uint16 tokens
//   llm.c Llama-3 files: magic 20240801, version 7, uint32 tokens
// Both have a 256 x int32 little-endian header ([0] magic, [1] version, [2] token
// count, rest reserved) followed by exactly `count` little-endian tokens. Any
// other file is raw text whose bytes are the tokens (vocabulary 256).
inline constexpr int32_t kLlmcMagicU16 = 20240520;
inline constexpr int32_t kLlmcVersionU16 = 1;
inline constexpr int32_t kLlmcMagicU32 = 20240801;
inline constexpr int32_t kLlmcVersionU32 = 7;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

class TokenSource {
 public:
  // Maps path read-only. Fails with CTR_STATUS_IO_ERROR if the file cannot be
  // opened or mapped, and with CTR_STATUS_DATA_ERROR (naming the file and the
  // fault: truncated header, bad version, token count not matching the file
  // size) if it carries an llm.c magic but is not a valid token file.
  static std::unique_ptr<TokenSource> open(const std::string &path);

  // The built-in English-like corpus of exactly `bytes` bytes, a pure function
  // of seed (see tokens.cc). Fails with CTR_STATUS_INVALID_ARGUMENT if bytes < 1.
  static std::unique_ptr<TokenSource> synthetic(uint64_t seed,
                                                int64_t bytes = kSyntheticDefaultBytes);

  ~TokenSource();
  TokenSource(const TokenSource &) = delete;
  TokenSource &operator=(const TokenSource &) = delete;

  // Number of tokens.
  int64_t size() const { return size_; }

  // Token i, 0 <= i < size(). Unchecked: this sits in the loader's inner loop.
  uint32_t token(int64_t i) const {
    const uint8_t *p = tokens_ + static_cast<size_t>(i) * width_;
    switch (width_) {
      case 1: return p[0];
      case 2: return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
      default:
        return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
               static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
    }
  }

  // Largest token id in the source (0 if empty). Scans the whole source on the
  // first call only, so opening a large file stays cheap until someone asks.
  uint32_t max_token() const;

  // The path, or a description of the synthetic corpus; for messages.
  const std::string &name() const { return name_; }

  // "llm.c uint16", "llm.c uint32", "bytes" or "synthetic".
  const char *kind() const { return kind_; }

 private:
  TokenSource() = default;

  std::string name_;
  const char *kind_ = "";
  const uint8_t *tokens_ = nullptr;  // first token, inside the mapping or owned_
  int64_t size_ = 0;
  int width_ = 1;  // bytes per token
  void *map_ = nullptr;
  size_t map_bytes_ = 0;
  std::vector<uint8_t> owned_;  // the synthetic corpus
  mutable std::once_flag max_once_;
  mutable uint32_t max_token_ = 0;
};

// ------------------------------------------------------------------------------------------
// Loader

// Everything needed to continue a loader exactly where it stopped. It does not
// depend on the number of ranks or on rows, only on the source and seq: restore
// it into a loader over the same source with the same seq.
struct LoaderState {
  uint64_t seed = 0;     // picks the permutation of every epoch
  uint64_t epoch = 0;     // completed passes over the source
  uint64_t position = 0;  // windows already handed out in the current epoch (< n)
};

// Hands out windows of seq + 1 consecutive tokens. Window w starts at token
// w * seq, for w in [0, n) with n = (size - 1) / seq: windows do not overlap as
// inputs (consecutive windows share one boundary token, the last target of one
// being the first input of the next) and a tail shorter than a window is unused.
//
// Order: each epoch visits all n windows exactly once, in the order of a
// permutation drawn from (seed, epoch). The permutation is an LCG of full period
// m = the smallest power of two >= n (multiplier = 1 mod 4, odd increment, so
// Hull-Dobell guarantees every residue appears once per period), followed by a
// bijective bit-mixer on [0, m) to hide the LCG's regular low bits, with values
// >= n skipped ("cycle walking"). No index array exists, so the memory cost is
// constant however large the source; restore() replays the current epoch up to
// `position`, which costs at most 2 * position integer steps.
class Loader {
 public:
  // seq, rows >= 1. Fails with CTR_STATUS_DATA_ERROR naming the source if it
  // holds fewer than seq + 1 tokens, so not one window fits.
  Loader(const TokenSource &src, int64_t seq, int64_t rows, uint64_t seed);

  // Fills the next `rows` windows into tokens and targets, each [rows, seq]
  // row-major int32: tokens[r, t] = window[t], targets[r, t] = window[t + 1].
  // A batch may cross an epoch boundary; the next epoch's permutation follows.
  void next(int32_t *tokens, int32_t *targets);

  LoaderState state() const;
  // Continues from `state`. Fails with CTR_STATUS_DATA_ERROR if state.position
  // exceeds the window count (a state saved for another source or seq);
  // position == n is accepted as the start of the next epoch.
  void restore(const LoaderState &state);

  // The index of the next window and advances past it; next() is rows of these.
  uint64_t next_window();

  int64_t windows() const { return static_cast<int64_t>(n_); }
  int64_t seq() const { return seq_; }
  int64_t rows() const { return rows_; }

 private:
  void begin_epoch();
  uint64_t mix(uint64_t x) const;

  const TokenSource &src_;
  int64_t seq_;
  int64_t rows_;
  uint64_t n_;      // windows per epoch
  uint64_t mask_;   // m - 1, m = 2^bits_
  int bits_;
  int shift_;       // of the bit-mixer
  uint64_t seed_;
  uint64_t epoch_ = 0;
  uint64_t position_ = 0;
  // The current epoch's LCG and mixer, derived from (seed, epoch).
  uint64_t mul_ = 1, inc_ = 1, x_ = 0, mix1_ = 1, mix2_ = 1;
};

}  // namespace ctr::data
