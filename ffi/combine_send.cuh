// combine_send: reset the dispatch ready words and tell every peer we are done reading our dispatch buffers (sync
// flag), then send each valid expert output row home, to every replica of its source DP group, into the slot
// (token, top-k slot). Given the weights (the fused combine, NVLink path) it pre-reduces instead: one row per
// (token, expert rank), the weighted sum of the token's rows on this rank (combine_send_reduced).
// The phase's device code, shared by its kernels (combine_send.cu) and the fused combine (combine.cu).
#pragma once

#include <cooperative_groups.h>

#include "device_common.cuh"
#include "dtypes.cuh"

namespace jmc {

constexpr int kSegChunks = 4;  // pre-reduced rows: chunks per lane of one warp's work item (1024 bf16 columns)
constexpr int kSegCols = 32 * kChunk * kSegChunks;
constexpr int kExpertRowsInFlight = 2;  // pre-reduced rows: expert rows whose chunks a lane loads before adding
constexpr int kPrefetchSegments = 1;  // whole rows: segments of each row asked of L2 ahead of the sums

// Column segments of a pre-reduced row (a warp's work item is one segment of one token).
__host__ __device__ inline int row_segments(const Sizes& s) { return (s.hidden + kSegCols - 1) / kSegCols; }

constexpr int kMinPiecePairs = 32 * 2;  // the flagged send's smallest part of a row: a 16-byte load per lane

// This thread's warp in an order that puts consecutive work items on different blocks (warp w of block b is b +
// w * gridDim.x): a few rows then run on as many SMs, not all on block 0's.
__device__ inline int spread_warp() { return static_cast<int>(threadIdx.x / 32 * gridDim.x + blockIdx.x); }

// Our sync flag, SET on every peer: this rank has finished reading its dispatch buffers of this round trip (its
// dispatch_recv has: same stream), so a peer's next dispatch_send may write them. kPublishedFailure: this rank
// published a failure of this round trip (before: its dispatch phases' ends), which the peers' combine_recv merges.
__device__ inline void signal_done_reading(const Context& ctx) {
  const uint32_t epoch = current_epoch(ctx);
  const uint64_t done = tagged(epoch, 1 | (__ldg(&ctx.local->published) == epoch ? kPublishedFailure : 0));
  for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x)
    if (pe != ctx.s.rank) signal_peer(ctx, ctx.sync_flags + ctx.s.rank, done, pe);
}

// The (group, slot) a row's origin names, or false for none or one outside this MoEComm's slots (a handle of
// another MoEComm): never an address out of bounds.
__device__ inline bool origin_slot(const Sizes& s, int origin, int* group, int* slot) {
  const int slots_per_group = s.max_tokens * s.experts_per_token;
  if (origin < 0 || origin >= s.num_dp * slots_per_group) return false;
  *group = origin / slots_per_group;
  *slot = origin % slots_per_group;
  return true;
}

// NVLink: an expert row into row `at` of combine_slots on every replica of DP group `group`, then slot `slot`'s flag
// there (`landed`). `at` is the slot, or its place in a round's window.
__device__ inline void store_slot_row(const Context& ctx, const char* row, int row_bytes, int at, int slot, int group,
                                      int lane, uint64_t landed) {
  const Sizes& s = ctx.s;
  char* dst = ctx.combine_slots + static_cast<size_t>(at) * s.combine_stride;
  for (int j = 0; j < s.dp_size; ++j) warp_copy(peer_ptr(ctx, dst, group * s.dp_size + j), row, row_bytes, lane);
  mark(ctx, kCombineSend, kStep1);  // block 0's (last) row copied
  __threadfence_system();
  __syncwarp();
  if (lane == 0)
    for (int j = 0; j < s.dp_size; ++j) signal_peer(ctx, ctx.combine_flags + slot, landed, group * s.dp_size + j);
  mark(ctx, kCombineSend, kStep2);  // and signalled
}

