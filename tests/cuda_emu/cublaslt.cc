// cuBLASLt on the emulated CUDA device: the descriptors, a heuristic that
// offers one algorithm, and cublasLtMatmul as a host GEMM (OpenBLAS sgemm on
// operands widened to f32, then the epilogue and the store in D's type, bf16
// rounded to nearest even).
//
// It refuses what cuBLASLt refuses, so a call that works here has a chance on
// a GPU: attribute buffers of the wrong size, operand shapes that do not
// chain, leading dimensions shorter than a column, batch counts that differ,
// type combinations outside cuBLASLt's table for CUBLAS_COMPUTE_32F (A and B
// alike; C and D alike; f32 or bf16) and CUBLAS_COMPUTE_32F_FAST_TF32 (f32
// only), a bias of another type than D, an auxiliary matrix without a pointer
// or with a leading dimension below D's rows or not a multiple of 8. Operands
// that reach outside their device allocations fault as on a GPU.
//
// The epilogues, as cuBLASLt's documentation defines them on D (m x n):
//   BIAS          D += bias[m] broadcast over columns
//   GELU(_BIAS)   D = gelu(D (+ bias)), gelu the tanh form
//   GELU_AUX(..)  the same, and the value before gelu stored in the auxiliary
//                 matrix (m x n, its own leading dimension and type)
//   DGELU         D *= gelu'(aux), aux the forward's stored gelu input
//   BGRADB        bias[n] = sum over k of op(B)[k, n] (the bias gradient of
//                 the product whose input gradient is B)
// FAST_TF32 rounds each element of A and B to TF32 (10 mantissa bits, to
// nearest, ties away from zero, as the GPU's conversion does) before the f32
// product, so the emulated error is the real one's order, not zero.

#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "emu.h"

