// Layer normalisation and RMS normalisation over the last dimension.
//
// Forward and the input gradient work row by row, split over the pool by rows.
// The weight and bias gradients are sums over rows; they are computed in a second
// pass split over columns, so each sum has one owner, needs no per-thread buffer,
// and comes out the same whatever the thread count. That pass re-reads dy and x,
// which for the usual sizes are still in the last-level cache.
//
// Statistics use two passes over the row (mean, then squared deviations) in
// float: for a row that fits in L1 this costs little and avoids the cancellation of
// the one-pass E[x^2] - E[x]^2 formula.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_sum;

// Elements per chunk below which a loop stays on the calling thread.
constexpr int64_t kGrain = 1 << 14;
constexpr int64_t kCols = 256;


// sum of (x - c)^2
float row_sq_dev(const float *x, float c, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) {
      const float d = x[i + k] - c;
      acc[k] += d * d;
    }
  float s = 0.0f;
  for (; i < n; ++i) s += (x[i] - c) * (x[i] - c);
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

int64_t row_grain(int64_t C) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)); }

// dw[j] (+)= sum_r dy[r,j] * xhat[r,j] with xhat = (x - shift[r]) * rstd[r]
// (shift null: 0), and db[j] (+)= sum_r dy[r,j] when db is set. dy and x are
// float or bf16 (widened exactly as read: the sums of an f32 copy).
template <typename T>
void weight_grads(const T *dy, const T *x, const float *shift, const float *rstd, float *dw, float *db, int64_t R,
                  int64_t C, bool accumulate) {
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(R, 1));
  ctr::parallel_for(C, grain, [=](int64_t c0, int64_t c1) {
    for (int64_t j0 = c0; j0 < c1; j0 += kCols) {
      const int64_t w = std::min(kCols, c1 - j0);
      float aw[kCols] = {}, ab[kCols] = {};
      for (int64_t r = 0; r < R; ++r) {
        const T *g = dy + r * C + j0;
        const T *xr = x + r * C + j0;
        const float m = shift ? shift[r] : 0.0f, s = rstd[r];
        for (int64_t j = 0; j < w; ++j) aw[j] += widen(g[j]) * ((widen(xr[j]) - m) * s);
        if (db)
          for (int64_t j = 0; j < w; ++j) ab[j] += widen(g[j]);
      }
      if (accumulate) {
        for (int64_t j = 0; j < w; ++j) dw[j0 + j] += aw[j];
        if (db)
          for (int64_t j = 0; j < w; ++j) db[j0 + j] += ab[j];
      } else {
        for (int64_t j = 0; j < w; ++j) dw[j0 + j] = aw[j];
        if (db)
          for (int64_t j = 0; j < w; ++j) db[j0 + j] = ab[j];
      }
    }
  });
}

// A thread's rows of f32 for the bf16 kernels (C floats each; unused for f32).
float *row_buffers(int64_t C, int n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n * C)) buf.resize(static_cast<size_t>(n * C));
  return buf.data();
}

// ---------------------------------------------------------------------------
// LayerNorm (T: float, or uint16_t for bf16 storage of x, y, dy and dx; each row
// widened into f32, computed as in f32 and rounded once: the same bits as the
// f32 kernel on widened copies)

template <typename T>
void layernorm_fwd_t(const T *x, const float *w, const float *b, T *y, float *mean, float *rstd, int64_t R,
                     int64_t C, float eps) {
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : row_buffers(C, 2);
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = row_f32(x + r * C, C, buf);
      float *yr = out_f32(y + r * C, buf ? buf + C : nullptr);
      const float m = row_sum(xr, C) / static_cast<float>(C);
      const float var = row_sq_dev(xr, m, C) / static_cast<float>(C);
      const float s = 1.0f / std::sqrt(var + eps);
      mean[r] = m;
      rstd[r] = s;
      if (b) {
        for (int64_t j = 0; j < C; ++j) yr[j] = (xr[j] - m) * s * w[j] + b[j];
      } else {
        for (int64_t j = 0; j < C; ++j) yr[j] = (xr[j] - m) * s * w[j];
      }
      store_row(yr, y + r * C, C);
    }
  });
}

template <typename T>
void layernorm_bwd_t(const T *dy, const T *x, const float *w, const float *mean, const float *rstd, T *dx,
                     float *dw, float *db, int64_t R, int64_t C, bool accumulate) {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : row_buffers(C, 3);
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = row_f32(dy + r * C, C, buf);
      const float *xr = row_f32(x + r * C, C, buf ? buf + C : nullptr);
      float *o = out_f32(dx + r * C, buf ? buf + 2 * C : nullptr);
      const float m = mean[r], s = rstd[r];
      float a1[16] = {}, a2[16] = {};
      int64_t j = 0;
      for (; j + 16 <= C; j += 16)
        for (int k = 0; k < 16; ++k) {
          const float gw = g[j + k] * w[j + k];
          a1[k] += gw;
          a2[k] += gw * ((xr[j + k] - m) * s);
        }
      float sg = 0.0f, sgx = 0.0f;
      for (; j < C; ++j) {
        const float gw = g[j] * w[j];
        sg += gw;
        sgx += gw * ((xr[j] - m) * s);
      }
      for (int k = 0; k < 16; ++k) {
        sg += a1[k];
        sgx += a2[k];
      }
      const float mg = sg / static_cast<float>(C), mgx = sgx / static_cast<float>(C);
      for (int64_t k = 0; k < C; ++k) o[k] = s * (g[k] * w[k] - mg - ((xr[k] - m) * s) * mgx);
      store_row(o, dx + r * C, C);
    }
  });
  weight_grads(dy, x, mean, rstd, dw, db, R, C, accumulate);
}

