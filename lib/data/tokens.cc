// Token sources (mapped files and the built-in corpus) and the permuted loader.
//
// Files are mapped, not read: the loader touches seq + 1 tokens per window at
// random offsets, so letting the page cache fetch exactly those pages keeps
// start-up constant and memory flat however large the corpus is.
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
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/status.h"
#include "data/data.h"

namespace ctr::data {

// ------------------------------------------------------------------------------------------
// Files

namespace {

// The header is little-endian on disk whatever the host is.
int32_t load_le32(const uint8_t *p) {
  return static_cast<int32_t>(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                              static_cast<uint32_t>(p[2]) << 16 |
                              static_cast<uint32_t>(p[3]) << 24);
}

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() { ::close(fd_); }
  FdCloser(const FdCloser &) = delete;
  FdCloser &operator=(const FdCloser &) = delete;

 private:
  int fd_;
};

}  // namespace

std::unique_ptr<TokenSource> TokenSource::open(const std::string &path) {
  std::unique_ptr<TokenSource> src(new TokenSource());
  src->name_ = path;

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CTR_REQUIRE(fd >= 0, CTR_STATUS_IO_ERROR, "cannot open data file '%s': %s", path.c_str(),
              std::strerror(errno));
  FdCloser closer(fd);
  struct stat st;
  CTR_REQUIRE(::fstat(fd, &st) == 0, CTR_STATUS_IO_ERROR, "cannot stat data file '%s': %s",
              path.c_str(), std::strerror(errno));
  CTR_REQUIRE(S_ISREG(st.st_mode), CTR_STATUS_IO_ERROR, "data file '%s' is not a regular file",
              path.c_str());
  const auto file_bytes = static_cast<int64_t>(st.st_size);

  // mmap rejects length 0; an empty file is simply a source of no tokens, and
  // the loader reports it as too short with the file's name.
  const uint8_t *bytes = nullptr;
  if (file_bytes > 0) {
    void *map = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_PRIVATE, fd, 0);
    CTR_REQUIRE(map != MAP_FAILED, CTR_STATUS_IO_ERROR, "cannot map data file '%s': %s",
                path.c_str(), std::strerror(errno));
    src->map_ = map;
    src->map_bytes_ = static_cast<size_t>(file_bytes);
    bytes = static_cast<const uint8_t *>(map);
  }

  const int32_t magic = file_bytes >= 4 ? load_le32(bytes) : 0;
  if (magic != kLlmcMagicU16 && magic != kLlmcMagicU32) {
    src->kind_ = "bytes";
    src->tokens_ = bytes;
    src->size_ = file_bytes;
    src->width_ = 1;
    return src;
  }

  const bool u16 = magic == kLlmcMagicU16;
  const int32_t want_version = u16 ? kLlmcVersionU16 : kLlmcVersionU32;
  const int width = u16 ? 2 : 4;
  CTR_REQUIRE(file_bytes >= kLlmcHeaderBytes, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated llm.c header: the file has %lld bytes, the header "
              "alone needs %lld",
              path.c_str(), static_cast<long long>(file_bytes),
              static_cast<long long>(kLlmcHeaderBytes));
  const int32_t version = load_le32(bytes + 4);
  CTR_REQUIRE(version == want_version, CTR_STATUS_DATA_ERROR,
              "data file '%s': bad llm.c header version %d (magic %d needs version %d)",
              path.c_str(), version, magic, want_version);
  const int64_t count = load_le32(bytes + 8);
  CTR_REQUIRE(count >= 0, CTR_STATUS_DATA_ERROR,
              "data file '%s': bad llm.c header: negative token count %lld", path.c_str(),
              static_cast<long long>(count));
  const int64_t payload = file_bytes - kLlmcHeaderBytes;
  CTR_REQUIRE(payload >= count * width, CTR_STATUS_DATA_ERROR,
              "data file '%s': truncated: the header says %lld tokens (%lld bytes) but only "
              "%lld bytes follow it",
              path.c_str(), static_cast<long long>(count),
              static_cast<long long>(count * width), static_cast<long long>(payload));
  CTR_REQUIRE(payload == count * width, CTR_STATUS_DATA_ERROR,
              "data file '%s': token count mismatch: the header says %lld tokens but %lld "
              "bytes follow it (%lld tokens of %d bytes)",
              path.c_str(), static_cast<long long>(count), static_cast<long long>(payload),
              static_cast<long long>(payload / width), width);

  src->kind_ = u16 ? "llm.c uint16" : "llm.c uint32";
  src->tokens_ = bytes + kLlmcHeaderBytes;
  src->size_ = count;
  src->width_ = width;
  return src;
}

TokenSource::~TokenSource() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

