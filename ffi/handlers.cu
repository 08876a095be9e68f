// XLA FFI handlers: unpack buffers, find the Context through the `context` attribute, launch the phase's kernel on
// XLA's stream. No host synchronisation and no collective host work happens here.
#include <chrono>
#include <string>
#include <thread>

#include "device_common.cuh"
#include "handlers.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

const Context& context_of(int64_t address) { return *reinterpret_cast<const Context*>(address); }

ffi::Error launched(cudaError_t err, const char* phase) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_moe_comm ") + phase + ": CUDA launch failed: " +
                              cudaGetErrorString(err));
}

int dtype_code(ffi::DataType t) {  // shared with combine_recv.cu
  switch (t) {
    case ffi::DataType::BF16: return 0;
    case ffi::DataType::F16: return 1;
    default: return 2;
  }
}

// topk_weights [T, K] go with the ids rows (given to dispatch; the NVLink path); an empty array: none.
// `after` is never read: an operand XLA must produce first, so the call runs after it (see design.md, "FFI and
// ordering"; an optimization barrier would not hold, XLA drops those).
ffi::Error DispatchSend(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales,
                        ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::S32> num_tokens,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*after*/,
                        ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t context) {
  DispatchSendArgs a{x.untyped_data(), scales.typed_data(), topk_ids.typed_data(), num_tokens.typed_data(),
                     status->typed_data(), topk_weights.element_count() ? topk_weights.typed_data() : nullptr};
  return launched(launch_dispatch_send(context_of(context), a, stream), "dispatch_send");
}

ffi::Error DispatchRecv(cudaStream_t stream, ffi::Buffer<ffi::S32> /*send_status: orders recv after send*/,
                        ffi::Result<ffi::AnyBuffer> expert_x, ffi::Result<ffi::Buffer<ffi::F32>> expert_scales,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes, ffi::Result<ffi::Buffer<ffi::S32>> row_origin,
                        ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t context) {
  DispatchRecvArgs a{expert_x->untyped_data(), expert_scales->typed_data(), group_sizes->typed_data(),
                     row_origin->typed_data(), status->typed_data()};
  return launched(launch_dispatch_recv(context_of(context), a, stream), "dispatch_recv");
}

// topk_weights [T, K] pre-reduces (the NVLink path); an empty array sends the rows per slot. `weights_sent`: the
// dispatch stored them on every rank already.
ffi::Error CombineSend(cudaStream_t stream, ffi::AnyBuffer expert_y, ffi::Buffer<ffi::S32> row_origin,
                       ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::Buffer<ffi::S32>> status,
                       int64_t context, int64_t partial_dtype, int64_t weights_sent) {
  CombineSendArgs a{expert_y.untyped_data(), static_cast<int>(ffi::ByteWidth(expert_y.element_type())),
                    row_origin.typed_data(), status->typed_data(),
                    topk_weights.element_count() ? topk_weights.typed_data() : nullptr,
                    dtype_code(expert_y.element_type()), static_cast<int>(partial_dtype), weights_sent != 0};
  return launched(launch_combine_send(context_of(context), a, stream), "combine_send");
}

ffi::Error CombineRecv(cudaStream_t stream, ffi::Buffer<ffi::S32> /*send_status*/, ffi::Buffer<ffi::S32> topk_ids,
                       ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> num_tokens,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t context,
                       int64_t in_dtype, int64_t reduced) {
  CombineRecvArgs a{topk_ids.typed_data(), topk_weights.typed_data(), num_tokens.typed_data(), out->untyped_data(),
                    static_cast<int>(in_dtype), dtype_code(out->element_type()), status->typed_data(), reduced != 0};
  return launched(launch_combine_recv(context_of(context), a, stream), "combine_recv");
}

// The fused dispatch (NVLink path): dispatch_send's arguments, dispatch_recv's results and both statuses.
ffi::Error Dispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> topk_ids,
                    ffi::Buffer<ffi::S32> num_tokens, ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*after*/,
                    ffi::Result<ffi::AnyBuffer> expert_x,
                    ffi::Result<ffi::Buffer<ffi::F32>> expert_scales, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                    ffi::Result<ffi::Buffer<ffi::S32>> row_origin, ffi::Result<ffi::Buffer<ffi::S32>> send_status,
                    ffi::Result<ffi::Buffer<ffi::S32>> recv_status, int64_t context) {
  DispatchSendArgs send{x.untyped_data(), scales.typed_data(), topk_ids.typed_data(), num_tokens.typed_data(),
                        send_status->typed_data(),
                        topk_weights.element_count() ? topk_weights.typed_data() : nullptr};
  DispatchRecvArgs recv{expert_x->untyped_data(), expert_scales->typed_data(), group_sizes->typed_data(),
                        row_origin->typed_data(), recv_status->typed_data()};
  return launched(launch_dispatch(context_of(context), send, recv, stream), "dispatch");
}

