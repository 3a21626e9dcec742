// Reductions over any set of dims (sum, mean, amax, var and their gradients,
// reduce_to) and softmax / log_softmax over a dim other than the last.
//
// A reduction's plan merges x's dims into alternating runs of kept and reduced
// dims (size-1 dims dropped). Two shapes of work follow from the innermost run:
//  - reduced innermost (the common "last dim" case): each output owns runs of L
//    contiguous elements, reduced with the 16-lane row helpers of rows.h;
//  - kept innermost: a tile of up to kCols consecutive outputs reads, at every
//    reduced position, kCols contiguous elements (one per output), so the
//    accumulators stay in registers and x is read along its rows.
// Either way each output has one owner and a fixed order of additions, so the
// result does not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::exp_sum;
using rows::row_dot;
using rows::row_max;
using rows::row_sum;

constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kCols = 256;

// An index over some dims (sizes, strides) turned into an offset.
int64_t offset_of(int64_t i, int n, const int64_t *size, const int64_t *stride) {
  int64_t off = 0;
  for (int d = n - 1; d >= 0; --d) {
    off += (i % size[d]) * stride[d];
    i /= size[d];
  }
  return off;
}

// Steps through the offsets of an index space, outer dims slowest.
struct Odometer {
  int n;
  const int64_t *size, *stride;
  int64_t idx[kMaxDims] = {};
  int64_t off = 0;
  void next() {
    for (int d = n - 1; d >= 0; --d) {
      off += stride[d];
      if (++idx[d] < size[d]) return;
      off -= size[d] * stride[d];
      idx[d] = 0;
    }
  }
};

struct Plan {
  int nk = 0, nr = 0;              // kept and reduced runs, outer to inner
  int64_t ks[kMaxDims], kx[kMaxDims];  // kept: sizes, x strides
  int64_t rs[kMaxDims], rx[kMaxDims];  // reduced: sizes, x strides
  int64_t outputs = 1, n = 1;      // outputs, elements per output
  bool inner_reduced = true;
};

Plan make_plan(ShapeRef xs, ShapeRef os) {
  int64_t stride[kMaxDims];
  int64_t acc = 1;
  for (int i = xs.rank - 1; i >= 0; --i) {
    stride[i] = acc;
    acc *= xs.dims[i];
  }
  Plan p;
  int last = -1;  // 0 kept, 1 reduced
  for (int i = 0; i < xs.rank; ++i) {
    const int64_t d = xs.dims[i];
    if (d == 1) continue;
    const int j = i - (xs.rank - os.rank);
    const int red = (j < 0 || os.dims[j] == 1) ? 1 : 0;
    int64_t *sz = red ? p.rs : p.ks, *st = red ? p.rx : p.kx;
    int &cnt = red ? p.nr : p.nk;
    if (red == last) {
      sz[cnt - 1] *= d;
      st[cnt - 1] = stride[i];
    } else {
      sz[cnt] = d;
      st[cnt] = stride[i];
      ++cnt;
    }
    (red ? p.n : p.outputs) *= d;
    last = red;
  }
  p.inner_reduced = last != 0;
  // Nothing reduced, or nothing kept: a virtual dim of size 1 keeps the loops uniform.
  if (p.nr == 0) {
    p.rs[0] = 1;
    p.rx[0] = 0;
    p.nr = 1;
  }
  if (p.nk == 0) {
    p.ks[0] = 1;
    p.kx[0] = 0;
    p.nk = 1;
    p.inner_reduced = true;
  }
  return p;
}

// Calls fn(o, base) for each output o whose elements are the runs of L = rs[nr-1]
// contiguous elements at base + offset_of(q, nr-1, rs, rx). Inner-reduced plans.
template <class Fn>
void for_outputs(const Plan &p, const Fn &fn) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(p.n, 1));
  ctr::parallel_for(p.outputs, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) fn(o, offset_of(o, p.nk, p.ks, p.kx));
  });
}

