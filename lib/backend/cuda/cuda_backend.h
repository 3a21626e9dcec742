// What the CUDA backend's other units in libctr-cuda.so (the NCCL
// communicators) need of a backend instance: its device, its stream 0, and one
// further CUDA stream that carries the instance's communication.
#pragma once

#include <cuda_runtime.h>

namespace ctr::cuda {

// backend_ctx is the context ctr_backend_plugin_init returned.
int backend_device(void *backend_ctx);
cudaStream_t backend_stream0(void *backend_ctx);
// Created at first use (null if that fails), destroyed with the backend; every
// communicator of the instance queues its work on it, so collectives of
// different communicators run in the order they were issued, as on every rank.
cudaStream_t backend_comm_stream(void *backend_ctx);

}  // namespace ctr::cuda
