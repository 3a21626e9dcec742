// Unit tests of lib/data: token-file parsing and its error messages (llm.c, .npy,
// raw uint16/uint32, bytes, shard lists), the token writer, manifests, the
// built-in corpus, and the loader's permutation, mixing, documents mode and
// resumability.
//
// The loader's guarantees are what make checkpoint/resume and multi-rank runs
// see the same data as an uninterrupted single run, so they are tested directly:
// every sample exactly once per epoch (for sample counts around the awkward
// sizes 1, 2, a non-power of two and powers of two), restore(state()) and
// restore_json(state_json()) continuing bit-identically, and the rescale
// property: batches of one global size on W1 ranks, a saved state, then batches
// of another global size on W2 ranks cover every sample of the epoch exactly
// once, for a single file and per sub-dataset of a mixture.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"
#include "data/data.h"

namespace ctr::data {
namespace {

// ------------------------------------------------------------------------------------------
// Helpers

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "ctr_data_XXXXXX";
    char *p = ::mkdtemp(tmpl.data());
    if (p == nullptr) std::abort();
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string write(const std::string &name, const std::vector<uint8_t> &bytes) {
    std::string f = path_ + "/" + name;
    FILE *fp = std::fopen(f.c_str(), "wb");
    if (fp == nullptr) std::abort();
    if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), fp);
    std::fclose(fp);
    return f;
  }
  std::string write_text(const std::string &name, const std::string &text) {
    return write(name, std::vector<uint8_t>(text.begin(), text.end()));
  }
  const std::string &path() const { return path_; }

 private:
  std::string path_;
};

void put_le32(std::vector<uint8_t> &out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// An llm.c token file: header (magic, version, count) then `tokens` of `width`
// bytes each. count_override lets a test lie in the header.
std::vector<uint8_t> llmc_file(int32_t magic, int32_t version, const std::vector<uint32_t> &tokens,
                               int width, int64_t count_override = -1) {
  std::vector<uint8_t> out(static_cast<size_t>(kLlmcHeaderBytes) + tokens.size() * width, 0);
  put_le32(out, 0, static_cast<uint32_t>(magic));
  put_le32(out, 4, static_cast<uint32_t>(version));
  put_le32(out, 8,
           static_cast<uint32_t>(count_override >= 0 ? count_override
                                                     : static_cast<int64_t>(tokens.size())));
  size_t at = static_cast<size_t>(kLlmcHeaderBytes);
  for (uint32_t t : tokens)
    for (int i = 0; i < width; ++i) out[at++] = static_cast<uint8_t>(t >> (8 * i));
  return out;
}

// Runs f, which must throw ctr::Error with `code`; returns its message.
template <class F>
std::string error_of(F f, ctr_status code) {
  try {
    f();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), code) << e.message();
    return e.message();
  }
  ADD_FAILURE() << "expected a ctr::Error";
  return "";
}

// ------------------------------------------------------------------------------------------
// Files

