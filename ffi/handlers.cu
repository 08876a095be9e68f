// XLA FFI handlers: unpack buffers, find the Context by its id (the `context` attribute), launch the phase's kernel on
// XLA's stream (a send half with `side_stream`: on the context's own, see forked). No host synchronisation and no collective host work happens here. Shapes: T = max_tokens, H = hidden,
// K = experts per token, B = the fp8 scale block, C = capacity, L = local experts, E = experts of the layer;
// "status" is int32[kStatusWords].
#include <chrono>
#include <string>
#include <thread>

#include "device_common.cuh"
#include "dtypes.cuh"
#include "handlers.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmc {
namespace {

ffi::Error launched(cudaError_t err, const char* phase) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_moe_comm ") + phase + ": CUDA launch failed: " +
                              cudaGetErrorString(err));
}

// Runs launch(context) for the context with this id, or fails the call (a MoEComm closed while a program that uses
// it still runs).
template <typename Launch>
ffi::Error with_context(int64_t id, const char* phase, Launch&& launch) {
  const Context* ctx = find_context(id);
  if (ctx == nullptr)
    return ffi::Error::InvalidArgument(std::string("jax_moe_comm ") + phase + ": this MoEComm was closed");
  return launched(launch(*ctx), phase);
}

// The RowType of a combine buffer's element type (bf16, f16 or f32: MoEComm checks them).
int row_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return kBf16;
    case ffi::DataType::F16: return kF16;
    default: return kF32;
  }
}

// A bf16 x into an fp8 MoEComm: its rows are quantized as they are sent (MoEComm.dispatch(..., quantize=...)).
bool quantizes(const ffi::AnyBuffer& x, const Context& ctx) {
  return x.element_type() == ffi::DataType::BF16 && ctx.s.scale_cols > 0;
}

// Launches a send half: on XLA's stream, or with `side_stream` (MoEComm(send_stream="own")) forked onto the
// context's own stream (SideStream): after what XLA queued before it, beside what XLA queues after it, until a
// later handler joins it. Inside a command buffer (XLA's stream capturing) it is not forked: a fork joined by
// another call cannot be captured, and a replayed graph would not rerun the join. The "own" targets are registered
// without the command-buffer trait, so XLA runs them (and the work between them) outside command buffers.
template <typename Launch>
cudaError_t forked(const Context& c, int64_t side_stream, cudaStream_t stream, Launch&& launch) {
  SideStream* side = c.side;
  if (side_stream == 0 || side == nullptr) return launch(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess || capture != cudaStreamCaptureStatusNone) return err == cudaSuccess ? launch(stream) : err;
  if ((err = cudaEventRecord(side->inputs, stream)) != cudaSuccess) return err;
  if ((err = cudaStreamWaitEvent(side->stream, side->inputs, 0)) != cudaSuccess) return err;
  if ((err = launch(side->stream)) != cudaSuccess) return err;
  if ((err = cudaEventRecord(side->sent, side->stream)) != cudaSuccess) return err;
  side->pending = true;
  return cudaSuccess;
}

// Makes XLA's stream wait for a forked send (a no-op when none is pending): every kernel handler does so before it
// launches, the receive half first of all; the buffers that send reads are that receive's operands (kept live by
// XLA until then).
cudaError_t joined(const Context& c, cudaStream_t stream) {
  SideStream* side = c.side;
  if (side == nullptr || !side->pending) return cudaSuccess;
  side->pending = false;
  return cudaStreamWaitEvent(stream, side->sent, 0);
}

// joined, then launch(stream).
template <typename Launch>
cudaError_t after_join(const Context& c, cudaStream_t stream, Launch&& launch) {
  const cudaError_t err = joined(c, stream);
  return err == cudaSuccess ? launch(stream) : err;
}

// `after` is never read by any handler: an operand XLA must produce first, so the call runs after it (see
// design.md, "FFI and ordering").
ffi::Error DispatchSend(cudaStream_t stream,
                        ffi::AnyBuffer x,                      // [T, H] payload (cfg.dtype), or bf16: quantized
                        ffi::Buffer<ffi::F32> scales,          // [T, H / B] fp8 scales, or [T, 0]
                        ffi::Buffer<ffi::S32> topk_ids,        // [T, K] expert ids, -1 for none
                        ffi::Buffer<ffi::S32> num_tokens,      // [] tokens of this rank that count
                        ffi::Buffer<ffi::F32> topk_weights,    // [T, K] stored with the ids (NVLink path), or [0]
                        ffi::AnyBuffer /*after*/,              // any
                        ffi::Result<ffi::Buffer<ffi::S32>> status,  // this phase's status
                        int64_t context, int64_t side_stream) {
  DispatchSendArgs a{x.untyped_data(), scales.typed_data(), topk_ids.typed_data(), num_tokens.typed_data(),
                     status->typed_data(), topk_weights.element_count() ? topk_weights.typed_data() : nullptr};
  return with_context(context, "dispatch_send", [&](const Context& c) {
    a.quantize = quantizes(x, c);
    return after_join(c, stream, [&](cudaStream_t) {
      return forked(c, side_stream, stream, [&](cudaStream_t s) { return launch_dispatch_send(c, a, s); });
    });
  });
}