uint32_t TokenSource::max_token() const {
  std::call_once(max_once_, [this] {
    uint32_t m = 0;
    if (width_ == 1) {
      // The common raw-text case: a plain byte loop the compiler vectorises.
      for (int64_t i = 0; i < size_; ++i) m = std::max<uint32_t>(m, tokens_[i]);
    } else {
      for (int64_t i = 0; i < size_; ++i) m = std::max(m, token(i));
    }
    max_token_ = m;
  });
  return max_token_;
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
  std::unique_ptr<TokenSource> src(new TokenSource());
  src->name_ = strformat("synthetic corpus (seed %llu)", static_cast<unsigned long long>(seed));
  src->kind_ = "synthetic";

  std::string text;
  text.reserve(static_cast<size_t>(bytes) + 4096);
  Grammar grammar(seed);
  while (static_cast<int64_t>(text.size()) < bytes) grammar.paragraph(text);
  text.resize(static_cast<size_t>(bytes));

  src->owned_.assign(text.begin(), text.end());
  src->tokens_ = src->owned_.data();
  src->size_ = bytes;
  src->width_ = 1;
  return src;
}

// ------------------------------------------------------------------------------------------
// Loader

Loader::Loader(const TokenSource &src, int64_t seq, int64_t rows, uint64_t seed)
    : src_(src), seq_(seq), rows_(rows), seed_(seed) {
  CTR_REQUIRE(seq >= 1, CTR_STATUS_INVALID_ARGUMENT, "data loader: seq must be >= 1, got %lld",
              static_cast<long long>(seq));
  CTR_REQUIRE(rows >= 1, CTR_STATUS_INVALID_ARGUMENT,
              "data loader: rows must be >= 1, got %lld", static_cast<long long>(rows));
  CTR_REQUIRE(src.size() >= seq + 1, CTR_STATUS_DATA_ERROR,
              "data source '%s' holds %lld tokens, fewer than seq + 1 = %lld: not one "
              "training window fits",
              src.name().c_str(), static_cast<long long>(src.size()),
              static_cast<long long>(seq + 1));
  n_ = static_cast<uint64_t>((src.size() - 1) / seq);
  bits_ = 0;
  while ((uint64_t{1} << bits_) < n_) ++bits_;
  mask_ = (uint64_t{1} << bits_) - 1;
  shift_ = std::max(1, bits_ / 2);
  begin_epoch();
}

void Loader::begin_epoch() {
  // Eight counters per epoch, five used: the LCG's multiplier (made = 1 mod 4)
  // and increment (made odd) satisfy Hull-Dobell for a power-of-two modulus, so
  // the generator walks all m residues before repeating.
  const uint64_t stream = rng::hash_name("ctr.data.loader");
  const uint64_t base = epoch_ * 8;
  mul_ = (rng::bits(seed_, stream, base) & ~uint64_t{3}) | 1;
  inc_ = rng::bits(seed_, stream, base + 1) | 1;
  x_ = rng::bits(seed_, stream, base + 2) & mask_;
  mix1_ = rng::bits(seed_, stream, base + 3) | 1;
  mix2_ = rng::bits(seed_, stream, base + 4) | 1;
  position_ = 0;
}

// A bijection of [0, m): odd multiplies and xor-shifts are each invertible
// modulo 2^bits. It moves the high bits of the LCG (its good ones) into the low
// bits, which a bare power-of-two LCG would leave strictly periodic.
uint64_t Loader::mix(uint64_t x) const {
  if (bits_ == 0) return 0;
  x = (x * mix1_) & mask_;
  x ^= x >> shift_;
  x = (x * mix2_) & mask_;
  x ^= x >> shift_;
  return x;
}

uint64_t Loader::next_window() {
  for (;;) {
    x_ = (mul_ * x_ + inc_) & mask_;
    const uint64_t w = mix(x_);
    // m < 2n, so fewer than half the draws are skipped.
    if (w >= n_) continue;
    // Roll over as soon as the epoch is used up, so that state() always reads
    // "epoch = completed passes, position < n".
    if (++position_ == n_) {
      ++epoch_;
      begin_epoch();
    }
    return w;
  }
}

void Loader::next(int32_t *tokens, int32_t *targets) {
  for (int64_t r = 0; r < rows_; ++r) {
    const auto start = static_cast<int64_t>(next_window()) * seq_;
    int32_t *tok = tokens + r * seq_;
    int32_t *tgt = targets + r * seq_;
    // Ids above INT32_MAX (possible only in uint32 files) turn negative here and
    // are rejected, with their position, by the step's input check.
    auto prev = static_cast<int32_t>(src_.token(start));
    for (int64_t t = 0; t < seq_; ++t) {
      const auto cur = static_cast<int32_t>(src_.token(start + t + 1));
      tok[t] = prev;
      tgt[t] = cur;
      prev = cur;
    }
  }
}

LoaderState Loader::state() const { return LoaderState{seed_, epoch_, position_}; }

void Loader::restore(const LoaderState &state) {
  CTR_REQUIRE(state.position <= n_, CTR_STATUS_DATA_ERROR,
              "data loader state is at window %llu of an epoch, but '%s' at seq %lld has only "
              "%llu windows: the state was saved for another data file or sequence length",
              static_cast<unsigned long long>(state.position), src_.name().c_str(),
              static_cast<long long>(seq_), static_cast<unsigned long long>(n_));
  seed_ = state.seed;
  // A state at the very end of an epoch is the start of the next one.
  epoch_ = state.position == n_ ? state.epoch + 1 : state.epoch;
  begin_epoch();
  const uint64_t target = state.position == n_ ? 0 : state.position;
  while (position_ < target) next_window();
}

}  // namespace ctr::data
