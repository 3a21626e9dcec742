// The emulated CUDA device itself (tests/cuda_emu): kernels written here, as
// kernels/cuda writes them, launched through CTR_LAUNCH and checked against
// what CUDA specifies. Faults are sticky for the whole process, as on a GPU,
// so each test that makes one runs in a child process (a death test).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/common.cuh"

namespace {

using ctr::cuda::clear_error;
using ctr::cuda::error_message;
using ctr::cuda::has_error;

template <class T>
T *device(size_t n) {
  T *p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemset(p, 0, n * sizeof(T)), cudaSuccess);
  return p;
}

template <class T>
std::vector<T> host(const T *d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

std::string checked_error() {
  char buf[1024] = {};
  error_message(buf, sizeof buf);
  return buf;
}

// The child of a death test: fault, then exit 0 if the fault reads as expected.
void expect_fault_in_child(const std::string &part) {
  const cudaError_t e = cudaDeviceSynchronize();
  const std::string s = cudaGetErrorString(e);
  std::fprintf(stderr, "child saw: %s\n", s.c_str());
  std::exit(e != cudaSuccess && s.find(part) != std::string::npos && cudaGetLastError() == e ? 0 : 1);
}

// ---------------------------------------------------------------------------
// Threads, blocks and shared memory

__global__ void ids_kernel(uint3 *tid, uint3 *bid, dim3 *dims) {
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned i = b * blockDim.x * blockDim.y * blockDim.z + t;
  tid[i] = threadIdx;
  bid[i] = blockIdx;
  if (i == 0) {
    dims[0] = blockDim;
    dims[1] = gridDim;
  }
}

TEST(Emu, ThreadsAndBlocksSeeTheirIndices) {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  const size_t n = 12 * 24;
  auto *tid = device<uint3>(n), *bid = device<uint3>(n);
  auto *dims = device<dim3>(2);
  CTR_LAUNCH(ids_kernel, grid, block, 0, nullptr)(tid, bid, dims);
  ASSERT_FALSE(has_error()) << checked_error();
  auto t = host(tid, n), b = host(bid, n);
  auto d = host(dims, 2);
  EXPECT_EQ(d[0].x, 4u);
  EXPECT_EQ(d[0].z, 2u);
  EXPECT_EQ(d[1].x, 3u);
  EXPECT_EQ(d[1].y, 2u);
  for (size_t i = 0; i < n; ++i) {
    const size_t bl = i / 24, th = i % 24;
    EXPECT_EQ(t[i].x, th % 4);
    EXPECT_EQ(t[i].y, th / 4 % 3);
    EXPECT_EQ(t[i].z, th / 12);
    EXPECT_EQ(b[i].x, bl % 3);
    EXPECT_EQ(b[i].y, bl / 3 % 2);
    EXPECT_EQ(b[i].z, bl / 6);
  }
}

// Each block reverses its slice through shared memory; thread 0 also counts
// the block's odd threads with __syncthreads_count.
__global__ void reverse_kernel(const int *x, int *y, int *odd) {
  __shared__ int sh[256];
  const int t = threadIdx.x, n = blockDim.x;
  sh[t] = x[blockIdx.x * n + t];
  __syncthreads();
  y[blockIdx.x * n + t] = sh[n - 1 - t];
  const int c = __syncthreads_count(t & 1);
  if (__syncthreads_and(c == n / 2) && __syncthreads_or(t == 0) && t == 0) odd[blockIdx.x] = c;
}

TEST(Emu, SyncthreadsOrdersSharedMemory) {
  const int blocks = 3, n = 256;
  std::vector<int> hx(blocks * n);
  std::iota(hx.begin(), hx.end(), 0);
  auto *x = device<int>(hx.size()), *y = device<int>(hx.size()), *odd = device<int>(blocks);
  ASSERT_EQ(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  CTR_LAUNCH(reverse_kernel, blocks, n, 0, nullptr)(x, y, odd);
  ASSERT_FALSE(has_error()) << checked_error();
  auto hy = host(y, hx.size());
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < n; ++t) EXPECT_EQ(hy[b * n + t], b * n + n - 1 - t);
  for (int c : host(odd, blocks)) EXPECT_EQ(c, n / 2);
}

// Dynamic shared memory starts as NaN bytes; threads past the half return
// before the barrier, which then waits for the others only.
__global__ void dynamic_kernel(float *out) {
  CTR_DYNAMIC_SHARED(float, sm);
  const int t = threadIdx.x;
  out[t] = sm[t];  // unwritten: the emulator's poison
  if (t >= static_cast<int>(blockDim.x) / 2) return;
  sm[t] = static_cast<float>(t);
  __syncthreads();
  out[t] = sm[blockDim.x / 2 - 1 - t];
}

TEST(Emu, DynamicSharedMemoryAndEarlyExit) {
  auto *out = device<float>(64);
  CTR_LAUNCH(dynamic_kernel, 1, 64, 64 * sizeof(float), nullptr)(out);
  ASSERT_FALSE(has_error()) << checked_error();
  auto h = host(out, 64);
  for (int t = 0; t < 32; ++t) EXPECT_EQ(h[t], static_cast<float>(31 - t));
  for (int t = 32; t < 64; ++t) EXPECT_TRUE(std::isnan(h[t])) << t;
}

// ---------------------------------------------------------------------------
// Warps

struct WarpOut {
  float bcast, bcast8, sum;
  int up, down, xor1;
  unsigned ballot, match;
  int any, all, match_all_pred;
  unsigned match_all, active;
};

__global__ void warp_kernel(WarpOut *out) {
  const int lane = threadIdx.x & 31;
  WarpOut &o = out[threadIdx.x];
  const unsigned full = __activemask();
  o.active = full;
  o.bcast = __shfl_sync(full, static_cast<float>(lane) * 2.0f, 5);
  o.bcast8 = __shfl_sync(full, static_cast<float>(lane), 3, 8);  // lane 3 of each group of 8
  float v = static_cast<float>(lane);
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(full, v, d);
  o.sum = v;
  o.up = __shfl_up_sync(full, lane * 10, 3);
  o.down = __shfl_down_sync(full, lane * 10, 3);
  o.xor1 = __shfl_xor_sync(full, lane, 1);
  o.ballot = __ballot_sync(full, lane % 3 == 0);
  o.any = __any_sync(full, lane == 7);
  o.all = __all_sync(full, lane < 100);
  o.match = __match_any_sync(full, lane / 4);
  o.match_all = __match_all_sync(full, 42, &o.match_all_pred);
  __syncwarp();
}

TEST(Emu, WarpShufflesVotesAndMatches) {
  auto *out = device<WarpOut>(32);
  CTR_LAUNCH(warp_kernel, 1, 32, 0, nullptr)(out);
  ASSERT_FALSE(has_error()) << checked_error();
  auto h = host(out, 32);
  unsigned ballot = 0;
  for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    const WarpOut &o = h[l];
    EXPECT_EQ(o.active, 0xffffffffu);
    EXPECT_EQ(o.bcast, 10.0f);
    EXPECT_EQ(o.bcast8, static_cast<float>(l / 8 * 8 + 3));
    EXPECT_EQ(o.sum, 496.0f);
    EXPECT_EQ(o.up, l >= 3 ? (l - 3) * 10 : l * 10);  // below the first lane: its own value
    EXPECT_EQ(o.down, l + 3 < 32 ? (l + 3) * 10 : l * 10);
    EXPECT_EQ(o.xor1, l ^ 1);
    EXPECT_EQ(o.ballot, ballot);
    EXPECT_EQ(o.any, 1);
    EXPECT_EQ(o.all, 1);
    EXPECT_EQ(o.match, 0xfu << (l / 4 * 4));
    EXPECT_EQ(o.match_all, 0xffffffffu);
    EXPECT_EQ(o.match_all_pred, 1);
  }
}