struct cublasLtContext {
  int live = 1;
};
struct ctr_emu_matmul_desc {
  int32_t compute = CUBLAS_COMPUTE_32F;
  int32_t scale = CUDA_R_32F;
  int32_t pointer_mode = 0;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N, transc = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = nullptr;
  int64_t bias_batch_stride = 0;
  int32_t bias_type = -1;
  void *aux = nullptr;
  int64_t aux_ld = 0, aux_batch_stride = 0;
  int32_t aux_type = -1;
};
struct ctr_emu_matrix_layout {
  uint32_t type = CUDA_R_32F;
  int32_t order = 0;  // column-major
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct ctr_emu_matmul_preference {
  uint32_t search_mode = 0;
  uint64_t max_workspace = 0;
};

namespace {

constexpr uint64_t kAlgoMagic = 0x63747220656d75ull;  // the one algorithm

bool is_float(uint32_t t) { return t == CUDA_R_32F || t == CUDA_R_16BF; }
size_t elem_size(uint32_t t) { return t == CUDA_R_32F ? 4 : 2; }

template <class T>
cublasStatus_t set(T &field, const void *buf, size_t size) {
  if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t refuse(cublasStatus_t s, const std::string &why) {
  std::fprintf(stderr, "ctr emu: cuBLASLt: %s\n", why.c_str());
  return s;
}

struct Shape {
  int64_t m, n, k, batch;
};

// An epilogue value taken apart into what it does.
struct Epilogue {
  bool known = false;
  bool bias = false;        // add bias[m]
  bool gelu = false;        // apply gelu
  bool aux_out = false;     // store the gelu input in aux
  bool dgelu = false;       // multiply by gelu'(aux)
  bool bgrad_b = false;     // bias[n] = column sums of op(B) (BGRADB)
};

Epilogue epilogue_parts(uint32_t v) {
  Epilogue e;
  e.known = true;
  switch (v) {
    case CUBLASLT_EPILOGUE_DEFAULT: break;
    case CUBLASLT_EPILOGUE_BIAS: e.bias = true; break;
    case CUBLASLT_EPILOGUE_GELU: e.gelu = true; break;
    case CUBLASLT_EPILOGUE_GELU_BIAS: e.gelu = e.bias = true; break;
    case CUBLASLT_EPILOGUE_GELU_AUX: e.gelu = e.aux_out = true; break;
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: e.gelu = e.aux_out = e.bias = true; break;
    case CUBLASLT_EPILOGUE_DGELU: e.dgelu = true; break;
    case CUBLASLT_EPILOGUE_BGRADB: e.bgrad_b = true; break;
    default: e.known = false;
  }
  return e;
}

// GELU, tanh form, and its derivative, in f32.
float gelu_tanh(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}
float gelu_tanh_grad(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  const float t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

// f32 to TF32 (1 sign, 8 exponent, 10 mantissa bits), to nearest with ties
// away from zero; infinities and NaN pass unchanged.
float to_tf32(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&v, &u, 4);
  return v;
}

// cuBLASLt's checks of a product's description.
cublasStatus_t validate(const ctr_emu_matmul_desc &d, const ctr_emu_matrix_layout &a, const ctr_emu_matrix_layout &b,
                        const ctr_emu_matrix_layout &c, const ctr_emu_matrix_layout &D, bool run, Shape *shape) {
  if ((d.compute != CUBLAS_COMPUTE_32F && d.compute != CUBLAS_COMPUTE_32F_FAST_TF32) || d.scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED,
                  "only CUBLAS_COMPUTE_32F and CUBLAS_COMPUTE_32F_FAST_TF32 with f32 scale are emulated");
  if (d.pointer_mode != 0) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "only host pointers for alpha and beta");
  for (int32_t t : {d.transa, d.transb})
    if (t != CUBLAS_OP_N && t != CUBLAS_OP_T) return refuse(CUBLAS_STATUS_INVALID_VALUE, "TRANSA/TRANSB not N or T");
  if (d.transc != CUBLAS_OP_N) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "TRANSC must be N");
  for (const auto *l : {&a, &b, &c, &D}) {
    if (l->order != 0) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "only column-major layouts are emulated");
    if (l->ld < static_cast<int64_t>(l->rows > 0 ? l->rows : 1))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "a leading dimension " + std::to_string(l->ld) +
                                                     " shorter than the layout's " + std::to_string(l->rows) + " rows");
    if (l->batch < 1) return refuse(CUBLAS_STATUS_INVALID_VALUE, "a batch count below 1");
  }
  const int64_t m = static_cast<int64_t>(D.rows), n = static_cast<int64_t>(D.cols);
  const int64_t k = static_cast<int64_t>(d.transa == CUBLAS_OP_N ? a.cols : a.rows);
  const uint64_t am = d.transa == CUBLAS_OP_N ? a.rows : a.cols;
  const uint64_t bk = d.transb == CUBLAS_OP_N ? b.rows : b.cols, bn = d.transb == CUBLAS_OP_N ? b.cols : b.rows;
  if (static_cast<int64_t>(am) != m || static_cast<int64_t>(bk) != k || static_cast<int64_t>(bn) != n ||
      c.rows != D.rows || c.cols != D.cols)
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "shapes do not chain: op(A) " + std::to_string(am) + "x" + std::to_string(k) + ", op(B) " +
                      std::to_string(bk) + "x" + std::to_string(bn) + ", C " + std::to_string(c.rows) + "x" +
                      std::to_string(c.cols) + ", D " + std::to_string(m) + "x" + std::to_string(n));
  if (m == 0 || n == 0 || k == 0)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "a product with a zero dimension (m " + std::to_string(m) + ", n " +
                                                   std::to_string(n) + ", k " + std::to_string(k) + ")");
  if (a.batch != D.batch || b.batch != D.batch || c.batch != D.batch)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "batch counts differ (A " + std::to_string(a.batch) + ", B " +
                                                   std::to_string(b.batch) + ", C " + std::to_string(c.batch) +
                                                   ", D " + std::to_string(D.batch) + ")");
  const bool types_ok = is_float(a.type) && a.type == b.type && c.type == D.type && is_float(D.type) &&
                        (a.type == CUDA_R_16BF || D.type == CUDA_R_32F);
  if (!types_ok)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "type combination A " + std::to_string(a.type) + ", B " +
                                                   std::to_string(b.type) + ", C " + std::to_string(c.type) +
                                                   ", D " + std::to_string(D.type) +
                                                   " is not in cuBLASLt's table for CUBLAS_COMPUTE_32F");
  if (d.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && (a.type != CUDA_R_32F || D.type != CUDA_R_32F))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_COMPUTE_32F_FAST_TF32 takes f32 A, B, C and D only");
  const Epilogue e = epilogue_parts(d.epilogue);
  if (!e.known) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "epilogue " + std::to_string(d.epilogue) + " is not emulated");
  if ((e.bias || e.bgrad_b) && d.bias_type != -1 && static_cast<uint32_t>(d.bias_type) != D.type)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "a bias of type " + std::to_string(d.bias_type) +
                                                   " for D of type " + std::to_string(D.type) +
                                                   " (the bias and its gradient have D's type)");
  // The heuristic is asked before the pointers are set; the product needs them.
  if (run && (e.bias || e.bgrad_b) && !d.bias)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "a bias or bias gradient epilogue without CUBLASLT_MATMUL_DESC_BIAS_POINTER");
  if (e.aux_out || e.dgelu) {
    if (run && !d.aux) return refuse(CUBLAS_STATUS_INVALID_VALUE, "an auxiliary epilogue without EPILOGUE_AUX_POINTER");
    if (d.aux_ld < static_cast<int64_t>(D.rows) || d.aux_ld % 8 != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "EPILOGUE_AUX_LD " + std::to_string(d.aux_ld) +
                                                     " is below D's " + std::to_string(D.rows) +
                                                     " rows or not a multiple of 8");
    if (D.batch > 1 && d.aux_batch_stride % 8 != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "EPILOGUE_AUX_BATCH_STRIDE is not a multiple of 8");
    if (d.aux_type != -1 && !is_float(static_cast<uint32_t>(d.aux_type)))
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "an auxiliary matrix of type " + std::to_string(d.aux_type));
  }
  *shape = Shape{m, n, k, D.batch};
  return CUBLAS_STATUS_SUCCESS;
}

