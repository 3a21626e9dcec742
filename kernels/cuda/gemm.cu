// GEMMs through cuBLASLt: linear and batched matmul, forward and backward,
// and the products the epilogues pass fuses with their element-wise
// neighbours through cuBLASLt's epilogues (linear_bwd_wb: BGRADB,
// linear_gelu: GELU_AUX[_BIAS], linear_bwd_x_dgelu: DGELU). Storage is f32 or
// bf16 with f32 accumulation; parameter gradients are written in their own
// dtype (f32 master gradients from bf16 activations). f32 operands are
// multiplied on TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded
// to 10 mantissa bits, f32 accumulation) unless the backend was created with
// CTR_CUDA_TF32=0. The heuristic's choice of algorithm and the descriptors are
// cached per shape and epilogue, so a step's GEMMs cost one lookup each after
// the first run. Where the heuristic offers no algorithm for an epilogue (a
// shape or type cuBLASLt does not fuse), the product runs plain and the
// element-wise part runs as the own kernel (elementwise.cu).
//
// Everything here is row-major: C[M,N] = op(A)[M,K] op(B)[K,N] is the
// column-major product C^T = op(B)^T op(A)^T, so cuBLASLt is called with the
// operands swapped and m = N, n = M.

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {

namespace {

cudaDataType_t cuda_type(int32_t dtype) { return dtype == CTR_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// One product: row-major operands, optional strided batch and bias.
struct GemmKey {
  int32_t ta, tb;
  int64_t M, N, K, lda, ldb, ldc;
  int64_t batch, sa, sb, sc;
  int32_t a_type, b_type, c_type, bias_type;  // bias_type -1: no bias (or bias gradient)
  int32_t compute;                            // cublasComputeType_t
  int32_t epilogue;                           // cublasLtEpilogue_t
  int64_t aux_ld;                             // GELU_AUX / DGELU: leading dimension of aux
  bool operator==(const GemmKey &o) const { return std::memcmp(this, &o, sizeof *this) == 0; }
};

struct GemmKeyHash {
  size_t operator()(const GemmKey &k) const {
    const auto *p = reinterpret_cast<const unsigned char *>(&k);
    size_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof k; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
};

}  // namespace

struct GemmCache {
  std::mutex mu;
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans;
};

GemmCache *gemm_cache_create() { return new GemmCache; }

void gemm_cache_destroy(GemmCache *c) {
  if (!c) return;
  for (auto &[k, p] : c->plans) {
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  }
  delete c;
}

namespace {

// Zeroes key padding so that memcmp/hash see only the fields.
GemmKey make_key() {
  GemmKey k;
  std::memset(&k, 0, sizeof k);
  return k;
}

// What the epilogue does beyond the product. bias: the bias read (BIAS) or
// the bias gradient written (BGRADB); aux: the gelu input written (GELU_AUX)
// or read (DGELU), in D's type, aux_ld elements apart.
struct Epi {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = nullptr;
  int32_t bias_type = -1;
  void *aux = nullptr;
  int64_t aux_ld = 0;
};

// Column-major layout of a row-major rows x cols matrix with row stride ld.
cublasLtMatrixLayout_t layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                              int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  CTR_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), ld));
  if (batch > 1) {
    int32_t bc = static_cast<int32_t>(batch);
    CTR_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    CTR_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
  return l;
}

GemmPlan &plan_for(StreamCtx &s, const GemmKey &k) {
  GemmCache &cache = *s.gemm;
  std::lock_guard<std::mutex> lock(cache.mu);
  auto it = cache.plans.find(k);
  if (it != cache.plans.end()) return it->second;
  GemmPlan p;
  CTR_CUBLAS_CHECK(
      cublasLtMatmulDescCreate(&p.desc, static_cast<cublasComputeType_t>(k.compute), CUDA_R_32F));
  // Swapped operands: cuBLASLt's A is our B and its B is our A.
  const cublasOperation_t opa = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  CTR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  CTR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  if (k.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    const cublasLtEpilogue_t epi = static_cast<cublasLtEpilogue_t>(k.epilogue);
    CTR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  }
  if (k.bias_type >= 0) {
    const cudaDataType_t bt = cuda_type(k.bias_type);
    CTR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
  }
  if (k.aux_ld > 0)
    CTR_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &k.aux_ld, sizeof k.aux_ld));
  // Row-major shapes as stored: A is [M,K] (or [K,M] when transposed), B [K,N] (or [N,K]).
  p.b = layout(cuda_type(k.a_type), k.ta ? k.K : k.M, k.ta ? k.M : k.K, k.lda, k.batch, k.sa);
  p.a = layout(cuda_type(k.b_type), k.tb ? k.N : k.K, k.tb ? k.K : k.N, k.ldb, k.batch, k.sb);
  p.c = layout(cuda_type(k.c_type), k.M, k.N, k.ldc, k.batch, k.sc);
  cublasLtMatmulPreference_t pref = nullptr;
  CTR_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = s.workspace_bytes;
  CTR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(s.lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &found) ==
          CUBLAS_STATUS_SUCCESS &&
      found > 0) {
    p.algo = res.algo;
    p.has_algo = true;
  }
  CTR_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  return cache.plans.emplace(k, p).first->second;
}

