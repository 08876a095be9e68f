// The fused combine (NVLink path, Context::p2p): combine_send and combine_recv in one kernel, for the fused
// `combine` call. Each block sends its rows (per slot, or pre-reduced partial rows), then receives: it waits for
// rows that other blocks send, on this rank and on its peers, so every block must be resident (a cooperative
// launch, its grid capped at co-residency). The device code is the phases' own (combine_send.cuh,
// combine_recv.cuh), hence the same sums in the same order as the two kernels.
#include <algorithm>

#include "combine_recv.cuh"
#include "combine_send.cuh"

namespace jmc {
namespace {

// The send did not run (refused, or out of protocol order: the send status says so): neither does the receive, whose
// end still ends the round trip (finish_phase), and y is NaN.
template <typename Out>
__device__ inline void skip_receive(const Context& ctx, const CombineRecvArgs& recv) {
  fill_nan<Out>(ctx, recv.out, true);
  if (threadIdx.x == 0) refuse(ctx, kCombineRecv);  // the round trip's status: failed
  finish_phase(ctx, kCombineRecv, recv.status);
}

// Rows per slot (expert_y of type In), summed with the weights into Out.
template <typename In, typename Out>
__global__ void combine_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  if (!combine_send_rows(ctx, send, false)) return skip_receive<Out>(ctx, recv);
  mark(ctx, kCombineRecv, kStart);  // no second order check: the receive's end moves the protocol past both
  receive_combined<In, Out>(ctx, recv);
}

// Pre-reduced: partial rows in the output dtype, one per (token, expert rank), added up.
// 16 warps per SM (at most 128 registers: two blocks): the pre-reduction waits on loads, so it wants warps to switch
// to. Not launched under an SM budget that binds (launch_combine: the two halves' kernels there).
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, 2)
    combine_reduced_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  if (!combine_send_reduced<In, Out>(ctx, send, false)) return skip_receive<Out>(ctx, recv);
  mark(ctx, kCombineRecv, kStart);
  receive_combined<Out, Out>(ctx, recv);
}

// The low-latency path (Context::flagged): rows per slot in flagged words, each chunk summed as its words land; the
// send's end with the receive's (end_combine), off the sums' path.
template <typename In, typename Out>
__global__ void combine_flagged_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  if (!combine_send_flagged(ctx, send)) return skip_receive<Out>(ctx, recv);
  mark(ctx, kCombineRecv, kStart);
  sum_flagged_slot_rows<In, Out>(ctx, recv, min(max(*recv.num_tokens, 0), ctx.s.max_tokens));
  end_combine<Out>(ctx, recv, send.status);
}

// The windowed combine (Sizes::window_slots below slots_per_source: a bounded heap): rounds of window_tokens tokens
// of every DP group through a window of that many tokens' rows on every rank. Each round: wait until every rank has
// summed the previous round out of its window (combine_window_free); send the round's rows (per slot, each followed
// by its flag; or pre-reduced, then partials_ready tagged with the round, waited for from every rank); sum the
// round's tokens; a grid barrier; SET our combine_window_free everywhere. Rows per slot (Reduced false: expert_y of
// type In) or pre-reduced partial rows (in Out), summed into Out in the same order as the other combines. Waits that
// give up leave the block's later work undone (y is NaN then); the grid barriers are still met by every block.
template <typename In, typename Out, bool Reduced>
__device__ inline void combine_in_rounds(const Context& ctx, const CombineSendArgs& send, const CombineRecvArgs& recv) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, send.status)) return skip_receive<Out>(ctx, recv);
  const uint32_t epoch = current_epoch(ctx);
  if constexpr (Reduced) {
    exchange_weights(ctx, send);
  } else if (blockIdx.x == gridDim.x - 1) {
    signal_done_reading(ctx);  // rows per slot read no dispatch buffer
  }
  mark(ctx, kCombineRecv, kStart);
  const int num_tokens = min(max(*recv.num_tokens, 0), s.max_tokens), per_round = window_tokens(s);
  const bool vector = vector_rows<Out>(s);
  bool lost = false;
  for (int round = 0; round < window_rounds(s); ++round) {
    // A wait that gives up is the receive's failure (whichever half waits): its status is the round trip's, and y
    // is NaN then.
    if (round > 0 && !lost)
      lost = !wait_for_every_rank(ctx, ctx.combine_window_free, tagged(epoch, round), kCombineRecv);
    const int first = round * per_round, tokens = min(per_round, s.max_tokens - first);
    if constexpr (Reduced) {
      if (!lost) store_partial_rows<In, Out>(ctx, send, round * s.window_slots, s.window_slots);
      __threadfence_system();  // this thread's partial rows reach every rank before the round's signal
      cooperative_groups::this_grid().sync();
      if (blockIdx.x == 0) signal_every_rank(ctx, ctx.partials_ready, tagged(epoch, round + 1));
      if (!lost) lost = !wait_for_every_rank(ctx, ctx.partials_ready, tagged(epoch, round + 1), kCombineRecv);
      if (!lost) sum_partial_rows<Out, Out>(ctx, recv, num_tokens, vector, first, tokens);
    } else {
      if (!lost) store_window_slot_rows(ctx, send, round);
      if (!lost) sum_slot_rows<In, Out>(ctx, recv, num_tokens, vector, first, tokens);
    }
    __threadfence();  // this block's reads of the window are done before it counts as released
    cooperative_groups::this_grid().sync();
    if (blockIdx.x == 0) signal_every_rank(ctx, ctx.combine_window_free, tagged(epoch, round + 1));
  }
  int32_t code;
  if (finish_phase(ctx, kCombineSend, send.status, false, &code)) {
    if (Reduced && completed(code)) signal_done_reading(ctx);  // the ids rows were read in every round
    mark(ctx, kCombineSend, kEnd, true);
  }
  end_combine<Out>(ctx, recv);
}

