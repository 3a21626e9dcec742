// The loader: samples of weighted sub-datasets in a seeded order that is computed,
// never stored, and a state of a few integers that survives any change of world
// size.
//
// Two things make rescaling exact. First, the order is global: every rank runs
// the same loader from the same state and draws every sample of a global batch,
// reading only its own rows, so the state after a batch does not depend on how
// the batch was split. Second, the state counts samples, not batches or ranks:
// per sub-dataset (epoch, position), from which the mixing schedule follows too.
// A job that stops after k batches of G1 rows and resumes with batches of G2
// rows continues the same sequence of samples at sample k * G1, so within an
// epoch nothing is repeated or skipped.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/status.h"
#include "data/data.h"

namespace ctr::data {

using nlohmann::json;

// ------------------------------------------------------------------------------------------
// The permutation of one sub-dataset

namespace {

// Weights are integers in units of 2^-30 of the total: fine enough for any
// ratio people write, and exact, so the schedule is the same on every machine.
constexpr double kWeightUnits = 1073741824.0;

// Total samples drawn from a sub-dataset; 128 bits so that products with
// weights in the mixing rule cannot overflow however long a run is.
using Wide = __int128;

// A seeded permutation of [0, n) per epoch (see Loader in data.h).
class Permutation {
 public:
  Permutation() = default;
  Permutation(uint64_t n, uint64_t seed, uint64_t stream) : n_(n), seed_(seed), stream_(stream) {
    bits_ = 0;
    while ((uint64_t{1} << bits_) < n_) ++bits_;
    mask_ = (uint64_t{1} << bits_) - 1;
    shift_ = std::max(1, bits_ / 2);
    begin_epoch();
  }

  uint64_t next() {
    for (;;) {
      x_ = (mul_ * x_ + inc_) & mask_;
      const uint64_t w = mix(x_);
      // m < 2n, so fewer than half the draws are skipped.
      if (w >= n_) continue;
      // Roll over as soon as the epoch is used up, so that the state always
      // reads "epoch = completed passes, position < n".
      if (++position_ == n_) {
        ++epoch_;
        begin_epoch();
      }
      return w;
    }
  }

  // position < n; replays the epoch up to it.
  void reset(uint64_t seed, uint64_t epoch, uint64_t position) {
    seed_ = seed;
    epoch_ = epoch;
    begin_epoch();
    while (position_ < position) next();
  }

  uint64_t size() const { return n_; }
  uint64_t epoch() const { return epoch_; }
  uint64_t position() const { return position_; }
  Wide drawn() const { return static_cast<Wide>(epoch_) * n_ + position_; }

 private:
  void begin_epoch() {
    // Eight counters per epoch, five used: the LCG's multiplier (made = 1 mod 4)
    // and increment (made odd) satisfy Hull-Dobell for a power-of-two modulus, so
    // the generator walks all m residues before repeating.
    const uint64_t base = epoch_ * 8;
    mul_ = (rng::bits(seed_, stream_, base) & ~uint64_t{3}) | 1;
    inc_ = rng::bits(seed_, stream_, base + 1) | 1;
    x_ = rng::bits(seed_, stream_, base + 2) & mask_;
    mix1_ = rng::bits(seed_, stream_, base + 3) | 1;
    mix2_ = rng::bits(seed_, stream_, base + 4) | 1;
    position_ = 0;
  }

  // A bijection of [0, m): odd multiplies and xor-shifts are each invertible
  // modulo 2^bits. It moves the high bits of the LCG (its good ones) into the
  // low bits, which a bare power-of-two LCG would leave strictly periodic.
  uint64_t mix(uint64_t x) const {
    if (bits_ == 0) return 0;
    x = (x * mix1_) & mask_;
    x ^= x >> shift_;
    x = (x * mix2_) & mask_;
    x ^= x >> shift_;
    return x;
  }