// A block of 40 threads: warp 1 has 8 lanes. A lane that exits leaves the
// others' warp operations; a read from a lane that is not there is undefined
// (the emulator's poison, all bits set).
__global__ void partial_warp_kernel(unsigned *active, int *from_missing, int *sum) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 39) return;
  __syncwarp();  // completes once lane 39 (lane 7 of warp 1) has exited
  active[threadIdx.x] = __activemask();
  from_missing[threadIdx.x] = __shfl_sync(0xffffffffu, lane, 20);
  int v = 1;
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += t;
  }
  sum[threadIdx.x] = v;  // inclusive scan of ones: the lane number + 1
}

TEST(Emu, PartialWarpsAndExitedLanes) {
  auto *active = device<unsigned>(40);
  auto *missing = device<int>(40), *sum = device<int>(40);
  CTR_LAUNCH(partial_warp_kernel, 1, 40, 0, nullptr)(active, missing, sum);
  ASSERT_FALSE(has_error()) << checked_error();
  auto a = host(active, 40);
  auto m = host(missing, 40), s = host(sum, 40);
  for (int t = 0; t < 39; ++t) {
    EXPECT_EQ(a[t], t < 32 ? 0xffffffffu : 0x7fu) << t;
    EXPECT_EQ(m[t], t < 32 ? 20 : -1) << t;
    EXPECT_EQ(s[t], (t & 31) + 1) << t;
  }
}

