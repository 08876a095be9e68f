// dispatch_send: pack this rank's tokens into the symmetric staging buffer, then put each token into the slot
// region of every destination expert and signal the per-expert count. Never waits on a peer.
//
// Slot order is deterministic: the warp that owns destination expert e scans this replica's tokens in index
// order and gives the n-th token that selects e slot n (a ballot prefix), so the receiver's layout depends on
// the routing alone.
#include <cooperative_groups.h>

#include "device_common.cuh"

namespace cg = cooperative_groups;

namespace jmc {
namespace {

__global__ void dispatch_send_kernel(Context ctx, DispatchSendArgs a) {
  const Sizes& s = ctx.s;
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int nwarps = gridDim.x * warps_per_block;
  const int K = s.experts_per_token;
  const int num_tokens = min(max(*a.num_tokens, 0), s.max_tokens);
  const int replica = s.rank % s.dp_size;
  const int my_tokens = num_tokens > replica ? (num_tokens - replica + s.dp_size - 1) / s.dp_size : 0;

  // 1. Validate every live token's routing (each replica checks all, like the reference backend).
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_tokens * K; i += gridDim.x * blockDim.x) {
    const int t = i / K, k = i % K;
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    const int e = ids[k];
    if (e < -1 || e >= s.num_experts) {
      report(a.status, kBadExpertId, kDispatchSend, t, e);
    } else if (e >= 0) {
      for (int j = 0; j < k; ++j)
        if (ids[j] == e) report(a.status, kRepeatedExpertId, kDispatchSend, t, e);
    }
  }

  // 2. Pack: payload | scales | token index | K ids, one stride per token this replica sends.
  for (int i = gwarp; i < my_tokens; i += nwarps) {
    const int t = replica + i * s.dp_size;
    char* staged = ctx.dispatch_staging + static_cast<size_t>(t) * s.token_stride;
    warp_copy(staged, static_cast<const char*>(a.x) + static_cast<size_t>(t) * s.payload_bytes, s.payload_bytes,
              lane);
    if (s.scale_cols)
      warp_copy(staged + scales_offset(s), a.scales + static_cast<size_t>(t) * s.scale_cols, 4 * s.scale_cols, lane);
    auto* header = reinterpret_cast<int32_t*>(staged + header_offset(s));
    if (lane == 0) header[0] = t;
    if (lane < K) header[1 + lane] = a.topk_ids[static_cast<size_t>(t) * K + lane];
  }
  cg::this_grid().sync();  // staging complete before any warp puts it

  // 3. One warp per destination expert: put its tokens in index order, then signal count + 1.
  for (int e = gwarp; e < s.num_experts; e += nwarps) {
    const int dest = e / s.local_experts, l = e % s.local_experts;
    const size_t region = static_cast<size_t>(l) * s.world + s.rank;
    char* slots = ctx.dispatch_slots + region * s.slots_per_region * s.token_stride;
    uint64_t* arrived = ctx.dispatch_arrived + region;
    int n = 0;
    for (int base = 0; base < my_tokens; base += 32) {
      const int i = base + lane;
      bool selects = false;
      if (i < my_tokens) {
        const int32_t* ids = a.topk_ids + static_cast<size_t>(replica + i * s.dp_size) * K;
        for (int k = 0; k < K; ++k) selects |= ids[k] == e;
      }
      for (unsigned hits = __ballot_sync(0xffffffffu, selects); hits; hits &= hits - 1) {
        const int t = replica + (base + __ffs(hits) - 1) * s.dp_size;
        nvshmemx_putmem_signal_nbi_warp(slots + static_cast<size_t>(n) * s.token_stride,
                                        ctx.dispatch_staging + static_cast<size_t>(t) * s.token_stride,
                                        s.token_stride, arrived, 1, NVSHMEM_SIGNAL_ADD, dest);
        ++n;
      }
    }
    if (lane == 0) nvshmemx_signal_op(ctx.dispatch_count + region, n + 1, NVSHMEM_SIGNAL_SET, dest);
  }
}

}  // namespace

cudaError_t launch_dispatch_send(const Context& ctx, const DispatchSendArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.status, 0, kStatusWords * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  Context c = ctx;
  DispatchSendArgs args = a;
  void* params[] = {&c, &args};
  // Cooperative (grid.sync), so at most one block per SM; a warp per token to pack and per expert to send.
  const int blocks = blocks_for(std::max(ctx.s.max_tokens, ctx.s.num_experts), kThreads / 32, ctx.s.sm_count);
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dispatch_send_kernel), blocks, kThreads, params, 0,
                                     stream);
}

}  // namespace jmc