// `kept` (send_stream="own"): the send's operands, which its kernel may still read until this call joins it.
ffi::Error DispatchRecv(cudaStream_t stream,
                        ffi::Buffer<ffi::S32> /*send_status*/,             // orders the receive after the send
                        ffi::RemainingArgs /*kept*/,                       // the send's operands, or none
                        ffi::Result<ffi::AnyBuffer> expert_x,              // [C, H] rows by local expert
                        ffi::Result<ffi::Buffer<ffi::F32>> expert_scales,  // [C, H / B], or [C, 0]
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,    // [L]
                        ffi::Result<ffi::Buffer<ffi::S32>> row_origin,     // [C] (group * T + token) * K + slot
                        ffi::Result<ffi::Buffer<ffi::S32>> expert_counts,  // [E] every expert's live slots
                        ffi::Result<ffi::Buffer<ffi::S32>> status,         // this phase's status
                        int64_t context) {
  DispatchRecvArgs a{expert_x->untyped_data(), expert_scales->typed_data(), group_sizes->typed_data(),
                     row_origin->typed_data(), status->typed_data(), expert_counts->typed_data()};
  return with_context(context, "dispatch_recv", [&](const Context& c) {
    return after_join(c, stream, [&](cudaStream_t s) { return launch_dispatch_recv(c, a, s); });
  });
}

// `partial_type` (a RowType): the element type of the pre-reduced rows; `weights_sent` (0/1): the dispatch stored the
// weights on every rank already. Integer attributes: the codes are RowType's, which jax_moe_comm asks for.
ffi::Error CombineSend(cudaStream_t stream,
                       ffi::AnyBuffer expert_y,                     // [C, H] expert outputs (bf16, f16, f32)
                       ffi::Buffer<ffi::S32> row_origin,            // [C] from dispatch
                       ffi::Buffer<ffi::F32> topk_weights,          // [T, K]: pre-reduce (NVLink path); [0]: per slot
                       ffi::Result<ffi::Buffer<ffi::S32>> status,   // this phase's status
                       int64_t context, int64_t partial_type, int64_t weights_sent, int64_t side_stream) {
  CombineSendArgs a{expert_y.untyped_data(), static_cast<int>(ffi::ByteWidth(expert_y.element_type())),
                    row_origin.typed_data(), status->typed_data(),
                    topk_weights.element_count() ? topk_weights.typed_data() : nullptr,
                    row_type(expert_y.element_type()), static_cast<int>(partial_type), weights_sent != 0};
  return with_context(context, "combine_send", [&](const Context& c) {
    return after_join(c, stream, [&](cudaStream_t) {
      return forked(c, side_stream, stream, [&](cudaStream_t s) { return launch_combine_send(c, a, s); });
    });
  });
}

// `rows_type` (a RowType): the element type of the rows in flight (expert_y's, or the pre-reduced rows');
// `reduced` (0/1): they arrived pre-reduced, one per (token, expert rank).
ffi::Error CombineRecv(cudaStream_t stream,
                       ffi::Buffer<ffi::S32> /*send_status*/,       // orders the receive after the send
                       ffi::Buffer<ffi::S32> topk_ids,              // [T, K] this rank's routing
                       ffi::Buffer<ffi::F32> topk_weights,          // [T, K]
                       ffi::Buffer<ffi::S32> num_tokens,            // []
                       ffi::RemainingArgs /*kept*/,                 // the send's operands (send_stream="own"), or none
                       ffi::Result<ffi::AnyBuffer> out,             // [T, H] out_dtype
                       ffi::Result<ffi::Buffer<ffi::S32>> status,   // the round trip's status (every rank's)
                       int64_t context, int64_t rows_type, int64_t reduced) {
  CombineRecvArgs a{topk_ids.typed_data(), topk_weights.typed_data(), num_tokens.typed_data(), out->untyped_data(),
                    static_cast<int>(rows_type), row_type(out->element_type()), status->typed_data(), reduced != 0};
  return with_context(context, "combine_recv", [&](const Context& c) {
    return after_join(c, stream, [&](cudaStream_t s) { return launch_combine_recv(c, a, s); });
  });
}