  uint64_t n_ = 0, mask_ = 0;
  int bits_ = 0, shift_ = 1;
  uint64_t seed_ = 0, stream_ = 0, epoch_ = 0, position_ = 0;
  // The current epoch's LCG and mixer, derived from (seed, stream, epoch).
  uint64_t mul_ = 1, inc_ = 1, x_ = 0, mix1_ = 1, mix2_ = 1;
};

const char *mode_name(Mode m) { return m == Mode::Documents ? "documents" : "windows"; }

std::string u64s(uint64_t v) { return std::to_string(v); }

}  // namespace

// ------------------------------------------------------------------------------------------
// Sub-datasets

struct Loader::PartData {
  std::string name;
  std::unique_ptr<const TokenSource> owned;
  const TokenSource *src = nullptr;
  double weight = 1;
  uint64_t units = 0;  // the weight in units of 2^-30 of the total
  uint64_t phase = 0;  // the seeded start of the schedule, in [0, total units)
  uint64_t n = 0;      // samples per epoch
  // Documents mode: boundary[d] is the first token of document d, whose last
  // token is boundary[d + 1]; first_sample[d] is the index of its first sample,
  // first_sample[documents] == n.
  std::vector<int64_t> boundary;
  std::vector<uint64_t> first_sample;
  Permutation perm;
};

namespace {

uint64_t part_stream(size_t k) {
  // Part 0 keeps the stream the single-source loader always used, so its
  // order, and old checkpoints' positions, mean the same as before.
  return rng::hash_name("ctr.data.loader") + k;
}

}  // namespace

Loader::Loader(const TokenSource &src, int64_t seq, int64_t rows, uint64_t seed)
    : Loader(src, LoaderConfig{seq, seed, Mode::Windows, -1}, rows) {}

Loader::Loader(const TokenSource &src, const LoaderConfig &config, int64_t rows)
    : Loader(
          [&] {
            std::vector<Part> parts(1);
            parts[0].source = &src;
            return parts;
          }(),
          config, rows) {}

Loader::Loader(std::vector<Part> parts, const LoaderConfig &config, int64_t rows)
    : config_(config), rows_(rows) {
  const int64_t seq = config.seq;
  CTR_REQUIRE(seq >= 1, CTR_STATUS_INVALID_ARGUMENT, "data loader: seq must be >= 1, got %lld",
              static_cast<long long>(seq));
  CTR_REQUIRE(rows >= 1, CTR_STATUS_INVALID_ARGUMENT, "data loader: rows must be >= 1, got %lld",
              static_cast<long long>(rows));
  CTR_REQUIRE(!parts.empty(), CTR_STATUS_INVALID_ARGUMENT, "data loader: no sub-datasets");
  CTR_REQUIRE(config.mode == Mode::Windows || (config.eot >= 0 && config.eot <= UINT32_MAX),
              CTR_STATUS_INVALID_ARGUMENT,
              "data loader: documents mode needs an end-of-text id in [0, 2^32), got %lld",
              static_cast<long long>(config.eot));

  double total = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part &p = parts[k];
    const std::string label = !p.name.empty()       ? p.name
                              : p.source != nullptr ? p.source->name()
                              : p.owned != nullptr  ? p.owned->name()
                                                    : std::string("?");
    CTR_REQUIRE(p.source != nullptr || p.owned != nullptr, CTR_STATUS_INVALID_ARGUMENT,
                "data loader: sub-dataset %zu has no source", k);
    CTR_REQUIRE(std::isfinite(p.weight) && p.weight > 0, CTR_STATUS_INVALID_ARGUMENT,
                "data loader: sub-dataset '%s' has weight %g; weights must be positive",
                label.c_str(), p.weight);
    total += p.weight;
  }
  CTR_REQUIRE(std::isfinite(total), CTR_STATUS_INVALID_ARGUMENT,
              "data loader: the weights add up to infinity");

