// Element-wise, broadcast, embedding, softmax and layout kernels.
//
// These are short loops written so that GCC vectorises them at -O3: inner
// loops are unit-stride over float arrays, transcendental functions come from the
// polynomial forms in common/math.h (a libm call would keep the loop scalar), and
// reductions keep sixteen independent partial sums, which vectorise without the
// reassociation that strict IEEE mode forbids.
//
// Reductions over rows (bias gradients, scatter-adds) are split over columns, not
// rows: every output element then has one owner, no thread needs a private copy,
// and the result is the same whatever the thread count.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_max;
using rows::row_sum;
using rows::exp_sum;
using rows::row_dot;

// Elements per chunk below which a loop stays on the calling thread. Streaming 32K
// floats takes a few microseconds, about what waking the pool costs; loops with an
// exp per element are worth splitting eight times sooner.
constexpr int64_t kGrain = 1 << 15;
constexpr int64_t kGrainExp = 1 << 12;

// Columns per accumulator tile in column-split reductions (stays in registers / L1).
constexpr int64_t kCols = 256;





// Splits [0, n) over the pool; fn(begin, end) sees one contiguous range.
template <class Fn>
void for_range(int64_t n, int64_t grain, const Fn &fn) {
  ctr::parallel_for(n, grain, [&fn](int64_t b, int64_t e) { fn(b, e); });
}

// Visits the flat range [begin, end) of an n-element tensor whose broadcast
// operand has nb elements, in pieces that do not wrap around nb:
// fn(i, len, j) covers elements i .. i+len, paired with operand entries j .. j+len.
template <class Fn>
void broadcast_pieces(int64_t begin, int64_t end, int64_t nb, const Fn &fn) {
  int64_t i = begin;
  while (i < end) {
    const int64_t j = i % nb;
    const int64_t len = std::min(end - i, nb - j);
    fn(i, len, j);
    i += len;
  }
}

// out[j] (+)= sum over rows r of f(r, j) for an [n / nb, nb] layout, split over
// column tiles. f is called as f(row_offset, j0, w, acc) and adds its row's
// contribution for columns j0 .. j0+w into acc[0 .. w).
template <class RowFn>
void reduce_columns(int64_t n, int64_t nb, float *out, bool accumulate, const RowFn &row) {
  const int64_t rows = n / nb;
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(rows, 1));
  for_range(nb, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t j0 = c0; j0 < c1; j0 += kCols) {
      const int64_t w = std::min(kCols, c1 - j0);
      float acc[kCols] = {};
      for (int64_t r = 0; r < rows; ++r) row(r * nb, j0, w, acc);
      float *o = out + j0;
      if (accumulate)
        for (int64_t j = 0; j < w; ++j) o[j] += acc[j];
      else
        for (int64_t j = 0; j < w; ++j) o[j] = acc[j];
    }
  });
}

// The functor of a unary op (common/math.h), passed to fn.
template <class Fn>
void with_unary(Unary op, float p, float q, const Fn &fn) {
  switch (op) {
    case Unary::Exp: return fn(math::Exp{});
    case Unary::Log: return fn(math::Log{});
    case Unary::Tanh: return fn(math::Tanh{});
    case Unary::Erf: return fn(math::Erf{});
    case Unary::Rsqrt: return fn(math::Rsqrt{});
    case Unary::Sqrt: return fn(math::Sqrt{});
    case Unary::Neg: return fn(math::Neg{});
    case Unary::Reciprocal: return fn(math::Reciprocal{});
    case Unary::Sigmoid: return fn(math::Sigmoid{});
    case Unary::Relu: return fn(math::Relu{});
    case Unary::Clamp: return fn(math::Clamp{p, q});
    case Unary::Pow: return fn(math::Pow{p});
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Embedding

void embedding_fwd(const int32_t *ids, const float *table, float *out, int64_t n, int64_t V,
                   int64_t C) {
  (void)V;
  for_range(n, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)), [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(out + i * C, table + static_cast<int64_t>(ids[i]) * C, C * sizeof(float));
  });
}

void embedding_fwd_bf16(const int32_t *ids, const uint16_t *table, uint16_t *out, int64_t n, int64_t C) {
  for_range(n, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)), [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(out + i * C, table + static_cast<int64_t>(ids[i]) * C, C * sizeof(uint16_t));
  });
}