// Bytes a batched matrix spans from its pointer.
size_t extent(const ctr_emu_matrix_layout &l) {
  const size_t one = (static_cast<size_t>(l.cols) - 1) * static_cast<size_t>(l.ld) + static_cast<size_t>(l.rows);
  return ((static_cast<size_t>(l.batch) - 1) * static_cast<size_t>(l.stride) + one) * elem_size(l.type);
}

// Column j of a batch of l starting at p, widened to f32.
void widen(const void *p, const ctr_emu_matrix_layout &l, int64_t batch, std::vector<float> &out) {
  const size_t rows = l.rows, cols = l.cols;
  out.resize(rows * cols);
  for (size_t j = 0; j < cols; ++j)
    for (size_t i = 0; i < rows; ++i) {
      const size_t at = static_cast<size_t>(batch) * static_cast<size_t>(l.stride) + j * static_cast<size_t>(l.ld) + i;
      out[j * rows + i] = l.type == CUDA_R_32F ? static_cast<const float *>(p)[at]
                                               : __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[at]);
    }
}

struct Matmul {
  ctr_emu_matmul_desc d;
  ctr_emu_matrix_layout a, b, c, D;
  Shape s;
  float alpha, beta;
  const void *A, *B, *C;
  void *Dp;

  cudaError_t operator()() const {
    const Epilogue e = epilogue_parts(d.epilogue);
    const bool tf32 = d.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    const uint32_t aux_type = d.aux_type == -1 ? D.type : static_cast<uint32_t>(d.aux_type);
    auto read = [](const void *p, uint32_t t, size_t at) {
      return t == CUDA_R_32F ? static_cast<const float *>(p)[at]
                             : __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[at]);
    };
    auto write = [](void *p, uint32_t t, size_t at, float v) {
      if (t == CUDA_R_32F)
        static_cast<float *>(p)[at] = v;
      else
        static_cast<__nv_bfloat16 *>(p)[at] = __float2bfloat16_rn(v);
    };
    std::vector<float> af, bf, cf, acc(static_cast<size_t>(s.m * s.n));
    for (int64_t bi = 0; bi < s.batch; ++bi) {
      widen(A, a, bi, af);
      widen(B, b, bi, bf);
      if (tf32) {
        for (float &v : af) v = to_tf32(v);
        for (float &v : bf) v = to_tf32(v);
      }
      cblas_sgemm(CblasColMajor, d.transa == CUBLAS_OP_T ? CblasTrans : CblasNoTrans,
                  d.transb == CUBLAS_OP_T ? CblasTrans : CblasNoTrans, static_cast<int>(s.m), static_cast<int>(s.n),
                  static_cast<int>(s.k), alpha, af.data(), static_cast<int>(a.rows), bf.data(),
                  static_cast<int>(b.rows), 0.0f, acc.data(), static_cast<int>(s.m));
      if (beta != 0.0f) {
        widen(C, c, bi, cf);
        for (size_t i = 0; i < acc.size(); ++i) acc[i] += beta * cf[i];
      }
      const size_t boff = static_cast<size_t>(bi * d.bias_batch_stride);
      if (e.bgrad_b) {
        // op(B) is k x n: column j of B, or row j when B is transposed.
        for (int64_t j = 0; j < s.n; ++j) {
          float sum = 0.0f;
          for (int64_t q = 0; q < s.k; ++q)
            sum += d.transb == CUBLAS_OP_N ? bf[static_cast<size_t>(j * static_cast<int64_t>(b.rows) + q)]
                                           : bf[static_cast<size_t>(q * static_cast<int64_t>(b.rows) + j)];
          write(const_cast<void *>(d.bias), D.type, boff + static_cast<size_t>(j), sum);
        }
      }
      for (int64_t j = 0; j < s.n; ++j)
        for (int64_t i = 0; i < s.m; ++i) {
          float v = acc[static_cast<size_t>(j * s.m + i)];
          const size_t aux_at = static_cast<size_t>(bi * d.aux_batch_stride + j * d.aux_ld + i);
          if (e.bias) v += read(d.bias, D.type, boff + static_cast<size_t>(i));
          if (e.aux_out) write(d.aux, aux_type, aux_at, v);
          if (e.gelu) v = gelu_tanh(v);
          if (e.dgelu) v *= gelu_tanh_grad(read(d.aux, aux_type, aux_at));
          write(Dp, D.type, static_cast<size_t>(bi * D.stride + j * D.ld + i), v);
        }
    }
    return cudaSuccess;
  }
};

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

