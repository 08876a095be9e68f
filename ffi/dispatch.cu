// The fused dispatch (NVLink path, Context::p2p): dispatch_send and dispatch_recv in one kernel, for the fused
// `dispatch` call (no work to overlap between the halves). Each block sends its tokens, then receives (from
// Context::ids_first, the ids-first order below: the ids, the layout, then the rows to peers and the own rows'
// copies together, then the peers' rows). The ready words a block waits for are SET by the last block of each
// source's send, this rank's included, so every block must be resident: a cooperative launch, its grid capped at
// co-residency. One launch, one start and one close instead of two; the device code is the phases' own
// (dispatch_send.cuh, dispatch_recv.cuh), hence the same layout and rows, bit for bit.
#include <algorithm>

#include "dispatch_recv.cuh"
#include "dispatch_send.cuh"

namespace jmc {
namespace {

// The send did not run (refused, or out of protocol order: the send status says so): nor does the receive, which
// leaves an empty layout and moves the protocol on past both phases.
__device__ inline void skip_receive(const Context& ctx, const DispatchRecvArgs& recv) {
  receive_nothing(ctx, recv);
  if (threadIdx.x == 0) refuse(ctx, kDispatchRecv);
  finish_phase(ctx, kDispatchRecv, recv.status);
}

template <bool Quantize>
__global__ void dispatch_kernel(Context ctx, DispatchSendArgs send, DispatchRecvArgs recv) {
  if (!dispatch_send_p2p<Quantize>(ctx, send, false)) return skip_receive(ctx, recv);
  mark(ctx, kDispatchRecv, kStart);  // no second order check: the receive's end moves the protocol past both
  receive_tokens(ctx, recv);
}

// This rank's own rows, read by its receive straight from x (one replica per DP group: its token t is token t).
struct FromX {
  static constexpr bool kRowPerToken = true;  // one row for all of a token's slots (copy_share's fan-out)
  const Sizes& s;
  const DispatchSendArgs& a;
  __device__ const char* payload(int, int t) const {
    return static_cast<const char*>(a.x) + static_cast<size_t>(t) * s.payload_bytes;
  }
  __device__ const void* scales(int, int t) const { return a.scales + static_cast<size_t>(t) * s.scale_cols; }
  __device__ void copy(char* payload_to, float* scales_to, int g, int t, int /*k*/, int lane) const {
    warp_copy_pair(payload_to, payload(g, t), s.payload_bytes, scales_to, scales(g, t), 4 * s.scale_cols, lane);
  }
};

// The low-latency order (Context::flagged: few tokens per rank, NVLink): the send SETs its count into the ready
// word (epoch-tagged), stores the ids and rows in flagged words and never waits; the receive waits for every source's count, lands every arrival's ids, makes the
// layout as receive_tokens does and copies the rows as their words land. No fence, block count or signal between the
// halves, so a peer's rows are copied as soon as they arrive. The same layout and rows as the other orders, bit for
// bit (the stages after the ids are theirs).
__global__ void dispatch_flagged_kernel(Context ctx, DispatchSendArgs send, DispatchRecvArgs recv) {
  if (!dispatch_send_flagged(ctx, send)) return skip_receive(ctx, recv);
  mark(ctx, kDispatchRecv, kStart);
  extern __shared__ int smem[];
  Receive r = carve_receive(ctx.s, smem);
  read_token_counts(ctx, r, -1);
  land_flagged_ids(ctx, r);
  mark(ctx, kDispatchRecv, kWaited);  // counts and ids landed
  const Share sh = share_of(r.first[0], ctx.s.num_dp, 0, gridDim.x);
  histogram_all(ctx, r, sh);
  tally_remote_experts(ctx, r, &sh, 1);
  mark(ctx, kDispatchRecv, kStep1);  // histogram done
  derive_layout(ctx, recv, r);
  mark(ctx, kDispatchRecv, kStep2);  // layout derived
  copy_share(ctx, recv, r, sh, FromFlagged{ctx});
  mark(ctx, kDispatchRecv, kWorked);
  // The send's end (its status, a routing error published to every rank) with the receive's, one count of blocks:
  // off the copies' path. Its errors reach the peers before our sync flag, which the combine sets.
  finish_receive(ctx, recv, r, send.status);
}

// The ids-first order (Context::ids_first: large T, one replica per DP group): the receive's layout needs only the
// ids, and this rank's own rows need nothing from a peer, so the layout and the own rows are made while the rows
// to peers are on the link, where the order above sends everything and then waits.
//   1. Every token's ids row to every rank; a grid barrier; our ready word (count + 1) SET everywhere.
//   2. Every source's ids: the layout (histogram_split, both passes' shares).
//   3. Blocks [0, senders) store the rows to the other ranks; the others copy this rank's own tokens' rows from x
//      (pass 0). Then the last block SETs kRowsLanded in our ready word on the other ranks.
//   4. Every source's kRowsLanded; every block copies its share of the other ranks' tokens (pass 1) from the slots.
__global__ void dispatch_ids_first_kernel(Context ctx, DispatchSendArgs send, DispatchRecvArgs recv) {
  const Sizes& s = ctx.s;
  int my_tokens;
  if (!begin_send(ctx, send, &my_tokens)) return skip_receive(ctx, recv);
  store_ids_rows<false>(ctx, send, my_tokens);
  __threadfence_system();  // this thread's ids reach every peer before the ready signal
  cooperative_groups::this_grid().sync();
  // Every block is past begin_send: a routing error it found is in the send's scratch. It goes out with the rows'
  // signal (signal_rows_landed); the ids signal carries the count alone.
  if (blockIdx.x == 0) {
    __threadfence_system();
    const uint64_t ready = tagged(current_epoch(ctx), static_cast<uint32_t>(my_tokens));
    for (int pe = threadIdx.x; pe < s.world; pe += blockDim.x) signal_peer(ctx, ctx.dispatch_ready + s.rank, ready, pe);
  }
  mark(ctx, kDispatchSend, kStep1);  // ids out, ready word set

  mark(ctx, kDispatchRecv, kStart);
  extern __shared__ int smem[];
  Receive r = carve_receive(s, smem);
  read_token_counts(ctx, r, s.rank);  // pass 0: our own tokens (group s.rank); pass 1: the others
  mark(ctx, kDispatchRecv, kWaited);
  // Blocks [0, senders) store the rows to the other ranks, the others copy this rank's own rows (a grid of one block
  // sends, then copies). A rank with no peer has no rows to send: every block copies.
  const int senders = s.world > 1 ? gridDim.x / 2 : 0;
  const Share shares[2] = {share_of(r.first[0], s.num_dp, senders, gridDim.x - senders),
                           share_of(r.first[1], s.num_dp, 0, gridDim.x)};
  histogram_split(ctx, r, shares, 2);
  tally_remote_experts(ctx, r, shares, 2);
  mark(ctx, kDispatchRecv, kStep1);  // histogram done
  derive_layout(ctx, recv, r);
  mark(ctx, kDispatchRecv, kStep2);  // layout derived

  if (s.world > 1 && static_cast<int>(blockIdx.x) < max(senders, 1)) {
    store_remote_rows(ctx, send, my_tokens, max(senders, 1));
    mark(ctx, kDispatchSend, kWorked);
    __threadfence_system();  // this thread's rows reach every peer before the kRowsLanded signal
    mark(ctx, kDispatchSend, kClosed);
  }
  if (static_cast<int>(blockIdx.x) >= senders) copy_share(ctx, recv, r, shares[0], FromX{s, send});
  signal_rows_landed(ctx, send, my_tokens);

  const uint64_t rows_landed = tagged(current_epoch(ctx), kRowsLanded);
  if (!r.timed_out)
    for (int src = threadIdx.x; src < s.world; src += blockDim.x)
      if (src != s.rank) wait_for(ctx, ctx.dispatch_ready + src, rows_landed, kDispatchRecv, src);
  __syncthreads();
  copy_share(ctx, recv, r, shares[1], FromSlots{ctx});
  mark(ctx, kDispatchRecv, kWorked);
  finish_receive(ctx, recv, r);
}

// The windowed order (Sizes::window_slots below slots_per_source: a bounded heap): the ids first, then the rows in
// rounds of window_slots slots per source, through a window of that many slots per source on every rank.
//   1. Every ids row of this replica to every rank; a grid barrier; our ready word (count) SET everywhere.
//   2. Every source's ids: the layout (histogram_split over every arrival).
//   3. Each round: wait until every rank has copied the previous round out of its window (dispatch_window_free);
//      store this round's rows into the windows of their ranks (this one's included); a grid barrier; SET our
//      window_ready everywhere; wait for every source's; histogram the round's arrivals (their places follow the
//      earlier rounds' rows of each (local expert, group): group_base moves on) and copy them; a grid barrier; SET
//      our dispatch_window_free everywhere.
// The same layout and rows as the other orders, bit for bit: a row's place depends on the routing alone. Waits
// that give up (a timeout, a peer's abort) leave the block's copies and every later round's work undone; the grid
// barriers are still met by every block.
template <bool Quantize>
__global__ void dispatch_windowed_kernel(Context ctx, DispatchSendArgs send, DispatchRecvArgs recv) {
  const Sizes& s = ctx.s;
  const int G = s.num_dp, LG = s.local_experts * s.num_dp;
  int my_tokens;
  if (!begin_send(ctx, send, &my_tokens)) return skip_receive(ctx, recv);
  store_ids_rows<true>(ctx, send, my_tokens);
  __threadfence_system();  // this thread's ids reach every rank before the ready signal
  cooperative_groups::this_grid().sync();
  const uint32_t epoch = current_epoch(ctx);
  if (blockIdx.x == 0) signal_every_rank(ctx, ctx.dispatch_ready, tagged(epoch, static_cast<uint32_t>(my_tokens)));
  mark(ctx, kDispatchSend, kStep1);  // ids out, ready word set

  mark(ctx, kDispatchRecv, kStart);
  extern __shared__ int smem[];
  Receive r = carve_receive(s, smem);
  read_token_counts(ctx, r, -1);  // pass 0: every group; r.first[1] (pass 1) then holds each round's arrivals
  mark(ctx, kDispatchRecv, kWaited);
  const Share every = share_of(r.first[0], G, 0, gridDim.x);
  histogram_split(ctx, r, &every, 1);
  tally_remote_experts(ctx, r, &every, 1);
  derive_layout(ctx, recv, r);
  mark(ctx, kDispatchRecv, kStep2);  // layout derived

  const int per_round = window_tokens(s);
  bool lost = __syncthreads_or(r.timed_out);
  for (int round = 0; round < window_rounds(s); ++round) {
    if (round > 0 && !lost) lost = !wait_for_every_rank(ctx, ctx.dispatch_window_free, tagged(epoch, round),
                                                        kDispatchSend);
    if (!lost) store_window_rows<Quantize>(ctx, send, my_tokens, round);
    __threadfence_system();  // this thread's rows reach every rank before the round's signal
    cooperative_groups::this_grid().sync();
    if (blockIdx.x == 0) signal_every_rank(ctx, ctx.window_ready, tagged(epoch, round + 1));
    if (!lost) lost = !wait_for_every_rank(ctx, ctx.window_ready, tagged(epoch, round + 1), kDispatchRecv);
    if (threadIdx.x == 0) {  // the round's arrivals: each group's tokens [round * per_round, (round + 1) * per_round)
      int* first = r.first[1];
      for (int g = 0; g < G; ++g)
        first[g + 1] = first[g] + min(max(r.group_tokens[g] - round * per_round, 0), per_round);
    }
    for (int i = threadIdx.x; i < LG; i += blockDim.x) r.count[i] = 0;
    __syncthreads();
    const Share round_share = share_of(r.first[1], G, 0, gridDim.x, round * per_round);
    histogram_split(ctx, r, &round_share, 1);
    if (!lost) copy_share(ctx, recv, r, round_share, FromSlots{ctx, round * s.window_slots});
    for (int i = threadIdx.x; i < LG; i += blockDim.x) r.group_base[i] += r.count[i];
    __syncthreads();
    __threadfence();  // this block's reads of the window are done before it counts as released
    cooperative_groups::this_grid().sync();
    if (blockIdx.x == 0) signal_every_rank(ctx, ctx.dispatch_window_free, tagged(epoch, round + 1));
  }
  mark(ctx, kDispatchSend, kWorked);
  if (finish_phase(ctx, kDispatchSend, send.status, false)) mark(ctx, kDispatchSend, kEnd, true);
  mark(ctx, kDispatchRecv, kWorked);
  finish_receive(ctx, recv, r);
}

// Either order's kernel, its grid the larger of the two phases' grids capped at co-residency (it waits for itself).
template <typename Kernel>
cudaError_t launch_cooperative(Kernel kernel, int wanted_blocks, const Context& ctx, const DispatchSendArgs& send,
                               const DispatchRecvArgs& recv, cudaStream_t stream) {
  const size_t shared = dispatch_recv_shared_bytes(ctx.s);
  if (shared > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared);
  if (err != cudaSuccess) return err;
  const int blocks = within_budget(ctx.s, std::min(wanted_blocks, std::max(per_sm, 1) * ctx.s.sm_count));
  Context c = ctx;
  DispatchSendArgs send_args = send;
  DispatchRecvArgs recv_args = recv;
  void* params[] = {&c, &send_args, &recv_args};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), blocks, kThreads, params, shared, stream);
}

}  // namespace