  uint64_t units_total = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    auto d = std::make_unique<PartData>();
    Part &p = parts[k];
    d->owned = std::move(p.owned);
    d->src = p.source != nullptr ? p.source : d->owned.get();
    d->name = p.name.empty() ? d->src->name() : p.name;
    d->weight = p.weight;
    // At least one unit, so that a tiny weight still means "sometimes".
    d->units =
        std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(p.weight / total * kWeightUnits)));
    units_total += d->units;
    const TokenSource &src = *d->src;

    if (config.mode == Mode::Windows) {
      CTR_REQUIRE(src.size() >= seq + 1, CTR_STATUS_DATA_ERROR,
                  "data source '%s' holds %lld tokens, fewer than seq + 1 = %lld: not one "
                  "training window fits",
                  d->name.c_str(), static_cast<long long>(src.size()),
                  static_cast<long long>(seq + 1));
      d->n = static_cast<uint64_t>((src.size() - 1) / seq);
    } else {
      // Boundaries: the start, every end-of-text token, the end; consecutive
      // ones delimit a document. One sequential pass in blocks keeps the scan
      // at the speed of reading the file.
      const auto eot = static_cast<uint32_t>(config.eot);
      const int64_t size = src.size();
      if (size >= 2) {
        d->boundary.push_back(0);
        std::vector<uint32_t> block(size_t{1} << 16);
        for (int64_t at = 0; at < size; at += static_cast<int64_t>(block.size())) {
          const int64_t len = std::min<int64_t>(static_cast<int64_t>(block.size()), size - at);
          src.read(at, len, block.data());
          for (int64_t i = 0; i < len; ++i)
            if (block[static_cast<size_t>(i)] == eot && at + i > 0) d->boundary.push_back(at + i);
        }
        if (d->boundary.back() != size - 1) d->boundary.push_back(size - 1);
      }
      const size_t docs = d->boundary.empty() ? 0 : d->boundary.size() - 1;
      d->first_sample.resize(docs + 1);
      uint64_t n = 0;
      for (size_t j = 0; j < docs; ++j) {
        d->first_sample[j] = n;
        const auto predictions = static_cast<uint64_t>(d->boundary[j + 1] - d->boundary[j]);
        n += (predictions + static_cast<uint64_t>(seq) - 1) / static_cast<uint64_t>(seq);
      }
      d->first_sample[docs] = n;
      CTR_REQUIRE(n >= 1, CTR_STATUS_DATA_ERROR,
                  "data source '%s' holds %lld tokens: no document of at least two tokens, so "
                  "not one training sample fits",
                  d->name.c_str(), static_cast<long long>(size));
      d->n = n;
    }
    d->perm = Permutation(d->n, config.seed, part_stream(k));
    parts_.push_back(std::move(d));
  }
  const uint64_t mix_stream = rng::hash_name("ctr.data.mix");
  for (size_t k = 0; k < parts_.size(); ++k)
    parts_[k]->phase = parts_.size() == 1 ? 0 : rng::bits(config.seed, mix_stream, k) % units_total;
  scratch_.resize(static_cast<size_t>(seq) + 1);
}

Loader::~Loader() = default;

int64_t Loader::samples(int part) const {
  return static_cast<int64_t>(parts_[static_cast<size_t>(part)]->n);
}
const TokenSource &Loader::source(int part) const {
  return *parts_[static_cast<size_t>(part)]->src;
}
const std::string &Loader::part_name(int part) const {
  return parts_[static_cast<size_t>(part)]->name;
}
double Loader::weight(int part) const { return parts_[static_cast<size_t>(part)]->weight; }

int64_t Loader::tokens() const {
  int64_t n = 0;
  for (const auto &p : parts_) n += p->src->size();
  return n;
}

uint32_t Loader::max_token() const {
  uint32_t m = 0;
  for (const auto &p : parts_) m = std::max(m, p->src->max_token());
  return m;
}

// ------------------------------------------------------------------------------------------
// Drawing

Loader::Draw Loader::next_draw() {
  size_t k = 0;
  if (parts_.size() > 1) {
    // Smooth weighted round-robin on the counts (see data.h): the largest
    // deficit W_k (t + 1) + phase_k - c_k S goes next.
    Wide total = 0;
    for (const auto &p : parts_) total += p->units;
    Wide best = 0;
    for (size_t j = 0; j < parts_.size(); ++j) {
      const PartData &p = *parts_[j];
      const Wide deficit = static_cast<Wide>(p.units) * (static_cast<Wide>(draws_) + 1) + p.phase -
                           p.perm.drawn() * total;
      if (j == 0 || deficit > best) {
        best = deficit;
        k = j;
      }
    }
  }
  const uint64_t sample = parts_[k]->perm.next();
  ++draws_;
  return {static_cast<int>(k), sample};
}

void Loader::fill(int part, uint64_t sample, int32_t *tokens, int32_t *targets) const {
  const PartData &p = *parts_[static_cast<size_t>(part)];
  const int64_t seq = config_.seq;
  int64_t start = 0, len = seq;
  if (config_.mode == Mode::Windows) {
    start = static_cast<int64_t>(sample) * seq;
  } else {
    const auto it = std::upper_bound(p.first_sample.begin(), p.first_sample.end(), sample);
    const auto doc = static_cast<size_t>(it - p.first_sample.begin()) - 1;
    const int64_t chunk = static_cast<int64_t>(sample - p.first_sample[doc]);
    start = p.boundary[doc] + chunk * seq;
    len = std::min(seq, p.boundary[doc + 1] - start);
  }
  p.src->read(start, len + 1, scratch_.data());
  // Ids above INT32_MAX (possible only in uint32 files, or negative ids of int32
  // .npy files) are no ids a step takes.
  for (int64_t t = 0; t <= len; ++t) {
    const uint32_t id = scratch_[static_cast<size_t>(t)];
    if (id > static_cast<uint32_t>(INT32_MAX))
      fail(CTR_STATUS_DATA_ERROR,
           strformat("data '%s': token %lld is id %u (%d as a signed int32), which no vocabulary "
                     "holds: token ids are int32 and at least 0; the file is damaged or was "
                     "written with another dtype",
                     p.src->name().c_str(), static_cast<long long>(start + t), id,
                     static_cast<int32_t>(id)));
  }
  for (int64_t t = 0; t < len; ++t) {
    tokens[t] = static_cast<int32_t>(scratch_[static_cast<size_t>(t)]);
    targets[t] = static_cast<int32_t>(scratch_[static_cast<size_t>(t) + 1]);
  }
  for (int64_t t = len; t < seq; ++t) {
    tokens[t] = static_cast<int32_t>(config_.eot);
    targets[t] = -1;
  }
}