const char *cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = new ctr_emu_matmul_desc;
  (*desc)->compute = compute;
  (*desc)->scale = scale;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
  if (!d) return CUBLAS_STATUS_NOT_INITIALIZED;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return set(d->compute, buf, size);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return set(d->scale, buf, size);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return set(d->pointer_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSA: return set(d->transa, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set(d->transb, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSC: return set(d->transc, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set(d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set(d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE: return set(d->bias_batch_stride, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set(d->bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return set(d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return set(d->aux_ld, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE: return set(d->aux_batch_stride, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return set(d->aux_type, buf, size);
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "matmul attribute " + std::to_string(attr) + " is not emulated");
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType_t type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new ctr_emu_matrix_layout;
  (*layout)->type = static_cast<uint32_t>(type);
  (*layout)->rows = rows;
  (*layout)->cols = cols;
  (*layout)->ld = ld;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
  if (!l) return CUBLAS_STATUS_NOT_INITIALIZED;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return set(l->type, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return set(l->order, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return set(l->rows, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_COLS: return set(l->cols, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_LD: return set(l->ld, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return set(l->batch, buf, size);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return set(l->stride, buf, size);
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "layout attribute " + std::to_string(attr) + " is not emulated");
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new ctr_emu_matmul_preference;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
  if (!p) return CUBLAS_STATUS_NOT_INITIALIZED;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return set(p->search_mode, buf, size);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set(p->max_workspace, buf, size);
  }
  return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "preference attribute " + std::to_string(attr) + " is not emulated");
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *results, int *returned) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!desc || !a || !b || !c || !d || !pref || requested < 1 || !results || !returned)
    return CUBLAS_STATUS_INVALID_VALUE;
  Shape s{};
  if (cublasStatus_t st = validate(*desc, *a, *b, *c, *d, false, &s)) return st;
  std::memset(&results[0], 0, sizeof results[0]);
  results[0].algo.data[0] = kAlgoMagic;
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *, size_t, cudaStream_t stream) {
  using namespace ctr_emu;
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!desc || !a || !b || !c || !d || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (algo && algo->data[0] != kAlgoMagic)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "an algorithm the heuristic did not return");
  Matmul mm{*desc, *a, *b, *c, *d, {}, 0.0f, 0.0f, A, B, C, D};
  if (cublasStatus_t st = validate(mm.d, mm.a, mm.b, mm.c, mm.D, true, &mm.s)) return st;
  std::memcpy(&mm.alpha, alpha, sizeof(float));
  std::memcpy(&mm.beta, beta, sizeof(float));
  if (sticky_error()) return CUBLAS_STATUS_EXECUTION_FAILED;
  // What the GEMM would read or write outside device memory faults.
  auto outside = [](const char *what, const void *p, size_t bytes) {
    if (in_device_memory(p, bytes)) return false;
    char b[64];
    std::snprintf(b, sizeof b, "%p, +%zu", p, bytes);
    set_fault(cudaErrorIllegalAddress,
              std::string("cublasLtMatmul: ") + what + " [" + b + ") is not inside one device allocation");
    return true;
  };
  const Epilogue e = epilogue_parts(mm.d.epilogue);
  const size_t bias_len = static_cast<size_t>(e.bgrad_b ? mm.s.n : mm.s.m);
  const uint32_t aux_type = mm.d.aux_type == -1 ? mm.D.type : static_cast<uint32_t>(mm.d.aux_type);
  const size_t aux_bytes = (static_cast<size_t>((mm.s.batch - 1) * mm.d.aux_batch_stride) +
                            static_cast<size_t>((mm.s.n - 1) * mm.d.aux_ld + mm.s.m)) *
                           elem_size(aux_type);
  if (outside("A", A, extent(mm.a)) || outside("B", B, extent(mm.b)) ||
      (mm.beta != 0.0f && outside("C", C, extent(mm.c))) || outside("D", D, extent(mm.D)) ||
      ((e.bias || e.bgrad_b) &&
       outside("the bias", mm.d.bias,
               (static_cast<size_t>((mm.s.batch - 1) * mm.d.bias_batch_stride) + bias_len) * elem_size(mm.D.type))) ||
      ((e.aux_out || e.dgelu) && outside("the auxiliary matrix", mm.d.aux, aux_bytes)))
    return CUBLAS_STATUS_EXECUTION_FAILED;
  if (enqueue(stream, mm) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