// ---------------------------------------------------------------------------
// RMSNorm (T as for LayerNorm)

template <typename T>
void rmsnorm_fwd_t(const T *x, const float *w, T *y, float *rstd, int64_t R, int64_t C, float eps) {
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : row_buffers(C, 2);
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = row_f32(x + r * C, C, buf);
      float *yr = out_f32(y + r * C, buf ? buf + C : nullptr);
      const float s = 1.0f / std::sqrt(row_sq_dev(xr, 0.0f, C) / static_cast<float>(C) + eps);
      rstd[r] = s;
      for (int64_t j = 0; j < C; ++j) yr[j] = xr[j] * s * w[j];
      store_row(yr, y + r * C, C);
    }
  });
}

template <typename T>
void rmsnorm_bwd_t(const T *dy, const T *x, const float *w, const float *rstd, T *dx, float *dw, int64_t R,
                   int64_t C, bool accumulate) {
  // dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd.
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : row_buffers(C, 3);
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = row_f32(dy + r * C, C, buf);
      const float *xr = row_f32(x + r * C, C, buf ? buf + C : nullptr);
      float *o = out_f32(dx + r * C, buf ? buf + 2 * C : nullptr);
      const float s = rstd[r];
      float acc[16] = {};
      int64_t j = 0;
      for (; j + 16 <= C; j += 16)
        for (int k = 0; k < 16; ++k) acc[k] += g[j + k] * w[j + k] * xr[j + k];
      float sgx = 0.0f;
      for (; j < C; ++j) sgx += g[j] * w[j] * xr[j];
      for (int k = 0; k < 16; ++k) sgx += acc[k];
      const float c = s * s * sgx / static_cast<float>(C);  // mean(g * xhat) * rstd
      for (int64_t k = 0; k < C; ++k) o[k] = s * (g[k] * w[k] - xr[k] * c);
      store_row(o, dx + r * C, C);
    }
  });
  weight_grads(dy, x, nullptr, rstd, dw, nullptr, R, C, accumulate);
}

}  // namespace

void layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd, int64_t R,
                   int64_t C, float eps) {
  layernorm_fwd_t(x, w, b, y, mean, rstd, R, C, eps);
}
void layernorm_fwd_bf16(const uint16_t *x, const float *w, const float *b, uint16_t *y, float *mean, float *rstd,
                        int64_t R, int64_t C, float eps) {
  layernorm_fwd_t(x, w, b, y, mean, rstd, R, C, eps);
}
void layernorm_bwd(const float *dy, const float *x, const float *w, const float *mean, const float *rstd, float *dx,
                   float *dw, float *db, int64_t R, int64_t C, bool accumulate) {
  layernorm_bwd_t(dy, x, w, mean, rstd, dx, dw, db, R, C, accumulate);
}
void layernorm_bwd_bf16(const uint16_t *dy, const uint16_t *x, const float *w, const float *mean,
                        const float *rstd, uint16_t *dx, float *dw, float *db, int64_t R, int64_t C,
                        bool accumulate) {
  layernorm_bwd_t(dy, x, w, mean, rstd, dx, dw, db, R, C, accumulate);
}
void rmsnorm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t R, int64_t C, float eps) {
  rmsnorm_fwd_t(x, w, y, rstd, R, C, eps);
}
void rmsnorm_fwd_bf16(const uint16_t *x, const float *w, uint16_t *y, float *rstd, int64_t R, int64_t C,
                      float eps) {
  rmsnorm_fwd_t(x, w, y, rstd, R, C, eps);
}
void rmsnorm_bwd(const float *dy, const float *x, const float *w, const float *rstd, float *dx, float *dw,
                 int64_t R, int64_t C, bool accumulate) {
  rmsnorm_bwd_t(dy, x, w, rstd, dx, dw, R, C, accumulate);
}
void rmsnorm_bwd_bf16(const uint16_t *dy, const uint16_t *x, const float *w, const float *rstd, uint16_t *dx,
                      float *dw, int64_t R, int64_t C, bool accumulate) {
  rmsnorm_bwd_t(dy, x, w, rstd, dx, dw, R, C, accumulate);
}

}  // namespace ctr::cpu
