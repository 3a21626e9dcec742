// Matrix products: the generic gemm, the linear layer and batched matmul.
//
// Every product is an OpenBLAS cblas_sgemm call, and OpenBLAS is kept to one thread:
// the parallelism comes from the process thread pool, which gives each thread one
// block of C. Two measurements decided this. Attention calls gemm from inside its
// own parallel loop, and a multi-threaded OpenBLAS entered from two threads at once
// ran those calls 2.3x slower than single-threaded ones. And after a threaded
// OpenBLAS call its workers keep spinning for a while, so the pool's next loop
// (a GELU, say) ran 1.7x slower on the shared cores. Splitting C ourselves costs
// nothing measurable on the large products: each thread packs its own copy of the
// shared operand, and the split is along the dimension that makes that copy small.
//
// Setting OpenBLAS's thread count is process-wide; it happens once, on the first
// product, and CTR_NUM_THREADS (through the pool) then governs all CPU parallelism.

#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

// Below this many flops a product runs on the calling thread: waking the pool
// costs tens of microseconds, about what 2 MFLOP take on one core.
constexpr double kParallelFlops = 2e6;

// Blocks are cut at multiples of the OpenBLAS micro-kernel tile so that no thread
// ends up with a ragged edge in the middle of the matrix.
constexpr int64_t kTile = 16;

void blas_single_threaded() {
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
}

void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
              static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

struct Product {
  bool ta, tb;
  int64_t M, N, K;
  float alpha;
  const float *A;
  int64_t lda;
  const float *B;
  int64_t ldb;
  float beta;
  float *C;
  int64_t ldc;
  const float *bias;  // when set, C is first filled with bias[N] per row and beta is 1
};

// Rows [r0, r1) and columns [c0, c1) of C.
void run_block(const Product &p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float beta = p.beta;
  if (p.bias) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(p.C + r * p.ldc + c0, p.bias + c0, (c1 - c0) * sizeof(float));
    beta = 1.0f;
  }
  const float *A = p.ta ? p.A + r0 : p.A + r0 * p.lda;
  const float *B = p.tb ? p.B + c0 * p.ldb : p.B + c0;
  sgemm(p.ta, p.tb, r1 - r0, c1 - c0, p.K, p.alpha, A, p.lda, B, p.ldb, beta, p.C + r0 * p.ldc + c0,
        p.ldc);
}

// split: whether a large product is cut over the pool (false: one call here).
void run(const Product &p, bool split = true) {
  if (p.M <= 0 || p.N <= 0) return;
  if (p.K <= 0) {
    // An empty sum: C = beta C (+ bias). BLAS would reject the leading dimensions.
    for (int64_t r = 0; r < p.M; ++r)
      for (int64_t c = 0; c < p.N; ++c) {
        float &o = p.C[r * p.ldc + c];
        o = p.bias ? p.bias[c] : (p.beta == 0.0f ? 0.0f : p.beta * o);
      }
    return;
  }
  blas_single_threaded();
  const int threads = ctr::num_threads();
  const double flops = 2.0 * static_cast<double>(p.M) * p.N * p.K;
  if (!split || threads == 1 || flops < kParallelFlops) {
    run_block(p, 0, p.M, 0, p.N);
    return;
  }
  // Rows split: every thread packs all of op(B) (K x N); columns split: all of
  // op(A) (M x K). Pick the split that duplicates less.
  const bool rows = p.M >= p.N;
  const int64_t n = rows ? p.M : p.N;
  int64_t grain = (n + threads - 1) / threads;
  grain = (grain + kTile - 1) / kTile * kTile;
  ctr::parallel_for(n, grain, [&p, rows](int64_t b, int64_t e) {
    if (rows)
      run_block(p, b, e, 0, p.N);
    else
      run_block(p, 0, p.M, b, e);
  });
}

// Column sums of x[R, C] into out[C] (overwrite or add), split over columns so each
// sum has a single owner and the result does not depend on the thread count.
void column_sums(const float *x, float *out, int64_t R, int64_t C, bool accumulate) {
  constexpr int64_t kCols = 256;
  const int64_t grain = std::max<int64_t>(kTile, (1 << 15) / std::max<int64_t>(R, 1));
  ctr::parallel_for(C, grain, [=](int64_t c0, int64_t c1) {
    for (int64_t j0 = c0; j0 < c1; j0 += kCols) {
      const int64_t w = std::min(kCols, c1 - j0);
      float acc[kCols] = {};
      for (int64_t r = 0; r < R; ++r) {
        const float *row = x + r * C + j0;
        for (int64_t j = 0; j < w; ++j) acc[j] += row[j];
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
  run(Product{trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, nullptr});
}

void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                 int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  run(Product{trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, nullptr}, false);
}

// ---------------------------------------------------------------------------
// Linear

void linear_fwd(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t K,
                int64_t N) {
  // The bias is written into y first and the product added on top (beta = 1):
  // one write pass instead of a separate read-modify-write pass afterwards.
  run(Product{false, true, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N, b});
}

void linear_bwd_x(const float *dy, const float *w, float *dx, int64_t M, int64_t K, int64_t N) {
  run(Product{false, false, M, K, N, 1.0f, dy, N, w, K, 0.0f, dx, K, nullptr});
}

void linear_bwd_w(const float *dy, const float *x, float *dw, int64_t M, int64_t K, int64_t N,
                  bool accumulate) {
  run(Product{true, false, N, K, M, 1.0f, dy, N, x, K, accumulate ? 1.0f : 0.0f, dw, K, nullptr});
}

void linear_bwd_b(const float *dy, float *db, int64_t M, int64_t N, bool accumulate) {
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
    run(Product{false, false, batch * M, N, K, 1.0f, a, K, b, N, 0.0f, c, N, nullptr});
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
    if (da) run(Product{false, true, batch * M, K, N, 1.0f, dc, N, b, N, 0.0f, da, K, nullptr});
    if (db) run(Product{true, false, K, N, batch * M, 1.0f, a, K, dc, N, 0.0f, db, N, nullptr});
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

}  // namespace ctr::cpu