// The fused combine (NVLink path); `reduced`: pre-reduce on the expert side (partial rows in out's dtype);
// `weights_sent`: the dispatch stored the weights on every rank already.
ffi::Error Combine(cudaStream_t stream, ffi::AnyBuffer expert_y, ffi::Buffer<ffi::S32> row_origin,
                   ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> num_tokens,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> send_status,
                   ffi::Result<ffi::Buffer<ffi::S32>> recv_status, int64_t context, int64_t reduced,
                   int64_t weights_sent) {
  const int in_dtype = dtype_code(expert_y.element_type()), out_dtype = dtype_code(out->element_type());
  CombineSendArgs send{expert_y.untyped_data(), static_cast<int>(ffi::ByteWidth(expert_y.element_type())),
                       row_origin.typed_data(), send_status->typed_data(),
                       reduced ? topk_weights.typed_data() : nullptr, in_dtype, out_dtype,
                       reduced != 0 && weights_sent != 0};
  CombineRecvArgs recv{topk_ids.typed_data(), topk_weights.typed_data(), num_tokens.typed_data(), out->untyped_data(),
                       reduced ? out_dtype : in_dtype, out_dtype, recv_status->typed_data(), reduced != 0};
  return launched(launch_combine(context_of(context), send, recv, stream), "combine");
}

// The bench's floor (probe.cu): x's bytes to the next rank; out gets the previous rank's. `flagged`: in words that
// carry their own validity (no fence, no signal).
ffi::Error Probe(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t context, int64_t flagged) {
  return launched(launch_probe(context_of(context), x.untyped_data(), out->untyped_data(),
                               static_cast<long long>(x.size_bytes()), status->typed_data(), flagged != 0, stream),
                  "probe");
}

// The deferred error check, in front of each round trip's dispatch: XLA runs it on the host at every execution (it is
// never recorded into a command buffer) and it does not synchronize the stream. It raises, as this call's error, the
// first failure the device has told the host of (HostWords) once that failure is settled: a failure of an earlier
// execution (the first check of an execution waits until the device has finished every round trip launched before
// it), or of this execution `lag` or more round trips ago (the host waits until the device has finished the round
// trip `lag` before this one, so it runs at most `lag` round trips ahead of it). Every rank therefore raises at the
// same call of the same program, and no rank is left waiting in a collective for one that stopped. A routing error
// is cleared once raised (the next round trip may succeed); a protocol failure is raised again by every later
// check until comm.reset().
ffi::Error Check(ffi::RunId run, ffi::AnyBuffer /*after: orders the check after the previous round trip*/,
                 ffi::Result<ffi::Buffer<ffi::S32>> /*token: the dispatch's `after`*/, int64_t context, int64_t lag) {
  Context& ctx = *reinterpret_cast<Context*>(context);
  HostState& host = *ctx.host_state;
  const bool first_of_execution = run.run_id != host.execution;
  host.execution = run.run_id;
  const uint32_t launched = ++host.launched;
  const uint32_t behind = first_of_execution ? 1 : static_cast<uint32_t>(lag);
  const uint32_t settled = launched > behind ? launched - behind : 0;
  const volatile uint32_t* done = &ctx.host_view->done;
  if (*done < settled) {  // wait for the device, which is behind the host
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(2 * ctx.s.timeout_ns);
    while (*done < settled) {
      if (std::chrono::steady_clock::now() > deadline) {  // a round trip counted here never ran: count again from here
        host.launched = *done + behind;
        break;
      }
      std::this_thread::yield();
    }
  }
  const std::vector<int32_t> failure = host_failure(&ctx);
  if (failure[kCode] == 0 || static_cast<uint32_t>(failure[kEpochWord]) > settled) return ffi::Error::Success();
  if (!(failure[kCode] & kFatalCodes)) clear_host_failure(&ctx);
  --host.launched;  // this round trip does not run
  return ffi::Error(ffi::ErrorCode::kAborted, describe_failure(failure));
}

}  // namespace
}  // namespace jmc

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_check, jmc::Check,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("lag"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch_send, jmc::DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch_recv, jmc::DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine_send, jmc::CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("partial_dtype")
                                  .Attr<int64_t>("weights_sent"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine_recv, jmc::CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("in_dtype")
                                  .Attr<int64_t>("reduced"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch, jmc::Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine, jmc::Combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("reduced")
                                  .Attr<int64_t>("weights_sent"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_probe, jmc::Probe,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("flagged"));