void embedding_bwd(const int32_t *ids, const float *dout, float *dtable, int64_t n, int64_t V,
                   int64_t C, bool accumulate, int64_t padding_idx) {
  if (!accumulate) fill(dtable, 0.0f, V * C);
  // Split over columns: two rows with the same id then never race, and the
  // additions into each row happen in token order, as in a serial loop.
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(n, 1));
  for_range(C, grain, [=](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] == padding_idx) continue;
      float *dst = dtable + static_cast<int64_t>(ids[i]) * C + c0;
      const float *src = dout + i * C + c0;
      for (int64_t j = 0; j < w; ++j) dst[j] += src[j];
    }
  });
}

void vocab_embedding_fwd(const int32_t *ids, const float *table, float *out, int64_t n, int64_t C, int64_t offset,
                         int64_t valid) {
  for_range(n, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)), [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = static_cast<int64_t>(ids[i]) - offset;
      if (r >= 0 && r < valid)
        std::memcpy(out + i * C, table + r * C, C * sizeof(float));
      else
        std::memset(out + i * C, 0, C * sizeof(float));
    }
  });
}

void vocab_embedding_bwd(const int32_t *ids, const float *dout, float *dtable, int64_t n, int64_t rows, int64_t C,
                         int64_t offset, int64_t valid, int64_t padding_idx) {
  fill(dtable, 0.0f, rows * C);
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(n, 1));
  for_range(C, grain, [=](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = static_cast<int64_t>(ids[i]) - offset;
      if (ids[i] == padding_idx || r < 0 || r >= valid) continue;
      float *dst = dtable + r * C + c0;
      const float *src = dout + i * C + c0;
      for (int64_t j = 0; j < w; ++j) dst[j] += src[j];
    }
  });
}

// ---------------------------------------------------------------------------
// Broadcast arithmetic

void add_fwd(const float *a, const float *b, float *out, int64_t n, int64_t nb) {
  if (nb == 1) {
    const float s = b[0];
    for_range(n, kGrain, [=](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + s;
    });
    return;
  }
  for_range(n, kGrain, [=](int64_t i0, int64_t i1) {
    broadcast_pieces(i0, i1, nb, [=](int64_t i, int64_t len, int64_t j) {
      const float *x = a + i;
      const float *y = b + j;
      float *o = out + i;
      for (int64_t k = 0; k < len; ++k) o[k] = x[k] + y[k];
    });
  });
}

void reduce_rows(const float *dout, float *db, int64_t n, int64_t nb, bool accumulate) {
  if (nb == 1) {
    const float s = row_sum(dout, n);
    db[0] = accumulate ? db[0] + s : s;
    return;
  }
  reduce_columns(n, nb, db, accumulate, [=](int64_t off, int64_t j0, int64_t w, float *acc) {
    const float *x = dout + off + j0;
    for (int64_t j = 0; j < w; ++j) acc[j] += x[j];
  });
}

void mul_fwd(const float *a, const float *b, float *out, int64_t n, int64_t nb) {
  if (nb == 1) {
    scale(a, out, n, b[0]);
    return;
  }
  for_range(n, kGrain, [=](int64_t i0, int64_t i1) {
    broadcast_pieces(i0, i1, nb, [=](int64_t i, int64_t len, int64_t j) {
      const float *x = a + i;
      const float *y = b + j;
      float *o = out + i;
      for (int64_t k = 0; k < len; ++k) o[k] = x[k] * y[k];
    });
  });
}

void mul_bwd(const float *dout, const float *a, const float *b, float *da, float *db, int64_t n,
             int64_t nb, bool accumulate_db) {
  if (da) mul_fwd(dout, b, da, n, nb);
  if (!db) return;
  if (nb == 1) {
    const float s = row_dot(dout, a, n);
    db[0] = accumulate_db ? db[0] + s : s;
    return;
  }
  reduce_columns(n, nb, db, accumulate_db, [=](int64_t off, int64_t j0, int64_t w, float *acc) {
    const float *g = dout + off + j0;
    const float *x = a + off + j0;
    for (int64_t j = 0; j < w; ++j) acc[j] += g[j] * x[j];
  });
}