void Loader::next_slice(int64_t global_rows, int64_t first_row, int64_t rows, int32_t *tokens,
                        int32_t *targets) {
  const int64_t seq = config_.seq;
  for (int64_t g = 0; g < global_rows; ++g) {
    const Draw d = next_draw();
    const int64_t r = g - first_row;
    if (r < 0 || r >= rows) continue;
    fill(d.part, d.sample, tokens + r * seq, targets + r * seq);
  }
}

void Loader::next(int32_t *tokens, int32_t *targets) {
  next_slice(rows_, 0, rows_, tokens, targets);
}

// ------------------------------------------------------------------------------------------
// State

LoaderState Loader::state() const {
  LoaderState s;
  s.seed = config_.seed;
  for (const auto &p : parts_) s.parts.push_back({p->perm.epoch(), p->perm.position()});
  return s;
}

void Loader::check_state(const LoaderState &state) const {
  CTR_REQUIRE(state.parts.size() == parts_.size(), CTR_STATUS_DATA_ERROR,
              "data loader state has %zu sub-datasets, this loader has %zu (over '%s'): the "
              "state was saved for other data",
              state.parts.size(), parts_.size(), parts_[0]->name.c_str());
  for (size_t k = 0; k < parts_.size(); ++k) {
    const PartData &p = *parts_[k];
    CTR_REQUIRE(state.parts[k].position <= p.n, CTR_STATUS_DATA_ERROR,
                "data loader state is at sample %llu of an epoch, but '%s' at seq %lld has only "
                "%llu samples: the state was saved for another data file or sequence length",
                static_cast<unsigned long long>(state.parts[k].position), p.name.c_str(),
                static_cast<long long>(config_.seq), static_cast<unsigned long long>(p.n));
  }
}

void Loader::apply_state(const LoaderState &state) {
  config_.seed = state.seed;
  draws_ = 0;
  for (size_t k = 0; k < parts_.size(); ++k) {
    PartData &p = *parts_[k];
    const PartState &s = state.parts[k];
    // A state at the very end of an epoch is the start of the next one.
    if (s.position == p.n)
      p.perm.reset(state.seed, s.epoch + 1, 0);
    else
      p.perm.reset(state.seed, s.epoch, s.position);
    draws_ += static_cast<uint64_t>(p.perm.drawn());
  }
  const uint64_t mix_stream = rng::hash_name("ctr.data.mix");
  uint64_t units_total = 0;
  for (const auto &p : parts_) units_total += p->units;
  for (size_t k = 0; k < parts_.size(); ++k)
    parts_[k]->phase = parts_.size() == 1 ? 0 : rng::bits(state.seed, mix_stream, k) % units_total;
}

void Loader::restore(const LoaderState &state) {
  check_state(state);
  apply_state(state);
}

json Loader::state_json() const {
  json datasets = json::array();
  for (const auto &p : parts_)
    datasets.push_back({{"name", p->name},
                        {"tokens", p->src->size()},
                        {"samples", p->n},
                        {"weight", p->weight},
                        {"epoch", p->perm.epoch()},
                        {"position", p->perm.position()}});
  json j = {{"version", 1},       {"seed", config_.seed},
            {"seq", config_.seq}, {"mode", mode_name(config_.mode)},
            {"draws", draws_},    {"datasets", std::move(datasets)}};
  if (config_.mode == Mode::Documents) j["eot"] = config_.eot;
  return j;
}

