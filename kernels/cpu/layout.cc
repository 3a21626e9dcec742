// Slice and concatenation kernels: row-block copies.
//
// Both ops see their tensors as [outer, rows, inner] around the sliced or
// joined dim, so every copy is a run of contiguous bytes: a whole block of
// len * inner elements per outer index for a unit-step slice, a run of inner
// elements per taken row otherwise, one run per (outer index, input) for cat.
// Loops run over runs, never over elements, and split over the thread pool by
// runs; each run has one writer, so results do not depend on the thread count.
// Elements are 4 bytes (f32 or i32): values are moved, never computed on.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

constexpr int64_t kElem = 4;
// Bytes per chunk below which a loop stays on the calling thread (as the
// element-wise kernels' 32K floats).
constexpr int64_t kGrainBytes = int64_t{1} << 17;

// Copies rows start, start + step, ... of x[outer, size, inner] to or from
// y[outer, len, inner] (scatter: from y back into x's places).
template <bool Scatter>
void slice_rows(const char *src, char *dst, int64_t outer, int64_t size, int64_t inner, int64_t start,
                int64_t len, int64_t step) {
  if (outer == 0 || len == 0 || inner == 0) return;
  // A unit step takes one block per outer index.
  const int64_t runs_per_outer = step == 1 ? 1 : len;
  const int64_t run = (step == 1 ? len : 1) * inner * kElem;
  const int64_t xblock = size * inner * kElem, yblock = len * inner * kElem;
  const int64_t xstep = step * inner * kElem, first = start * inner * kElem;
  parallel_for(outer * runs_per_outer, std::max<int64_t>(1, kGrainBytes / run), [&](int64_t r0, int64_t r1) {
    int64_t o = r0 / runs_per_outer, j = r0 % runs_per_outer;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t xoff = o * xblock + first + j * xstep, yoff = o * yblock + j * run;
      if (Scatter)
        std::memcpy(dst + xoff, src + yoff, static_cast<size_t>(run));
      else
        std::memcpy(dst + yoff, src + xoff, static_cast<size_t>(run));
      if (++j == runs_per_outer) {
        j = 0;
        ++o;
      }
    }
  });
}

}  // namespace

void slice_fwd(const void *x, void *y, int64_t outer, int64_t size, int64_t inner, int64_t start, int64_t len,
               int64_t step) {
  slice_rows<false>(static_cast<const char *>(x), static_cast<char *>(y), outer, size, inner, start, len, step);
}

void slice_bwd(const float *dy, float *dx, int64_t outer, int64_t size, int64_t inner, int64_t start,
               int64_t len, int64_t step) {
  // Zeros, then the gradient's rows put back: the rows no slice took stay zero.
  if (len < size) fill(dx, 0.0f, outer * size * inner);
  slice_rows<true>(reinterpret_cast<const char *>(dy), reinterpret_cast<char *>(dx), outer, size, inner, start,
                   len, step);
}

void cat_fwd(const void *const *xs, const int64_t *widths, int64_t n, void *y, int64_t outer) {
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) total += widths[k];
  if (outer == 0 || total == 0) return;
  // Runs are (outer index, input) pairs; the grain counts them by their mean size.
  const int64_t mean = std::max<int64_t>(1, total * kElem / n);
  char *out = static_cast<char *>(y);
  parallel_for(outer * n, std::max<int64_t>(1, kGrainBytes / mean), [&](int64_t r0, int64_t r1) {
    int64_t o = r0 / n, k = r0 % n;
    // Column of input k within y's rows, found once per chunk.
    int64_t col = 0;
    for (int64_t i = 0; i < k; ++i) col += widths[i];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t w = widths[k] * kElem;
      if (w > 0)
        std::memcpy(out + (o * total + col) * kElem, static_cast<const char *>(xs[k]) + o * w,
                    static_cast<size_t>(w));
      col += widths[k];
      if (++k == n) {
        k = 0;
        col = 0;
        ++o;
      }
    }
  });
}

}  // namespace ctr::cpu