// Rows per slot, a warp per row, each followed by its slot's flag (tagged with the epoch). False when the phase did
// not run (refused or out of protocol order). `advance`: move the protocol on at the end (finish_phase; false in the
// fused combine).
__device__ inline bool combine_send_rows(const Context& ctx, const CombineSendArgs& a, bool advance) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, a.status)) return false;
  if (blockIdx.x == gridDim.x - 1) {  // the last block, so that block 0 starts on the first rows meanwhile
    signal_done_reading(ctx);
    mark(ctx, kCombineSend, kWaited, true);
  }
  const uint64_t landed = tagged(current_epoch(ctx), kSlotLanded);

  const int lane = lane_index(), gwarp = spread_warp(), nwarps = grid_warps();
  const int row_bytes = s.hidden * a.elem_bytes;
  for (int p = gwarp; p < s.capacity; p += nwarps) {
    int group, slot;
    if (!origin_slot(s, a.row_origin[p], &group, &slot)) continue;
    const char* row = static_cast<const char*>(a.expert_y) + static_cast<size_t>(p) * row_bytes;
    char* dst = ctx.combine_slots + static_cast<size_t>(slot) * s.combine_stride;
    if (ctx.p2p) {  // NVLink: store the row straight into each replica's slot, then signal
      store_slot_row(ctx, row, row_bytes, slot, slot, group, lane, landed);
    } else {  // stage into symmetric memory: a put's source must be symmetric on other transports
      char* staged = ctx.combine_staging + static_cast<size_t>(p) * s.combine_stride;
      bool in_staging = false;  // staged once, for the first replica reached by a put
      for (int j = 0; j < s.dp_size; ++j) {
        const int replica = group * s.dp_size + j;
        if (is_direct(ctx, replica)) {  // a replica on this node: the row stored, then (fenced) its flag
          warp_copy(peer_ptr(ctx, dst, replica), row, row_bytes, lane);
          __threadfence_system();
          __syncwarp();
          if (lane == 0) signal_peer(ctx, ctx.combine_flags + slot, landed, replica);
          continue;
        }
        if (!in_staging) {
          warp_copy(staged, row, row_bytes, lane);
          __syncwarp();
          in_staging = true;
        }
        nvshmemx_putmem_signal_nbi_warp(dst, staged, row_bytes, ctx.combine_flags + slot, landed, NVSHMEM_SIGNAL_SET,
                                        pe_of(ctx, replica));
        if (lane == 0) count_put(ctx, kCombineSend, replica, row_bytes);
      }
    }
  }
  mark(ctx, kCombineSend, kWorked);
  if (!ctx.p2p) complete_remote_writes(ctx);  // this thread's puts have completed before the phase counts as done
  if (finish_phase(ctx, kCombineSend, a.status, advance)) mark(ctx, kCombineSend, kEnd, true);
  return true;
}

// The low-latency send (Context::flagged; the fused combine, combine.cu): our sync flags as combine_send_rows sets
// them (they carry this rank's failures of the round trip to every peer), then a warp per row, stored home into its
// slot of every replica of its source DP group in flagged words: no fence, no slot flag after it. False when the
// phase did not run (refused or out of protocol order).
__device__ inline bool combine_send_flagged(const Context& ctx, const CombineSendArgs& a) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, a.status)) return false;
  if (blockIdx.x == gridDim.x - 1) {  // the last block, so that block 0 starts on the first rows meanwhile
    signal_done_reading(ctx);
    mark(ctx, kCombineSend, kWaited, true);
  }
  const uint32_t epoch = current_epoch(ctx);
  const int lane = lane_index(), gwarp = spread_warp(), nwarps = grid_warps();
  const int row_bytes = s.hidden * a.elem_bytes, pairs = row_bytes / 8;
  // Fewer rows than warps (a few tokens): each row in `pieces` parts, a warp each, part q of row p work item
  // q * capacity + p, so a row's parts run on different blocks. A warp alone stores a row's flagged words (twice its
  // bytes) at a fraction of an SM's store rate; receivers need no order among the words.
  const int pieces = max(1, min(nwarps / max(s.capacity, 1), pairs / kMinPiecePairs));
  const int piece_pairs = (pairs + pieces - 1) / pieces + 1 & ~1;  // even: a piece starts 16-byte aligned
  for (int item = gwarp; item < s.capacity * pieces; item += nwarps) {
    const int p = item % s.capacity, begin = item / s.capacity * piece_pairs, n = min(piece_pairs, pairs - begin);
    int group, slot;
    if (n <= 0 || !origin_slot(s, a.row_origin[p], &group, &slot)) continue;
    const auto* part = reinterpret_cast<const uint2*>(static_cast<const char*>(a.expert_y) +
                                                      static_cast<size_t>(p) * row_bytes) + begin;
    uint64_t* dst = ctx.flagged_combine + static_cast<size_t>(slot) * flagged_combine_words(s) + 2 * begin;
    warp_store_flagged(part, n, part, n, epoch, s.dp_size,
                       [&](int j) { return peer_ptr(ctx, dst, group * s.dp_size + j); }, lane);
    mark(ctx, kCombineSend, kStep1);  // block 0's (last) part stored
  }
  mark(ctx, kCombineSend, kWorked);
  return true;
}

