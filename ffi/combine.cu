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
// Two blocks per SM (at most 128 registers): the pre-reduction waits on loads, so it wants warps to switch to.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, 2)
    combine_reduced_kernel(Context ctx, CombineSendArgs send, CombineRecvArgs recv) {
  if (!combine_send_reduced<In, Out>(ctx, send, false)) return skip_receive<Out>(ctx, recv);
  mark(ctx, kCombineRecv, kStart);
  receive_combined<Out, Out>(ctx, recv);
}

void* fused_kernel_for(int in_dtype, int out_dtype, bool reduced) {
  return with_row_type(in_dtype, [&](auto in) {
    return with_row_type(out_dtype, [&](auto out) {
      return reduced ? reinterpret_cast<void*>(combine_reduced_kernel<decltype(in), decltype(out)>)
                     : reinterpret_cast<void*>(combine_kernel<decltype(in), decltype(out)>);
    });
  });
}

}  // namespace

cudaError_t launch_combine(const Context& ctx, const CombineSendArgs& send, const CombineRecvArgs& recv,
                           cudaStream_t stream) {
  if (!ctx.p2p) return cudaErrorNotSupported;  // staged puts: two kernels there
  const bool reduced = send.topk_weights != nullptr;
  if (reduced != recv.reduced || (reduced && recv.in_dtype != recv.out_dtype)) return cudaErrorInvalidValue;
  void* kernel = fused_kernel_for(send.in_dtype, recv.out_dtype, reduced);
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  const int blocks = std::min(std::max(combine_send_blocks(ctx.s, reduced), combine_recv_blocks(ctx.s)),
                              std::max(per_sm, 1) * ctx.s.sm_count);
  Context c = ctx;
  CombineSendArgs send_args = send;
  CombineRecvArgs recv_args = recv;
  void* params[] = {&c, &send_args, &recv_args};
  return cudaLaunchCooperativeKernel(kernel, blocks, kThreads, params, 0, stream);
}

}  // namespace jmc