// The fused dispatch (NVLink path): dispatch_send's arguments, dispatch_recv's results and both statuses.
ffi::Error Dispatch(cudaStream_t stream,
                    ffi::AnyBuffer x,                                  // [T, H] cfg.dtype, or bf16: quantized
                    ffi::Buffer<ffi::F32> scales,                      // [T, H / B], or [T, 0]
                    ffi::Buffer<ffi::S32> topk_ids,                    // [T, K]
                    ffi::Buffer<ffi::S32> num_tokens,                  // []
                    ffi::Buffer<ffi::F32> topk_weights,                // [T, K], or [0]
                    ffi::AnyBuffer /*after*/,                          // any
                    ffi::Result<ffi::AnyBuffer> expert_x,              // [C, H]
                    ffi::Result<ffi::Buffer<ffi::F32>> expert_scales,  // [C, H / B], or [C, 0]
                    ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,    // [L]
                    ffi::Result<ffi::Buffer<ffi::S32>> row_origin,     // [C]
                    ffi::Result<ffi::Buffer<ffi::S32>> expert_counts,  // [E]
                    ffi::Result<ffi::Buffer<ffi::S32>> send_status,    // the send's status
                    ffi::Result<ffi::Buffer<ffi::S32>> recv_status,    // the receive's status
                    int64_t context) {
  DispatchSendArgs send{x.untyped_data(), scales.typed_data(), topk_ids.typed_data(), num_tokens.typed_data(),
                        send_status->typed_data(),
                        topk_weights.element_count() ? topk_weights.typed_data() : nullptr};
  DispatchRecvArgs recv{expert_x->untyped_data(), expert_scales->typed_data(), group_sizes->typed_data(),
                        row_origin->typed_data(), recv_status->typed_data(), expert_counts->typed_data()};
  return with_context(context, "dispatch", [&](const Context& c) {
    send.quantize = quantizes(x, c);
    return after_join(c, stream, [&](cudaStream_t s) { return launch_dispatch(c, send, recv, s); });
  });
}

// The fused combine (NVLink path); `reduced`: pre-reduce on the expert side (partial rows in out's dtype);
// `weights_sent`: the dispatch stored the weights on every rank already.
ffi::Error Combine(cudaStream_t stream,
                   ffi::AnyBuffer expert_y,                          // [C, H]
                   ffi::Buffer<ffi::S32> row_origin,                 // [C]
                   ffi::Buffer<ffi::S32> topk_ids,                   // [T, K]
                   ffi::Buffer<ffi::F32> topk_weights,               // [T, K]
                   ffi::Buffer<ffi::S32> num_tokens,                 // []
                   ffi::Result<ffi::AnyBuffer> out,                  // [T, H] out_dtype
                   ffi::Result<ffi::Buffer<ffi::S32>> send_status,   // the send's status
                   ffi::Result<ffi::Buffer<ffi::S32>> recv_status,   // the round trip's status (every rank's)
                   int64_t context, int64_t reduced, int64_t weights_sent) {
  const int in_dtype = row_type(expert_y.element_type()), out_dtype = row_type(out->element_type());
  CombineSendArgs send{expert_y.untyped_data(), static_cast<int>(ffi::ByteWidth(expert_y.element_type())),
                       row_origin.typed_data(), send_status->typed_data(),
                       reduced ? topk_weights.typed_data() : nullptr, in_dtype, out_dtype, reduced && weights_sent};
  const bool pre_reduced = reduced != 0;
  CombineRecvArgs recv{topk_ids.typed_data(), topk_weights.typed_data(), num_tokens.typed_data(), out->untyped_data(),
                       pre_reduced ? out_dtype : in_dtype, out_dtype, recv_status->typed_data(), pre_reduced};
  return with_context(context, "combine", [&](const Context& c) {
    return after_join(c, stream, [&](cudaStream_t s) { return launch_combine(c, send, recv, s); });
  });
}

#ifdef JMC_MEASUREMENT
// The bench's floor (probe.cu): x's bytes to the next rank; out gets the previous rank's. `flagged`: in words that
// carry their own validity (no fence, no signal).
ffi::Error Probe(cudaStream_t stream,
                 ffi::AnyBuffer x,                           // any, a multiple of 16 bytes
                 ffi::Result<ffi::AnyBuffer> out,            // x's shape: what the previous rank sent
                 ffi::Result<ffi::Buffer<ffi::S32>> status,  // a timeout's status
                 int64_t context, int64_t flagged) {
  return with_context(context, "probe", [&](const Context& c) {
    return launch_probe(c, x.untyped_data(), out->untyped_data(), static_cast<long long>(x.size_bytes()),
                        status->typed_data(), flagged != 0, stream);
  });
}
#endif

