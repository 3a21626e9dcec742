// Attention forward through cuDNN's fused scaled-dot-product attention (the
// flash-attention engines of cuDNN 9), behind the AttentionLib slot of stream
// 0's StreamCtx (kernels/cuda/common.cuh). kernels/cuda/attention.cu asks it
// first and runs its own kernels where it declines.
//
// The graph (cudnn_sdpa_graph.cc) writes the natural-log log-sum-exp of each
// scaled, masked score row, f32 [B, Hq, T], exactly what the own forward
// writes into the op's saved output and the own backward reads
// (CTR_BACKEND_ATTENTION_LSE), so the backward runs on the own kernels
// whichever forward ran.
//
// A plan (operation graph, engine configuration, execution plan) is built the
// first time a shape is seen, outside any capture (the executor's warm-up
// launches before it captures), and kept per shape; a shape cuDNN refuses is
// remembered as refused. Every cuDNN call is checked: a refusal while
// building is a fallback, said once per reason on stderr ("ctr: cudnn: ...");
// a failure to run a built plan is the backend's sticky error (check.cuh),
// since the op's outputs were then not written.

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cudnn_load.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/cudnn_sdpa_graph.h"
#include "common/op_params.h"
#include "cuda/common.cuh"

namespace ctr::cuda {
namespace {

// ---------------------------------------------------------------------------
// The slot

struct CudnnAttention : AttentionLib {
  const CudnnApi *api = nullptr;
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  std::string off;  // non-empty: cuDNN is not used, and why
  std::mutex mu;
  std::map<SdpaShape, std::unique_ptr<SdpaPlan>> plans;
  void *workspace = nullptr;
  int64_t workspace_bytes = 0;
  std::set<std::string> said;
  bool said_on = false;

  void say_once(const std::string &line) {
    if (said.insert(line).second) std::fprintf(stderr, "ctr: cudnn: %s\n", line.c_str());
  }
  ~CudnnAttention() {
    plans.clear();
    if (workspace) CTR_CUDA_CHECK(cudaFree(workspace));
    if (handle) {
      const cudnnStatus_t st = api->destroy(handle);
      if (st != CUDNN_STATUS_SUCCESS) note_error("cudnnDestroy", __FILE__, __LINE__, cudnn_words(*api, st).c_str());
    }
  }
};

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool cudnn_forward(AttentionLib *self, const Args &c) {
  auto &a = *static_cast<CudnnAttention *>(self);
  std::lock_guard<std::mutex> lock(a.mu);
  if (!a.off.empty()) {
    a.say_once("attention takes the own kernels: " + a.off);
    return false;
  }
  const auto &p = c.params<ctr_attention_params>();
  SdpaShape s{};
  s.B = c.in_dim(0, 0);
  s.T = c.in_dim(0, 1);
  s.Hq = p.heads;
  s.Hkv = p.kv_heads;
  s.D = c.in_dim(0, 2) / s.Hq;
  s.causal = p.causal != 0;
  s.scale = p.scale;
  // What this path takes: bf16 storage, head dims that are multiples of 8 up
  // to 128 (cuDNN's bf16 range on every supported GPU), more than one key
  // (with one the saved output is too small for the stats), 16-byte aligned
  // operands. Anything else is the own kernels' without a word: not a fault.
  const bool shape_ok = c.bf16() && c.in_ref(1).dtype == CTR_DTYPE_BF16 && c.in_ref(2).dtype == CTR_DTYPE_BF16 &&
                        s.D % 8 == 0 && s.D <= 128 && s.T > 1 && s.B * s.Hq * s.T > 0;
  const bool ptrs_ok = aligned16(c.in<void>(0)) && aligned16(c.in<void>(1)) && aligned16(c.in<void>(2)) &&
                       aligned16(c.out<void>(0)) && aligned16(c.out<void>(1));
  if (!shape_ok || !ptrs_ok) return false;

  auto it = a.plans.find(s);
  if (it == a.plans.end()) {
    // Building a plan may load modules and allocate: never inside a capture.
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!CTR_CUDA_CHECK(cudaStreamIsCapturing(c.stream(), &cap))) return false;
    if (cap != cudaStreamCaptureStatusNone) {
      a.say_once("attention [" + std::to_string(s.B) + ", " + std::to_string(s.T) +
                 "] first seen inside a CUDA graph capture: captured on the own kernels");
      return false;
    }
    auto plan = sdpa_forward_plan(*a.api, a.handle, nullptr, s);
    if (plan->why.empty() && plan->workspace > a.workspace_bytes) {
      // The old workspace may still be in use by queued work. Too little
      // memory is a refusal of this shape, not a fault.
      if (!CTR_CUDA_CHECK(cudaStreamSynchronize(c.stream()))) return false;
      void *w = nullptr;
      if (const cudaError_t e = cudaMalloc(&w, static_cast<size_t>(plan->workspace)); e != cudaSuccess) {
        cudaGetLastError();  // not sticky: out of memory
        plan->why = "its workspace of " + std::to_string(plan->workspace) + " bytes cannot be allocated (" +
                    cudaGetErrorString(e) + ")";
      } else {
        if (a.workspace) CTR_CUDA_CHECK(cudaFree(a.workspace));
        a.workspace = w;
        a.workspace_bytes = plan->workspace;
      }
    }
    const std::string dims = "B " + std::to_string(s.B) + ", T " + std::to_string(s.T) + ", heads " +
                             std::to_string(s.Hq) + "/" + std::to_string(s.Hkv) + ", head dim " +
                             std::to_string(s.D) + (s.causal ? ", causal" : "");
    if (plan->why.empty()) {
      if (!a.said_on) {
        a.said_on = true;
        a.say_once("attention forward runs on cuDNN " + cudnn_version_string(a.api->version) +
                   "'s fused SDPA (" + plan->engine + "; " + dims + ", workspace " + std::to_string(plan->workspace) +
                   " bytes; from " + a.api->path + "); its backward on the own kernels");
      }
    } else {
      a.say_once("attention (" + dims + ") takes the own kernels: cuDNN's plan: " + plan->why);
    }
    it = a.plans.emplace(s, std::move(plan)).first;
  }
  SdpaPlan &plan = *it->second;
  if (!plan.why.empty()) return false;

