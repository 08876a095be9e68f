// dispatch_send's kernels (the phase itself: dispatch_send.cuh) and their launch.
#include <cooperative_groups.h>

#include "dispatch_send.cuh"

namespace cg = cooperative_groups;

namespace jmc {
namespace {

template <bool Quantize>
__global__ void dispatch_send_p2p_kernel(Context ctx, DispatchSendArgs a) {
  dispatch_send_p2p<Quantize>(ctx, a, true);
}

__global__ void dispatch_send_staged_kernel(Context ctx, DispatchSendArgs a) {
  int my_tokens;
  if (!begin_send(ctx, a, &my_tokens)) return;
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const int lane = threadIdx.x % 32;
  const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;

  // Pack: one stride per token this replica sends, and its ids row into this rank's own slots of dispatch_ids: the
  // block of every ids row this rank sends, contiguous there and at every peer (the same offset), so that it
  // travels in one put per peer instead of one per token.
  int32_t* my_ids = ctx.dispatch_ids + static_cast<size_t>(s.rank) * s.slots_per_source * K;
  for (int i = gwarp; i < my_tokens; i += nwarps) {
    const int t = replica + i * s.dp_size;
    write_token_row(ctx.dispatch_staging + static_cast<size_t>(i) * s.token_stride, s, a, t, lane);
    if (lane < K) my_ids[static_cast<size_t>(i) * K + lane] = a.topk_ids[static_cast<size_t>(t) * K + lane];
  }
  cg::this_grid().sync();  // staging and the ids block complete before any warp sends them

  const int ids_bytes = 4 * K * my_tokens;
  for (int d = gwarp; d < s.world && ids_bytes > 0; d += nwarps) {  // the ids block, a warp per peer
    if (d == s.rank) continue;  // in place
    if (is_direct(ctx, d))
      warp_copy(peer_ptr(ctx, my_ids, d), my_ids, ids_bytes, lane);
    else
      nvshmemx_putmem_nbi_warp(my_ids, my_ids, ids_bytes, pe_of(ctx, d));
  }
  for (int i = gwarp; i < my_tokens; i += nwarps) {  // the rows, each to the ranks of its live experts
    const int t = replica + i * s.dp_size;
    const char* staged = ctx.dispatch_staging + static_cast<size_t>(i) * s.token_stride;
    const int dest_of_lane = lane_dest(s, a.topk_ids + static_cast<size_t>(t) * K, lane);
    char* row = ctx.dispatch_slots + (static_cast<size_t>(s.rank) * s.slots_per_source + i) * s.token_stride;
    for (int d = 0; d < s.world; ++d) {
      if (!__any_sync(0xffffffffu, dest_of_lane == d)) continue;
      if (is_direct(ctx, d))  // a peer on this node: stores, as the NVLink path
        warp_copy(peer_ptr(ctx, row, d), staged, s.token_stride, lane);
      else
        nvshmemx_putmem_nbi_warp(row, staged, s.token_stride, pe_of(ctx, d));
    }
  }
  mark(ctx, kDispatchSend, kWorked);
  complete_remote_writes(ctx);  // this thread's stores and puts are complete before the ready signal
  mark(ctx, kDispatchSend, kClosed);
  signal_ready(ctx, a, my_tokens, true);
}

}  // namespace

cudaError_t launch_dispatch_send(const Context& ctx, const DispatchSendArgs& a, cudaStream_t stream) {
  if (windowed(ctx.s)) return cudaErrorNotSupported;  // rounds wait on the other half: the fused calls only
  Context c = ctx;
  DispatchSendArgs args = a;
  void* params[] = {&c, &args};
  const int blocks_for_tokens = within_budget(ctx.s, dispatch_send_blocks(ctx.s));
  if (ctx.p2p)  // a warp per token; blocks never wait on each other
    return cudaLaunchKernel(a.quantize ? reinterpret_cast<void*>(dispatch_send_p2p_kernel<true>)
                                       : reinterpret_cast<void*>(dispatch_send_p2p_kernel<false>),
                            blocks_for_tokens, kThreads, params, 0, stream);
  // Cooperative (grid.sync), so at most one block per SM.
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dispatch_send_staged_kernel),
                                     std::min(blocks_for_tokens, ctx.s.sm_count), kThreads, params, 0, stream);
}

}  // namespace jmc
