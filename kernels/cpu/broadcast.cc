// General broadcasting: binary arithmetic, expand, masked_fill and div's
// gradient over operands whose shapes broadcast NumPy style.
//
// A plan describes the output's dims with each operand's stride per dim (0 where
// the operand is broadcast) after dropping size-1 dims and merging neighbours
// across which both operands stay contiguous. A same-shaped pair or a scalar
// operand merges into one dim, a trailing bias into two: the innermost merged
// dim is a unit-stride (or constant) loop, and the outer dims are walked by an
// odometer once per row, never per element. Work is split over the flat output,
// so a few long rows and many short ones both spread over the pool; every
// element is computed alone, so results do not depend on the thread count.

#include <algorithm>
#include <cstdint>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;

struct Plan {
  int n = 0;  // merged dims, outer to inner
  int64_t size[kMaxDims], sa[kMaxDims], sb[kMaxDims];
  int64_t total = 1;
};

// Dim i of an operand of rank r aligned at the trailing end of rank `rank`.
int64_t dim_at(ShapeRef s, int rank, int i) {
  const int j = i - (rank - s.rank);
  return j >= 0 ? s.dims[j] : 1;
}

// Strides of a (contiguous) operand over the output's dims, 0 where broadcast.
void operand_strides(ShapeRef s, ShapeRef os, int64_t *st) {
  int64_t acc = 1;
  for (int i = os.rank - 1; i >= 0; --i) {
    const int64_t d = dim_at(s, os.rank, i);
    st[i] = d == 1 ? 0 : acc;
    acc *= d;
  }
}

Plan make_plan(ShapeRef as, ShapeRef bs, ShapeRef os) {
  int64_t sa[kMaxDims], sb[kMaxDims];
  operand_strides(as, os, sa);
  operand_strides(bs, os, sb);
  Plan p;
  for (int i = 0; i < os.rank; ++i) {
    const int64_t d = os.dims[i];
    p.total *= d;
    if (d == 1) continue;
    if (p.n > 0) {
      const int k = p.n - 1;  // merge into the previous (outer) dim when contiguous across
      if (p.sa[k] == sa[i] * d && p.sb[k] == sb[i] * d) {
        p.size[k] *= d;
        p.sa[k] = sa[i];
        p.sb[k] = sb[i];
        continue;
      }
    }
    p.size[p.n] = d;
    p.sa[p.n] = sa[i];
    p.sb[p.n] = sb[i];
    ++p.n;
  }
  if (p.n == 0) {  // a single element
    p.n = 1;
    p.size[0] = 1;
    p.sa[0] = p.sb[0] = 1;
  }
  return p;
}

// Calls row(o, ia, ib, len, sa, sb) for runs of the innermost dim: output
// elements o .. o+len, operand a from ia with stride sa (0 or 1), b likewise.
template <class Row>
void for_rows(const Plan &p, const Row &row) {
  const int last = p.n - 1;
  const int64_t L = p.size[last], sa = p.sa[last], sb = p.sb[last];
  ctr::parallel_for(p.total, kGrain, [&](int64_t e0, int64_t e1) {
    // Odometer over the outer dims, started at e0's row.
    int64_t idx[kMaxDims] = {};
    int64_t r = e0 / L, ia = 0, ib = 0;
    for (int d = last - 1; d >= 0; --d) {
      idx[d] = r % p.size[d];
      r /= p.size[d];
      ia += idx[d] * p.sa[d];
      ib += idx[d] * p.sb[d];
    }
    int64_t col = e0 % L, e = e0;
    while (e < e1) {
      const int64_t len = std::min(L - col, e1 - e);
      row(e, ia + col * sa, ib + col * sb, len, sa, sb);
      e += len;
      col = 0;
      for (int d = last - 1; d >= 0; --d) {
        ia += p.sa[d];
        ib += p.sb[d];
        if (++idx[d] < p.size[d]) break;
        ia -= p.size[d] * p.sa[d];
        ib -= p.size[d] * p.sb[d];
        idx[d] = 0;
      }
    }
  });
}

// out[o] = f(a[.], b[.], o) over the plan, one loop per stride pattern so that
// each vectorises.
template <class F>
void apply(const Plan &p, const float *a, const float *b, float *out, const F &f) {
  for_rows(p, [&](int64_t o, int64_t ia, int64_t ib, int64_t len, int64_t sa, int64_t sb) {
    const float *x = a + ia;
    const float *y = b + ib;
    float *z = out + o;
    if (sa && sb) {
      for (int64_t k = 0; k < len; ++k) z[k] = f(x[k], y[k], o + k);
    } else if (sa) {
      const float s = y[0];
      for (int64_t k = 0; k < len; ++k) z[k] = f(x[k], s, o + k);
    } else if (sb) {
      const float s = x[0];
      for (int64_t k = 0; k < len; ++k) z[k] = f(s, y[k], o + k);
    } else {
      const float s = x[0], t = y[0];
      for (int64_t k = 0; k < len; ++k) z[k] = f(s, t, o + k);
    }
  });
}

const int64_t kNoDims[1] = {1};
constexpr ShapeRef kScalar = {kNoDims, 0};

}  // namespace

void binary_fwd(Binary op, const float *a, ShapeRef as, const float *b, ShapeRef bs, float *out,
                ShapeRef os) {
  const Plan p = make_plan(as, bs, os);
  switch (op) {
    case Binary::Add: return apply(p, a, b, out, [](float x, float y, int64_t) { return x + y; });
    case Binary::Sub: return apply(p, a, b, out, [](float x, float y, int64_t) { return x - y; });
    case Binary::Mul: return apply(p, a, b, out, [](float x, float y, int64_t) { return x * y; });
    case Binary::Div: return apply(p, a, b, out, [](float x, float y, int64_t) { return x / y; });
  }
}

void broadcast_to(const float *x, ShapeRef xs, float *out, ShapeRef os, float scale) {
  // b is x's first element as a scalar: never read by the functor.
  const Plan p = make_plan(xs, kScalar, os);
  if (scale == 1.0f)
    apply(p, x, x, out, [](float v, float, int64_t) { return v; });
  else
    apply(p, x, x, out, [scale](float v, float, int64_t) { return scale * v; });
}

void masked_fill(const float *x, const float *mask, ShapeRef ms, float *out, ShapeRef xs,
                 float value) {
  const Plan p = make_plan(xs, ms, xs);
  apply(p, x, mask, out, [value](float v, float m, int64_t) { return m != 0.0f ? value : v; });
}

void div_bwd_b(const float *g, const float *y, const float *b, ShapeRef bs, float *out,
               ShapeRef os) {
  const Plan p = make_plan(os, bs, os);
  apply(p, y, b, out, [g](float yv, float bv, int64_t o) { return -(g[o] * (yv / bv)); });
}

// ---------------------------------------------------------------------------
// Exact GELU (its formula lives in common/math.h)

void gelu_exact_fwd(const float *x, float *y, int64_t n) {
  ctr::parallel_for(n, 1 << 12, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = math::gelu_exact_fast(x[i]);
  });
}

void gelu_exact_bwd(const float *dy, const float *x, float *dx, int64_t n) {
  ctr::parallel_for(n, 1 << 12, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dx[i] = dy[i] * math::gelu_exact_grad_fast(x[i]);
  });
}

}  // namespace ctr::cpu
