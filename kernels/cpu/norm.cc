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

#include "core/thread_pool.h"
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
// (shift null: 0), and db[j] (+)= sum_r dy[r,j] when db is set.
void weight_grads(const float *dy, const float *x, const float *shift, const float *rstd, float *dw,
                  float *db, int64_t R, int64_t C, bool accumulate) {
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(R, 1));
  ctr::parallel_for(C, grain, [=](int64_t c0, int64_t c1) {
    for (int64_t j0 = c0; j0 < c1; j0 += kCols) {
      const int64_t w = std::min(kCols, c1 - j0);
      float aw[kCols] = {}, ab[kCols] = {};
      for (int64_t r = 0; r < R; ++r) {
        const float *g = dy + r * C + j0;
        const float *xr = x + r * C + j0;
        const float m = shift ? shift[r] : 0.0f, s = rstd[r];
        for (int64_t j = 0; j < w; ++j) aw[j] += g[j] * ((xr[j] - m) * s);
        if (db)
          for (int64_t j = 0; j < w; ++j) ab[j] += g[j];
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

}  // namespace

// ---------------------------------------------------------------------------
// LayerNorm

void layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                   float *rstd, int64_t R, int64_t C, float eps) {
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = x + r * C;
      float *yr = y + r * C;
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
    }
  });
}

void layernorm_bwd(const float *dy, const float *x, const float *w, const float *mean,
                   const float *rstd, float *dx, float *dw, float *db, int64_t R, int64_t C,
                   bool accumulate) {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = dy + r * C;
      const float *xr = x + r * C;
      float *o = dx + r * C;
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
    }
  });
  weight_grads(dy, x, mean, rstd, dw, db, R, C, accumulate);
}

// ---------------------------------------------------------------------------
// RMSNorm

void rmsnorm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t R, int64_t C,
                 float eps) {
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = x + r * C;
      float *yr = y + r * C;
      const float s = 1.0f / std::sqrt(row_sq_dev(xr, 0.0f, C) / static_cast<float>(C) + eps);
      rstd[r] = s;
      for (int64_t j = 0; j < C; ++j) yr[j] = xr[j] * s * w[j];
    }
  });
}

void rmsnorm_bwd(const float *dy, const float *x, const float *w, const float *rstd, float *dx,
                 float *dw, int64_t R, int64_t C, bool accumulate) {
  // dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd.
  ctr::parallel_for(R, row_grain(C), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = dy + r * C;
      const float *xr = x + r * C;
      float *o = dx + r * C;
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
    }
  });
  weight_grads(dy, x, nullptr, rstd, dw, nullptr, R, C, accumulate);
}

}  // namespace ctr::cpu