// A round of the windowed combine (combine.cu), rows per slot: the rows whose tokens are in the round (tokens
// [round * W, (round + 1) * W) of each DP group, W = window_tokens), each into its slot's place in the round's window
// of every replica, then the slot's flag. NVLink only.
__device__ inline void store_window_slot_rows(const Context& ctx, const CombineSendArgs& a, int round) {
  const Sizes& s = ctx.s;
  const uint64_t landed = tagged(current_epoch(ctx), kSlotLanded);
  const int first = round * window_tokens(s) * s.experts_per_token, slots = window_tokens(s) * s.experts_per_token;
  const int row_bytes = s.hidden * a.elem_bytes;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  for (int p = gwarp; p < s.capacity; p += nwarps) {
    int group, slot;
    if (!origin_slot(s, a.row_origin[p], &group, &slot) || slot < first || slot >= first + slots) continue;
    const char* row = static_cast<const char*>(a.expert_y) + static_cast<size_t>(p) * row_bytes;
    store_slot_row(ctx, row, row_bytes, slot - first, slot, group, lane, landed);
  }
}

// The number of slots source `src` filled in this round trip's dispatch (its ready word, which dispatch_send SETs on
// every rank, this one included).
__device__ inline int arrived_tokens(const Context& ctx, int src) {
  return min(max(token_count(*reinterpret_cast<volatile uint64_t*>(ctx.dispatch_ready + src)), 0),
             ctx.s.slots_per_source);
}

// Our weights are on every rank (the caller has fenced and met a grid barrier): block 0 SETs our weights_ready word
// everywhere; every block waits for every source's (a thread per source).
__device__ inline void signal_and_wait_weights(const Context& ctx, uint32_t epoch) {
  const Sizes& s = ctx.s;
  if (blockIdx.x == 0)
    for (int pe = threadIdx.x; pe < s.world; pe += blockDim.x)
      signal_peer(ctx, ctx.weights_ready + s.rank, tagged(epoch, 1), pe);
  for (int src = threadIdx.x; src < s.world; src += blockDim.x)
    wait_for(ctx, ctx.weights_ready + src, tagged(epoch, 1), kCombineSend, src);
}

// Step 4 of the pre-reduced combine_send (below): the last block SETs partials_ready and the sync flag ("done
// reading your dispatch buffers") on every rank, unless some block gave up (then peers give up too).
__device__ inline void finish_reduced_send(const Context& ctx, const CombineSendArgs& a, uint32_t epoch,
                                           bool advance) {
  int32_t code;
  if (finish_phase(ctx, kCombineSend, a.status, advance, &code)) {
    if (completed(code)) {
      for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x)
        signal_peer(ctx, ctx.partials_ready + ctx.s.rank, tagged(epoch, 1), pe);
      signal_done_reading(ctx);
    }
    mark(ctx, kCombineSend, kEnd, true);
  }
}

// Steps 1 and 2 of the pre-reduced combine_send (below): the weights everywhere, row_of.
__device__ inline void exchange_weights(const Context& ctx, const CombineSendArgs& a) {
  const Sizes& s = ctx.s;
  const uint32_t epoch = current_epoch(ctx);
  const int K = s.experts_per_token, T = s.max_tokens, replica = s.rank % s.dp_size;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const int gthread = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;

  // 1. Our own token count is our own ready word (dispatch_send SETs it on every rank, this one included).
  const int publish = a.weights_sent ? 0 : arrived_tokens(ctx, s.rank);  // our tokens whose weights go out here
  for (int i = gwarp; i < publish; i += nwarps) {
    const float w = lane < K ? a.topk_weights[static_cast<size_t>(replica + i * s.dp_size) * K + lane] : 0.f;
    const size_t at = (static_cast<size_t>(s.rank) * s.slots_per_source + i) * K + lane;
    for (int d = 0; d < s.world; ++d)
      if (lane < K) peer_ptr(ctx, ctx.combine_weights, d)[at] = w;
  }
  const int entries = s.num_dp * T * K;
  for (int p = gthread; p < s.capacity; p += nthreads) {
    const int origin = a.row_origin[p];
    if (origin >= 0 && origin < entries) ctx.row_of[origin] = p;
  }
  // Our weights reach every rank before the weights_ready signal below. With the weights sent by the dispatch there
  // are no stores to peers here, and the grid barrier alone makes row_of visible to every block.
  if (publish > 0) __threadfence_system();
  cooperative_groups::this_grid().sync();

  // 2. Weights: ours are everywhere; wait for every source's.
  if (!a.weights_sent) signal_and_wait_weights(ctx, epoch);
  __syncthreads();
  mark(ctx, kCombineSend, kWaited);
}