// The deferred error check, in front of each round trip's dispatch: XLA runs it on the host at every execution (it is
// never recorded into a command buffer) and it does not synchronize the stream. It raises, as this call's error, the
// first failure the device has told the host of (HostWords) once that failure is settled: a failure of an earlier
// execution (the first check of an execution waits until the device has finished every round trip launched before
// it), or of this execution `lag` or more round trips ago (the host waits until the device has finished the round
// trip `lag` before this one, so it runs at most `lag` round trips ahead of it). Every rank therefore raises at the
// same call of the same program, and no rank is left waiting in a collective for one that stopped. A routing error
// is cleared once raised (the next round trip may succeed); a protocol failure is raised again by every later
// check until comm.reset().
ffi::Error Check(ffi::RunId run,
                 ffi::AnyBuffer /*after*/,                   // orders the check after the previous round trip
                 ffi::Result<ffi::Buffer<ffi::S32>> /*token*/,  // [1]: the dispatch's `after`
                 int64_t context, int64_t lag) {
  Context* found = find_context(context);
  if (found == nullptr) return ffi::Error::InvalidArgument("jax_moe_comm: this MoEComm was closed");
  Context& ctx = *found;
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
  failure_raised(&ctx);
  --host.launched;  // this round trip does not run
  return raise_if_failed(failure);
}

// On the GPU: the status is copied to the host, and the host waits for the stream (a synchronous check).
ffi::Error RaiseIfFailedDevice(cudaStream_t stream,
                               ffi::Buffer<ffi::S32> status,           // [kStatusWords] the round trip's status
                               ffi::AnyBuffer /*after*/,                 // orders the check after the round trip
                               ffi::Result<ffi::Buffer<ffi::S32>> ok) {  // []: 0
  if (ffi::Error bad = status_words_checked(status); bad.failure()) return bad;
  std::vector<int32_t> words(kStatusWords);
  cudaError_t err = cudaMemcpyAsync(words.data(), status.typed_data(), kStatusWords * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return launched(err, "check");
  if (ffi::Error failed = raise_if_failed(words); failed.failure()) return failed;
  return launched(cudaMemsetAsync(ok->typed_data(), 0, sizeof(int32_t), stream), "check");
}

}  // namespace
}  // namespace jmc

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_check, jmc::Check,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::Buffer<ffi::S32>>()   // token
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("lag"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch_send, jmc::DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_tokens
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::Buffer<ffi::S32>>()   // status
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("side_stream"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch_recv, jmc::DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // send_status
                                  .RemainingArgs()                // kept
                                  .Ret<ffi::AnyBuffer>()          // expert_x
                                  .Ret<ffi::Buffer<ffi::F32>>()   // expert_scales
                                  .Ret<ffi::Buffer<ffi::S32>>()   // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_origin
                                  .Ret<ffi::Buffer<ffi::S32>>()   // expert_counts
                                  .Ret<ffi::Buffer<ffi::S32>>()   // status
                                  .Attr<int64_t>("context"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine_send, jmc::CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // expert_y
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_origin
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()   // status
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("partial_type")
                                  .Attr<int64_t>("weights_sent")
                                  .Attr<int64_t>("side_stream"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine_recv, jmc::CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // send_status
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_tokens
                                  .RemainingArgs()                // kept
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::S32>>()   // status
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("rows_type")
                                  .Attr<int64_t>("reduced"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_dispatch, jmc::Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_tokens
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::AnyBuffer>()          // expert_x
                                  .Ret<ffi::Buffer<ffi::F32>>()   // expert_scales
                                  .Ret<ffi::Buffer<ffi::S32>>()   // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_origin
                                  .Ret<ffi::Buffer<ffi::S32>>()   // expert_counts
                                  .Ret<ffi::Buffer<ffi::S32>>()   // send_status
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_status
                                  .Attr<int64_t>("context"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_combine, jmc::Combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // expert_y
                                  .Arg<ffi::Buffer<ffi::S32>>()   // row_origin
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_tokens
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::S32>>()   // send_status
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_status
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("reduced")
                                  .Attr<int64_t>("weights_sent"));

#ifdef JMC_MEASUREMENT
XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_probe, jmc::Probe,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::S32>>()   // status
                                  .Attr<int64_t>("context")
                                  .Attr<int64_t>("flagged"));
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(jmc_raise_if_failed_device, jmc::RaiseIfFailedDevice,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // status
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::Buffer<ffi::S32>>()); // ok
