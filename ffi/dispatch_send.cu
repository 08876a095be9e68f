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

// The distinct ranks of a token's live slots, one at a time: f(d, same), `same` the lanes whose slot is on rank d
// (every lane of the warp calls f alike; `dest` is this lane's slot's rank or -1: lane_dest).
template <typename F>
__device__ inline void for_each_dest(int dest, F&& f) {
  for (unsigned todo = __ballot_sync(0xffffffffu, dest >= 0); todo;) {
    const int d = __shfl_sync(0xffffffffu, dest, __ffs(todo) - 1);
    const unsigned same = __ballot_sync(0xffffffffu, dest == d);
    todo &= ~same;
    f(d, same);
  }
}

// Each rank gets the rows bound for it as one run at the start of this source's region of its dispatch_slots, in
// the order the warps reach them (an atomic per (token, rank): the order carries no meaning, the routes say where
// each row went). Peers on this node get their rows by stores as they are numbered; the rows for each other rank are
// packed into one run of staging, so that the ids, the routes, the counts and the rows travel in four puts per rank
// whatever the token count. Dynamic shared memory: [world] int, each rank's first row in staging.
__global__ void dispatch_send_staged_kernel(Context ctx, DispatchSendArgs a) {
  int my_tokens;
  if (!begin_send(ctx, a, &my_tokens)) return;
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size, slots = s.slots_per_source;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const size_t region = static_cast<size_t>(s.rank) * slots;  // this source's slots, in every rank's buffers
  int32_t* my_ids = ctx.dispatch_ids + region * K;
  int32_t* my_routes = ctx.dispatch_routes + region * K;
  int32_t* my_counts = ctx.dispatch_counts + static_cast<size_t>(s.rank) * s.world;
  extern __shared__ int staged_first[];  // [world]
  // With a.quantize each token is quantized once, into its row of staging past the runs (local memory: byte stores),
  // and copied from there.
  char* quantized = ctx.dispatch_staging + static_cast<size_t>(s.max_tokens) * min(K, s.world) * s.token_stride;
  const auto token_row = [&](int i) { return quantized + static_cast<size_t>(i) * s.token_stride; };

  // 1. Every token's ids and its row's number at each of its ranks (the route of each of its slots); rows for the
  //    peers of this node stored there at once.
  for (int i = gwarp; i < my_tokens; i += nwarps) {
    const int t = replica + i * s.dp_size;
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    if (lane < K) my_ids[static_cast<size_t>(i) * K + lane] = ids[lane];
    const int dest = lane_dest(s, ids, lane);
    if (a.quantize && __any_sync(0xffffffffu, dest >= 0)) {
      write_token_row(token_row(i), s, a, t, lane);
      __syncwarp();  // the row's bytes, stored by every lane, before any lane copies them
    }
    int route = -1;
    for_each_dest(dest, [&](int d, unsigned same) {
      int row = 0;
      if (lane == 0) row = atomicAdd(ctx.dest_rows + d, 1);
      row = __shfl_sync(0xffffffffu, row, 0);
      if (same >> lane & 1u) route = row;
      if (!stores_into(ctx, d)) return;  // this rank or a peer on this node: stores, as the NVLink path
      char* to = store_ptr(ctx, ctx.dispatch_slots + (region + row) * s.token_stride, d);
      if (a.quantize)
        warp_copy(to, token_row(i), s.token_stride, lane);
      else
        write_token_row(to, s, a, t, lane);
    });
    if (lane < K) my_routes[static_cast<size_t>(i) * K + lane] = route;
  }
  cg::this_grid().sync();  // every row numbered: the counts are final

  // 2. Each other node's rank's run in staging (every block: its first rows in shared memory), then its rows.
  if (threadIdx.x == 0) {
    int next = 0;
    for (int d = 0; d < s.world; ++d) {
      staged_first[d] = next;
      if (!stores_into(ctx, d)) next += ctx.dest_rows[d];
    }
  }
  if (blockIdx.x == 0)
    for (int d = threadIdx.x; d < s.world; d += blockDim.x) my_counts[d] = ctx.dest_rows[d];
  __syncthreads();
  for (int i = gwarp; i < my_tokens; i += nwarps) {
    const int t = replica + i * s.dp_size;
    const int dest = lane_dest(s, a.topk_ids + static_cast<size_t>(t) * K, lane);
    const int route = lane < K ? my_routes[static_cast<size_t>(i) * K + lane] : -1;
    for_each_dest(dest, [&](int d, unsigned same) {
      if (stores_into(ctx, d)) return;
      const int row = __shfl_sync(0xffffffffu, route, __ffs(same) - 1);
      char* to = ctx.dispatch_staging + static_cast<size_t>(staged_first[d] + row) * s.token_stride;
      if (a.quantize)
        warp_copy(to, token_row(i), s.token_stride, lane);
      else
        write_token_row(to, s, a, t, lane);
    });
  }
  cg::this_grid().sync();  // staging, the routes and the counts complete before any warp sends them

  // 3. A warp per rank: the ids, the routes and the counts (the same for every rank), then its run of rows.
  const int route_bytes = 4 * K * my_tokens, count_bytes = 4 * s.world;
  for (int d = gwarp; d < s.world; d += nwarps) {
    const int rows = my_counts[d];
    if (d != s.rank && is_direct(ctx, d)) {  // its rows are there already
      warp_copy(peer_ptr(ctx, my_ids, d), my_ids, route_bytes, lane);
      warp_copy(peer_ptr(ctx, my_routes, d), my_routes, route_bytes, lane);
      warp_copy(peer_ptr(ctx, my_counts, d), my_counts, count_bytes, lane);
    } else if (d != s.rank) {
      if (route_bytes > 0) {
        put_warp(ctx, kDispatchSend, my_ids, my_ids, route_bytes, d, lane);
        put_warp(ctx, kDispatchSend, my_routes, my_routes, route_bytes, d, lane);
      }
      put_warp(ctx, kDispatchSend, my_counts, my_counts, count_bytes, d, lane);
      if (rows > 0)
        put_warp(ctx, kDispatchSend, ctx.dispatch_slots + region * s.token_stride,
                 ctx.dispatch_staging + static_cast<size_t>(staged_first[d]) * s.token_stride,
                 static_cast<size_t>(rows) * s.token_stride, d, lane);
    }
    if (lane == 0) ctx.dest_rows[d] = 0;  // for the next call (every read of it was before the barrier)
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
                                     std::min(blocks_for_tokens, ctx.s.sm_count), kThreads, params,
                                     sizeof(int) * ctx.s.world, stream);
}

}  // namespace jmc