// The staged path's pre-reduced rows (combine_send_reduced_staged): this rank's partial rows for source s's tokens
// are one run, in the order of the routes s's dispatch gave its tokens here (row route of the run: the token's). On
// every replica of s's DP group the runs of the group's sources lie one after another in combine_partials, each
// source's ordered by rank: from partial_first[s] on. Here, in staging, the runs for every source in source order:
// from stage_first[s] on. Both from the counts every source sent with its dispatch (Context::dispatch_counts).
struct PartialRuns {
  int partial_first[kMaxNvlinkPeers];
  int stage_first[kMaxNvlinkPeers];
};

// Step 3 of the pre-reduced combine_send (below), for the sources' slots [first_slot, first_slot + slots): all of
// them, or a round of the windowed combine (combine.cu), whose tokens' partial rows go to their places in the
// round's window (token t at t - first_slot * dp_size). Staged (combine_send_reduced_staged): into the runs of
// `runs` instead.
// WholeRows: a work item is a token's whole row (every segment), its lookups made once: where the warps are few (an
// SM budget) the lookups, not the loads, held the rows back.
template <typename In, typename Partial, bool Staged = false, bool WholeRows = false>
__device__ inline void store_partial_rows(const Context& ctx, const CombineSendArgs& a, int first_slot, int slots,
                                          const PartialRuns* runs = nullptr) {
  // One partial row per arrived token with a live slot here. A warp takes one segment of kSegChunks chunks per lane
  // of the row (lanes interleaved: coalesced), so a token's columns spread over many warps, each lane with the
  // chunks of kExpertRowsInFlight rows in flight together: a warp per token walked the 7168 columns of R1 one load
  // at a time. (Whole tokens per warp, reading each ids row once, lost at T=4096 with every SM: a token has 0 to 8
  // rows here, and the warp with the most rows ended the phase tens of microseconds after the rest. WholeRows.)
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, T = s.max_tokens, L = s.local_experts, H = s.hidden;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const bool vector_ok = H % kChunk == 0 && (H * sizeof(In)) % 16 == 0;
  const bool vector_out = vector_ok && (H * sizeof(Partial)) % 16 == 0;
  const int segments = row_segments(s);
  // Arrived tokens interleaved by source (token i of every source, then token i + 1), so that from the start the
  // warps store partial rows to every rank at once. Numbered source by source, the first half of the items sent
  // only to one rank (for one of the two ranks at EP2: its own HBM) and the second half only to the other (the
  // link), one after the other.
  // Each source's token count, read once per block (the ready words are volatile: a load per item was one more
  // L2 round trip ahead of every item's lookups).
  __shared__ int arrived_from[kMaxNvlinkPeers];
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) arrived_from[src] = arrived_tokens(ctx, src);
  __syncthreads();
  int most = 0;  // tokens of the largest source
  for (int src = 0; src < s.world; ++src) most = max(most, arrived_from[src]);
  const int round_slots = max(min(most - first_slot, slots), 0);
  const int items_per_token = WholeRows ? 1 : segments;
  for (int item = gwarp; item < round_slots * s.world * items_per_token; item += nwarps) {
    const int src = item / items_per_token % s.world, i = first_slot + item / items_per_token / s.world,
              item_seg = item % items_per_token;
    if (i >= arrived_from[src]) continue;  // a source with fewer tokens
    const int g = src / s.dp_size;
    const size_t slot = static_cast<size_t>(src) * s.slots_per_source + i;
    const int32_t* ids = ctx.dispatch_ids + slot * K;
    const int t = src % s.dp_size + i * s.dp_size;
    // The token's rows here, a lane per slot (k = lane), so the lookups of all its slots are in flight together:
    // the ids row, then row_of and the weight, then row_origin (slot after slot, two dependent loads per local slot
    // came before the first expert row's load).
    const unsigned live = live_slots(ids, K, s.num_experts);
    const int id = lane < K ? ids[lane] : -1;
    const bool local_slot = (live >> lane & 1u) && id / L == s.rank;
    if (__ballot_sync(0xffffffffu, local_slot) == 0) continue;  // no live slot here: the source adds no partial
    int row = -1;
    [[maybe_unused]] int route = 0;  // Staged: the token's row in this rank's run of its source
    float weight = 0.f;
    if (local_slot) {
      if constexpr (Staged) route = ctx.dispatch_routes[slot * K + lane];
      const int origin = (g * T + t) * K + lane;
      const int r = ctx.row_of[origin];
      weight = ctx.combine_weights[slot * K + lane];
      // A live slot without a row (capacity overflow, which dispatch_recv reported, or a handle of another
      // routing) contributes nothing; the token's partial row is still written (the source adds it).
      if (r >= 0 && r < s.capacity && a.row_origin[r] == origin) row = r;
    }
    const unsigned with_row = __ballot_sync(0xffffffffu, row >= 0);  // the slots summed, in slot order
    size_t at;
    if constexpr (Staged) {  // the token's row in this rank's run of its source (one route for all its slots here)
      route = __shfl_sync(0xffffffffu, route, __ffs(__ballot_sync(0xffffffffu, local_slot)) - 1);
      at = runs->partial_first[src] + route;
    } else {  // its place in the window
      at = static_cast<size_t>(t - first_slot * s.dp_size) * K + partial_place(live, id / L, s.rank);
    }
    char* dst = ctx.combine_partials + at * s.combine_stride;
    // One segment of the row: its weighted sum, stored to every replica of the source.
    const auto reduce_segment = [&](int seg) {
      const auto col_of = [&](int u) { return seg * kSegCols + (u * 32 + lane) * kChunk; };
      float acc[kSegChunks][kChunk] = {};
      // Slots in order, like the reference; kExpertRowsInFlight rows' chunks are loaded before any is added. A row and
      // its weight come from its slot's lane.
      for (unsigned pending = with_row; pending;) {
        const In* rows[kExpertRowsInFlight];
        float weights[kExpertRowsInFlight];
        bool has[kExpertRowsInFlight];
#pragma unroll
        for (int b = 0; b < kExpertRowsInFlight; ++b) {
          has[b] = pending != 0;
          const int k = has[b] ? __ffs(pending) - 1 : 0;
          pending &= pending - 1;
          const int r = max(__shfl_sync(0xffffffffu, row, k), 0);  // 0: no row (not loaded)
          rows[b] = static_cast<const In*>(a.expert_y) + static_cast<size_t>(r) * H;
          weights[b] = __shfl_sync(0xffffffffu, weight, k);
        }
        if (vector_ok) {
          Chunk<In> v[kExpertRowsInFlight][kSegChunks];
#pragma unroll
          for (int b = 0; b < kExpertRowsInFlight; ++b)
#pragma unroll
            for (int u = 0; u < kSegChunks; ++u)
              if (has[b] && col_of(u) < H) v[b][u] = *reinterpret_cast<const Chunk<In>*>(rows[b] + col_of(u));
#pragma unroll
          for (int b = 0; b < kExpertRowsInFlight; ++b)
#pragma unroll
            for (int u = 0; u < kSegChunks; ++u)
              if (has[b] && col_of(u) < H)
#pragma unroll
                for (int c = 0; c < kChunk; ++c) acc[u][c] += weights[b] * to_float(v[b][u].v[c]);
        } else {
          for (int b = 0; b < kExpertRowsInFlight; ++b)
            for (int u = 0; u < kSegChunks; ++u)
              if (has[b] && col_of(u) < H)
                add_chunk(acc[u], weights[b], rows[b] + col_of(u), false, min(kChunk, H - col_of(u)));
        }
      }
      const auto store = [&](char* to) {
        Partial* out = reinterpret_cast<Partial*>(to);
#pragma unroll
        for (int u = 0; u < kSegChunks; ++u)
          if (col_of(u) < H) store_chunk(out + col_of(u), acc[u], vector_out, min(kChunk, H - col_of(u)));
      };
      bool staged = false;  // Staged: the row is in staging for the replicas off NVLink
      for (int r = 0; r < s.dp_size; ++r) {
        const int replica = g * s.dp_size + r;
        if (!Staged) {
          store(peer_ptr(ctx, dst, replica));
        } else if (stores_into(ctx, replica)) {
          store(store_ptr(ctx, dst, replica));
        } else if (!staged) {
          store(ctx.combine_staging + (static_cast<size_t>(runs->stage_first[src]) + route) * s.combine_stride);
          staged = true;
        }
      }
    };
    if constexpr (WholeRows) {
      // Each row's lane asks L2 for the row's segment kPrefetchSegments ahead, so that the warp's loads, a few rows at
      // a time, come from L2.
      const auto prefetch_segment = [&](int seg) {
        if (!vector_ok || row < 0 || seg >= segments) return;
        const int col = seg * kSegCols;
        prefetch_to_l2(static_cast<const In*>(a.expert_y) + static_cast<size_t>(row) * H + col,
                       static_cast<uint32_t>(min(kSegCols, H - col) * sizeof(In)));
      };
      for (int seg = 0; seg < kPrefetchSegments; ++seg) prefetch_segment(seg);
      for (int seg = 0; seg < segments; ++seg) {
        prefetch_segment(seg + kPrefetchSegments);
        reduce_segment(seg);
      }
    } else {
      reduce_segment(item_seg);
    }
  }
}

