// combine_send: reset the dispatch ready words and tell every peer we are done reading our dispatch buffers (sync
// flag), then send each valid expert output row home, to every replica of its source DP group, into the slot
// (token, top-k slot).
#include "device_common.cuh"

namespace jmc {
namespace {

__global__ void combine_send_kernel(Context ctx, CombineSendArgs a) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, a.status)) return;
  if (blockIdx.x == 0) {
    // dispatch_recv (finished: same stream) has read every ready word: reset them before the sync flag lets a
    // peer start its next dispatch_send.
    for (int src = threadIdx.x; src < s.world; src += blockDim.x) ctx.dispatch_ready[src] = 0;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < s.world && threadIdx.x != s.rank)
      nvshmemx_signal_op(ctx.sync_flags + s.rank, 1, NVSHMEM_SIGNAL_SET, threadIdx.x);
  }

  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int nwarps = gridDim.x * warps_per_block;
  const int row_bytes = s.hidden * a.elem_bytes;
  const int slots_per_group = s.max_tokens * s.experts_per_token;
  for (int p = gwarp; p < s.capacity; p += nwarps) {
    const int origin = a.row_origin[p];
    if (origin < 0) continue;
    const int group = origin / slots_per_group, slot = origin % slots_per_group;
    const int token = slot / s.experts_per_token;
    const char* row = static_cast<const char*>(a.expert_y) + static_cast<size_t>(p) * row_bytes;
    char* dst = ctx.combine_slots + static_cast<size_t>(slot) * s.combine_stride;
    if (ctx.p2p) {  // NVLink: store the row straight into each replica's slot, then signal
      for (int j = 0; j < s.dp_size; ++j)
        warp_copy(nvshmem_ptr(dst, group * s.dp_size + j), row, row_bytes, lane);
      __threadfence_system();
      __syncwarp();
      if (lane == 0)
        for (int j = 0; j < s.dp_size; ++j)
          nvshmemx_signal_op(ctx.combine_arrived + token, 1, NVSHMEM_SIGNAL_ADD, group * s.dp_size + j);
    } else {  // stage into symmetric memory: a put's source must be symmetric on other transports
      char* staged = ctx.combine_staging + static_cast<size_t>(p) * s.combine_stride;
      warp_copy(staged, row, row_bytes, lane);
      __syncwarp();
      for (int j = 0; j < s.dp_size; ++j)
        nvshmemx_putmem_signal_nbi_warp(dst, staged, row_bytes, ctx.combine_arrived + token, 1, NVSHMEM_SIGNAL_ADD,
                                        group * s.dp_size + j);
    }
  }
  finish_phase(ctx, kCombineSend, a.status);
}

}  // namespace

cudaError_t launch_combine_send(const Context& ctx, const CombineSendArgs& a, cudaStream_t stream) {
  const int blocks = blocks_for(ctx.s.capacity, kThreads / 32, 8 * ctx.s.sm_count);  // a warp per row
  combine_send_kernel<<<blocks, kThreads, 0, stream>>>(ctx, a);
  return cudaGetLastError();
}

}  // namespace jmc