// Calls fn(o0, w, base) for tiles of w <= kCols consecutive outputs whose
// elements at reduced position r lie at base + offset_of(r, nr, rs, rx) + j.
// Kept-innermost plans.
template <class Fn>
void for_tiles(const Plan &p, const Fn &fn) {
  const int64_t W = p.ks[p.nk - 1];
  const int64_t tiles = (W + kCols - 1) / kCols, groups = p.outputs / W;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(p.n * std::min(W, kCols), 1));
  ctr::parallel_for(groups * tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / tiles, c0 = (t % tiles) * kCols;
      fn(g * W + c0, std::min(kCols, W - c0), offset_of(g, p.nk - 1, p.ks, p.kx) + c0);
    }
  });
}

// Runs fn(off) over the runs of one output (inner-reduced plans).
template <class Fn>
void each_run(const Plan &p, int64_t base, const Fn &fn) {
  const int64_t L = p.rs[p.nr - 1], runs = p.n / L;
  Odometer od{p.nr - 1, p.rs, p.rx};
  od.off = base;
  for (int64_t q = 0; q < runs; ++q, od.next()) fn(od.off, L);
}

// Runs fn(off) over the reduced positions of a tile (kept-innermost plans).
template <class Fn>
void each_position(const Plan &p, int64_t base, const Fn &fn) {
  Odometer od{p.nr, p.rs, p.rx};
  od.off = base;
  for (int64_t r = 0; r < p.n; ++r, od.next()) fn(od.off);
}

float var_divisor(int64_t n, int64_t correction) {
  return static_cast<float>(std::max<int64_t>(0, n - correction));
}

}  // namespace

void reduce(Reduction op, const float *x, ShapeRef xs, float *out, ShapeRef os,
            int64_t correction, float *mean) {
  const Plan p = make_plan(xs, os);
  const float div = var_divisor(p.n, correction);
  if (p.inner_reduced) {
    for_outputs(p, [&](int64_t o, int64_t base) {
      if (op == Reduction::Amax) {
        float m = -std::numeric_limits<float>::infinity();
        each_run(p, base, [&](int64_t off, int64_t L) { m = std::max(m, row_max(x + off, L)); });
        out[o] = m;
        return;
      }
      float s = 0.0f;
      each_run(p, base, [&](int64_t off, int64_t L) { s += row_sum(x + off, L); });
      if (op == Reduction::Sum) {
        out[o] = s;
        return;
      }
      const float mu = s / static_cast<float>(p.n);
      if (op == Reduction::Mean) {
        out[o] = mu;
        return;
      }
      float m2 = 0.0f;
      each_run(p, base, [&](int64_t off, int64_t L) {
        float acc[16] = {};
        int64_t i = 0;
        for (; i + 16 <= L; i += 16)
          for (int k = 0; k < 16; ++k) {
            const float d = x[off + i + k] - mu;
            acc[k] += d * d;
          }
        for (; i < L; ++i) m2 += (x[off + i] - mu) * (x[off + i] - mu);
        for (int k = 0; k < 16; ++k) m2 += acc[k];
      });
      out[o] = m2 / div;
      if (mean) mean[o] = mu;
    });
    return;
  }
  for_tiles(p, [&](int64_t o0, int64_t w, int64_t base) {
    float acc[kCols];
    const float init = op == Reduction::Amax ? -std::numeric_limits<float>::infinity() : 0.0f;
    for (int64_t j = 0; j < w; ++j) acc[j] = init;
    if (op == Reduction::Amax) {
      each_position(p, base, [&](int64_t off) {
        for (int64_t j = 0; j < w; ++j) acc[j] = std::max(acc[j], x[off + j]);
      });
    } else {
      each_position(p, base, [&](int64_t off) {
        for (int64_t j = 0; j < w; ++j) acc[j] += x[off + j];
      });
    }
    float *y = out + o0;
    if (op == Reduction::Sum || op == Reduction::Amax) {
      for (int64_t j = 0; j < w; ++j) y[j] = acc[j];
      return;
    }
    for (int64_t j = 0; j < w; ++j) acc[j] /= static_cast<float>(p.n);
    if (op == Reduction::Mean) {
      for (int64_t j = 0; j < w; ++j) y[j] = acc[j];
      return;
    }
    float m2[kCols] = {};
    each_position(p, base, [&](int64_t off) {
      for (int64_t j = 0; j < w; ++j) {
        const float d = x[off + j] - acc[j];
        m2[j] += d * d;
      }
    });
    for (int64_t j = 0; j < w; ++j) y[j] = m2[j] / div;
    if (mean)
      for (int64_t j = 0; j < w; ++j) mean[o0 + j] = acc[j];
  });
}