// Every block's PartialRuns, a thread per source (world <= kMaxNvlinkPeers: the staged pre-reduced combine's bound).
__device__ inline void plan_partial_runs(const Context& ctx, PartialRuns* runs) {
  const Sizes& s = ctx.s;
  const int32_t* counts = ctx.dispatch_counts;  // [source][rank]
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) {
    const int first_source = src / s.dp_size * s.dp_size;
    int stage = 0;
    for (int q = 0; q < src; ++q) stage += counts[q * s.world + s.rank];
    runs->partial_first[src] =
        partial_run_first(counts + first_source * s.world, s.world, src - first_source, s.rank);
    runs->stage_first[src] = stage;
  }
  __syncthreads();
}

// The staged path's step 1 of the pre-reduced combine_send: this replica's weights into its region of
// combine_weights here and on each peer of this node (stores), then to each other rank in one put; row_of; our
// weights_ready on every rank once they are complete; then every source's.
__device__ inline void exchange_weights_staged(const Context& ctx, const CombineSendArgs& a) {
  const Sizes& s = ctx.s;
  const uint32_t epoch = current_epoch(ctx);
  const int K = s.experts_per_token, T = s.max_tokens, replica = s.rank % s.dp_size;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const int gthread = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
  const int publish = arrived_tokens(ctx, s.rank);
  float* mine = ctx.combine_weights + static_cast<size_t>(s.rank) * s.slots_per_source * K;
  for (int i = gwarp; i < publish; i += nwarps) {
    if (lane >= K) continue;
    const float w = a.topk_weights[static_cast<size_t>(replica + i * s.dp_size) * K + lane];
    for (int d = 0; d < s.world; ++d)
      if (stores_into(ctx, d)) store_ptr(ctx, mine, d)[static_cast<size_t>(i) * K + lane] = w;
  }
  const int entries = s.num_dp * T * K;
  for (int p = gthread; p < s.capacity; p += nthreads) {
    const int origin = a.row_origin[p];
    if (origin >= 0 && origin < entries) ctx.row_of[origin] = p;
  }
  cooperative_groups::this_grid().sync();  // our weights complete here before any warp puts them
  const size_t bytes = 4ull * K * publish;
  for (int d = gwarp; d < s.world && bytes > 0; d += nwarps) {
    if (!stores_into(ctx, d)) put_warp(ctx, kCombineSend, mine, mine, bytes, d, lane);
  }
  complete_remote_writes(ctx);  // this thread's stores and puts of the weights are complete
  cooperative_groups::this_grid().sync();  // and every thread's, before the signal
  signal_and_wait_weights(ctx, epoch);
  __syncthreads();
  mark(ctx, kCombineSend, kWaited);
}

