// cuDNN's fused scaled-dot-product attention as a backend-API graph, and the
// execution plan for it (cudnn_sdpa_graph.cc). Host code alone: the backend
// builds plans with its cuDNN handle (cudnn_sdpa.cu), and the unit suite
// builds the same plans without a GPU against a described device
// (tests/unit/test_cudnn.cc), so that cuDNN's acceptance of the graph is
// tested on every machine that has cuDNN 9.8 or later.
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "backend/cuda/cudnn_load.h"

namespace ctr::cuda {

// What a failed cuDNN call returned, in cuDNN's words (status name, number,
// and the library's last message).
std::string cudnn_words(const CudnnApi &api, cudnnStatus_t st);

// One attention op: q [B, T, Hq*D], k and v [B, T, Hkv*D], bf16.
struct SdpaShape {
  int64_t B, T, Hq, Hkv, D;
  bool causal;
  float scale;
  auto key() const { return std::make_tuple(B, T, Hq, Hkv, D, causal, scale); }
  bool operator<(const SdpaShape &o) const { return key() < o.key(); }
};

// Tensor ids of the variant pack. Backward only: dO, dQ, dK, dV, K again
// (untransposed, same address), and two workspace tensors: the row sums of
// dO * O (f32 [B, H, T]) and dQ's f32 accumulator ([B, T, H*D], zeroed before
// each run).
enum : int64_t {
  kSdpaQ = 1, kSdpaK, kSdpaV, kSdpaO, kSdpaStats, kSdpaScale, kSdpaLowest,
  kSdpaDO, kSdpaDQ, kSdpaDK, kSdpaDV, kSdpaKRows, kSdpaDelta, kSdpaDQAcc
};

// A built forward plan, or the reason there is none.
struct SdpaPlan {
  const CudnnApi *api = nullptr;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace = 0;
  float scale = 0, lowest = 0;  // by-value operands: their addresses go into each variant pack
  std::string why;              // non-empty: refused
  std::string engine;           // the configuration taken ("heuristic A, choice 0")
  SdpaPlan() = default;
  SdpaPlan(const SdpaPlan &) = delete;
  SdpaPlan &operator=(const SdpaPlan &) = delete;
  ~SdpaPlan();
};

// Builds the forward graph of `s` and the first execution plan cuDNN
// finalizes for it, for the device of `handle`, or, with a null handle, for
// the device `device_prop` describes (a finalized DEVICEPROP descriptor; cuDNN
// 9.8 or later). Never null; check why.
std::unique_ptr<SdpaPlan> sdpa_forward_plan(const CudnnApi &api, cudnnHandle_t handle,
                                            cudnnBackendDescriptor_t device_prop, const SdpaShape &s);

// The same for the backward: dQ, dK, dV from Q, K, V, O, dO and the
// forward's Stats. dK and dV come out per query head ([B, T, Hq*D]); with
// grouped-query heads the caller sums each kv head's group of them.
std::unique_ptr<SdpaPlan> sdpa_backward_plan(const CudnnApi &api, cudnnHandle_t handle,
                                             cudnnBackendDescriptor_t device_prop, const SdpaShape &s);

}  // namespace ctr::cuda