// ---------------------------------------------------------------------------
// Atomics and bf16

__global__ void atomics_kernel(int *count, float *fsum, int *imax, unsigned *cas) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(count, 1);
  atomicAdd(fsum, 0.5f);
  atomicMax(imax, i);
  atomicCAS(cas, 0u, static_cast<unsigned>(i + 1));  // the first thread wins
}

TEST(Emu, Atomics) {
  auto *count = device<int>(1), *imax = device<int>(1);
  auto *fsum = device<float>(1);
  auto *cas = device<unsigned>(1);
  CTR_LAUNCH(atomics_kernel, 4, 96, 0, nullptr)(count, fsum, imax, cas);
  ASSERT_FALSE(has_error()) << checked_error();
  EXPECT_EQ(host(count, 1)[0], 384);
  EXPECT_EQ(host(fsum, 1)[0], 192.0f);
  EXPECT_EQ(host(imax, 1)[0], 383);
  EXPECT_EQ(host(cas, 1)[0], 1u);
}

TEST(Emu, Bf16RoundsToNearestEven) {
  auto bits = [](float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); };
  EXPECT_EQ(bits(1.0f), 0x3f80);
  EXPECT_EQ(bits(1.0f + 1.0f / 256), 0x3f80);             // a tie: to the even neighbour
  EXPECT_EQ(bits(1.0f + 3.0f / 256), 0x3f82);             // a tie: up, to even
  EXPECT_EQ(bits(1.0f + 1.0f / 256 + 1.0f / 65536), 0x3f81);  // above the tie
  EXPECT_EQ(bits(-2.5f), 0xc020);
  EXPECT_EQ(bits(INFINITY), 0x7f80);
  EXPECT_EQ(bits(3.4e38f), 0x7f80);  // rounds up past the largest bf16
  EXPECT_EQ(bits(std::nanf("")), 0x7fff);
  EXPECT_EQ(__bfloat162float(__ushort_as_bfloat16(0x3fc0)), 1.5f);
  __nv_bfloat16 h = 0.333333f;
  EXPECT_EQ(static_cast<float>(h), __bfloat162float(__float2bfloat16_rn(0.333333f)));
}

// ---------------------------------------------------------------------------
// Launch checks: the configuration errors CUDA reports at the launch, seen by
// the kernels' launch check (kernels/cuda/check.cuh) and cleared after.

__global__ void noop_kernel(int *p) {
  if (p) p[threadIdx.x] = 1;
}
__global__ void big_shared_kernel(int *p) {
  CTR_DYNAMIC_SHARED(int, sm);
  sm[threadIdx.x] = 1;
  p[threadIdx.x] = sm[threadIdx.x];
}