// Pre-reduced combine_send (a cooperative launch: every block resident, so blocks may wait for peers' blocks).
// False when the phase did not run (out of protocol order); `advance` as in combine_send_rows.
//   1. Publish this replica's tokens' weights to every rank (unless the dispatch did: a.weights_sent); invert
//      row_origin into row_of (local).
//   2. Grid barrier; SET our weights_ready word on every rank; wait for every source's (unless a.weights_sent: the
//      weights came before each source's dispatch ready signal, which this rank's dispatch waited for).
//   3. A warp per arrived token (source rank src, its slot i): sum w * expert_y over the token's live slots whose
//      expert is here, in slot order, in fp32; store the sum (Partial) into every replica of the token's group, at
//      combine_partials[token][j], j this rank's place among the ranks of the token's live slots (partial_place).
//   4. The last block SETs partials_ready and the sync flag ("done reading your dispatch buffers": the ids rows
//      are read in 3) on every rank. Every word is tagged with the round trip's epoch.
template <typename In, typename Partial, bool WholeRows = false>
__device__ inline bool combine_send_reduced(const Context& ctx, const CombineSendArgs& a, bool advance) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, a.status)) return false;
  const uint32_t epoch = current_epoch(ctx);
  exchange_weights(ctx, a);
  store_partial_rows<In, Partial, false, WholeRows>(ctx, a, 0, s.slots_per_source);
  mark(ctx, kCombineSend, kWorked);
  __threadfence_system();  // this thread's partial rows reach every peer before the signals below
  mark(ctx, kCombineSend, kClosed);

  finish_reduced_send(ctx, a, epoch, advance);
  return true;
}


