// Rotary position embedding, forward and backward: the "rotate half" form
// (pairs (i, i + D/2)) and the interleaved form (pairs (2i, 2i+1), Meta's complex
// numbers), both by angle t * theta^(-2i/D) for pair i.
//
// The angles depend only on (t, i), so the loop is split over positions t and each
// chunk builds the cos/sin of one position once, then applies them to every batch
// entry and head (x may alias y: each pair is read before it is written).
// Angles are computed in double: t * theta^(-2i/D) reaches thousands of radians for
// long sequences, where a float angle would lose most of its fractional part
// before the sine is taken.
//
// On bf16 storage each row is widened into f32, rotated as in f32 and rounded
// once (the bits of the f32 kernel on widened copies).
//
// Backward is the same rotation by the opposite angle, so both directions share
// one routine with the sign of the sine flipped.
//
// Under context parallelism (cp_ranks > 1) the rows are two chunks of a longer
// sequence, and each row's angle is that of its global position (ctr_cp_position).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/op_params.h"
#include "core/thread_pool.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

// Per-thread buffer that grows once and is then reused across calls.
template <class T>
T *scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <typename X>
void rotate(const X *x, X *y, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
            float sign, bool interleaved, int64_t cp_ranks, int64_t cp_index) {
  const int64_t half = D / 2;
  const int64_t row = H * D;
  double *freq = scratch<double>(half);
  for (int64_t i = 0; i < half; ++i)
    freq[i] = std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / D);
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(B * row, 1));
  ctr::parallel_for(T, grain, [=](int64_t t0, int64_t t1) {
    float *cs = scratch<float>(2 * half + (std::is_same_v<X, float> ? 0 : 2 * row)), *sn = cs + half;
    float *bin = sn + half, *bout = bin + row;  // bf16: one row widened, one computed
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = cp_ranks > 1 ? ctr_cp_position(t, T, cp_ranks, cp_index) : t;
      for (int64_t i = 0; i < half; ++i) {
        const double ang = static_cast<double>(pos) * freq[i];
        cs[i] = static_cast<float>(std::cos(ang));
        sn[i] = sign * static_cast<float>(std::sin(ang));
      }
      for (int64_t b = 0; b < B; ++b) {
        const float *xr = row_f32(x + (b * T + t) * row, row, bin);
        float *yr = out_f32(y + (b * T + t) * row, bout);
        if (interleaved) {
          for (int64_t h = 0; h < H; ++h) {
            const float *xh = xr + h * D;
            float *yh = yr + h * D;
            for (int64_t i = 0; i < half; ++i) {
              const float a = xh[2 * i], c = xh[2 * i + 1];
              yh[2 * i] = a * cs[i] - c * sn[i];
              yh[2 * i + 1] = a * sn[i] + c * cs[i];
            }
          }
          store_row(yr, y + (b * T + t) * row, row);
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          const float *x1 = xr + h * D, *x2 = x1 + half;
          float *y1 = yr + h * D, *y2 = y1 + half;
          for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], c = x2[i];
            y1[i] = a * cs[i] - c * sn[i];
            y2[i] = a * sn[i] + c * cs[i];
          }
        }
        store_row(yr, y + (b * T + t) * row, row);
      }
    }
  });
}

}  // namespace

void rope_fwd(const float *x, float *y, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
              bool interleaved, int64_t cp_ranks, int64_t cp_index) {
  rotate(x, y, B, T, H, D, theta, 1.0f, interleaved, cp_ranks, cp_index);
}

void rope_bwd(const float *dy, float *dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
              bool interleaved, int64_t cp_ranks, int64_t cp_index) {
  rotate(dy, dx, B, T, H, D, theta, -1.0f, interleaved, cp_ranks, cp_index);
}
void rope_fwd_bf16(const uint16_t *x, uint16_t *y, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   bool interleaved, int64_t cp_ranks, int64_t cp_index) {
  rotate(x, y, B, T, H, D, theta, 1.0f, interleaved, cp_ranks, cp_index);
}
void rope_bwd_bf16(const uint16_t *dy, uint16_t *dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   bool interleaved, int64_t cp_ranks, int64_t cp_index) {
  rotate(dy, dx, B, T, H, D, theta, -1.0f, interleaved, cp_ranks, cp_index);
}

}  // namespace ctr::cpu