void Loader::restore_json(const json &j) {
  // Everything is checked before anything changes, so a refused state leaves
  // the loader where it was.
  const auto bad = [](const std::string &what) {
    fail(CTR_STATUS_DATA_ERROR, "data loader state: " + what);
  };
  LoaderState st;
  try {
    if (!j.is_object()) bad("not a JSON object");
    if (j.contains("seq") && j.at("seq").get<int64_t>() != config_.seq)
      bad(strformat("saved at seq %lld, this loader uses seq %lld: another sequence length",
                    static_cast<long long>(j.at("seq").get<int64_t>()),
                    static_cast<long long>(config_.seq)));
    st.seed = j.at("seed").get<uint64_t>();
    if (!j.contains("datasets")) {
      // The single-source form of earlier checkpoints: {seed, epoch, position, seq}.
      if (parts_.size() != 1)
        bad(
            strformat("the state is of a single-source loader, this loader mixes %zu "
                      "sub-datasets: another manifest",
                      parts_.size()));
      st.parts.push_back({j.at("epoch").get<uint64_t>(), j.at("position").get<uint64_t>()});
    } else {
      if (j.value("version", 0) != 1)
        bad(strformat("unsupported version %d", j.value("version", 0)));
      const std::string mode = j.at("mode").get<std::string>();
      if (mode != mode_name(config_.mode))
        bad(strformat("saved in %s mode, this loader is in %s mode", mode.c_str(),
                      mode_name(config_.mode)));
      if (config_.mode == Mode::Documents && j.at("eot").get<int64_t>() != config_.eot)
        bad(strformat("saved with end-of-text id %lld, this loader uses %lld",
                      static_cast<long long>(j.at("eot").get<int64_t>()),
                      static_cast<long long>(config_.eot)));
      const json &ds = j.at("datasets");
      if (!ds.is_array()) bad("\"datasets\" is not an array");
      if (ds.size() != parts_.size())
        bad(
            strformat("saved for %zu sub-datasets, this loader has %zu (the first '%s'): "
                      "another manifest",
                      ds.size(), parts_.size(), parts_[0]->name.c_str()));
      // Weights compare as the schedule sees them, so 7:3 and 0.7:0.3 are one.
      double total = 0;
      std::string saved_weights, weights;
      for (size_t k = 0; k < parts_.size(); ++k) {
        const double w = ds[k].at("weight").get<double>();
        if (!(std::isfinite(w) && w > 0)) bad(strformat("sub-dataset %zu has weight %g", k, w));
        total += w;
        saved_weights += strformat("%s%g", k ? ", " : "", w);
        weights += strformat("%s%g", k ? ", " : "", parts_[k]->weight);
      }
      for (size_t k = 0; k < parts_.size(); ++k) {
        const json &d = ds[k];
        const PartData &p = *parts_[k];
        const std::string name = d.value("name", std::string("?"));
        const auto tokens = d.at("tokens").get<int64_t>();
        const auto samples = d.at("samples").get<uint64_t>();
        const auto weight = d.at("weight").get<double>();
        if (tokens != p.src->size() || samples != p.n)
          bad(strformat(
              "sub-dataset %zu was '%s' with %lld tokens and %llu samples, here it "
              "is '%s' with %lld tokens and %llu samples: other files or another "
              "manifest",
              k, name.c_str(), static_cast<long long>(tokens),
              static_cast<unsigned long long>(samples), p.name.c_str(),
              static_cast<long long>(p.src->size()), static_cast<unsigned long long>(p.n)));
        const auto units = std::max<uint64_t>(
            1, static_cast<uint64_t>(std::llround(weight / total * kWeightUnits)));
        if (units != p.units)
          bad(strformat("saved with weights %s, this loader has weights %s: another manifest",
                        saved_weights.c_str(), weights.c_str()));
        st.parts.push_back({d.at("epoch").get<uint64_t>(), d.at("position").get<uint64_t>()});
      }
    }
  } catch (const json::exception &e) {
    bad(strformat("malformed: %s", e.what()));
  }
  check_state(st);
  if (j.contains("draws")) {
    Wide sum = 0;
    for (size_t k = 0; k < parts_.size(); ++k) {
      const uint64_t pos = st.parts[k].position;
      sum += static_cast<Wide>(st.parts[k].epoch) * parts_[k]->n + pos;
    }
    uint64_t draws = 0;
    try {
      draws = j.at("draws").get<uint64_t>();
    } catch (const json::exception &e) {
      bad(strformat("malformed: %s", e.what()));
    }
    if (static_cast<Wide>(draws) != sum)
      bad(
          strformat("inconsistent: %s draws in total, but the sub-datasets' epochs and "
                    "positions add up to %s",
                    u64s(draws).c_str(), u64s(static_cast<uint64_t>(sum)).c_str()));
  }
  apply_state(st);
}

}  // namespace ctr::data
