// The four phases and the two fused halves without XLA: the same launch helpers the FFI handlers call, given device
// pointers as integers. tests/gpu/kernel_harness.py runs round trips through them with no XLA:GPU in the process
// (so compute-sanitizer sees our kernels and NVSHMEM alone).
#include <map>
#include <stdexcept>
#include <string>

#include "device_common.cuh"
#include "runtime.h"

namespace jmc {
namespace {

using Args = std::map<std::string, int64_t>;

int64_t arg(const Args& a, const char* name) {
  auto it = a.find(name);
  if (it == a.end()) throw std::invalid_argument(std::string("launch_phase: missing argument ") + name);
  return it->second;
}

template <typename T>
T* ptr(const Args& a, const char* name) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(arg(a, name)));
}

// An argument a caller may leave out (0 then: a null pointer, or false).
int64_t optional_arg(const Args& a, const char* name) {
  auto it = a.find(name);
  return it == a.end() ? 0 : it->second;
}

// Each phase's arguments; `status` names the status output (the fused calls have two).
DispatchSendArgs dispatch_send_args(const Args& a, const char* status) {  // topk_weights: given with the dispatch
  return {ptr<const void>(a, "x"), ptr<const float>(a, "scales"), ptr<const int32_t>(a, "topk_ids"),
          ptr<const int32_t>(a, "num_tokens"), ptr<int32_t>(a, status),
          reinterpret_cast<const float*>(static_cast<intptr_t>(optional_arg(a, "topk_weights"))),
          optional_arg(a, "quantize") != 0};  // x is bf16: quantized as sent
}

DispatchRecvArgs dispatch_recv_args(const Args& a, const char* status) {
  return {ptr<void>(a, "expert_x"), ptr<float>(a, "expert_scales"), ptr<int32_t>(a, "group_sizes"),
          ptr<int32_t>(a, "row_origin"), ptr<int32_t>(a, status), ptr<int32_t>(a, "expert_counts")};
}

// prereduce_weights 0: rows per slot; weights_sent: the dispatch stored them on every rank already.
CombineSendArgs combine_send_args(const Args& a, const char* status) {
  return {ptr<const void>(a, "expert_y"), static_cast<int>(arg(a, "elem_bytes")), ptr<const int32_t>(a, "row_origin"),
          ptr<int32_t>(a, status), ptr<const float>(a, "prereduce_weights"), static_cast<int>(arg(a, "in_dtype")),
          static_cast<int>(arg(a, "partial_dtype")), optional_arg(a, "weights_sent") != 0};
}

CombineRecvArgs combine_recv_args(const Args& a, const char* status) {
  return {ptr<const int32_t>(a, "topk_ids"), ptr<const float>(a, "topk_weights"), ptr<const int32_t>(a, "num_tokens"),
          ptr<void>(a, "out"), static_cast<int>(arg(a, "rows_dtype")), static_cast<int>(arg(a, "out_dtype")),
          ptr<int32_t>(a, status), arg(a, "reduced") != 0};
}

}  // namespace

std::string launch_phase(Context* ctx, const std::string& phase, const Args& a, intptr_t stream_handle) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  // Every argument is read (and a missing one named) before the context is needed.
  const auto need = [&]() -> Context& {
    if (ctx == nullptr) throw std::invalid_argument("launch_phase: no such context (closed?)");
    return *ctx;
  };
  cudaError_t err;
  if (phase == "dispatch_send") {
    const DispatchSendArgs send = dispatch_send_args(a, "status");
    err = launch_dispatch_send(need(), send, stream);
  } else if (phase == "dispatch_recv") {
    const DispatchRecvArgs recv = dispatch_recv_args(a, "status");
    err = launch_dispatch_recv(need(), recv, stream);
  } else if (phase == "combine_send") {
    const CombineSendArgs send = combine_send_args(a, "status");
    err = launch_combine_send(need(), send, stream);
  } else if (phase == "combine_recv") {
    const CombineRecvArgs recv = combine_recv_args(a, "status");
    err = launch_combine_recv(need(), recv, stream);
  } else if (phase == "dispatch") {  // fused: both phases' arguments, statuses send_status and recv_status
    const DispatchSendArgs send = dispatch_send_args(a, "send_status");  // the send's missing arguments first
    const DispatchRecvArgs recv = dispatch_recv_args(a, "recv_status");
    err = launch_dispatch(need(), send, recv, stream);
  } else if (phase == "combine") {
    const CombineSendArgs send = combine_send_args(a, "send_status");
    const CombineRecvArgs recv = combine_recv_args(a, "recv_status");
    err = launch_combine(need(), send, recv, stream);
  } else {
    throw std::invalid_argument("launch_phase: unknown phase " + phase);
  }
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace jmc
