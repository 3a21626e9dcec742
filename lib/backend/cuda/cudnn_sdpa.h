// The CUDA backend's library attention (cudnn_sdpa.cu): cuDNN's fused SDPA
// behind kernels/cuda/common.cuh's AttentionLib slot.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common.cuh"

namespace ctr::cuda {

// The slot for the backend stream `stream`. knob: cudnn_knob()'s 0 or 1. Never
// NULL: where cuDNN cannot be used (knob 0, not loadable, no handle) the slot
// declines every op and says why once on stderr at the first attention.
AttentionLib *cudnn_attention_create(cudaStream_t stream, int knob);
// Accepts NULL. The stream must be idle.
void cudnn_attention_destroy(AttentionLib *lib);

}  // namespace ctr::cuda
