// dispatch_send: write this replica's tokens into the slot region of every destination expert, then signal the
// region's row count. Never waits on a peer.
//
// Slot order is deterministic: expert e's rows are this replica's tokens that select e, in index order (the n-th
// such token takes slot n), so the receiver's layout depends on the routing alone. Each row is one token stride:
// payload | fp32 scales | int32 token index | int32 ids[K].
//
// Two kernels, one protocol. With every peer reachable by loads/stores (NVLink, `Context::p2p`), a block per
// expert writes the rows straight from x into the peer's slots, then signals. Otherwise tokens are packed once into
// symmetric staging and each row is a put-with-signal (the source of a put must be symmetric off NVLink).
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>

#include "device_common.cuh"

namespace cg = cooperative_groups;

namespace jmc {
namespace {

// Every live token's routing is checked (each replica checks all, like the reference backend).
__device__ void validate_ids(const Sizes& s, const DispatchSendArgs& a, int num_tokens, int32_t* status) {
  const int K = s.experts_per_token;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_tokens * K; i += gridDim.x * blockDim.x) {
    const int t = i / K, k = i % K;
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    const int e = ids[k];
    if (e < -1 || e >= s.num_experts) {
      report(status, kBadExpertId, kDispatchSend, t, e);
    } else if (e >= 0) {
      for (int j = 0; j < k; ++j)
        if (ids[j] == e) report(status, kRepeatedExpertId, kDispatchSend, t, e);
    }
  }
}

__device__ inline int replica_tokens(const Sizes& s, const DispatchSendArgs& a, int* num_tokens) {
  *num_tokens = min(max(*a.num_tokens, 0), s.max_tokens);
  const int replica = s.rank % s.dp_size;
  return *num_tokens > replica ? (*num_tokens - replica + s.dp_size - 1) / s.dp_size : 0;
}

__device__ inline bool selects(const int32_t* topk_ids, int t, int K, int e) {
  const int32_t* ids = topk_ids + static_cast<size_t>(t) * K;
  bool hit = false;
  for (int k = 0; k < K; ++k) hit |= ids[k] == e;
  return hit;
}

__global__ void dispatch_send_p2p_kernel(Context ctx, DispatchSendArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  __shared__ int hits[kThreads];  // tokens of the current batch that select e, in index order
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kDispatchSend);
  if (!in_protocol_order(ctx, kDispatchSend)) {
    finish_phase(ctx, kDispatchSend, a.status, false);
    return;
  }
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int num_tokens;
  const int my_tokens = replica_tokens(s, a, &num_tokens);
  validate_ids(s, a, num_tokens, status);

  for (int e = blockIdx.x; e < s.num_experts; e += gridDim.x) {
    const int dest = e / s.local_experts, l = e % s.local_experts;
    const size_t region = static_cast<size_t>(l) * s.world + s.rank;
    char* slots = static_cast<char*>(
        nvshmem_ptr(ctx.dispatch_slots + region * s.slots_per_region * s.token_stride, dest));
    int n = 0;
    for (int base = 0; base < my_tokens; base += blockDim.x) {
      const int i = base + threadIdx.x;
      const int hit = i < my_tokens && selects(a.topk_ids, replica + i * s.dp_size, K, e);
      int pos, total;
      Scan(scan_temp).ExclusiveSum(hit, pos, total);
      if (hit) hits[pos] = replica + i * s.dp_size;
      __syncthreads();
      for (int h = warp; h < total; h += warps) {
        const int t = hits[h];
        char* row = slots + static_cast<size_t>(n + h) * s.token_stride;
        warp_copy(row, static_cast<const char*>(a.x) + static_cast<size_t>(t) * s.payload_bytes, s.payload_bytes,
                  lane);
        if (s.scale_cols)
          warp_copy(row + scales_offset(s), a.scales + static_cast<size_t>(t) * s.scale_cols, 4 * s.scale_cols, lane);
        auto* header = reinterpret_cast<int32_t*>(row + header_offset(s));
        if (lane == 0) header[0] = t;
        if (lane < K) header[1 + lane] = a.topk_ids[static_cast<size_t>(t) * K + lane];
      }
      n += total;
      __syncthreads();  // hits and scan_temp are reused by the next batch
    }
    __threadfence_system();  // this thread's row stores reach the peer before the signals below
    __syncthreads();
    if (threadIdx.x == 0) {
      nvshmemx_signal_op(ctx.dispatch_arrived + region, n, NVSHMEM_SIGNAL_ADD, dest);
      nvshmemx_signal_op(ctx.dispatch_count + region, n + 1, NVSHMEM_SIGNAL_SET, dest);
    }
  }
  finish_phase(ctx, kDispatchSend, a.status);
}

__global__ void dispatch_send_staged_kernel(Context ctx, DispatchSendArgs a) {
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kDispatchSend);
  if (!in_protocol_order(ctx, kDispatchSend)) {
    finish_phase(ctx, kDispatchSend, a.status, false);
    return;
  }
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int nwarps = gridDim.x * warps_per_block;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  int num_tokens;
  const int my_tokens = replica_tokens(s, a, &num_tokens);
  validate_ids(s, a, num_tokens, status);

  // Pack: one stride per token this replica sends.
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

  // One warp per destination expert: put its tokens in index order (a ballot prefix), then signal count + 1.
  for (int e = gwarp; e < s.num_experts; e += nwarps) {
    const int dest = e / s.local_experts, l = e % s.local_experts;
    const size_t region = static_cast<size_t>(l) * s.world + s.rank;
    char* slots = ctx.dispatch_slots + region * s.slots_per_region * s.token_stride;
    uint64_t* arrived = ctx.dispatch_arrived + region;
    int n = 0;
    for (int base = 0; base < my_tokens; base += 32) {
      const int i = base + lane;
      const bool hit = i < my_tokens && selects(a.topk_ids, replica + i * s.dp_size, K, e);
      for (unsigned m = __ballot_sync(0xffffffffu, hit); m; m &= m - 1) {
        const int t = replica + (base + __ffs(m) - 1) * s.dp_size;
        nvshmemx_putmem_signal_nbi_warp(slots + static_cast<size_t>(n) * s.token_stride,
                                        ctx.dispatch_staging + static_cast<size_t>(t) * s.token_stride,
                                        s.token_stride, arrived, 1, NVSHMEM_SIGNAL_ADD, dest);
        ++n;
      }
    }
    if (lane == 0) nvshmemx_signal_op(ctx.dispatch_count + region, n + 1, NVSHMEM_SIGNAL_SET, dest);
  }
  finish_phase(ctx, kDispatchSend, a.status);
}

}  // namespace

cudaError_t launch_dispatch_send(const Context& ctx, const DispatchSendArgs& a, cudaStream_t stream) {
  Context c = ctx;
  DispatchSendArgs args = a;
  void* params[] = {&c, &args};
  if (ctx.p2p) {  // a block per expert; blocks never wait on each other
    const int blocks = blocks_for(ctx.s.num_experts, 1, 8 * ctx.s.sm_count);
    return cudaLaunchKernel(reinterpret_cast<void*>(dispatch_send_p2p_kernel), blocks, kThreads, params, 0, stream);
  }
  // Cooperative (grid.sync), so at most one block per SM; a warp per token to pack and per expert to send.
  const int blocks = blocks_for(std::max(ctx.s.max_tokens, ctx.s.num_experts), kThreads / 32, ctx.s.sm_count);
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dispatch_send_staged_kernel), blocks, kThreads, params,
                                     0, stream);
}

}  // namespace jmc