void add_same(const float *a, const float *b, float *out, int64_t n) {
  for_range(n, kGrain, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

void scale(const float *x, float *y, int64_t n, float alpha) {
  for_range(n, kGrain, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = alpha * x[i];
  });
}

// ---------------------------------------------------------------------------
// Activations

void gelu_fwd(const float *x, float *y, int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = math::gelu_fast(x[i]);
  });
}

void gelu_bwd(const float *dy, const float *x, float *dx, int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dx[i] = dy[i] * math::gelu_grad_fast(x[i]);
  });
}

void silu_fwd(const float *x, float *y, int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = math::silu_fast(x[i]);
  });
}

void silu_bwd(const float *dy, const float *x, float *dx, int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dx[i] = dy[i] * math::silu_grad_fast(x[i]);
  });
}

// (One loop per GELU form: a choice inside the loop keeps it from being vectorised.)
void geglu_fwd(const float *gate, const float *up, float *y, int64_t n, bool exact) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    if (exact) {
      for (int64_t i = i0; i < i1; ++i) y[i] = math::gelu_exact_fast(gate[i]) * up[i];
    } else {
      for (int64_t i = i0; i < i1; ++i) y[i] = math::gelu_fast(gate[i]) * up[i];
    }
  });
}

void geglu_bwd(const float *dy, const float *gate, const float *up, float *dgate, float *dup,
               int64_t n, bool exact) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    if (exact) {
      for (int64_t i = i0; i < i1; ++i) {
        const float g = gate[i], d = dy[i];
        dup[i] = d * math::gelu_exact_fast(g);
        dgate[i] = d * up[i] * math::gelu_exact_grad_fast(g);
      }
    } else {
      for (int64_t i = i0; i < i1; ++i) {
        const float g = gate[i], d = dy[i];
        dup[i] = d * math::gelu_fast(g);
        dgate[i] = d * up[i] * math::gelu_grad_fast(g);
      }
    }
  });
}

void swiglu_fwd(const float *gate, const float *up, float *y, int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = math::silu_fast(gate[i]) * up[i];
  });
}

void swiglu_bwd(const float *dy, const float *gate, const float *up, float *dgate, float *dup,
                int64_t n) {
  for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float g = gate[i], d = dy[i];
      dup[i] = d * math::silu_fast(g);
      dgate[i] = d * up[i] * math::silu_grad_fast(g);
    }
  });
}

// ---------------------------------------------------------------------------
// Unary math: one loop over the op's functor. libm calls keep these loops
// scalar, so they split as soon as the exp-based activations do.

void unary_fwd(Unary op, const float *x, float *y, int64_t n, float p, float q) {
  with_unary(op, p, q, [=](auto f) {
    for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) y[i] = f.value(x[i]);
    });
  });
}

void unary_bwd(Unary op, const float *dy, const float *v, float *dx, int64_t n, float p,
               float q) {
  if (op == Unary::Neg) {
    unary_fwd(op, dy, dx, n);
    return;
  }
  with_unary(op, p, q, [=](auto f) {
    for_range(n, kGrainExp, [=](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dx[i] = dy[i] * f.grad(v[i]);
    });
  });
}

// ---------------------------------------------------------------------------
// Softmax

void softmax_fwd(const float *x, float *y, int64_t R, int64_t C) {
  for_range(R, std::max<int64_t>(1, kGrainExp / std::max<int64_t>(C, 1)),
            [=](int64_t r0, int64_t r1) {
              for (int64_t r = r0; r < r1; ++r) {
                const float *xr = x + r * C;
                float *yr = y + r * C;
                const float inv = 1.0f / exp_sum(xr, yr, row_max(xr, C), C);
                for (int64_t j = 0; j < C; ++j) yr[j] *= inv;
              }
            });
}

void softmax_bwd(const float *dy, const float *y, float *dx, int64_t R, int64_t C) {
  for_range(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = dy + r * C;
      const float *p = y + r * C;
      float *o = dx + r * C;
      const float dot = row_dot(g, p, C);
      for (int64_t j = 0; j < C; ++j) o[j] = p[j] * (g[j] - dot);
    }
  });
}

// ---------------------------------------------------------------------------
// Layout