void amax_bwd(const float *g, const float *x, const float *y, float *gx, ShapeRef xs, ShapeRef os) {
  const Plan p = make_plan(xs, os);
  if (p.inner_reduced) {
    for_outputs(p, [&](int64_t o, int64_t base) {
      const float m = y[o];
      int64_t ties = 0;
      each_run(p, base, [&](int64_t off, int64_t L) {
        for (int64_t i = 0; i < L; ++i) ties += x[off + i] == m;
      });
      const float share = g[o] / static_cast<float>(std::max<int64_t>(ties, 1));
      each_run(p, base, [&](int64_t off, int64_t L) {
        for (int64_t i = 0; i < L; ++i) gx[off + i] = x[off + i] == m ? share : 0.0f;
      });
    });
    return;
  }
  for_tiles(p, [&](int64_t o0, int64_t w, int64_t base) {
    float ties[kCols] = {};
    const float *m = y + o0;
    each_position(p, base, [&](int64_t off) {
      for (int64_t j = 0; j < w; ++j) ties[j] += x[off + j] == m[j] ? 1.0f : 0.0f;
    });
    float share[kCols];
    for (int64_t j = 0; j < w; ++j) share[j] = g[o0 + j] / std::max(ties[j], 1.0f);
    each_position(p, base, [&](int64_t off) {
      for (int64_t j = 0; j < w; ++j) gx[off + j] = x[off + j] == m[j] ? share[j] : 0.0f;
    });
  });
}

void var_bwd(const float *g, const float *x, const float *mean, float *gx, ShapeRef xs,
             ShapeRef os, int64_t correction) {
  const Plan p = make_plan(xs, os);
  const float div = var_divisor(p.n, correction);
  if (p.inner_reduced) {
    for_outputs(p, [&](int64_t o, int64_t base) {
      const float mu = mean[o], k = 2.0f * g[o] / div;
      each_run(p, base, [&](int64_t off, int64_t L) {
        for (int64_t i = 0; i < L; ++i) gx[off + i] = k * (x[off + i] - mu);
      });
    });
    return;
  }
  for_tiles(p, [&](int64_t o0, int64_t w, int64_t base) {
    float k[kCols];
    const float *mu = mean + o0;
    for (int64_t j = 0; j < w; ++j) k[j] = 2.0f * g[o0 + j] / div;
    each_position(p, base, [&](int64_t off) {
      for (int64_t j = 0; j < w; ++j) gx[off + j] = k[j] * (x[off + j] - mu[j]);
    });
  });
}

// ---------------------------------------------------------------------------
// Softmax and log_softmax over the middle dim of [outer, C, inner]: tiles of up
// to kCols columns of the inner dim, each column a softmax over C rows.

namespace {

template <class Fn>
void for_column_tiles(int64_t outer, int64_t C, int64_t inner, const Fn &fn) {
  const int64_t tiles = (inner + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, (1 << 12) / std::max<int64_t>(C * std::min(inner, kCols), 1));
  ctr::parallel_for(outer * tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / tiles, c0 = (t % tiles) * kCols;
      fn(o * C * inner + c0, std::min(kCols, inner - c0));
    }
  });
}