TEST(Emu, BadConfigurationsFailTheLaunchCheck) {
  int *p = device<int>(1024);
  CTR_LAUNCH(noop_kernel, 1, 1025, 0, nullptr)(p);
  ASSERT_TRUE(has_error());
  EXPECT_NE(checked_error().find("noop_kernel failed at test_emu.cc:"), std::string::npos) << checked_error();
  EXPECT_NE(checked_error().find("invalid configuration argument"), std::string::npos) << checked_error();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the launch check clears a configuration error";
  clear_error();
  CTR_LAUNCH(noop_kernel, dim3(1, 65536), 32, 0, nullptr)(p);
  EXPECT_TRUE(has_error());
  clear_error();
  CTR_LAUNCH(noop_kernel, dim3(2, 2), dim3(32, 32), 0, nullptr)(p);
  EXPECT_FALSE(has_error()) << checked_error();
  // More than 48 KiB of dynamic shared memory needs the kernel's attribute.
  const size_t big = 64 << 10;
  CTR_LAUNCH(big_shared_kernel, 1, 32, big, nullptr)(p);
  ASSERT_TRUE(has_error());
  EXPECT_NE(checked_error().find("invalid argument"), std::string::npos) << checked_error();
  clear_error();
  const auto k = big_shared_kernel;
  ASSERT_EQ(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(big)), cudaSuccess);
  CTR_LAUNCH(k, 1, 32, big, nullptr)(p);
  EXPECT_FALSE(has_error()) << checked_error();
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  EXPECT_EQ(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, optin + 1), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Emu, InjectedConfigurationFailure) {
  setenv("CTR_EMU_FAIL_CONFIG", "noop_kernel:2", 1);
  int *p = device<int>(32);
  CTR_LAUNCH(noop_kernel, 1, 32, 0, nullptr)(p);
  EXPECT_FALSE(has_error());
  CTR_LAUNCH(noop_kernel, 1, 32, 0, nullptr)(p);
  EXPECT_TRUE(has_error());
  EXPECT_NE(checked_error().find("invalid configuration argument"), std::string::npos) << checked_error();
  unsetenv("CTR_EMU_FAIL_CONFIG");
  clear_error();
}

// ---------------------------------------------------------------------------
// Copies, fills, streams and graphs