// One row-major product C[M,N] = op(A)[M,K] op(B)[K,N], `batch` times at the
// given element strides (0: one product).
struct Product {
  bool ta, tb;
  int64_t M, N, K;
  const ctr_tensor_ref *A;
  int64_t lda;
  const ctr_tensor_ref *B;
  int64_t ldb;
  const ctr_tensor_ref *C;
  int64_t ldc;
  int64_t batch = 1, sa = 0, sb = 0, sc = 0;
};

// The product, then the epilogue e. Returns false, having launched nothing,
// when e is not the default and the heuristic found no algorithm for it: the
// caller then runs the product plain and the epilogue's work itself
// (fused_or_split).
bool rm_gemm(StreamCtx &s, const Product &g, const Epi &e = Epi{}) {
  const ctr_tensor_ref &A = *g.A, &B = *g.B, &C = *g.C;
  GemmKey k = make_key();
  k.ta = g.ta;
  k.tb = g.tb;
  k.M = g.M;
  k.N = g.N;
  k.K = g.K;
  k.lda = g.lda;
  k.ldb = g.ldb;
  k.ldc = g.ldc;
  k.batch = g.batch;
  k.sa = g.sa;
  k.sb = g.sb;
  k.sc = g.sc;
  k.a_type = A.dtype;
  k.b_type = B.dtype;
  k.c_type = C.dtype;
  k.bias_type = e.bias ? e.bias_type : -1;
  k.compute = s.tf32 && A.dtype == CTR_DTYPE_F32 && B.dtype == CTR_DTYPE_F32 && C.dtype == CTR_DTYPE_F32
                  ? CUBLAS_COMPUTE_32F_FAST_TF32
                  : CUBLAS_COMPUTE_32F;
  k.epilogue = e.kind;
  k.aux_ld = e.aux ? e.aux_ld : 0;
  GemmPlan &p = plan_for(s, k);
  if (e.kind != CUBLASLT_EPILOGUE_DEFAULT && !p.has_algo) return false;
  if (e.bias)
    CTR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &e.bias, sizeof e.bias));
  if (e.aux)
    CTR_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof e.aux));
  const float alpha = 1.0f, beta = 0.0f;
  CTR_CUBLAS_CHECK(cublasLtMatmul(s.lt, p.desc, &alpha, B.data, p.a, A.data, p.b, &beta, C.data, p.c, C.data, p.c,
                 p.has_algo ? &p.algo : nullptr, s.workspace, s.workspace_bytes, s.stream));
  return true;
}

// The fused ops' one shape: `fused` with epilogue e where the operands allow
// it (`fusable`) and cuBLASLt has an algorithm for it; otherwise `plain` with
// the epilogue plain_e (the bias, which every algorithm takes), then `rest`,
// the remaining element-wise work on the own kernels.
template <typename Rest>
void fused_or_split(StreamCtx &s, bool fusable, const Product &fused, const Epi &e, const Product &plain,
                    const Epi &plain_e, Rest rest) {
  if (fusable && rm_gemm(s, fused, e)) return;
  rm_gemm(s, plain, plain_e);
  rest();
}

