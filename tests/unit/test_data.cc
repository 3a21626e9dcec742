// Unit tests of lib/data: token-file parsing and its error messages, raw-byte
// sources, the built-in corpus, and the loader's permutation and resumability.
//
// The loader's guarantees are what make checkpoint/resume and multi-rank runs
// see the same data as an uninterrupted single run, so they are tested directly:
// every window exactly once per epoch (for window counts around the awkward
// sizes 1, 2, a non-power of two and powers of two), and restore(state())
// continuing bit-identically, including across an epoch boundary.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
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
    for (const auto &f : files_) std::remove(f.c_str());
    ::rmdir(path_.c_str());
  }
  std::string write(const std::string &name, const std::vector<uint8_t> &bytes) {
    std::string f = path_ + "/" + name;
    FILE *fp = std::fopen(f.c_str(), "wb");
    if (fp == nullptr) std::abort();
    if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), fp);
    std::fclose(fp);
    files_.push_back(f);
    return f;
  }
  const std::string &path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::string> files_;
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
  EXPECT_EQ(Loader(*src, 3, 1, 0).windows(), 1);
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
      ASSERT_EQ(loader.windows(), n);
      std::vector<uint64_t> previous;
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<uint64_t> order;
        std::set<uint64_t> seen;
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_EQ(loader.state().epoch, static_cast<uint64_t>(epoch));
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
    EXPECT_EQ(b.state().epoch, saved.epoch);
    EXPECT_EQ(b.state().position, saved.position);
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
    EXPECT_EQ(six.state().epoch, two.state().epoch);
    EXPECT_EQ(six.state().position, two.state().position);
  }
}

TEST(Loader, RestoreRejectsForeignState) {
  auto src = TokenSource::synthetic(1, 10 * 4 + 1);
  Loader loader(*src, 4, 1, 0);
  LoaderState s{0, 0, 11};
  auto msg = error_of([&] { loader.restore(s); }, CTR_STATUS_DATA_ERROR);
  EXPECT_NE(msg.find("synthetic corpus"), std::string::npos) << msg;
  s.position = 10;  // the end of an epoch is the start of the next
  loader.restore(s);
  EXPECT_EQ(loader.state().epoch, 1u);
  EXPECT_EQ(loader.state().position, 0u);
  loader.next_window();
  EXPECT_EQ(loader.state().position, 1u);
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

}  // namespace
}  // namespace ctr::data