// The two windowed kernels, with the registers of their unwindowed twins (combine_kernel, combine_reduced_kernel).
template <typename In, typename Out>
__global__ void combine_windowed_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  combine_in_rounds<In, Out, false>(ctx, send, recv);
}
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, 2)
    combine_windowed_reduced_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  combine_in_rounds<In, Out, true>(ctx, send, recv);
}

// The fused kernel of these row types: pre-reduced or per slot, in rounds (windowed) or in one, in flagged words
// (the low-latency path: per slot only).
void* fused_kernel_for(int in_dtype, int out_dtype, bool reduced, bool in_rounds, bool flagged) {
  return with_row_type(in_dtype, [&](auto in) {
    return with_row_type(out_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      if (flagged && !reduced) return reinterpret_cast<void*>(combine_flagged_kernel<In, Out>);
      if (in_rounds)
        return reduced ? reinterpret_cast<void*>(combine_windowed_reduced_kernel<In, Out>)
                       : reinterpret_cast<void*>(combine_windowed_kernel<In, Out>);
      return reduced ? reinterpret_cast<void*>(combine_reduced_kernel<In, Out>)
                     : reinterpret_cast<void*>(combine_kernel<In, Out>);
    });
  });
}

}  // namespace

cudaError_t launch_combine(const Context& ctx, const CombineSendArgs& send, const CombineRecvArgs& recv,
                           cudaStream_t stream) {
  if (!ctx.p2p) return cudaErrorNotSupported;  // staged puts: two kernels there
  const bool reduced = send.topk_weights != nullptr;
  if (reduced != recv.reduced || (reduced && recv.in_dtype != recv.out_dtype)) return cudaErrorInvalidValue;
  // A flagged slot row holds combine_stride bytes of expert_y's row.
  const bool flagged = ctx.flagged && ctx.s.hidden * send.elem_bytes <= ctx.s.combine_stride;
  void* kernel = fused_kernel_for(send.in_dtype, recv.out_dtype, reduced, windowed(ctx.s), flagged);
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  const int wanted = std::min(std::max(combine_send_blocks(ctx.s, reduced), combine_recv_blocks(ctx.s)),
                              std::max(per_sm, 1) * ctx.s.sm_count);
  const int blocks = within_budget(ctx.s, wanted);
  // Under an SM budget that binds, the pre-reduced combine runs as its two halves' kernels, one after the other (the
  // split calls' device code, the same sums): on few SMs they take less time than the one kernel (benchmarks/NOTES.md).
  if (reduced && !windowed(ctx.s) && !flagged && blocks < wanted) {
    const cudaError_t sent = launch_combine_send(ctx, send, stream);
    return sent != cudaSuccess ? sent : launch_combine_recv(ctx, recv, stream);
  }
  Context c = ctx;
  CombineSendArgs send_args = send;
  CombineRecvArgs recv_args = recv;
  void* params[] = {&c, &send_args, &recv_args};
  return cudaLaunchCooperativeKernel(kernel, blocks, kThreads, params, 0, stream);
}

}  // namespace jmc
