// Matrix products: the generic gemm, the linear layer, batched matmul, and the
// bf16 products.
//
// Every product runs on oneDNN's matmul primitive (dnnl_matmul.h) where the
// library has it: its JIT brgemm kernels for AVX-512 ran the f32 products of a
// gpt step 4-7x faster on one core of this project's Xeon than Debian's
// OpenBLAS (which runs that CPU with its generic "Prescott" kernels); see
// BENCHMARKS.md. OpenBLAS's cblas_sgemm remains for a build without oneDNN and
// for a product oneDNN has no JIT code for.
//
// Both engines are kept to one thread: the parallelism comes from the process
// thread pool, which gives each thread one block of C. Two measurements decided
// this. Attention calls gemm from inside its own parallel loop, and a
// multi-threaded OpenBLAS entered from two threads at once ran those calls 2.3x
// slower than single-threaded ones. And after a threaded OpenBLAS call its
// workers keep spinning for a while, so the pool's next loop (a GELU, say) ran
// 1.7x slower on the shared cores. Splitting C ourselves costs nothing
// measurable on the large products: each thread packs its own copy of the
// shared operand, and the split is along the dimension that makes that copy
// small.
//
// Setting OpenBLAS's thread count is process-wide; it happens once, on the first
// product, and CTR_NUM_THREADS (through the pool) then governs all CPU parallelism.

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "core/status.h"
#include "core/thread_pool.h"
#include "cpu/dnnl_matmul.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

using dnnl_mm::Type;

// Below this many flops a product runs on the calling thread: waking the pool
// costs tens of microseconds, about what 2 MFLOP take on one core.
constexpr double kParallelFlops = 2e6;

// Blocks are cut at multiples of the micro-kernel tiles so that no thread ends
// up with a ragged edge in the middle of the matrix.
constexpr int64_t kTile = 32;

void blas_single_threaded() {
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

// A product as dnnl_mm::Product describes it (bf16 operands only through
// oneDNN).
using Product = dnnl_mm::Product;

size_t type_size(Type t) { return t == Type::bf16 ? 2 : 4; }

const void *offset(const void *p, int64_t elements, Type t) {
  return static_cast<const char *>(p) + static_cast<size_t>(elements) * type_size(t);
}

// The f32 product on OpenBLAS.
void blas_block(const Product &p) {
  blas_single_threaded();
  float beta = p.beta;
  float *C = static_cast<float *>(p.C);
  if (p.bias) {
    for (int64_t r = 0; r < p.M; ++r)
      std::memcpy(C + r * p.ldc, p.bias, static_cast<size_t>(p.N) * sizeof(float));
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, p.ta ? CblasTrans : CblasNoTrans, p.tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(p.M), static_cast<int>(p.N), static_cast<int>(p.K), p.alpha,
              static_cast<const float *>(p.A), static_cast<int>(p.lda), static_cast<const float *>(p.B),
              static_cast<int>(p.ldb), beta, C, static_cast<int>(p.ldc));
}

// Rows [r0, r1) and columns [c0, c1) of C; any failure is returned as text
// (the pool's threads must not throw).
std::string run_block(const Product &p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  Product b = p;
  b.M = r1 - r0;
  b.N = c1 - c0;
  b.A = offset(p.A, p.ta ? r0 : r0 * p.lda, p.in);
  b.B = offset(p.B, p.tb ? c0 * p.ldb : c0, p.in);
  b.C = const_cast<void *>(offset(p.C, r0 * p.ldc + c0, p.out));
  if (p.bias) b.bias = offset(p.bias, c0, p.out);
  std::string error;
  switch (dnnl_mm::run(b, &error)) {
    case dnnl_mm::Outcome::done:
      return "";
    case dnnl_mm::Outcome::failed:
      return error;
    case dnnl_mm::Outcome::declined:
      break;
  }
  if (p.in != Type::f32 || p.out != Type::f32)
    return strformat("a bf16 product of %lldx%lldx%lld has no oneDNN code on this CPU", static_cast<long long>(b.M),
                     static_cast<long long>(b.N), static_cast<long long>(b.K));
  blas_block(b);
  return "";
}

// An empty sum: C = beta C (+ bias).
void empty_sum(const Product &p) {
  const size_t es = type_size(p.out);
  for (int64_t r = 0; r < p.M; ++r) {
    char *row = static_cast<char *>(p.C) + static_cast<size_t>(r * p.ldc) * es;
    if (p.bias) {
      std::memcpy(row, p.bias, static_cast<size_t>(p.N) * es);
    } else if (p.beta == 0.0f) {
      std::memset(row, 0, static_cast<size_t>(p.N) * es);
    } else {
      float *o = reinterpret_cast<float *>(row);  // beta != 0 only with f32 C
      for (int64_t c = 0; c < p.N; ++c) o[c] *= p.beta;
    }
  }
}

// split: whether a large product is cut over the pool (false: one call here).
void run(const Product &p, bool split = true) {
  if (p.M <= 0 || p.N <= 0) return;
  if (p.K <= 0) {
    empty_sum(p);
    return;
  }
  const int threads = ctr::num_threads();
  const double flops = 2.0 * static_cast<double>(p.M) * p.N * p.K;
  std::string err;
  if (!split || threads == 1 || flops < kParallelFlops) {
    err = run_block(p, 0, p.M, 0, p.N);
  } else {
    // Rows split: every thread packs all of op(B) (K x N); columns split: all of
    // op(A) (M x K). Pick the split that duplicates less.
    const bool rows = p.M >= p.N;
    const int64_t n = rows ? p.M : p.N;
    int64_t grain = (n + threads - 1) / threads;
    grain = (grain + kTile - 1) / kTile * kTile;
    std::mutex mu;
    ctr::parallel_for(n, grain, [&](int64_t b, int64_t e) {
      std::string r = rows ? run_block(p, b, e, 0, p.N) : run_block(p, 0, p.M, b, e);
      if (!r.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (err.empty()) err = std::move(r);
      }
    });
  }
  CTR_REQUIRE(err.empty(), CTR_STATUS_INTERNAL, "%s", err.c_str());
}

Product f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
            const float *B, int64_t ldb, float beta, float *C, int64_t ldc, const float *bias = nullptr) {
  return Product{Type::f32, Type::f32, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias};
}

