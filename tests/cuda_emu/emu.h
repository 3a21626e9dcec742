// Internals of the emulated CUDA device shared by its runtime (runtime.cc),
// its grid executor (exec.cc) and its cuBLASLt (cublaslt.cc).
//
// Every stream executes its work when it is queued, in order, on the calling
// thread; device work (grids, copies, fills, GEMMs) holds one process-wide
// lock, so one piece runs at a time. A stream under graph capture keeps its
// work instead, and a graph launch runs the kept work again.
#pragma once

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>

#include "cuda_runtime.h"

namespace ctr_emu {

// Device work queued on a stream.
using Work = std::function<cudaError_t()>;

// Runs w now under the device lock, or records it when s is being captured.
// Returns (and makes the thread's last error) what w returns.
cudaError_t enqueue(cudaStream_t s, Work w);

// Sets the calling thread's last error (unless e is cudaSuccess); returns e.
cudaError_t set_error(cudaError_t e);
// A failure the emulator found that CUDA reports only by its code: printed
// on stderr with what was wrong, then set as the last error.
cudaError_t report(cudaError_t e, const std::string &detail);
// The sticky fault (a kernel that faulted): once set, every call returns it
// and cudaGetErrorString adds the detail. Returns the sticky code.
cudaError_t set_fault(cudaError_t e, const std::string &detail);
cudaError_t sticky_error();

// Whether [p, p + bytes) lies inside one device allocation; whether p points
// into one at all.
bool in_device_memory(const void *p, size_t bytes);
bool is_device_pointer(const void *p);
// For fault reports (called from a signal handler: never blocks): where p
// lies relative to the device allocations, or "".
std::string describe_device_address(const void *p);

// Device limits (cudaGetDeviceProperties).
size_t shared_per_block();        // without cudaFuncSetAttribute: 48 KiB
size_t shared_per_block_optin();  // CTR_EMU_SHARED_OPTIN, else 227 KiB as on sm_90
// The dynamic shared memory a kernel may use (cudaFuncSetAttribute).
size_t kernel_shared_limit(const void *func);

}  // namespace ctr_emu