TEST(TokenSource, ParsesLlmcUint16File) {
  TempDir dir;
  const std::vector<uint32_t> toks = {0, 1, 50256, 65535, 7, 300};
  auto f = dir.write("gpt2.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, toks, 2));
  auto src = TokenSource::open(f);
  EXPECT_STREQ(src->kind(), "llm.c uint16");
  EXPECT_EQ(src->name(), f);
  ASSERT_EQ(src->size(), static_cast<int64_t>(toks.size()));
  for (size_t i = 0; i < toks.size(); ++i) EXPECT_EQ(src->token(static_cast<int64_t>(i)), toks[i]);
  EXPECT_EQ(src->max_token(), 65535u);
}

TEST(TokenSource, ParsesLlmcUint32File) {
  TempDir dir;
  const std::vector<uint32_t> toks = {128000, 5, 70000, 1};
  auto f = dir.write("llama3.bin", llmc_file(kLlmcMagicU32, kLlmcVersionU32, toks, 4));
  auto src = TokenSource::open(f);
  EXPECT_STREQ(src->kind(), "llm.c uint32");
  ASSERT_EQ(src->size(), 4);
  for (size_t i = 0; i < toks.size(); ++i) EXPECT_EQ(src->token(static_cast<int64_t>(i)), toks[i]);
  EXPECT_EQ(src->max_token(), 128000u);
}

TEST(TokenSource, EmptyTokenFileIsValid) {
  TempDir dir;
  auto f = dir.write("empty.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {}, 2));
  auto src = TokenSource::open(f);
  EXPECT_EQ(src->size(), 0);
  EXPECT_EQ(src->max_token(), 0u);
}

TEST(TokenSource, TruncatedHeaderIsDataError) {
  TempDir dir;
  auto bytes = llmc_file(kLlmcMagicU16, kLlmcVersionU16, {}, 2);
  bytes.resize(100);
  auto f = dir.write("short_header.bin", bytes);
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated llm.c header"), std::string::npos) << msg;
}

TEST(TokenSource, BadVersionIsDataError) {
  TempDir dir;
  auto f = dir.write("v2.bin", llmc_file(kLlmcMagicU16, 2, {1, 2, 3}, 2));
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad llm.c header version 2"), std::string::npos) << msg;

  // The uint32 magic with the uint16 version is just as wrong.
  auto g = dir.write("mixed.bin", llmc_file(kLlmcMagicU32, kLlmcVersionU16, {1}, 4));
  msg = error_of([&] { TokenSource::open(g); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("version"), std::string::npos) << msg;
}

TEST(TokenSource, TruncatedTokensAreDataError) {
  TempDir dir;
  // The header promises 10 tokens, 4 follow.
  auto f = dir.write("cut.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {1, 2, 3, 4}, 2, 10));
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("10 tokens"), std::string::npos) << msg;
}

TEST(TokenSource, CountMismatchIsDataError) {
  TempDir dir;
  // The header says 2 tokens, 4 follow.
  auto f = dir.write("long.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {1, 2, 3, 4}, 2, 2));
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("count mismatch"), std::string::npos) << msg;

  // An odd trailing byte after uint16 tokens.
  auto bytes = llmc_file(kLlmcMagicU16, kLlmcVersionU16, {1, 2}, 2);
  bytes.push_back(0);
  auto g = dir.write("odd.bin", bytes);
  msg = error_of([&] { TokenSource::open(g); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("count mismatch"), std::string::npos) << msg;
}

TEST(TokenSource, NegativeCountIsDataError) {
  TempDir dir;
  auto bytes = llmc_file(kLlmcMagicU16, kLlmcVersionU16, {1}, 2);
  put_le32(bytes, 8, 0xffffffffu);
  auto f = dir.write("neg.bin", bytes);
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("negative token count"), std::string::npos) << msg;
}

TEST(TokenSource, MissingFileIsIoError) {
  TempDir dir;
  const std::string f = dir.path() + "/does_not_exist.bin";
  auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_IO_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  msg = error_of([&] { TokenSource::open(dir.path()); }, CTR_STATUS_IO_ERROR);
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
}

TEST(TokenSource, RawBytes) {
  TempDir dir;
  const std::string text = "hello, world\n\xff";
  auto f = dir.write("text.txt", std::vector<uint8_t>(text.begin(), text.end()));
  auto src = TokenSource::open(f);
  EXPECT_STREQ(src->kind(), "bytes");
  ASSERT_EQ(src->size(), static_cast<int64_t>(text.size()));
  for (size_t i = 0; i < text.size(); ++i)
    EXPECT_EQ(src->token(static_cast<int64_t>(i)), static_cast<uint8_t>(text[i]));
  EXPECT_EQ(src->max_token(), 255u);

  // Shorter than a magic number: still just bytes.
  auto g = dir.write("ab.txt", {'a', 'b'});
  EXPECT_EQ(TokenSource::open(g)->size(), 2);
}

TEST(Loader, TooShortSourceIsDataErrorNamingTheFile) {
  TempDir dir;
  auto f = dir.write("tiny.txt", {'a', 'b', 'c', 'd'});  // 4 tokens: seq 3 fits, seq 4 not
  auto src = TokenSource::open(f);
  EXPECT_EQ(Loader(*src, 3, 1, 0).samples(), 1);
  auto msg = error_of([&] { Loader(*src, 4, 1, 0); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(f), std::string::npos) << msg;

  auto e = dir.write("empty.txt", {});
  auto empty = TokenSource::open(e);
  EXPECT_EQ(empty->size(), 0);
  msg = error_of([&] { Loader(*empty, 1, 1, 0); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(e), std::string::npos) << msg;

  error_of([&] { Loader(*src, 0, 1, 0); }, CTR_STATUS_INVALID_ARGUMENT);
  error_of([&] { Loader(*src, 1, 0, 0); }, CTR_STATUS_INVALID_ARGUMENT);
}

// ------------------------------------------------------------------------------------------
// Loader

TEST(Loader, VisitsEveryWindowOncePerEpoch) {
  const int64_t seq = 4;
  for (int64_t n : {1, 2, 3, 7, 8, 9, 1000, 1023, 1024, 1025}) {
    // (size - 1) / seq == n, plus a short tail that must never be used.
    auto src = TokenSource::synthetic(1, n * seq + 1 + (seq - 1));
    for (uint64_t seed : {0ull, 1ull, 12345ull}) {
      Loader loader(*src, seq, 1, seed);
      ASSERT_EQ(loader.samples(), n);
      std::vector<uint64_t> previous;
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<uint64_t> order;
        std::set<uint64_t> seen;
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_EQ(loader.state().parts[0].epoch, static_cast<uint64_t>(epoch));
          const uint64_t w = loader.next_window();
          ASSERT_LT(w, static_cast<uint64_t>(n)) << "n=" << n;
          EXPECT_TRUE(seen.insert(w).second) << "n=" << n << " window " << w << " repeated";
          order.push_back(w);
        }
        EXPECT_EQ(seen.size(), static_cast<size_t>(n));
        // Each epoch draws a new permutation (a large n cannot repeat by chance).
        if (n >= 1000 && !previous.empty()) {
          EXPECT_NE(order, previous) << "n=" << n;
        }
        previous = order;
      }
    }
  }
}

TEST(Loader, OrderDependsOnSeedAndLooksShuffled) {
  auto src = TokenSource::synthetic(1, 1000 * 4 + 1);
  Loader a(*src, 4, 1, 1), b(*src, 4, 1, 2);
  std::vector<uint64_t> oa, ob;
  int ascending = 0;
  for (int i = 0; i < 1000; ++i) {
    oa.push_back(a.next_window());
    ob.push_back(b.next_window());
    if (i > 0 && oa[i] == oa[i - 1] + 1) ++ascending;
  }
  EXPECT_NE(oa, ob);
  EXPECT_LT(ascending, 20);  // not the identity or a rotation of it
}

TEST(Loader, WindowsAreConsecutiveTokensAndShiftedTargets) {
  TempDir dir;
  std::vector<uint8_t> bytes(1001);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i % 251);
  auto src = TokenSource::open(dir.write("ramp.bin", bytes));
  const int64_t seq = 10, rows = 7;
  Loader loader(*src, seq, rows, 3);
  std::vector<int32_t> tok(rows * seq), tgt(rows * seq);
  std::set<int32_t> starts;
  for (int batch = 0; batch < 30; ++batch) {  // 210 windows over 100: crosses epochs
    loader.next(tok.data(), tgt.data());
    for (int64_t r = 0; r < rows; ++r) {
      // The window's first token tells where it starts: the ramp repeats every
      // 251 tokens, so among multiples of seq below 1000 the residue is unique.
      int64_t start = -1;
      for (int64_t s = 0; s + seq < 1001; s += seq)
        if (static_cast<int32_t>(s % 251) == tok[r * seq]) start = s;
      ASSERT_GE(start, 0);
      starts.insert(static_cast<int32_t>(start));
      for (int64_t t = 0; t < seq; ++t) {
        EXPECT_EQ(tok[r * seq + t], static_cast<int32_t>((start + t) % 251));
        EXPECT_EQ(tgt[r * seq + t], static_cast<int32_t>((start + t + 1) % 251));
      }
    }
  }
  EXPECT_EQ(starts.size(), 100u);  // all (1001 - 1) / 10 windows were used
}

TEST(Loader, RestoreResumesIdentically) {
  auto src = TokenSource::synthetic(9, 50 * 8 + 1);  // 50 windows of seq 8
  const int64_t seq = 8, rows = 3;
  for (int stop : {0, 1, 5, 16, 17, 40}) {  // 16 and 17 batches straddle the epoch edge
    Loader a(*src, seq, rows, 77);
    std::vector<int32_t> tok(rows * seq), tgt(rows * seq);
    for (int i = 0; i < stop; ++i) a.next(tok.data(), tgt.data());
    const LoaderState saved = a.state();

    Loader b(*src, seq, rows, 5);  // a different seed, overwritten by the state
    b.restore(saved);
    EXPECT_EQ(b.state().seed, saved.seed);
    EXPECT_EQ(b.state().parts[0].epoch, saved.parts[0].epoch);
    EXPECT_EQ(b.state().parts[0].position, saved.parts[0].position);
    std::vector<int32_t> tok_b(rows * seq), tgt_b(rows * seq);
    for (int i = 0; i < 40; ++i) {
      a.next(tok.data(), tgt.data());
      b.next(tok_b.data(), tgt_b.data());
      ASSERT_EQ(tok, tok_b) << "stop=" << stop << " batch " << i;
      ASSERT_EQ(tgt, tgt_b) << "stop=" << stop << " batch " << i;
    }
  }
}

TEST(Loader, StateDoesNotDependOnRows) {
  // One loader of 6 rows and another of 2 rows called 3 times see the same
  // windows: the state a checkpoint stores is independent of how batches are cut.
  auto src = TokenSource::synthetic(2, 100 * 5 + 1);
  Loader six(*src, 5, 6, 11), two(*src, 5, 2, 11);
  std::vector<int32_t> t6(30), g6(30), t2(10), g2(10);
  for (int b = 0; b < 20; ++b) {
    six.next(t6.data(), g6.data());
    for (int k = 0; k < 3; ++k) {
      two.next(t2.data(), g2.data());
      for (int i = 0; i < 10; ++i) ASSERT_EQ(t2[i], t6[k * 10 + i]);
    }
    EXPECT_EQ(six.state().parts[0].epoch, two.state().parts[0].epoch);
    EXPECT_EQ(six.state().parts[0].position, two.state().parts[0].position);
  }
}

TEST(Loader, RestoreRejectsForeignState) {
  auto src = TokenSource::synthetic(1, 10 * 4 + 1);
  Loader loader(*src, 4, 1, 0);
  LoaderState s{0, {{0, 11}}};
  auto msg = error_of([&] { loader.restore(s); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("synthetic corpus"), std::string::npos) << msg;
  s.parts[0].position = 10;  // the end of an epoch is the start of the next
  loader.restore(s);
  EXPECT_EQ(loader.state().parts[0].epoch, 1u);
  EXPECT_EQ(loader.state().parts[0].position, 0u);
  loader.next_window();
  EXPECT_EQ(loader.state().parts[0].position, 1u);
}

// ------------------------------------------------------------------------------------------
// The built-in corpus

TEST(Synthetic, DeterministicAndSeeded) {
  auto a = TokenSource::synthetic(0, 100000);
  auto b = TokenSource::synthetic(0, 100000);
  auto c = TokenSource::synthetic(1, 100000);
  EXPECT_STREQ(a->kind(), "synthetic");
  ASSERT_EQ(a->size(), 100000);
  bool differs = false;
  for (int64_t i = 0; i < a->size(); ++i) {
    ASSERT_EQ(a->token(i), b->token(i)) << "at " << i;
    differs = differs || a->token(i) != c->token(i);
  }
  EXPECT_TRUE(differs);
  // A prefix of a longer corpus is the shorter one: the size only truncates.
  auto longer = TokenSource::synthetic(0, 150000);
  for (int64_t i = 0; i < a->size(); ++i) ASSERT_EQ(a->token(i), longer->token(i));
}

TEST(Synthetic, IsPlainEnglishLikeText) {
  auto src = TokenSource::synthetic(0, 200000);
  std::string text;
  for (int64_t i = 0; i < src->size(); ++i) text += static_cast<char>(src->token(i));
  for (unsigned char ch : text) ASSERT_TRUE(ch == '\n' || (ch >= 32 && ch < 127)) << int(ch);
  EXPECT_LT(src->max_token(), 128u);
  EXPECT_NE(text.find(". "), std::string::npos);
  EXPECT_NE(text.find("\n\n"), std::string::npos);
  EXPECT_NE(text.find(" the "), std::string::npos);
  EXPECT_NE(text.find("\" said "), std::string::npos);
  // Varied, not a loop: many distinct sentences.
  std::set<std::string> sentences;
  size_t from = 0;
  for (size_t at; (at = text.find(". ", from)) != std::string::npos; from = at + 2)
    sentences.insert(text.substr(from, at - from));
  EXPECT_GT(sentences.size(), 1000u);

  error_of([] { TokenSource::synthetic(0, 0); }, CTR_STATUS_INVALID_ARGUMENT);
}

// ------------------------------------------------------------------------------------------
// More helpers: raw and .npy files, loaders over many ranks

using nlohmann::json;

// Raw little-endian tokens of `width` bytes.
std::vector<uint8_t> raw_file(const std::vector<uint32_t> &tokens, int width) {
  std::vector<uint8_t> out;
  for (uint32_t t : tokens)
    for (int i = 0; i < width; ++i) out.push_back(static_cast<uint8_t>(t >> (8 * i)));
  return out;
}

// A .npy file: magic, version, header length, the header text `dict` padded as
// NumPy pads it (unless `exact`), then payload.
std::vector<uint8_t> npy_file(const std::string &dict, const std::vector<uint8_t> &payload,
                              int major = 1, bool exact = false) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  if (!exact) {
    const size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
    header.append(total - prefix - header.size() - 1, ' ');
    header += '\n';
  }
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), 0};
  const size_t len = header.size();
  out.push_back(static_cast<uint8_t>(len));
  out.push_back(static_cast<uint8_t>(len >> 8));
  if (major != 1) {
    out.push_back(static_cast<uint8_t>(len >> 16));
    out.push_back(static_cast<uint8_t>(len >> 24));
  }
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::string npy_dict(const std::string &descr, const std::string &shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
}

// A source whose token i is base + i: every window's first token says which
// sub-dataset (base >> 24) and which window it is.
std::unique_ptr<TokenSource> ramp(TempDir &dir, const std::string &name, uint32_t base, int64_t n) {
  std::vector<uint32_t> toks(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) toks[static_cast<size_t>(i)] = base + static_cast<uint32_t>(i);
  return TokenSource::open(dir.write(name, raw_file(toks, 4)), Format::U32);
}

struct Sample {
  int part;
  int64_t index;
  bool operator<(const Sample &o) const { return part != o.part ? part < o.part : index < o.index; }
  bool operator==(const Sample &o) const { return part == o.part && index == o.index; }
};

// The sample a row of a ramp source is, checking that it is a whole window.
Sample decode(const int32_t *tok, const int32_t *tgt, int64_t seq) {
  const auto first = static_cast<uint32_t>(tok[0]);
  for (int64_t t = 0; t < seq; ++t) {
    EXPECT_EQ(static_cast<uint32_t>(tok[t]), first + static_cast<uint32_t>(t));
    EXPECT_EQ(static_cast<uint32_t>(tgt[t]), first + static_cast<uint32_t>(t) + 1);
  }
  EXPECT_EQ((first & 0xffffffu) % static_cast<uint32_t>(seq), 0u);
  return {static_cast<int>(first >> 24), static_cast<int64_t>((first & 0xffffffu) / seq)};
}

using Factory = std::function<std::unique_ptr<Loader>()>;

// Runs `batches1` global batches on w1 ranks of l1 rows each (every rank its own
// loader, reading its own slice), takes rank 0's state through JSON text,
// restores it into w2 fresh ranks of l2 rows and continues until `total` rows
// have been drawn. Returns every row in global order, as decoded samples.
std::vector<Sample> rescaled_run(const Factory &make, int w1, int64_t l1, int batches1, int w2,
                                 int64_t l2, int64_t total) {
  std::vector<Sample> out;
  const auto run = [&](std::vector<std::unique_ptr<Loader>> &ranks, int64_t local, int batches,
                       bool until_total) {
    const auto world = static_cast<int64_t>(ranks.size());
    const int64_t seq = ranks[0]->seq();
    std::vector<int32_t> tok(static_cast<size_t>(local * seq)), tgt(tok.size());
    for (int b = 0; until_total ? static_cast<int64_t>(out.size()) < total : b < batches; ++b) {
      for (int64_t r = 0; r < world; ++r) {
        ranks[static_cast<size_t>(r)]->next_slice(world * local, r * local, local, tok.data(),
                                                  tgt.data());
        for (int64_t i = 0; i < local; ++i)
          out.push_back(decode(tok.data() + i * seq, tgt.data() + i * seq, seq));
      }
      // Every rank drew the whole global batch: their states agree.
      for (const auto &l : ranks) ASSERT_EQ(l->state_json(), ranks[0]->state_json());
    }
  };
  std::vector<std::unique_ptr<Loader>> first;
  for (int r = 0; r < w1; ++r) first.push_back(make());
  run(first, l1, batches1, false);
  const std::string saved = first[0]->state_json().dump();

  std::vector<std::unique_ptr<Loader>> second;
  for (int r = 0; r < w2; ++r) {
    second.push_back(make());
    second.back()->restore_json(json::parse(saved));
  }
  run(second, l2, 0, true);
  out.resize(static_cast<size_t>(total));
  return out;
}

// ------------------------------------------------------------------------------------------
// .npy files

TEST(Npy, ReadsUint16Uint32Int32InEveryVersion) {
  TempDir dir;
  const std::vector<uint32_t> toks = {0, 1, 50256, 65535, 7};
  for (int major : {1, 2, 3}) {
    auto f = dir.write("u2_v" + std::to_string(major) + ".npy",
                       npy_file(npy_dict("<u2", "(5,)"), raw_file(toks, 2), major));
    auto src = TokenSource::open(f);
    EXPECT_STREQ(src->kind(), "npy uint16");
    ASSERT_EQ(src->size(), 5);
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(src->token(i), toks[static_cast<size_t>(i)]);
    EXPECT_EQ(src->files()[0].width, 2);
    EXPECT_EQ(src->files()[0].header_bytes % 64, 0);
  }
  const std::vector<uint32_t> wide = {128000, 0, 70000};
  auto u4 =
      TokenSource::open(dir.write("u4.npy", npy_file(npy_dict("<u4", "(3,)"), raw_file(wide, 4))));
  EXPECT_STREQ(u4->kind(), "npy uint32");
  EXPECT_EQ(u4->token(0), 128000u);
  EXPECT_EQ(u4->max_token(), 128000u);
  auto i4 = TokenSource::open(
      dir.write("i4.npy", npy_file(npy_dict("<i4", "(3,)"), raw_file(wide, 4))), Format::Npy);
  EXPECT_STREQ(i4->kind(), "npy int32");
  EXPECT_EQ(i4->token(2), 70000u);

  // Key order, quotes, a Fortran-order 1-D array (the same bytes), Python 2's
  // long suffix and an empty array are all what NumPy may write.
  auto odd = TokenSource::open(dir.write(
      "odd.npy", npy_file("{\"shape\": (2L,), \"fortran_order\": True, \"descr\": \"<u2\"}",
                          raw_file({3, 4}, 2))));
  EXPECT_EQ(odd->size(), 2);
  EXPECT_EQ(odd->token(1), 4u);
  auto empty = TokenSource::open(dir.write("empty.npy", npy_file(npy_dict("<u2", "(0,)"), {})));
  EXPECT_EQ(empty->size(), 0);
}

TEST(Npy, MalformedHeadersAreDataErrorsNamingFileAndProblem) {
  TempDir dir;
  const auto payload = raw_file({1, 2, 3}, 2);
  struct Case {
    const char *name;
    std::vector<uint8_t> bytes;
    const char *problem;
  };
  auto truncated = npy_file(npy_dict("<u2", "(3,)"), payload);
  truncated.resize(9);
  auto cut_header = npy_file(npy_dict("<u2", "(3,)"), {});
  cut_header.resize(40);
  auto version4 = npy_file(npy_dict("<u2", "(3,)"), payload);
  version4[6] = 4;
  auto minor1 = npy_file(npy_dict("<u2", "(3,)"), payload);
  minor1[7] = 1;
  const std::vector<Case> cases = {
      {"magic.npy", std::vector<uint8_t>{'N', 'O', 'T', 'N', 'P', 'Y', 1, 0, 0, 0},
       "not a .npy file"},
      {"short.npy", truncated, "truncated .npy header"},
      {"cut.npy", cut_header, "truncated .npy header"},
      {"v4.npy", version4, "unsupported .npy format version 4.0"},
      {"v1_1.npy", minor1, "unsupported .npy format version 1.1"},
      {"nonl.npy", npy_file(npy_dict("<u2", "(3,)"), payload, 1, true),
       "does not end with a newline"},
      {"f4.npy", npy_file(npy_dict("<f4", "(3,)"), raw_file({1, 2, 3}, 4)),
       "unsupported .npy dtype '<f4'"},
      {"be.npy", npy_file(npy_dict(">u2", "(3,)"), payload), "big-endian"},
      {"u8.npy", npy_file(npy_dict("<u8", "(3,)"), raw_file({1, 2, 3, 0, 0, 0}, 4)), "dtype '<u8'"},
      {"2d.npy", npy_file(npy_dict("<u2", "(3, 1)"), payload), "shape (3, 1), 2-D"},
      {"0d.npy", npy_file(npy_dict("<u2", "()"), payload), "0-D"},
      {"few.npy", npy_file(npy_dict("<u2", "(4,)"), payload), "truncated"},
      {"many.npy", npy_file(npy_dict("<u2", "(2,)"), payload), "token count mismatch"},
      {"nokey.npy", npy_file("{'descr': '<u2', 'shape': (3,), }", payload),
       "missing key 'fortran_order'"},
      {"extra.npy",
       npy_file("{'descr': '<u2', 'fortran_order': False, 'shape': (3,), 'x': 1}", payload),
       "unsupported value"},
      {"extra2.npy",
       npy_file("{'descr': '<u2', 'fortran_order': False, 'shape': (3,), 'x': (1,)}", payload),
       "unexpected key 'x'"},
      {"twice.npy",
       npy_file("{'descr': '<u2', 'descr': '<u2', 'fortran_order': False, 'shape': (3,)}", payload),
       "appears twice"},
      {"order.npy", npy_file("{'descr': '<u2', 'fortran_order': 'no', 'shape': (3,)}", payload),
       "'fortran_order' is not True or False"},
      {"struct.npy",
       npy_file("{'descr': [('a', '<u2')], 'fortran_order': False, 'shape': (3,)}", payload),
       "unsupported value"},
      {"descr.npy", npy_file("{'descr': True, 'fortran_order': False, 'shape': (3,)}", payload),
       "'descr' is not a string"},
      {"quote.npy", npy_file("{'descr: '<u2'}", payload), "expected ':'"},
      {"unterminated.npy", npy_file("{'descr", payload), "unterminated string"},
      {"neg.npy", npy_file(npy_dict("<u2", "(-3,)"), payload), "expected a non-negative integer"},
      {"trailing.npy",
       npy_file("{'descr': '<u2', 'fortran_order': False, 'shape': (3,)} x", payload),
       "text after the closing '}'"},
  };
  for (const auto &c : cases) {
    auto f = dir.write(c.name, c.bytes);
    auto msg = error_of([&] { TokenSource::open(f); }, CTR_STATUS_DATA_ERROR);
    EXPECT_NE(msg.find(f), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.problem), std::string::npos) << c.name << ": " << msg;
  }
  // Under "npy" a file without the magic is refused, not read as bytes.
  auto text = dir.write_text("text.bin", std::string("hello"));
  auto msg = error_of([&] { TokenSource::open(text, Format::Npy); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("not a .npy file"), std::string::npos) << msg;
}

// ------------------------------------------------------------------------------------------
// Raw files, explicit formats, shard lists

TEST(TokenSource, RawUint16AndUint32NeedTheirFormat) {
  TempDir dir;
  const std::vector<uint32_t> toks = {5, 65535, 0, 300};
  auto f16 = dir.write("t.u16", raw_file(toks, 2));
  auto src = TokenSource::open(f16, Format::U16);
  EXPECT_STREQ(src->kind(), "uint16");
  ASSERT_EQ(src->size(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(src->token(i), toks[static_cast<size_t>(i)]);
  EXPECT_STREQ(TokenSource::open(f16)->kind(), "bytes");  // auto cannot know
  EXPECT_EQ(TokenSource::open(f16)->size(), 8);

  auto f32 = dir.write("t.u32", raw_file({1u << 31, 7}, 4));
  auto src32 = TokenSource::open(f32, Format::U32);
  EXPECT_STREQ(src32->kind(), "uint32");
  EXPECT_EQ(src32->token(0), 1u << 31);

  auto odd = dir.write("odd.u32", raw_file({1, 2, 3}, 2));  // 6 bytes
  auto msg = error_of([&] { TokenSource::open(odd, Format::U32); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(odd), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a whole number of 4-byte tokens"), std::string::npos) << msg;
  msg = error_of(
      [&] { TokenSource::open(dir.write_text("odd.u16", std::string("abc")), Format::U16); },
      CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("2-byte tokens"), std::string::npos) << msg;

  // "llmc" insists on the header; "bytes" reads an llm.c file as plain bytes.
  msg = error_of([&] { TokenSource::open(f16, Format::Llmc); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("not an llm.c token file"), std::string::npos) << msg;
  auto llmc = dir.write("g.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {1, 2}, 2));
  EXPECT_EQ(TokenSource::open(llmc, Format::Bytes)->size(), kLlmcHeaderBytes + 4);
  EXPECT_STREQ(TokenSource::open(llmc, Format::Llmc)->kind(), "llm.c uint16");
}

TEST(TokenSource, FormatNamesRoundTrip) {
  for (Format f :
       {Format::Auto, Format::Llmc, Format::Npy, Format::U16, Format::U32, Format::Bytes})
    EXPECT_EQ(format_from_name(format_name(f)), f);
  EXPECT_FALSE(format_from_name("uint16").has_value());
  EXPECT_EQ(format_names(), "auto, llmc, npy, u16, u32, bytes");
}

TEST(TokenSource, ShardListIsOneSequence) {
  TempDir dir;
  auto a = dir.write("a.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {10, 11, 12}, 2));
  auto e = dir.write("e.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {}, 2));
  auto b = dir.write("b.npy", npy_file(npy_dict("<u4", "(2,)"), raw_file({70000, 14}, 4)));
  auto c = dir.write_text("c.txt", std::string("AB"));
  auto src = TokenSource::open(std::vector<std::string>{a, e, b, c});
  EXPECT_STREQ(src->kind(), "mixed formats, 4 files");
  EXPECT_EQ(src->name(), a + ", " + e + ", " + b + ", " + c);
  const std::vector<uint32_t> want = {10, 11, 12, 70000, 14, 'A', 'B'};
  ASSERT_EQ(src->size(), static_cast<int64_t>(want.size()));
  for (int64_t i = 0; i < src->size(); ++i)
    EXPECT_EQ(src->token(i), want[static_cast<size_t>(i)]) << i;
  // read() across every boundary, from every start.
  for (int64_t start = 0; start < src->size(); ++start) {
    std::vector<uint32_t> got(static_cast<size_t>(src->size() - start));
    src->read(start, static_cast<int64_t>(got.size()), got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + start)) << start;
  }
  EXPECT_EQ(src->max_token(), 70000u);
  const auto files = src->files();
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[1].tokens, 0);
  EXPECT_EQ(files[2].kind, "npy uint32");

  auto same = TokenSource::open(std::vector<std::string>{a, a});
  EXPECT_STREQ(same->kind(), "llm.c uint16, 2 files");
  EXPECT_EQ(same->size(), 6);
  error_of([] { TokenSource::open(std::vector<std::string>{}); }, CTR_STATUS_INVALID_ARGUMENT);
  // A bad file anywhere in the list names that file.
  auto bad = dir.write_text("bad.npy", std::string("nope"));
  auto msg = error_of(
      [&] {
        TokenSource::open(std::vector<std::string>{a, bad});
      },
      CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find(bad), std::string::npos) << msg;
}

// ------------------------------------------------------------------------------------------
// Writing

TEST(TokenWriter, EveryFormatReadsBack) {
  TempDir dir;
  const std::vector<uint32_t> small = {0, 1, 255, 50256, 65535};
  const std::vector<uint32_t> wide = {0, 65536, 128000, 4000000000u};
  struct Case {
    Format format;
    int width;
    const std::vector<uint32_t> *toks;
    const char *kind;
  };
  const std::vector<Case> cases = {
      {Format::Llmc, 2, &small, "llm.c uint16"}, {Format::Llmc, 4, &wide, "llm.c uint32"},
      {Format::Npy, 2, &small, "npy uint16"},    {Format::Npy, 4, &wide, "npy uint32"},
      {Format::U16, 0, &small, "uint16"},        {Format::U32, 0, &wide, "uint32"},
  };
  for (const auto &c : cases) {
    const std::string path = dir.path() + "/out_" + c.kind;
    {
      TokenWriter w(path, c.format, c.width, static_cast<int64_t>(c.toks->size()));
      w.write(c.toks->data(), 2);
      w.write(c.toks->data() + 2, static_cast<int64_t>(c.toks->size()) - 2);
      EXPECT_FALSE(std::filesystem::exists(path));  // only path.tmp so far
      w.finish();
    }
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    const Format read_as =
        c.format == Format::U16 || c.format == Format::U32 ? c.format : Format::Auto;
    auto src = TokenSource::open(path, read_as);
    EXPECT_STREQ(src->kind(), c.kind);
    ASSERT_EQ(src->size(), static_cast<int64_t>(c.toks->size())) << c.kind;
    for (int64_t i = 0; i < src->size(); ++i)
      EXPECT_EQ(src->token(i), (*c.toks)[static_cast<size_t>(i)]);
  }
}

TEST(TokenWriter, RefusesWhatDoesNotFitAndLeavesNoFile) {
  TempDir dir;
  const std::string path = dir.path() + "/narrow.bin";
  {
    TokenWriter w(path, Format::U16, 0, 3);
    const uint32_t toks[] = {1, 65536, 2};
    auto msg = error_of([&] { w.write(toks, 3); }, CTR_STATUS_DATA_ERROR);
    EXPECT_NE(msg.find("token id 65536 at position 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("16 bits"), std::string::npos) << msg;
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  {
    TokenWriter w(path, Format::Npy, 2, 3);
    const uint32_t toks[] = {1, 2};
    w.write(toks, 2);
    auto msg = error_of([&] { w.finish(); }, CTR_STATUS_DATA_ERROR);
    EXPECT_NE(msg.find("2 tokens written, 3 announced"), std::string::npos) << msg;
    error_of([&] { w.write(toks, 2); }, CTR_STATUS_DATA_ERROR);  // one too many
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  auto msg = error_of([&] { TokenWriter(path, Format::Llmc, 2, int64_t{1} << 31); },
                      CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("int32 count"), std::string::npos) << msg;
  error_of([&] { TokenWriter(path, Format::Bytes, 1, 1); }, CTR_STATUS_INVALID_ARGUMENT);
  error_of([&] { TokenWriter(path, Format::Npy, 3, 1); }, CTR_STATUS_INVALID_ARGUMENT);
  error_of([&] { TokenWriter(dir.path() + "/no/such/dir/x.bin", Format::U16, 0, 1); },
           CTR_STATUS_IO_ERROR);
}

// ------------------------------------------------------------------------------------------
// Manifests

TEST(Manifest, ReadsDatasetsAndResolvesRelativePaths) {
  TempDir dir;
  std::filesystem::create_directories(dir.path() + "/sub");
  auto m = dir.write_text("sub/mix.json", R"({
    "datasets": [
      {"files": ["a.bin", "b.bin"], "weight": 0.7},
      {"files": ["/abs/c.npy"], "weight": 3, "format": "u16", "name": "code"},
      {"files": ["d.txt"]}
    ],
    "format": "llmc", "mode": "documents", "eot": 50256
  })");
  const Manifest man = read_manifest(m);
  ASSERT_EQ(man.datasets.size(), 3u);
  EXPECT_EQ(man.datasets[0].files,
            (std::vector<std::string>{dir.path() + "/sub/a.bin", dir.path() + "/sub/b.bin"}));
  EXPECT_EQ(man.datasets[0].name, "a.bin, b.bin");
  EXPECT_EQ(man.datasets[0].weight, 0.7);
  EXPECT_EQ(man.datasets[0].format, Format::Llmc);  // the manifest's default
  EXPECT_EQ(man.datasets[1].files[0], "/abs/c.npy");
  EXPECT_EQ(man.datasets[1].format, Format::U16);
  EXPECT_EQ(man.datasets[1].name, "code");
  EXPECT_EQ(man.datasets[2].weight, 1.0);
  EXPECT_EQ(man.mode, "documents");
  EXPECT_EQ(man.eot, 50256);
  EXPECT_TRUE(is_manifest(m));
  EXPECT_FALSE(is_manifest(dir.path() + "/a.bin"));
}

TEST(Manifest, BadManifestsNameTheManifestAndTheKey) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "not valid JSON"},
      {"[]", "not a JSON object"},
      {R"({"datasets": []})", "non-empty list"},
      {R"({"sets": []})", "unknown key \"sets\""},
      {R"({"format": "auto"})", "no \"datasets\""},
      {R"({"datasets": [{"files": []}]})", "datasets[0].files must be a non-empty list"},
      {R"({"datasets": [{"weight": 1}]})", "datasets[0] has no \"files\""},
      {R"({"datasets": [{"files": ["a"], "weight": 0}]})",
       "datasets[0].weight must be a positive number"},
      {R"({"datasets": [{"files": ["a"]}, {"files": ["b"], "weight": -1}]})", "datasets[1].weight"},
      {R"({"datasets": [{"files": ["a"], "weight": "1"}]})", "datasets[0].weight"},
      {R"({"datasets": [{"files": ["a"], "format": "u8"}]})", "unknown format 'u8'"},
      {R"({"datasets": [{"files": ["a"], "files2": 1}]})", "unknown key \"files2\" in datasets[0]"},
      {R"({"datasets": [{"files": [1]}]})", "not a path"},
      {R"({"datasets": [{"files": ["a"]}], "mode": "docs"})", "\"mode\" must be"},
      {R"({"datasets": [{"files": ["a"]}], "eot": -1})", "\"eot\" must be a token id"},
  };
  int i = 0;
  for (const auto &[text, problem] : cases) {
    auto m = dir.write_text("bad" + std::to_string(i++) + ".json", text);
    auto msg = error_of([&] { read_manifest(m); }, CTR_STATUS_DATA_ERROR);
    EXPECT_NE(msg.find(m), std::string::npos) << text << ": " << msg;
    EXPECT_NE(msg.find(problem), std::string::npos) << text << ": " << msg;
  }
  auto msg = error_of([&] { read_manifest(dir.path() + "/missing.json"); }, CTR_STATUS_IO_ERROR);
  EXPECT_NE(msg.find("missing.json"), std::string::npos) << msg;
  // A file named in a manifest that does not exist is named by the loader.
  auto m = dir.write_text("gone.json", R"({"datasets": [{"files": ["gone.bin"]}]})");
  OpenOptions o;
  o.seq = 4;
  msg = error_of([&] { open_loader(m, o); }, CTR_STATUS_IO_ERROR);
  EXPECT_NE(msg.find(dir.path() + "/gone.bin"), std::string::npos) << msg;
}

TEST(Manifest, OpenLoaderTakesModeAndEotFromManifestOrOptions) {
  TempDir dir;
  dir.write("a.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {9, 1, 2, 3, 9, 4, 5, 9}, 2));
  dir.write("b.u16", raw_file({1, 2, 3, 4, 5, 6, 7, 8, 9}, 2));
  auto m = dir.write_text("mix.json", R"({"datasets": [{"files": ["a.bin"], "weight": 2},
    {"files": ["b.u16"], "format": "u16"}], "mode": "documents", "eot": 9})");
  OpenOptions o;
  o.seq = 2;
  auto l = open_loader(m, o);
  ASSERT_EQ(l->parts(), 2);
  EXPECT_EQ(l->mode(), Mode::Documents);
  EXPECT_EQ(l->eot(), 9);
  EXPECT_EQ(l->part_name(0), "a.bin");
  EXPECT_EQ(l->weight(0), 2.0);
  EXPECT_EQ(l->tokens(), 17);
  EXPECT_EQ(l->max_token(), 9u);
  // Documents of a.bin: [9 1 2 3 9] (4 predictions, 2 samples), [9 4 5 9] (3, 2).
  EXPECT_EQ(l->samples(0), 4);
  // b.u16 holds one id 9 at its end: one document of 8 predictions.
  EXPECT_EQ(l->samples(1), 4);

  o.mode = Mode::Windows;  // options override the manifest
  auto w = open_loader(m, o);
  EXPECT_EQ(w->mode(), Mode::Windows);
  EXPECT_EQ(w->samples(0), 3);

  // An explicit format reads a .json name as a token file.
  OpenOptions raw;
  raw.seq = 2;
  raw.format = Format::Bytes;
  auto bytes = open_loader(m, raw);
  EXPECT_EQ(bytes->parts(), 1);
  EXPECT_STREQ(bytes->source().kind(), "bytes");

  OpenOptions docs;
  docs.seq = 2;
  docs.mode = Mode::Documents;
  auto msg = error_of([&] { open_loader(dir.path() + "/a.bin", docs); }, CTR_STATUS_INVALID_OPTION);
  EXPECT_NE(msg.find("'eot'"), std::string::npos) << msg;
  docs.eot = 9;
  EXPECT_EQ(open_loader(dir.path() + "/a.bin", docs)->samples(), 4);
  // No path: the built-in corpus.
  OpenOptions corpus;
  corpus.seq = 8;
  corpus.corpus_bytes = 1000;
  EXPECT_STREQ(open_loader("", corpus)->source().kind(), "synthetic");
}

// ------------------------------------------------------------------------------------------
// Mixing

// Draws from a mixture and returns which sub-dataset each draw took.
std::vector<int> mixture_draws(const std::vector<double> &weights, uint64_t seed, int draws,
                               std::vector<std::unique_ptr<TokenSource>> &keep) {
  std::vector<Part> parts;
  for (size_t k = 0; k < weights.size(); ++k) {
    if (keep.size() <= k) keep.push_back(TokenSource::synthetic(k, 4 * (100 + 37 * k) + 1));
    Part p;
    p.source = keep[k].get();
    p.weight = weights[k];
    parts.push_back(std::move(p));
  }
  Loader l(std::move(parts), LoaderConfig{4, seed});
  std::vector<int> out;
  for (int i = 0; i < draws; ++i) out.push_back(l.next_draw().part);
  return out;
}

TEST(Mixture, WeightsAreFollowedClosely) {
  // Smooth weighted round-robin keeps every count close to its share at every
  // point, not only on average. The tolerance held here: within 2 draws of
  // t * w_k / sum(w) after every one of 10,000 draws, for 2 to 5 sub-datasets.
  const std::vector<std::vector<double>> cases = {
      {0.7, 0.3}, {5, 3, 2}, {1, 1}, {0.01, 0.99}, {1, 2, 3, 4, 5}};
  for (const auto &w : cases) {
    std::vector<std::unique_ptr<TokenSource>> keep;
    double total = 0;
    for (double x : w) total += x;
    for (uint64_t seed : {0ull, 7ull}) {
      const auto draws = mixture_draws(w, seed, 10000, keep);
      std::vector<int64_t> count(w.size(), 0);
      for (size_t t = 0; t < draws.size(); ++t) {
        ++count[static_cast<size_t>(draws[t])];
        for (size_t k = 0; k < w.size(); ++k) {
          const double expected = static_cast<double>(t + 1) * w[k] / total;
          ASSERT_LE(std::fabs(static_cast<double>(count[k]) - expected), 2.0)
              << "weights " << ::testing::PrintToString(w) << " sub-dataset " << k << " after "
              << t + 1 << " draws";
        }
      }
    }
  }
}

TEST(Mixture, ScheduleIsDeterministicAndSeeded) {
  std::vector<std::unique_ptr<TokenSource>> keep;
  const auto a = mixture_draws({0.5, 0.3, 0.2}, 1, 1000, keep);
  EXPECT_EQ(a, mixture_draws({0.5, 0.3, 0.2}, 1, 1000, keep));
  bool differs = false;
  for (uint64_t seed = 2; seed < 10 && !differs; ++seed)
    differs = a != mixture_draws({0.5, 0.3, 0.2}, seed, 1000, keep);
  EXPECT_TRUE(differs) << "the seed should move the schedule's phase";
}

TEST(Mixture, EverySubDatasetKeepsItsOwnEpochs) {
  TempDir dir;
  const int64_t seq = 4;
  auto a = ramp(dir, "a.u32", 0u << 24, 13 * seq + 1);  // 13 samples
  auto b = ramp(dir, "b.u32", 1u << 24, 50 * seq + 3);  // 50 samples
  std::vector<Part> parts(2);
  parts[0].source = a.get();
  parts[0].weight = 0.6;
  parts[1].source = b.get();
  parts[1].weight = 0.4;
  Loader l(std::move(parts), LoaderConfig{seq, 3}, 5);
  std::vector<std::vector<int64_t>> seen(2);
  std::vector<int32_t> tok(5 * seq), tgt(5 * seq);
  for (int batch = 0; batch < 100; ++batch) {
    l.next(tok.data(), tgt.data());
    for (int r = 0; r < 5; ++r) {
      const Sample s = decode(tok.data() + r * seq, tgt.data() + r * seq, seq);
      seen[static_cast<size_t>(s.part)].push_back(s.index);
    }
  }
  for (int k = 0; k < 2; ++k) {
    const int64_t n = l.samples(k);
    const auto &v = seen[static_cast<size_t>(k)];
    ASSERT_GE(static_cast<int64_t>(v.size()), 2 * n);
    for (size_t e = 0; (e + 1) * static_cast<size_t>(n) <= v.size(); ++e) {
      std::set<int64_t> epoch(v.begin() + static_cast<std::ptrdiff_t>(e * n),
                              v.begin() + static_cast<std::ptrdiff_t>((e + 1) * n));
      EXPECT_EQ(static_cast<int64_t>(epoch.size()), n) << "sub-dataset " << k << " epoch " << e;
      EXPECT_EQ(*epoch.rbegin(), n - 1);
    }
  }
  const LoaderState st = l.state();
  EXPECT_GT(st.parts[0].epoch, st.parts[1].epoch);  // the small one cycles faster
}

// ------------------------------------------------------------------------------------------
// Documents

// Checks one epoch of documents mode over src: rows are whole pieces of one
// document (eot only as the first input or the last target), padded at the end
// with input eot and target -1, and the (input, target) pairs of the epoch are
// exactly the adjacent pairs of the source, each once.
void check_documents_epoch(const TokenSource &src, int64_t seq, uint32_t eot, uint64_t seed) {
  Loader l(src, LoaderConfig{seq, seed, Mode::Documents, eot}, 1);
  std::multiset<std::pair<uint32_t, uint32_t>> want, got;
  for (int64_t i = 0; i + 1 < src.size(); ++i) want.insert({src.token(i), src.token(i + 1)});
  std::vector<int32_t> tok(static_cast<size_t>(seq)), tgt(tok.size());
  for (int64_t s = 0; s < l.samples(); ++s) {
    l.next(tok.data(), tgt.data());
    ASSERT_NE(tgt[0], -1) << "an empty sample";
    bool ended = false;
    for (int64_t t = 0; t < seq; ++t) {
      if (tgt[static_cast<size_t>(t)] == -1) {
        EXPECT_EQ(static_cast<uint32_t>(tok[static_cast<size_t>(t)]), eot);
        ended = true;
        continue;
      }
      ASSERT_FALSE(ended) << "a target after the padding";
      const auto in = static_cast<uint32_t>(tok[static_cast<size_t>(t)]);
      const auto out = static_cast<uint32_t>(tgt[static_cast<size_t>(t)]);
      if (t > 0) {
        EXPECT_NE(in, eot) << "a sample crosses a document boundary";
        EXPECT_EQ(in, static_cast<uint32_t>(tgt[static_cast<size_t>(t) - 1]));
      }
      got.insert({in, out});
      if (out == eot) ended = true;  // the document's end: only padding may follow
    }
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(l.state().parts[0].epoch, 1u);
}

TEST(Documents, SamplesStayInsideDocumentsAndCoverEveryTargetOnce) {
  TempDir dir;
  const uint32_t eot = 7;
  // Document lengths (content tokens between eots); 0 is two eots in a row.
  const std::vector<int> lengths = {3, 1, 0, 8, 5, 12, 4, 0, 0, 2, 9, 31, 6};
  for (bool leading_eot : {true, false}) {
    for (bool trailing_eot : {true, false}) {
      std::vector<uint32_t> toks;
      uint32_t next = 1000;
      if (leading_eot) toks.push_back(eot);
      for (size_t d = 0; d < lengths.size(); ++d) {
        if (d > 0) toks.push_back(eot);
        for (int i = 0; i < lengths[d]; ++i) toks.push_back(next++);
      }
      if (trailing_eot) toks.push_back(eot);
      auto src = TokenSource::open(dir.write("docs.u32", raw_file(toks, 4)), Format::U32);
      for (int64_t seq : {1, 2, 4, 5, 64})
        for (uint64_t seed : {0ull, 5ull}) check_documents_epoch(*src, seq, eot, seed);
    }
  }
  // Without any eot the whole source is one document: windows plus a padded tail.
  auto plain = TokenSource::synthetic(3, 1001);
  check_documents_epoch(*plain, 64, 1u << 20, 1);
  Loader l(*plain, LoaderConfig{64, 0, Mode::Documents, 1u << 20});
  EXPECT_EQ(l.samples(), (1000 + 63) / 64);
}

TEST(Documents, SampleCountsAndErrors) {
  TempDir dir;
  // llm.c layout: every document starts with eot. Documents: [e a b c e] (4
  // predictions), [e d e] (2), [e f g h i j] (5).
  const uint32_t e = 50256;
  auto src = TokenSource::open(dir.write(
      "l.bin", llmc_file(kLlmcMagicU16, kLlmcVersionU16, {e, 1, 2, 3, e, 4, e, 5, 6, 7, 8, 9}, 2)));
  EXPECT_EQ(Loader(*src, LoaderConfig{1, 0, Mode::Documents, e}).samples(), 11);
  EXPECT_EQ(Loader(*src, LoaderConfig{2, 0, Mode::Documents, e}).samples(), 2 + 1 + 3);
  EXPECT_EQ(Loader(*src, LoaderConfig{4, 0, Mode::Documents, e}).samples(), 1 + 1 + 2);
  EXPECT_EQ(Loader(*src, LoaderConfig{100, 0, Mode::Documents, e}).samples(), 3);
  // Filled rows: the second document at seq 4 is [e 4 | pad pad].
  Loader l(*src, LoaderConfig{4, 0, Mode::Documents, e});
  std::vector<int32_t> tok(4), tgt(4);
  bool found = false;
  for (int i = 0; i < 4; ++i) {
    const auto d = l.next_draw();
    l.fill(d.part, d.sample, tok.data(), tgt.data());
    if (tok[1] != 4) continue;
    found = true;
    EXPECT_EQ(tok, (std::vector<int32_t>{static_cast<int32_t>(e), 4, static_cast<int32_t>(e),
                                         static_cast<int32_t>(e)}));
    EXPECT_EQ(tgt, (std::vector<int32_t>{4, static_cast<int32_t>(e), -1, -1}));
  }
  EXPECT_TRUE(found);

  auto one = TokenSource::open(dir.write("one.u16", raw_file({e}, 2)), Format::U16);
  auto msg = error_of(
      [&] {
        Loader(*one, LoaderConfig{4, 0, Mode::Documents, e});
      },
      CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("one.u16"), std::string::npos) << msg;
  auto eots = TokenSource::open(dir.write("eots.u16", raw_file({e, e, e}, 2)), Format::U16);
  EXPECT_EQ(Loader(*eots, LoaderConfig{4, 0, Mode::Documents, e}).samples(), 2);
  error_of(
      [&] {
        Loader(*src, LoaderConfig{4, 0, Mode::Documents, -1});
      },
      CTR_STATUS_INVALID_ARGUMENT);
}

// ------------------------------------------------------------------------------------------
// State as JSON

TEST(LoaderJson, RoundTripsAndContinuesIdentically) {
  TempDir dir;
  auto a = ramp(dir, "a.u32", 0u << 24, 40 * 8 + 1);
  auto b = ramp(dir, "b.u32", 1u << 24, 25 * 8 + 1);
  const auto make = [&](uint64_t seed) {
    std::vector<Part> parts(2);
    parts[0].source = a.get();
    parts[0].weight = 3;
    parts[0].name = "a";
    parts[1].source = b.get();
    parts[1].name = "b";
    return std::make_unique<Loader>(std::move(parts), LoaderConfig{8, seed}, 3);
  };
  for (int stop : {0, 1, 7, 13, 14, 40}) {  // 13-14 batches straddle a's epoch edge
    auto x = make(11);
    std::vector<int32_t> tok(24), tgt(24), tok2(24), tgt2(24);
    for (int i = 0; i < stop; ++i) x->next(tok.data(), tgt.data());
    const json saved = x->state_json();
    EXPECT_EQ(saved["draws"], static_cast<uint64_t>(3 * stop));
    EXPECT_EQ(saved["seq"], 8);
    EXPECT_EQ(saved["datasets"][1]["name"], "b");
    EXPECT_EQ(saved["datasets"][0]["samples"], 40);
    auto y = make(99);  // another seed: the state's wins
    y->restore_json(json::parse(saved.dump()));
    EXPECT_EQ(y->state_json(), saved);
    for (int i = 0; i < 30; ++i) {
      x->next(tok.data(), tgt.data());
      y->next(tok2.data(), tgt2.data());
      ASSERT_EQ(tok, tok2) << "stop=" << stop << " batch " << i;
      ASSERT_EQ(tgt, tgt2);
    }
  }
  // Weights 3:1 and 0.75:0.25 are the same schedule.
  auto x = make(1);
  json scaled = x->state_json();
  scaled["datasets"][0]["weight"] = 0.75;
  scaled["datasets"][1]["weight"] = 0.25;
  x->restore_json(scaled);
}

TEST(LoaderJson, MismatchesAreNamedAndLeaveTheLoaderUnchanged) {
  TempDir dir;
  auto a = ramp(dir, "a.u32", 0, 40 * 8 + 1);
  auto b = ramp(dir, "b.u32", 1u << 24, 25 * 8 + 1);
  auto c = ramp(dir, "c.u32", 2u << 24, 30 * 8 + 1);
  const auto make = [&](std::vector<const TokenSource *> srcs, int64_t seq,
                        Mode mode = Mode::Windows) {
    std::vector<Part> parts;
    for (const auto *s : srcs) {
      Part p;
      p.source = s;
      parts.push_back(std::move(p));
    }
    return std::make_unique<Loader>(std::move(parts), LoaderConfig{seq, 5, mode, 0}, 1);
  };
  auto src = make({a.get(), b.get()}, 8);
  std::vector<int32_t> tok(8), tgt(8);
  for (int i = 0; i < 9; ++i) src->next(tok.data(), tgt.data());
  const json saved = src->state_json();

  auto target = make({a.get(), b.get()}, 8);
  target->next(tok.data(), tgt.data());
  const json before = target->state_json();
  const auto refused = [&](const json &state, const std::string &problem, Loader *l = nullptr) {
    Loader *t = l != nullptr ? l : target.get();
    const json was = t->state_json();
    auto msg = error_of([&] { t->restore_json(state); }, CTR_STATUS_DATA_ERROR);
    EXPECT_NE(msg.find(problem), std::string::npos) << msg;
    EXPECT_NE(msg.find("data loader state"), std::string::npos) << msg;
    EXPECT_EQ(t->state_json(), was) << "a refused state changed the loader";
  };
  auto seq4 = make({a.get(), b.get()}, 4);
  refused(saved, "seq 8, this loader uses seq 4", seq4.get());
  auto three = make({a.get(), b.get(), c.get()}, 8);
  refused(saved, "saved for 2 sub-datasets, this loader has 3", three.get());
  auto other = make({a.get(), c.get()}, 8);
  refused(saved, "other files or another manifest", other.get());
  auto docs = make({a.get(), b.get()}, 8, Mode::Documents);
  refused(saved, "saved in windows mode, this loader is in documents mode", docs.get());

  json w = saved;
  w["datasets"][1]["weight"] = 2.0;
  refused(w, "saved with weights 1, 2, this loader has weights 1, 1");
  json far = saved;
  far["datasets"][0]["position"] = 41;
  far["draws"] =
      saved["draws"].get<uint64_t>() + 41 - saved["datasets"][0]["position"].get<uint64_t>();
  refused(far, "has only 40 samples");
  json draws = saved;
  draws["draws"] = 1000;
  refused(draws, "inconsistent");
  json missing = saved;
  missing["datasets"][0].erase("epoch");
  refused(missing, "malformed");
  json typed = saved;
  typed["seed"] = "five";
  refused(typed, "malformed");
  refused(json::array(), "not a JSON object");
  json version = saved;
  version["version"] = 2;
  refused(version, "unsupported version 2");
  EXPECT_EQ(target->state_json(), before);

  // The single-source form of older checkpoints restores a single source only.
  auto single = make({a.get()}, 8);
  single->restore_json(json{{"seed", 5}, {"epoch", 2}, {"position", 7}, {"seq", 8}});
  EXPECT_EQ(single->state().parts[0].epoch, 2u);
  EXPECT_EQ(single->state().parts[0].position, 7u);
  EXPECT_EQ(single->state_json()["draws"], 2 * 40 + 7);
  refused(json{{"seed", 5}, {"epoch", 0}, {"position", 1}, {"seq", 8}}, "single-source");
  // A position at the end of an epoch is the start of the next one.
  single->restore_json(json{{"seed", 5}, {"epoch", 0}, {"position", 40}});
  EXPECT_EQ(single->state().parts[0].epoch, 1u);
  EXPECT_EQ(single->state().parts[0].position, 0u);
}

// ------------------------------------------------------------------------------------------
// Rescaling: the state is valid for any world size

TEST(Rescale, SingleFileNoSampleRepeatedOrSkippedWithinTheEpoch) {
  TempDir dir;
  const int64_t seq = 4, n = 97;  // a prime: no global batch divides the epoch
  auto src = ramp(dir, "a.u32", 0, n * seq + 2);
  const Factory make = [&] { return std::make_unique<Loader>(*src, LoaderConfig{seq, 21}, 1); };
  // The order an uninterrupted single-rank run sees.
  std::vector<Sample> reference;
  {
    auto l = make();
    std::vector<int32_t> tok(static_cast<size_t>(seq)), tgt(tok.size());
    for (int64_t i = 0; i < n; ++i) {
      l->next(tok.data(), tgt.data());
      reference.push_back(decode(tok.data(), tgt.data(), seq));
    }
  }
  struct Case {
    int w1;
    int64_t l1;
    int k;
    int w2;
    int64_t l2;
  };
  for (const Case &c : {Case{4, 3, 5, 3, 5}, Case{1, 8, 3, 6, 1}, Case{3, 2, 0, 1, 7},
                        Case{8, 1, 11, 2, 3}, Case{2, 5, 9, 5, 2}}) {
    SCOPED_TRACE(::testing::Message() << "W1=" << c.w1 << " x " << c.l1 << ", " << c.k
                                      << " batches, then W2=" << c.w2 << " x " << c.l2);
    const auto drawn = rescaled_run(make, c.w1, c.l1, c.k, c.w2, c.l2, n);
    std::vector<int64_t> sorted;
    for (const auto &s : drawn) sorted.push_back(s.index);
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i) << "sample " << i;
    // Stronger: the order itself is the single-rank order.
    EXPECT_EQ(drawn, reference);
  }
}

TEST(Rescale, MixtureNoSampleRepeatedOrSkippedWithinEachSubDatasetEpoch) {
  TempDir dir;
  const int64_t seq = 4;
  auto a = ramp(dir, "a.u32", 0u << 24, 61 * seq + 1);
  auto b = ramp(dir, "b.u32", 1u << 24, 23 * seq + 3);
  auto c = ramp(dir, "c.u32", 2u << 24, 40 * seq + 1);
  const Factory make = [&] {
    std::vector<Part> parts(3);
    parts[0].source = a.get();
    parts[0].weight = 0.5;
    parts[1].source = b.get();
    parts[1].weight = 0.3;
    parts[2].source = c.get();
    parts[2].weight = 0.2;
    return std::make_unique<Loader>(std::move(parts), LoaderConfig{seq, 4}, 1);
  };
  // Draws until every sub-dataset has finished its first epoch.
  auto probe = make();
  int64_t total = 0;
  while (probe->state().parts[0].epoch == 0 || probe->state().parts[1].epoch == 0 ||
         probe->state().parts[2].epoch == 0) {
    probe->next_draw();
    ++total;
  }
  std::vector<Sample> reference;
  {
    auto l = make();
    std::vector<int32_t> tok(static_cast<size_t>(seq)), tgt(tok.size());
    for (int64_t i = 0; i < total; ++i) {
      l->next(tok.data(), tgt.data());
      reference.push_back(decode(tok.data(), tgt.data(), seq));
    }
  }
  const int64_t n[3] = {61, 23, 40};
  for (const auto &[w1, l1, k, w2, l2] : std::vector<std::tuple<int, int64_t, int, int, int64_t>>{
           {4, 2, 7, 3, 3}, {1, 16, 2, 8, 1}, {6, 1, 19, 2, 5}, {3, 3, 0, 4, 4}}) {
    SCOPED_TRACE(::testing::Message() << "W1=" << w1 << " x " << l1 << ", " << k
                                      << " batches, then W2=" << w2 << " x " << l2);
    const auto drawn = rescaled_run(make, w1, l1, k, w2, l2, total);
    std::vector<std::vector<int64_t>> per(3);
    for (const auto &s : drawn) per[static_cast<size_t>(s.part)].push_back(s.index);
    for (int p = 0; p < 3; ++p) {
      auto &v = per[static_cast<size_t>(p)];
      ASSERT_GE(static_cast<int64_t>(v.size()), n[p]);
      std::vector<int64_t> epoch(v.begin(), v.begin() + n[p]);
      std::sort(epoch.begin(), epoch.end());
      for (int64_t i = 0; i < n[p]; ++i)
        ASSERT_EQ(epoch[static_cast<size_t>(i)], i) << "sub-dataset " << p << " sample " << i;
    }
    EXPECT_EQ(drawn, reference);
  }
}

TEST(Rescale, DocumentsModeSlicesMatchTheGlobalOrder) {
  // Documents mode changes what a sample is, not how draws are shared out:
  // the rows of W ranks' slices are the rows of the single-rank order.
  TempDir dir;
  std::vector<uint32_t> toks;
  for (int d = 0; d < 40; ++d) {
    toks.push_back(0);  // eot
    for (int i = 0; i < (d * 7) % 11 + 1; ++i)
      toks.push_back(static_cast<uint32_t>(100 + toks.size()));
  }
  auto src = TokenSource::open(dir.write("d.u32", raw_file(toks, 4)), Format::U32);
  const int64_t seq = 3;
  const LoaderConfig cfg{seq, 8, Mode::Documents, 0};
  Loader single(*src, cfg, 1);
  const int64_t n = single.samples();
  std::vector<int32_t> want(static_cast<size_t>(2 * n * seq)), want_t(want.size());
  for (int64_t i = 0; i < 2 * n; ++i) single.next(want.data() + i * seq, want_t.data() + i * seq);

  for (int world : {2, 3, 5}) {
    std::vector<std::unique_ptr<Loader>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<Loader>(*src, cfg, 1));
    const int64_t local = 2;
    std::vector<int32_t> got, got_t, tok(static_cast<size_t>(local * seq)), tgt(tok.size());
    while (static_cast<int64_t>(got.size()) < 2 * n * seq) {
      for (int r = 0; r < world; ++r) {
        ranks[static_cast<size_t>(r)]->next_slice(world * local, r * local, local, tok.data(),
                                                  tgt.data());
        got.insert(got.end(), tok.begin(), tok.end());
        got_t.insert(got_t.end(), tgt.begin(), tgt.end());
      }
    }
    got.resize(want.size());
    got_t.resize(want.size());
    EXPECT_EQ(got, want) << "world " << world;
    EXPECT_EQ(got_t, want_t) << "world " << world;
  }
}

// ------------------------------------------------------------------------------------------
// Through the C ABI

TEST(LoaderAbi, NextSliceReadsOneRanksRowsOfTheGlobalBatch) {
  TempDir dir;
  const int64_t seq = 4;
  std::vector<uint32_t> toks(101 * 4 + 1);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i);
  dir.write("a.npy",
            npy_file(npy_dict("<u4", "(" + std::to_string(toks.size()) + ",)"), raw_file(toks, 4)));
  dir.write("b.u16", raw_file({5, 6, 7, 8, 9, 10, 11, 12, 13}, 2));
  const std::string manifest = dir.write_text("m.json", R"({"datasets": [
      {"files": ["a.npy"], "weight": 3}, {"files": ["b.u16"], "format": "u16"}]})");

  ctr_options *o = nullptr;
  ASSERT_EQ(ctr_options_create(&o), CTR_STATUS_OK);
  ASSERT_EQ(ctr_options_set_int(o, "seq", seq), CTR_STATUS_OK);
  ASSERT_EQ(ctr_options_set_int(o, "seed", 3), CTR_STATUS_OK);
  ctr_loader *whole = nullptr, *part = nullptr;
  ASSERT_EQ(ctr_loader_create(manifest.c_str(), o, &whole), CTR_STATUS_OK) << ctr_last_error();
  ASSERT_EQ(ctr_loader_create(manifest.c_str(), o, &part), CTR_STATUS_OK) << ctr_last_error();
  int64_t ntok = 0, maxtok = 0;
  ASSERT_EQ(ctr_loader_info(whole, &ntok, &maxtok), CTR_STATUS_OK);
  EXPECT_EQ(ntok, static_cast<int64_t>(toks.size()) + 9);
  EXPECT_EQ(maxtok, static_cast<int64_t>(toks.size()) - 1);

  const int64_t global = 6;
  std::vector<int32_t> all(global * seq), all_t(all.size()), mine(2 * seq), mine_t(mine.size());
  for (int batch = 0; batch < 20; ++batch) {
    ASSERT_EQ(ctr_loader_next(whole, global, all.data(), all_t.data()), CTR_STATUS_OK);
    const int64_t first = (batch % 3) * 2;  // rank batch % 3 of 3, 2 rows each
    ASSERT_EQ(ctr_loader_next_slice(part, global, first, 2, mine.data(), mine_t.data()),
              CTR_STATUS_OK)
        << ctr_last_error();
    EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + first * seq)) << batch;
    EXPECT_TRUE(std::equal(mine_t.begin(), mine_t.end(), all_t.begin() + first * seq)) << batch;
  }
  // A rank with no rows still advances; NULL buffers are fine then.
  ASSERT_EQ(ctr_loader_next_slice(part, global, global, 0, nullptr, nullptr), CTR_STATUS_OK);
  ASSERT_EQ(ctr_loader_next(whole, global, all.data(), all_t.data()), CTR_STATUS_OK);
  ASSERT_EQ(ctr_loader_next_slice(part, 1, 0, 1, mine.data(), mine_t.data()), CTR_STATUS_OK);
  ASSERT_EQ(ctr_loader_next(whole, 1, all.data(), all_t.data()), CTR_STATUS_OK);
  EXPECT_TRUE(std::equal(mine.begin(), mine.begin() + seq, all.begin()));

  // Bad slices are refused without moving the loader.
  EXPECT_EQ(ctr_loader_next_slice(part, 4, 3, 2, mine.data(), mine_t.data()),
            CTR_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ctr_last_error()).find("not inside the global batch"), std::string::npos);
  EXPECT_EQ(ctr_loader_next_slice(part, 4, -1, 1, mine.data(), mine_t.data()),
            CTR_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(ctr_loader_next_slice(part, -1, 0, 0, nullptr, nullptr), CTR_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(ctr_loader_next_slice(part, 4, 0, 1, nullptr, mine_t.data()),
            CTR_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(ctr_loader_next_slice(nullptr, 4, 0, 1, mine.data(), mine_t.data()),
            CTR_STATUS_INVALID_ARGUMENT);
  ASSERT_EQ(ctr_loader_next_slice(part, 3, 1, 1, mine.data(), mine_t.data()), CTR_STATUS_OK);
  ASSERT_EQ(ctr_loader_next(whole, 3, all.data(), all_t.data()), CTR_STATUS_OK);
  EXPECT_TRUE(std::equal(mine.begin(), mine.begin() + seq, all.begin() + seq));

  ctr_loader_free(whole);
  ctr_loader_free(part);
  ctr_options_free(o);
}

TEST(LoaderAbi, FormatModeAndEotOptions) {
  TempDir dir;
  const std::string u16 = dir.write("t.u16", raw_file({9, 1, 2, 9, 3, 4, 5, 9}, 2));
  ctr_options *o = nullptr;
  ASSERT_EQ(ctr_options_create(&o), CTR_STATUS_OK);
  ASSERT_EQ(ctr_options_set_int(o, "seq", 2), CTR_STATUS_OK);
  ctr_loader *l = nullptr;
  ASSERT_EQ(ctr_loader_create(u16.c_str(), o, &l), CTR_STATUS_OK);  // auto: bytes
  int64_t n = 0;
  ASSERT_EQ(ctr_loader_info(l, &n, nullptr), CTR_STATUS_OK);
  EXPECT_EQ(n, 16);
  ctr_loader_free(l);

  ASSERT_EQ(ctr_options_set_string(o, "format", "u16"), CTR_STATUS_OK);
  ASSERT_EQ(ctr_options_set_string(o, "mode", "documents"), CTR_STATUS_OK);
  l = nullptr;
  EXPECT_EQ(ctr_loader_create(u16.c_str(), o, &l), CTR_STATUS_INVALID_OPTION);
  EXPECT_NE(std::string(ctr_last_error()).find("'eot'"), std::string::npos) << ctr_last_error();
  EXPECT_EQ(l, nullptr);
  ASSERT_EQ(ctr_options_set_int(o, "eot", 9), CTR_STATUS_OK);
  ASSERT_EQ(ctr_loader_create(u16.c_str(), o, &l), CTR_STATUS_OK) << ctr_last_error();
  ASSERT_EQ(ctr_loader_info(l, &n, nullptr), CTR_STATUS_OK);
  EXPECT_EQ(n, 8);
  // Documents [9 1 2 9] and [9 3 4 5 9]: 2 + 2 samples, the last one padded.
  std::vector<int32_t> tok(8), tgt(8);
  ASSERT_EQ(ctr_loader_next(l, 4, tok.data(), tgt.data()), CTR_STATUS_OK);
  EXPECT_EQ(std::count(tgt.begin(), tgt.end(), -1), 1);
  ctr_loader_free(l);

  ASSERT_EQ(ctr_options_set_string(o, "format", "u24"), CTR_STATUS_OK);
  EXPECT_EQ(ctr_loader_create(u16.c_str(), o, &l), CTR_STATUS_INVALID_OPTION);
  EXPECT_NE(std::string(ctr_last_error()).find("'format'"), std::string::npos) << ctr_last_error();
  ASSERT_EQ(ctr_options_set_string(o, "format", "npy"), CTR_STATUS_OK);
  EXPECT_EQ(ctr_loader_create(u16.c_str(), o, &l), CTR_STATUS_DATA_ERROR);
  EXPECT_NE(std::string(ctr_last_error()).find(u16), std::string::npos) << ctr_last_error();
  ctr_options_free(o);
}

}  // namespace
}  // namespace ctr::data