// Column sums of x[R, C] into out[C] (overwrite or add), split over columns so each
// sum has a single owner and the result does not depend on the thread count. X is
// float or bf16 (uint16_t, widened exactly as it is read: the same sums as on an
// f32 copy).

template <typename X>
void column_sums(const X *x, float *out, int64_t R, int64_t C, bool accumulate) {
  constexpr int64_t kCols = 256;
  const int64_t grain = std::max<int64_t>(kTile, (1 << 15) / std::max<int64_t>(R, 1));
  ctr::parallel_for(C, grain, [=](int64_t c0, int64_t c1) {
    for (int64_t j0 = c0; j0 < c1; j0 += kCols) {
      const int64_t w = std::min(kCols, c1 - j0);
      float acc[kCols] = {};
      for (int64_t r = 0; r < R; ++r) {
        const X *row = x + r * C + j0;
        for (int64_t j = 0; j < w; ++j) acc[j] += widen(row[j]);
      }
      float *o = out + j0;
      if (accumulate)
        for (int64_t j = 0; j < w; ++j) o[j] += acc[j];
      else
        for (int64_t j = 0; j < w; ++j) o[j] = acc[j];
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------
// GEMM

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
          int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  run(f32(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}

void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                 int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  run(f32(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), false);
}

// ---------------------------------------------------------------------------
// Linear

void linear_fwd(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t K,
                int64_t N) {
  run(f32(false, true, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N, b));
}

void linear_bwd_x(const float *dy, const float *w, float *dx, int64_t M, int64_t K, int64_t N) {
  run(f32(false, false, M, K, N, 1.0f, dy, N, w, K, 0.0f, dx, K));
}

void linear_bwd_w(const float *dy, const float *x, float *dw, int64_t M, int64_t K, int64_t N,
                  bool accumulate) {
  run(f32(true, false, N, K, M, 1.0f, dy, N, x, K, accumulate ? 1.0f : 0.0f, dw, K));
}

void linear_bwd_b(const float *dy, float *db, int64_t M, int64_t N, bool accumulate) {
  column_sums(dy, db, M, N, accumulate);
}

void linear_bwd_b_bf16(const uint16_t *dy, float *db, int64_t M, int64_t N, bool accumulate) {
  column_sums(dy, db, M, N, accumulate);
}

// ---------------------------------------------------------------------------
// Batched matmul
//
// With a shared b the batch folds into one large product. Otherwise a batch of
// products of moderate size goes one product per thread (each single-threaded, as
// gemm runs on the calling thread inside a parallel loop); a batch of large ones
// runs in order, each split over the pool.

namespace {

// Grain (in batch entries) for a batch of products of `flops` each.
int64_t batch_grain(int64_t batch, double flops) {
  if (batch < ctr::num_threads() || flops >= 5e7) return batch;  // serial outer loop
  return std::max<int64_t>(1, static_cast<int64_t>(kParallelFlops / flops));
}

}  // namespace

void matmul_fwd(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K,
                int64_t N, bool b_shared) {
  if (b_shared) {
    run(f32(false, false, batch * M, N, K, 1.0f, a, K, b, N, 0.0f, c, N));
    return;
  }
  const double flops = 2.0 * static_cast<double>(M) * N * K;
  ctr::parallel_for(batch, batch_grain(batch, flops), [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      gemm(false, false, M, N, K, 1.0f, a + i * M * K, K, b + i * K * N, N, 0.0f, c + i * M * N, N);
  });
}

// da or db may be null when that gradient is not needed; db is overwritten (the
// interface has no accumulate flag for it).
void matmul_bwd(const float *dc, const float *a, const float *b, float *da, float *db,
                int64_t batch, int64_t M, int64_t K, int64_t N, bool b_shared) {
  if (b_shared) {
    // da[batch*M, K] = dc[batch*M, N] b^T, and db[K, N] = a^T dc with the batch
    // folded into the reduction, so the sum over the batch happens inside the GEMM.
    if (da) run(f32(false, true, batch * M, K, N, 1.0f, dc, N, b, N, 0.0f, da, K));
    if (db) run(f32(true, false, K, N, batch * M, 1.0f, a, K, dc, N, 0.0f, db, N));
    return;
  }
  const double flops = 2.0 * static_cast<double>(M) * N * K;
  ctr::parallel_for(batch, batch_grain(batch, flops), [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (da)
        gemm(false, true, M, K, N, 1.0f, dc + i * M * N, N, b + i * K * N, N, 0.0f, da + i * M * K,
             K);
      if (db)
        gemm(true, false, K, N, M, 1.0f, a + i * M * K, K, dc + i * M * N, N, 0.0f, db + i * K * N,
             N);
    }
  });
}

// ---------------------------------------------------------------------------
// bf16 products

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
               int64_t ldb, void *C, int64_t ldc, bool c_bf16, const void *bias) {
  CTR_CHECK(have_dnnl());
  run(Product{Type::bf16, c_bf16 ? Type::bf16 : Type::f32, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, bias});
}

}  // namespace ctr::cpu