// Epilogues. bias: BIAS adding b[N] (none without one).
Epi bias_epi(const ctr_tensor_ref *bias) {
  Epi e;
  if (bias) {
    e.kind = CUBLASLT_EPILOGUE_BIAS;
    e.bias = bias->data;
    e.bias_type = bias->dtype;
  }
  return e;
}
// An auxiliary matrix `aux` (GELU_AUX writes it, DGELU reads it) beside the
// output d, ld elements apart.
Epi aux_epi(cublasLtEpilogue_t kind, const ctr_tensor_ref &aux, int64_t ld, const ctr_tensor_ref *bias = nullptr) {
  Epi e = bias_epi(bias);
  e.kind = kind;
  e.aux = aux.data;
  e.aux_ld = ld;
  return e;
}
// cuBLASLt's auxiliary matrix has D's type and a leading dimension of a
// multiple of 8.
bool aux_fusable(const ctr_tensor_ref &aux, const ctr_tensor_ref &d, int64_t ld) {
  return aux.dtype == d.dtype && ld % 8 == 0;
}

// The products of linear(x[M,K], w[N,K]) and its gradients, into out.
// forward: out[M,N] = x w^T; bwd_x: out[M,K] = dy[M,N] w; bwd_w: out[N,K] = dy^T x.
Product linear_fwd(const Args &c, const ctr_tensor_ref &out) {
  const int64_t N = c.in_dim(1, 0), K = c.in_dim(1, 1), M = c.in_numel(0) / K;
  return Product{false, true, M, N, K, &c.in_ref(0), K, &c.in_ref(1), K, &out, N};
}
Product linear_bwd_x(const Args &c, const ctr_tensor_ref &out) {
  const int64_t N = c.in_dim(1, 0), K = c.in_dim(1, 1), M = c.in_numel(0) / N;
  return Product{false, false, M, K, N, &c.in_ref(0), N, &c.in_ref(1), K, &out, K};
}
Product linear_bwd_w(const Args &c, const ctr_tensor_ref &out) {
  const int64_t N = out.shape[0], K = out.shape[1], M = c.in_numel(1) / K;
  return Product{true, false, N, K, M, &c.in_ref(0), N, &c.in_ref(1), K, &out, K};
}

// linear: y[M,N] = x[M,K] w[N,K]^T (+ b[N])
void k_linear(const Args &c) {
  rm_gemm(*c.s, linear_fwd(c, c.out_ref(0)), bias_epi(c.num_inputs() > 2 ? &c.in_ref(2) : nullptr));
}
// linear_gelu(x, w [, b]) -> (y, h): h = x w^T (+ b), y = gelu(h) (tanh form),
// one GEMM with GELU_AUX[_BIAS] storing h as the auxiliary matrix.
void k_linear_gelu(const Args &c) {
  const ctr_tensor_ref *bias = c.num_inputs() > 2 ? &c.in_ref(2) : nullptr;
  const ctr_tensor_ref &y = c.out_ref(0), &h = c.out_ref(1);
  const Product fused = linear_fwd(c, y);
  fused_or_split(*c.s, aux_fusable(h, y, fused.N), fused,
                 aux_epi(bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX, h, fused.N, bias),
                 linear_fwd(c, h), bias_epi(bias), [&] { launch_gelu_tanh(h, y, c.stream()); });
}
// linear_bwd_x_dgelu(g, w, h): dh[M,K] = (g[M,N] w[N,K]) * gelu'(h), one GEMM
// with DGELU reading h as the auxiliary matrix.
void k_linear_bwd_x_dgelu(const Args &c) {
  const ctr_tensor_ref &h = c.in_ref(2), &dh = c.out_ref(0);
  const Product g = linear_bwd_x(c, dh);
  fused_or_split(*c.s, aux_fusable(h, dh, g.N), g, aux_epi(CUBLASLT_EPILOGUE_DGELU, h, g.N), g, Epi{},
                 [&] { launch_gelu_tanh_bwd(dh, h, dh, c.stream()); });
}
// linear_bwd_x(dy, w): dx[M,K] = dy[M,N] w[N,K]
void k_linear_bwd_x(const Args &c) { rm_gemm(*c.s, linear_bwd_x(c, c.out_ref(0))); }
// linear_bwd_w(dy, x): dw[N,K] = dy[M,N]^T x[M,K]
void k_linear_bwd_w(const Args &c) { rm_gemm(*c.s, linear_bwd_w(c, c.out_ref(0))); }
// linear_bwd_wb(dy, x) -> (dw, db): dw as linear_bwd_w, db[N] = column sums of
// dy, from the same GEMM (BGRADB: dy is cuBLASLt's B, summed over k = M).
void k_linear_bwd_wb(const Args &c) {
  const ctr_tensor_ref &dw = c.out_ref(0), &db = c.out_ref(1);
  Epi e;
  e.kind = CUBLASLT_EPILOGUE_BGRADB;
  e.bias = db.data;
  e.bias_type = db.dtype;
  const Product g = linear_bwd_w(c, dw);
  fused_or_split(*c.s, db.dtype == dw.dtype, g, e, g, Epi{}, [&] { launch_column_sums(c.in_ref(0), db, *c.s); });
}