// One body for every 4-byte element type: values are only moved.
template <typename E>
void transpose_as(const E *x, E *y, const int64_t *dims, const int *perm, int ndim) {
  if (ndim == 0) {
    y[0] = x[0];
    return;
  }
  // ystep[i]: how far x moves when y's index along axis i grows by one.
  int64_t xstride[6], ydims[6], ystep[6], ystride[6];
  int64_t total = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    xstride[i] = total;
    total *= dims[i];
  }
  if (total == 0) return;
  for (int i = 0; i < ndim; ++i) {
    ydims[i] = dims[perm[i]];
    ystep[i] = xstride[perm[i]];
  }
  for (int64_t i = ndim - 1, s = 1; i >= 0; --i) {
    ystride[i] = s;
    s *= ydims[i];
  }
  const int last = ndim - 1;
  // x's innermost axis, as an axis of y (size-1 axes do not count: their stride
  // never matters).
  int a = -1;
  for (int i = 0; i < ndim; ++i)
    if (ystep[i] == 1 && ydims[i] > 1) a = i;

  // Offsets in x and y of the start of y's outer index o, where the outer index
  // runs over every y axis except `last` and `skip`.
  auto offsets = [&](int64_t o, int skip, int64_t &xoff, int64_t &yoff) {
    xoff = yoff = 0;
    for (int i = last - 1; i >= 0; --i) {
      if (i == skip) continue;
      const int64_t idx = o % ydims[i];
      o /= ydims[i];
      xoff += idx * ystep[i];
      yoff += idx * ystride[i];
    }
  };
  const int64_t nl = ydims[last], xl = ystep[last];

  if (a < 0 || a == last) {
    // y's rows are runs of x, contiguous (a copy) or strided (a gather).
    const int64_t nrows = total / nl;
    for_range(nrows, std::max<int64_t>(1, kGrain / nl), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int64_t xoff, yoff;
        offsets(r, -1, xoff, yoff);
        if (xl == 1) {
          std::memcpy(y + yoff, x + xoff, nl * sizeof(E));
        } else {
          for (int64_t l = 0; l < nl; ++l) y[yoff + l] = x[xoff + l * xl];
        }
      }
    });
    return;
  }

  // x's rows run along axis a of y. Walk y in square tiles over (a, last) so that
  // both the reads (along x's rows) and the writes (along y's rows) stay in cache.
  // The parallel loop runs over strips of kT indices along a, so that a plain
  // matrix transpose (a single outer index) still splits over threads.
  constexpr int64_t kT = 32;
  const int64_t na = ydims[a], sa = ystride[a];
  const int64_t outer = total / (na * nl), strips = (na + kT - 1) / kT;
  for_range(outer * strips, std::max<int64_t>(1, kGrain / (kT * nl)), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t i0 = (s % strips) * kT, i1 = std::min(na, i0 + kT);
      int64_t xoff, yoff;
      offsets(s / strips, a, xoff, yoff);
      for (int64_t l0 = 0; l0 < nl; l0 += kT) {
        const int64_t l1 = std::min(nl, l0 + kT);
        for (int64_t i = i0; i < i1; ++i) {
          const E *src = x + xoff + i;
          E *dst = y + yoff + i * sa;
          for (int64_t l = l0; l < l1; ++l) dst[l] = src[l * xl];
        }
      }
    }
  });
}

void transpose(const float *x, float *y, const int64_t *dims, const int *perm, int ndim) {
  transpose_as(x, y, dims, perm, ndim);
}
void transpose(const int32_t *x, int32_t *y, const int64_t *dims, const int *perm, int ndim) {
  transpose_as(x, y, dims, perm, ndim);
}

void copy(const void *x, void *y, int64_t bytes) {
  // Two threads move more bytes per second than one on most machines, but only
  // once a copy is large enough to amortise waking them.
  constexpr int64_t kChunk = 1 << 20;
  const char *src = static_cast<const char *>(x);
  char *dst = static_cast<char *>(y);
  for_range((bytes + kChunk - 1) / kChunk, 1, [=](int64_t c0, int64_t c1) {
    const int64_t b = c0 * kChunk, e = std::min(bytes, c1 * kChunk);
    std::memcpy(dst + b, src + b, e - b);
  });
}

void fill(float *y, float value, int64_t n) {
  for_range(n, kGrain * 4, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = value;
  });
}

}  // namespace ctr::cpu