  // The variant pack: this launch's addresses.
  const CudnnApi &api = *a.api;
  int64_t uids[] = {kSdpaQ, kSdpaK, kSdpaV, kSdpaO, kSdpaStats, kSdpaScale, kSdpaLowest};
  void *ptrs[] = {c.in<void>(0), c.in<void>(1), c.in<void>(2), c.out<void>(0), c.out<void>(1), &plan.scale,
                  &plan.lowest};
  const int64_t n = s.causal ? 7 : 6;
  void *ws = a.workspace;
  cudnnBackendDescriptor_t pack = nullptr;
  cudnnStatus_t st = api.create_descriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  const char *what = "cudnnBackendCreateDescriptor(VARIANT_PACK)";
  if (st == CUDNN_STATUS_SUCCESS) {
    what = "cudnnBackendSetAttribute(VARIANT_PACK)";
    st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (st == CUDNN_STATUS_SUCCESS) {
      what = "cudnnBackendFinalize(VARIANT_PACK)";
      st = api.finalize(pack);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
      what = "cudnnBackendExecute (fused SDPA forward)";
      st = api.execute(a.handle, plan.plan, pack);
    }
  }
  if (pack) api.destroy_descriptor(pack);
  // A plan that built but does not run leaves the outputs unwritten: a fault
  // of the step, not a fallback.
  if (st != CUDNN_STATUS_SUCCESS) note_error(what, __FILE__, __LINE__, cudnn_words(api, st).c_str());
  return true;
}

}  // namespace

AttentionLib *cudnn_attention_create(cudaStream_t stream, int knob) {
  auto a = std::make_unique<CudnnAttention>();
  a->forward = cudnn_forward;
  a->stream = stream;
  if (knob == 0) {
    a->off = "CTR_CUDNN=0";
    return a.release();
  }
  std::string why;
  a->api = cudnn_api(&why);
  if (!a->api) {
    a->off = why;
    return a.release();
  }
  cudnnStatus_t st = a->api->create(&a->handle);
  if (st != CUDNN_STATUS_SUCCESS) {
    a->handle = nullptr;
    a->off = "cudnnCreate: " + cudnn_words(*a->api, st);
    return a.release();
  }
  st = a->api->set_stream(a->handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) a->off = "cudnnSetStream: " + cudnn_words(*a->api, st);
  return a.release();
}

void cudnn_attention_destroy(AttentionLib *lib) { delete static_cast<CudnnAttention *>(lib); }

}  // namespace ctr::cuda