struct MatmulDims {
  int64_t batch, M, K, N;
  bool shared;
};
MatmulDims matmul_dims(const ctr_tensor_ref &a, const ctr_tensor_ref &b) {
  MatmulDims d;
  d.M = a.shape[a.ndim - 2];
  d.K = a.shape[a.ndim - 1];
  d.N = b.shape[b.ndim - 1];
  d.batch = a.numel / (d.M * d.K);
  d.shared = b.ndim == 2;
  return d;
}

// matmul: c[batch,M,N] = a[batch,M,K] b[batch,K,N]; a shared b (2-D) makes
// one product of batch*M rows.
void k_matmul(const Args &c) {
  const MatmulDims d = matmul_dims(c.in_ref(0), c.in_ref(1));
  const ctr_tensor_ref *a = &c.in_ref(0), *b = &c.in_ref(1), *out = &c.out_ref(0);
  if (d.shared)
    rm_gemm(*c.s, Product{false, false, d.batch * d.M, d.N, d.K, a, d.K, b, d.N, out, d.N});
  else
    rm_gemm(*c.s, Product{false, false, d.M, d.N, d.K, a, d.K, b, d.N, out, d.N, d.batch, d.M * d.K, d.K * d.N,
                          d.M * d.N});
}
// matmul_bwd(g, a, b): da = g b^T ; db = a^T g (summed over batch when b is shared).
void k_matmul_bwd(const Args &c) {
  const MatmulDims d = matmul_dims(c.in_ref(1), c.in_ref(2));
  const ctr_tensor_ref *g = &c.in_ref(0), *a = &c.in_ref(1), *b = &c.in_ref(2);
  if (c.out_ref(0).data) {
    const ctr_tensor_ref *da = &c.out_ref(0);
    if (d.shared)
      rm_gemm(*c.s, Product{false, true, d.batch * d.M, d.K, d.N, g, d.N, b, d.N, da, d.K});
    else
      rm_gemm(*c.s, Product{false, true, d.M, d.K, d.N, g, d.N, b, d.N, da, d.K, d.batch, d.M * d.N, d.K * d.N,
                            d.M * d.K});
  }
  if (c.num_outputs() > 1 && c.out_ref(1).data) {
    const ctr_tensor_ref *db = &c.out_ref(1);
    if (d.shared)
      rm_gemm(*c.s, Product{true, false, d.K, d.N, d.batch * d.M, a, d.K, g, d.N, db, d.N});
    else
      rm_gemm(*c.s, Product{true, false, d.K, d.N, d.M, a, d.K, g, d.N, db, d.N, d.batch, d.M * d.K, d.M * d.N,
                            d.K * d.N});
  }
}

}  // namespace

const KernelEntry kGemmKernels[] = {
    {"linear", bind<k_linear>},
    {"linear_bwd_x", bind<k_linear_bwd_x>},
    {"linear_bwd_w", bind<k_linear_bwd_w>},
    {"linear_bwd_wb", bind<k_linear_bwd_wb>},
    {"linear_gelu", bind<k_linear_gelu>},
    {"linear_bwd_x_dgelu", bind<k_linear_bwd_x_dgelu>},
    {"matmul", bind<k_matmul>},
    {"matmul_bwd", bind<k_matmul_bwd>},
};
const size_t kGemmKernelCount = sizeof(kGemmKernels) / sizeof(kGemmKernels[0]);

}  // namespace ctr::cuda