// The pre-reduced combine_send of the staged path (Context::p2p false; cooperative): combine_send_reduced's steps,
// with the weights exchanged by stores within the node and a put per other rank (exchange_weights_staged), and the
// partial rows in runs (PartialRuns): stored into each replica on this node, staged for the others, then one put
// per (replica off NVLink, source of its group). Every put is complete before the signals. False when the phase
// did not run (out of protocol order).
template <typename In, typename Partial>
__device__ inline bool combine_send_reduced_staged(const Context& ctx, const CombineSendArgs& a) {
  const Sizes& s = ctx.s;
  if (!begin_phase(ctx, kCombineSend, a.status)) return false;
  const uint32_t epoch = current_epoch(ctx);
  exchange_weights_staged(ctx, a);
  __shared__ PartialRuns runs;
  plan_partial_runs(ctx, &runs);
  // This DP group's routes and counts, which combine_recv reads after our sync flag lets peers overwrite them.
  const int first_source = s.rank / s.dp_size * s.dp_size, K = s.experts_per_token;
  const size_t group_routes = static_cast<size_t>(s.dp_size) * s.slots_per_source * K;
  const int32_t* routes = ctx.dispatch_routes + static_cast<size_t>(first_source) * s.slots_per_source * K;
  const int32_t* counts = ctx.dispatch_counts + static_cast<size_t>(first_source) * s.world;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t e = first; e < group_routes; e += stride) ctx.group_routes[e] = routes[e];
  for (size_t e = first; e < static_cast<size_t>(s.dp_size) * s.world; e += stride) ctx.group_counts[e] = counts[e];
  store_partial_rows<In, Partial, true>(ctx, a, 0, s.slots_per_source, &runs);
  cooperative_groups::this_grid().sync();  // staging complete before any warp puts it
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  for (int item = gwarp; item < s.world * s.dp_size; item += nwarps) {
    const int replica = item / s.dp_size, src = replica / s.dp_size * s.dp_size + item % s.dp_size;
    const int rows = ctx.dispatch_counts[src * s.world + s.rank];
    if (stores_into(ctx, replica) || rows == 0) continue;
    put_warp(ctx, kCombineSend, ctx.combine_partials + static_cast<size_t>(runs.partial_first[src]) * s.combine_stride,
             ctx.combine_staging + static_cast<size_t>(runs.stage_first[src]) * s.combine_stride,
             static_cast<size_t>(rows) * s.combine_stride, replica, lane);
  }
  mark(ctx, kCombineSend, kWorked);
  complete_remote_writes(ctx);  // this thread's stores and puts are complete before the signals below
  mark(ctx, kCombineSend, kClosed);
  finish_reduced_send(ctx, a, epoch, true);
  return true;
}

// Rows per slot: a warp per expert row. Pre-reduced: a warp per (arrived token, column segment), one block per SM
// at most (cooperative).
inline int combine_send_blocks(const Sizes& s, bool reduced) {
  if (reduced)
    return blocks_for(static_cast<long long>(s.world) * s.slots_per_source * row_segments(s), kThreads / 32,
                      s.sm_count);
  return blocks_for(s.capacity, kThreads / 32, 8 * s.sm_count);
}

}  // namespace jmc