TEST(Emu, CopiesCheckTheirRangesAndKinds) {
  char *d = device<char>(100);
  std::vector<char> h(200, 1);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 100, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 101, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(h.data(), d, 10, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, d + 50, 50, cudaMemcpyDeviceToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, d + 10, 50, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue) << "overlap";
  EXPECT_EQ(cudaMemset(d + 90, 0, 11), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy2DAsync(d, 10, h.data(), 20, 10, 10, cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  EXPECT_EQ(cudaMemcpy2DAsync(d, 10, h.data(), 20, 11, 10, cudaMemcpyHostToDevice, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

__global__ void add_one_kernel(int *p, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] += 1;
}

TEST(Emu, CapturedWorkReplays) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  int *p = device<int>(100), *q = device<int>(100);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(q, 0, 400, s), cudaSuccess);
  CTR_LAUNCH(add_one_kernel, 2, 32, 0, s)(p, 100);
  ASSERT_EQ(cudaMemcpyAsync(q, p, 200, cudaMemcpyDeviceToDevice, s), cudaSuccess);
  EXPECT_EQ(host(p, 1)[0], 0) << "captured work does not run";
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  cudaGraphExec_t x = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&x, g, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(g), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(x, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  auto hp = host(p, 100), hq = host(q, 100);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(hp[i], 3);
    EXPECT_EQ(hq[i], i < 50 ? 3 : 0);
  }
  // Waiting for a stream under capture is refused and spoils the capture.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(g, nullptr);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaGraphExecDestroy(x), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// ---------------------------------------------------------------------------
// cuBLASLt

// D[m,n] (column-major) = op(A) op(B) + bias, every matrix batched.
TEST(Emu, CublasLtMatmulTransposesBatchesAndBias) {
  const int m = 5, n = 3, k = 4, batch = 2;
  std::vector<float> ha(batch * k * m), hb(batch * k * n), hbias(m);
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = static_cast<float>(i % 7) - 3.0f;
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = static_cast<float>(i % 5) * 0.5f;
  for (int i = 0; i < m; ++i) hbias[i] = static_cast<float>(i);
  float *A = device<float>(ha.size()), *B = device<float>(hb.size()), *bias = device<float>(m);
  float *D = device<float>(batch * m * n);
  cudaMemcpy(A, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(B, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(bias, hbias.data(), m * 4, cudaMemcpyHostToDevice);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulDesc_t desc = nullptr;
  ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
  const void *bp = bias;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, 4), CUBLAS_STATUS_INVALID_VALUE);
  auto layout = [&](uint64_t rows, uint64_t cols, int64_t stride) {
    cublasLtMatrixLayout_t l = nullptr;
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, rows, cols, static_cast<int64_t>(rows)), CUBLAS_STATUS_SUCCESS);
    const int32_t bc = batch;
    EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
              CUBLAS_STATUS_SUCCESS);
    return l;
  };
  cublasLtMatrixLayout_t la = layout(k, m, k * m), lb = layout(k, n, k * n), ld = layout(m, n, m * n);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, nullptr, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  auto hd = host(D, batch * m * n);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        float ref = hbias[i];
        for (int p = 0; p < k; ++p) ref += ha[b * k * m + i * k + p] * hb[b * k * n + j * k + p];
        EXPECT_FLOAT_EQ(hd[b * m * n + j * m + i], ref) << b << " " << i << " " << j;
      }
  // What cuBLASLt refuses: shapes that do not chain, a short leading
  // dimension, A and B of different types.
  cublasLtMatrixLayout_t bad = layout(k + 1, n, (k + 1) * n);
  EXPECT_EQ(cublasLtMatmul(lt, desc, &alpha, A, la, B, bad, &beta, D, ld, D, ld, nullptr, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayout_t shortld = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&shortld, CUDA_R_32F, m, n, m - 1), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t res{};
  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  int found = 0;
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, shortld, shortld, pref, 1, &res, &found),
            CUBLAS_STATUS_INVALID_VALUE);
  const uint32_t bf16 = CUDA_R_16BF;
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(bad, CUBLASLT_MATRIX_LAYOUT_TYPE, &bf16, sizeof bf16), CUBLAS_STATUS_SUCCESS);
  const uint64_t rows = k;
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(bad, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, bad, ld, ld, pref, 1, &res, &found),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &res, &found), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(found, 1);
  for (auto l : {la, lb, ld, bad, shortld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
}

// The epilogues the GEMM file uses and the TF32 compute type, against host
// references written from cuBLASLt's documentation: GELU_AUX_BIAS stores the
// biased product in aux and gelu (tanh form) of it in D; DGELU multiplies the
// product by gelu' of aux; BGRADB writes the sums of op(B) over k; FAST_TF32
// rounds the inputs to 10 mantissa bits. And what cuBLASLt refuses of them.
TEST(Emu, CublasLtEpiloguesAndTf32) {
  const int m = 8, n = 3, k = 4;
  std::vector<float> ha(k * m), hb(k * n), hbias(m), haux_in(m * n);
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  for (int i = 0; i < m; ++i) hbias[i] = 0.1f * static_cast<float>(i) - 0.3f;
  for (size_t i = 0; i < haux_in.size(); ++i) haux_in[i] = static_cast<float>(i % 9) * 0.4f - 1.6f;
  float *A = device<float>(ha.size()), *B = device<float>(hb.size()), *bias = device<float>(m),
        *aux = device<float>(m * n), *D = device<float>(m * n), *bgrad = device<float>(n);
  cudaMemcpy(A, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(B, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(bias, hbias.data(), m * 4, cudaMemcpyHostToDevice);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  // D (m x n) = A^T B, A stored k x m, B k x n.
  auto product = [&](int i, int j) {
    float r = 0.0f;
    for (int p = 0; p < k; ++p) r += ha[i * k + p] * hb[j * k + p];
    return r;
  };
  auto gelu = [](float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x))); };
  auto gelu_grad = [](float x) {
    const float t = std::tanh(0.7978845608f * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 0.134145f * x * x);
  };
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, k, m, k), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](cublasComputeType_t compute, cublasLtEpilogue_t epi, const void *bp, void *ap, int64_t aux_ld) {
    cublasLtMatmulDesc_t desc = nullptr;
    EXPECT_EQ(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    const cublasOperation_t t = CUBLAS_OP_T;
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
              CUBLAS_STATUS_SUCCESS);
    if (bp) {
      EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp),
                CUBLAS_STATUS_SUCCESS);
    }
    if (ap) {
      EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof ap),
                CUBLAS_STATUS_SUCCESS);
      EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
                CUBLAS_STATUS_SUCCESS);
    }
    const cublasStatus_t st =
        cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, nullptr, nullptr, 0, nullptr);
    cublasLtMatmulDescDestroy(desc);
    return st;
  };

  ASSERT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, aux, m), CUBLAS_STATUS_SUCCESS);
  auto hd = host(D, m * n), haux = host(aux, m * n);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      const float pre = product(i, j) + hbias[i];
      EXPECT_FLOAT_EQ(haux[j * m + i], pre) << i << " " << j;
      EXPECT_NEAR(hd[j * m + i], gelu(pre), 1e-6f) << i << " " << j;
    }

  cudaMemcpy(aux, haux_in.data(), haux_in.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_DGELU, nullptr, aux, m), CUBLAS_STATUS_SUCCESS);
  hd = host(D, m * n);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i)
      EXPECT_NEAR(hd[j * m + i], product(i, j) * gelu_grad(haux_in[j * m + i]), 1e-5f) << i << " " << j;

  ASSERT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_BGRADB, bgrad, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  const auto hg = host(bgrad, n);
  for (int j = 0; j < n; ++j) {
    float ref = 0.0f;
    for (int p = 0; p < k; ++p) ref += hb[j * k + p];
    EXPECT_FLOAT_EQ(hg[j], ref) << j;
  }

  // TF32: 1 + 2^-12 rounds to 1 (half a TF32 ulp is 2^-11), 1 + 3 * 2^-12 to
  // 1 + 2^-10; an exact product keeps both.
  std::vector<float> ones_a(k * m, 1.0f + 1.0f / 4096), ones_b(k * n, 1.0f + 3.0f / 4096);
  cudaMemcpy(A, ones_a.data(), ones_a.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(B, ones_b.data(), ones_b.size() * 4, cudaMemcpyHostToDevice);
  ASSERT_EQ(run(CUBLAS_COMPUTE_32F_FAST_TF32, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  const float tf32_value = k * (1.0f + 1.0f / 1024);
  EXPECT_EQ(host(D, 1)[0], tf32_value);
  ASSERT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(host(D, 1)[0], tf32_value);
  EXPECT_NEAR(host(D, 1)[0], k * (1.0 + 1.0 / 4096) * (1.0 + 3.0 / 4096), 1e-6);

  // Refused: an auxiliary matrix without its pointer or with a leading
  // dimension that is not a multiple of 8, a bias gradient without a pointer,
  // TF32 for bf16 inputs.
  EXPECT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_DGELU, nullptr, nullptr, 0), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_GELU_AUX, nullptr, aux, m + 2), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_BGRADB, nullptr, nullptr, 0), CUBLAS_STATUS_INVALID_VALUE);
  const uint32_t bf16 = CUDA_R_16BF;
  for (auto l : {la, lb})
    ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &bf16, sizeof bf16),
              CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(run(CUBLAS_COMPUTE_32F_FAST_TF32, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, 0),
            CUBLAS_STATUS_NOT_SUPPORTED);
  for (auto l : {la, lb, ld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtDestroy(lt);
}

// ---------------------------------------------------------------------------
// Faults: each makes the device fail for good, so each runs in a child
// (defined outside the death-test macro, whose arguments may not hold the
// launch's commas).

__global__ void divergent_barrier_kernel(int *p) {
  if ((threadIdx.x & 31) < 16)
    __syncthreads();
  else
    p[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

__global__ void divergent_ops_kernel(int *p) {
  if ((threadIdx.x & 31) < 16)
    p[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
  else
    p[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
}

__global__ void overrun_kernel(float *p, int n) { p[n + threadIdx.x] = 1.0f; }

__global__ void shared_overrun_kernel(float *p) {
  CTR_DYNAMIC_SHARED(float, sm);
  sm[threadIdx.x * 64] = 1.0f;
  p[threadIdx.x] = sm[0];
}

class EmuFault : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(EmuFault, ABarrierInDivergentCodeDeadlocks) {
  auto child = [] {
      int *p = device<int>(64);
      CTR_LAUNCH(divergent_barrier_kernel, 1, 64, 0, nullptr)(p);
      expect_fault_in_child("deadlock: 32 threads wait at __syncthreads; lanes 0xffff0000 of warp 0 wait in "
                            "__shfl_sync(0xffffffff)");
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "divergent_barrier_kernel");
}

TEST_F(EmuFault, DivergentWarpOperationsFail) {
  auto child = [] {
      int *p = device<int>(32);
      CTR_LAUNCH(divergent_ops_kernel, 1, 32, 0, nullptr)(p);
      expect_fault_in_child("divergent warp operations in warp 0");
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "unspecified launch failure");
}

TEST_F(EmuFault, AnInjectedFaultIsSticky) {
  auto child = [] {
      setenv("CTR_EMU_FAIL_LAUNCH", "noop_kernel", 1);
      int *p = device<int>(32);
      CTR_LAUNCH(noop_kernel, 1, 32, 0, nullptr)(p);
      if (!has_error() || checked_error().find("noop_kernel failed at test_emu.cc") == std::string::npos)
        std::exit(2);
      if (cudaMemset(p, 0, 4) != cudaErrorIllegalAddress) std::exit(3);
      expect_fault_in_child("made to fail by CTR_EMU_FAIL_LAUNCH");
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "illegal memory access");
}

TEST_F(EmuFault, WritingPastAnAllocationFaults) {
  auto child = [] {
      float *p = device<float>(128);
      CTR_LAUNCH(overrun_kernel, 1, 32, 0, nullptr)(p, 128);
  };
  EXPECT_DEATH(child(), "overrun_kernel .*faulted: SIGSEGV .* 0 bytes past the end of the device allocation of 512 bytes");
}

TEST_F(EmuFault, WritingPastDynamicSharedMemoryFaults) {
  auto child = [] {
      float *p = device<float>(32);
      CTR_LAUNCH(shared_overrun_kernel, 1, 32, 1024, nullptr)(p);
  };
  EXPECT_DEATH(child(), "past the end of the block's 1024 bytes of dynamic shared memory");
}

TEST_F(EmuFault, AGemmOperandOutsideDeviceMemoryFaults) {
  auto child = [] {
      float *A = device<float>(12);
      std::vector<float> host_b(12);
      cublasLtHandle_t lt = nullptr;
      cublasLtCreate(&lt);
      cublasLtMatmulDesc_t desc = nullptr;
      cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      cublasLtMatrixLayout_t l = nullptr;
      cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 3, 3, 3);
      const float one = 1.0f, zero = 0.0f;
      if (cublasLtMatmul(lt, desc, &one, A, l, host_b.data(), l, &zero, A, l, A, l, nullptr, nullptr, 0,
                         nullptr) != CUBLAS_STATUS_EXECUTION_FAILED)
        std::exit(2);
      expect_fault_in_child("cublasLtMatmul: B");
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "illegal memory access");
}

}  // namespace
