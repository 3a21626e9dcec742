// Every CUDA runtime, cuBLASLt and kernel-launch status is checked.
//
// A failed call is recorded once, process-wide, as the backend's sticky error:
// what failed (the call as written, or the kernel), where (file:line) and the
// library's own words. The backend's `status` slot reports it, and the
// executor reads that slot after each launch and at each point where it
// already waits for the device, so a fault becomes a step error naming the
// call or kernel and the op, never a wrong number. A device fault is sticky in
// CUDA too: once one is recorded, nothing the context computes can be trusted.
//
// Kernels are launched through CTR_LAUNCH rather than `<<<...>>>`:
//
//   CTR_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...);
//   CTR_LAUNCH((kernel<T, 4>), grid, block, 0, stream)(args...);   // commas: parenthesise
//
// which launches and then checks the launch (bad configuration, too many
// resources, and, under CUDA_LAUNCH_BLOCKING=1, the kernel's own fault).
// Only nvcc sees this definition; a host compile of the kernels defines
// CTR_LAUNCH itself.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace ctr::cuda {

// Records a failure (the first one is kept; later ones are counted). what:
// the call or kernel; detail: the library's message.
void note_error(const char *what, const char *file, int line, const char *detail);
// True once a failure has been recorded.
bool has_error();
// Copies the first failure's message into buf (NUL-terminated, cut to size);
// returns 0 when there is none, 1 otherwise.
int error_message(char *buf, size_t size);
// For tests of the emulated build: forget the recorded failure.
void clear_error();

inline bool check_cuda(cudaError_t e, const char *what, const char *file, int line) {
  if (e == cudaSuccess) return true;
  note_error(what, file, line, cudaGetErrorString(e));
  return false;
}
bool check_cublas(cublasStatus_t s, const char *what, const char *file, int line);
// After a launch: the launch's own status (cudaGetLastError, which also clears
// a non-sticky configuration error so it is not blamed on a later call).
inline void check_launch(const char *kernel, const char *file, int line) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) note_error(kernel, file, line, cudaGetErrorString(e));
}

// Checks the launch it follows: a temporary of the launch's full expression,
// so its destructor runs right after the kernel is queued.
struct LaunchCheck {
  const char *kernel;
  const char *file;
  int line;
  ~LaunchCheck() { check_launch(kernel, file, line); }
};

}  // namespace ctr::cuda

#define CTR_CUDA_CHECK(call) ::ctr::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define CTR_CUBLAS_CHECK(call) ::ctr::cuda::check_cublas((call), #call, __FILE__, __LINE__)
#if defined(__CUDACC__)
#define CTR_LAUNCH(kernel, grid, block, shared, stream) \
  ::ctr::cuda::LaunchCheck{#kernel, __FILE__, __LINE__}, kernel<<<grid, block, shared, stream>>>
#endif
