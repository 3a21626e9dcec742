// Counter-based random numbers for parameter init.
//
// A value is a pure function of (seed, stream, index): no generator state is
// carried from one element to the next, so any shard of a tensor, on any rank,
// draws exactly the numbers the unsharded tensor would hold at those indices.
// The stream is a 64-bit hash of the tensor's name, stable across files and runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace ctr::rng {

inline uint64_t mix64(uint64_t z) {
  // splitmix64 finaliser: a bijection with full avalanche.
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, then mixed
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return mix64(h);
}

inline uint64_t bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return mix64(mix64(seed ^ 0x9e3779b97f4a7c15ULL) ^ mix64(stream + 0x632be59bd9b4e019ULL) ^
               (index * 0xd1b54a32d192ed03ULL));
}

// Uniform in (0, 1), never 0 or 1.
inline double uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return ((bits(seed, stream, index) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal via Box-Muller on two independent counters per element.
inline double normal(uint64_t seed, uint64_t stream, uint64_t index) {
  double u1 = uniform(seed, stream, 2 * index);
  double u2 = uniform(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace ctr::rng