cudaError_t launch_dispatch(const Context& ctx, const DispatchSendArgs& send, const DispatchRecvArgs& recv,
                            cudaStream_t stream) {
  if (!ctx.p2p) return cudaErrorNotSupported;  // the staged send is cooperative on its own: two kernels there
  const int wanted = std::max(dispatch_send_blocks(ctx.s), dispatch_recv_blocks(ctx.s));
  if (windowed(ctx.s)) {
    if (ctx.block_counts == nullptr) return cudaErrorMemoryAllocation;  // its histograms were not allocated
    return launch_cooperative(send.quantize ? dispatch_windowed_kernel<true> : dispatch_windowed_kernel<false>, wanted,
                              ctx, send, recv, stream);
  }
  // The low-latency order moves rows as they are in x (a quantizing send, or weights to store with the ids, take
  // the order below: their rows and weights travel with a fence and a signal).
  if (ctx.flagged && !send.quantize && send.topk_weights == nullptr)
    return launch_cooperative(dispatch_flagged_kernel, wanted, ctx, send, recv, stream);
  // Quantizing sends take the send-first order: the ids-first order's receive reads this rank's own rows from x.
  if (ctx.ids_first && !send.quantize)
    return launch_cooperative(dispatch_ids_first_kernel, wanted, ctx, send, recv, stream);
  if (send.quantize) return launch_cooperative(dispatch_kernel<true>, wanted, ctx, send, recv, stream);
  return launch_cooperative(dispatch_kernel<false>, wanted, ctx, send, recv, stream);
}

}  // namespace jmc