// m[j] = max over rows, s[j] = sum of exp(x - m); y (may be null) receives the exps.
void column_stats(const float *x, float *y, int64_t C, int64_t inner, int64_t w, float *m, float *s) {
  for (int64_t j = 0; j < w; ++j) m[j] = x[j];
  for (int64_t c = 1; c < C; ++c)
    for (int64_t j = 0; j < w; ++j) m[j] = std::max(m[j], x[c * inner + j]);
  for (int64_t j = 0; j < w; ++j) s[j] = 0.0f;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < w; ++j) {
      const float e = math::exp_fast(x[c * inner + j] - m[j]);
      if (y) y[c * inner + j] = e;
      s[j] += e;
    }
}

}  // namespace

void softmax_dim_fwd(const float *x, float *y, int64_t outer, int64_t C, int64_t inner) {
  for_column_tiles(outer, C, inner, [&](int64_t off, int64_t w) {
    float m[kCols], s[kCols];
    column_stats(x + off, y + off, C, inner, w, m, s);
    for (int64_t j = 0; j < w; ++j) s[j] = 1.0f / s[j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) y[off + c * inner + j] *= s[j];
  });
}

void softmax_dim_bwd(const float *dy, const float *y, float *dx, int64_t outer, int64_t C,
                     int64_t inner) {
  for_column_tiles(outer, C, inner, [&](int64_t off, int64_t w) {
    float dot[kCols] = {};
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) dot[j] += dy[off + c * inner + j] * y[off + c * inner + j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) {
        const int64_t i = off + c * inner + j;
        dx[i] = y[i] * (dy[i] - dot[j]);
      }
  });
}

void log_softmax_fwd(const float *x, float *y, int64_t outer, int64_t C, int64_t inner) {
  if (inner == 1) {
    ctr::parallel_for(outer, std::max<int64_t>(1, (1 << 12) / std::max<int64_t>(C, 1)),
                      [=](int64_t r0, int64_t r1) {
                        for (int64_t r = r0; r < r1; ++r) {
                          const float *xr = x + r * C;
                          float *yr = y + r * C;
                          const float m = row_max(xr, C);
                          const float shift = m + std::log(exp_sum(xr, yr, m, C));
                          for (int64_t j = 0; j < C; ++j) yr[j] = xr[j] - shift;
                        }
                      });
    return;
  }
  for_column_tiles(outer, C, inner, [&](int64_t off, int64_t w) {
    float m[kCols], s[kCols];
    column_stats(x + off, nullptr, C, inner, w, m, s);
    for (int64_t j = 0; j < w; ++j) m[j] += std::log(s[j]);
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) y[off + c * inner + j] = x[off + c * inner + j] - m[j];
  });
}

void log_softmax_bwd(const float *dy, const float *y, float *dx, int64_t outer, int64_t C,
                     int64_t inner) {
  if (inner == 1) {
    ctr::parallel_for(outer, std::max<int64_t>(1, (1 << 12) / std::max<int64_t>(C, 1)),
                      [=](int64_t r0, int64_t r1) {
                        for (int64_t r = r0; r < r1; ++r) {
                          const float *g = dy + r * C, *yr = y + r * C;
                          float *o = dx + r * C;
                          const float s = row_sum(g, C);
                          for (int64_t j = 0; j < C; ++j) o[j] = g[j] - math::exp_fast(yr[j]) * s;
                        }
                      });
    return;
  }
  for_column_tiles(outer, C, inner, [&](int64_t off, int64_t w) {
    float s[kCols] = {};
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) s[j] += dy[off + c * inner + j];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < w; ++j) {
        const int64_t i = off + c * inner + j;
        dx[i] = dy[i] - math::exp_fast(y[i]) * s[j];
      }
  });
}

}  // namespace ctr::cpu
