// dispatch_recv: wait for every source's ready word, then fan the arrived tokens out to this rank's experts:
// expert_x is packed by (local expert, source DP group, token), each expert padded to `align`; write group_sizes
// and row_origin. Every block derives the whole layout from the ids rows (a histogram and a block scan; in the
// ids-first dispatch each block's histogram of its own shares, summed after a grid barrier), then copies the rows of
// its own contiguous share of the arrived tokens: where each lands follows from the tokens before it, counted in the
// same histogram pass (before the share) and in shared bit masks (inside it). The stages are functions (counts,
// histogram, layout, a share's copies, finish) that receive_tokens here and the ids-first kernel (dispatch.cu) run
// in their orders. The ready words are reset by combine_send, which the stream runs after every block here has read
// them.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include "device_common.cuh"

namespace jmc {

// Last index i in [0, n) with starts[i] <= value (starts ascending, starts[0] == 0).
__device__ inline int find_run(const int* starts, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// out[i] = sum of in[j] for j < i, for i in [0, n], with the whole block (in and out in shared memory).
template <typename Scan>
__device__ inline void block_exclusive_sum(typename Scan::TempStorage& temp, const int* in, int* out, int n) {
  int running = 0;
  for (int base = 0; base <= n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    int value = i < n ? in[i] : 0, prefix, total;
    Scan(temp).ExclusiveSum(value, prefix, total);
    if (i <= n) out[i] = running + prefix;
    running += total;
    __syncthreads();
  }
}

// Where token t of DP group g arrived: its source rank (the replica that owns t) and that source's slot.
struct Arrival {
  int src, slot;
};
__device__ inline Arrival arrival_of(const Sizes& s, int g, int t) {
  return Arrival{g * s.dp_size + t % s.dp_size, t / s.dp_size};
}

__device__ inline const int32_t* ids_of(const Context& ctx, Arrival a) {
  return ctx.dispatch_ids + (static_cast<size_t>(a.src) * ctx.s.slots_per_source + a.slot) * ctx.s.experts_per_token;
}

// Arrived tokens a block takes at a time: one per thread; their local experts as bit masks in shared memory.
constexpr int kBitWords = kThreads / 32;

// Set bits of words[] in [from, to) (bit i: word i / 32, bit i % 32).
__device__ inline int count_bits(const unsigned* words, int from, int to) {
  int n = 0;
  for (int w = from / 32; w * 32 < to; ++w) {
    unsigned word = words[w];
    if (w == from / 32) word &= ~0u << (from % 32);
    if (to < (w + 1) * 32) word &= (1u << (to % 32)) - 1u;
    n += __popc(word);
  }
  return n;
}

// A receive's layout state, in dynamic shared memory (dispatch_recv_shared_bytes).
struct Receive {
  int* group_tokens;  // [G] tokens of each DP group
  int* first[2];      // [G + 1] each: arrival number of each group's first token in each pass (below)
  int* count;         // [L * G] rows of (local expert, group)
  int* before;        // [L * G] of those, from arrivals before this block's next batch
  int* expert_rows;   // [L] padded, then unpadded, rows per expert
  int* expert_start;  // [L + 1] packed start of each expert
  int* group_base;    // [L * G] packed start of (local expert, group)
  unsigned* hits;     // [L][kBitWords] the batch's tokens per expert
  int* remote;        // [E] slots of this block's shares routed to each expert of another rank (world > 1; else
                      // no space)
  bool timed_out;     // a source's ready word never came (this block's wait)
};

// Experts of other ranks: every rank but a lone one has some, and counts their slots for expert_counts.
__host__ __device__ inline bool has_remote_experts(const Sizes& s) { return s.local_experts < s.num_experts; }

inline size_t dispatch_recv_shared_bytes(const Sizes& s) {
  const int L = s.local_experts, G = s.num_dp;
  const int remote = has_remote_experts(s) ? s.num_experts : 0;
  return sizeof(int) * (3 * G + 2 + 3 * L * G + 2 * L + 1 + L * kBitWords + remote);
}

__device__ inline Receive carve_receive(const Sizes& s, int* smem) {
  const int L = s.local_experts, G = s.num_dp;
  Receive r;
  r.group_tokens = smem;
  r.first[0] = r.group_tokens + G;
  r.first[1] = r.first[0] + G + 1;
  r.count = r.first[1] + G + 1;
  r.before = r.count + L * G;
  r.expert_rows = r.before + L * G;
  r.expert_start = r.expert_rows + L;
  r.group_base = r.expert_start + L + 1;
  r.hits = reinterpret_cast<unsigned*>(r.group_base + L * G);
  r.remote = reinterpret_cast<int*>(r.hits + L * kBitWords);
  r.timed_out = false;
  return r;
}

// The arrivals a block copies in one pass: a pass takes some DP groups' tokens, numbered group by group (first),
// and shares them among a range of blocks, each a contiguous share [begin, end) in block order. A group's first
// arrival of the pass is its token `token_base` (a round of the windowed dispatch; else 0).
struct Share {
  const int* first;
  int begin, end;
  int token_base;
};
__device__ inline Share share_of(const int* first, int groups, int first_block, int blocks, int token_base = 0) {
  const int arrivals = first[groups], b = static_cast<int>(blockIdx.x) - first_block;
  if (b < 0 || b >= blocks) return Share{first, arrivals, arrivals, token_base};
  const int per_block = (arrivals + blocks - 1) / blocks;
  const int begin = min(b * per_block, arrivals);
  return Share{first, begin, min(begin + per_block, arrivals), token_base};
}

// The DP group of pass arrival i.
__device__ inline int group_of(const int* first, int i) {
  int g = 0;
  while (i >= first[g + 1]) ++g;
  return g;
}

// 1. Every source's token count (its ready word of this epoch); pass 0 takes every group, or only group `alone`
//    (>= 0), whose tokens pass 1 then leaves out.
__device__ inline void read_token_counts(const Context& ctx, Receive& r, int alone) {
  const Sizes& s = ctx.s;
  const int L = s.local_experts, G = s.num_dp;
  const uint64_t ready = tagged(current_epoch(ctx), 0);
  __shared__ bool timed_out;
  if (threadIdx.x == 0) timed_out = false;
  for (int g = threadIdx.x; g < G; g += blockDim.x) r.group_tokens[g] = 0;
  for (int i = threadIdx.x; i < L * G; i += blockDim.x) r.count[i] = r.before[i] = 0;
  for (int i = threadIdx.x; i < L * kBitWords; i += blockDim.x) r.hits[i] = 0;
  __syncthreads();
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) {
    const uint64_t word = wait_for(ctx, ctx.dispatch_ready + src, ready, kDispatchRecv, src);
    const int n = word ? token_count(word) : 0;
    if (!word) timed_out = true;
    atomicAdd(&r.group_tokens[src / s.dp_size], min(max(n, 0), s.slots_per_source));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    r.first[0][0] = r.first[1][0] = 0;
    for (int g = 0; g < G; ++g) {
      const bool in_first = alone < 0 || g == alone;
      r.first[0][g + 1] = r.first[0][g] + (in_first ? r.group_tokens[g] : 0);
      r.first[1][g + 1] = r.first[1][g] + (in_first ? 0 : r.group_tokens[g]);
    }
  }
  __syncthreads();
  r.timed_out = timed_out;
}

// 2. Rows per (local expert, group) over a share's arrivals (or [from, to) of its pass): a histogram over the arrived
//    tokens' ids (counts, hence deterministic), a thread per arrival; rows of arrivals before the share go to
//    `before`, the others to `count`. Rows of up to kUnrolledSlots ids: several in flight per thread, then counted
//    from registers (a load per slot between the shared atomics would serialize them). One shared atomic per row
//    (an atomic on both for the rows before the share would make ~1.5 atomics per row).
__device__ inline void histogram(const Context& ctx, Receive& r, const Share& sh, int from, int to) {
  const Sizes& s = ctx.s;
  const int L = s.local_experts, G = s.num_dp, K = s.experts_per_token, first_local = s.rank * L;
  const auto tally = [&](int e, int g, bool early) {
    const int l = e - first_local;
    if (l < 0 || l >= L) return;  // an expert of another rank
    atomicAdd(early ? &r.before[l * G + g] : &r.count[l * G + g], 1);
  };
  const auto ids_at = [&](int i, int g) { return ids_of(ctx, arrival_of(s, g, sh.token_base + i - sh.first[g])); };
  if (K <= kUnrolledSlots) {
    constexpr int kRowsInFlight = 4;
    for (int base = from + threadIdx.x; base < to; base += kRowsInFlight * blockDim.x) {
      IdsRow rows[kRowsInFlight];
      int group[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int i = base + u * blockDim.x;
        group[u] = i < to ? group_of(sh.first, i) : 0;
        rows[u] = i < to ? load_ids_row(ids_at(i, group[u]), K) : load_ids_row(nullptr, 0);  // all -1
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const unsigned live = live_mask(rows[u], s.num_experts);
#pragma unroll
        for (int k = 0; k < kUnrolledSlots; ++k)
          if (live >> k & 1u) tally(rows[u].id[k], group[u], base + u * blockDim.x < sh.begin);
      }
    }
  } else {
    for (int i = from + threadIdx.x; i < to; i += blockDim.x) {
      const int g = group_of(sh.first, i);
      const int32_t* ids = ids_at(i, g);
      for (int k = 0; k < K; ++k)
        if (slot_is_live(ids, k, s.num_experts)) tally(ids[k], g, i < sh.begin);
    }
  }
}

// Every block histograms every arrival of its pass (no block waits for another).
__device__ inline void histogram_all(const Context& ctx, Receive& r, const Share& sh) {
  histogram(ctx, r, sh, 0, sh.first[ctx.s.num_dp]);
  __syncthreads();
  for (int i = threadIdx.x; i < ctx.s.local_experts * ctx.s.num_dp; i += blockDim.x) r.count[i] += r.before[i];
  __syncthreads();
}

// Each block histograms its own shares, publishes the counts (block_counts) and, after a grid barrier (every block
// resident: a cooperative launch), sums the published counts, those of the blocks before it into `before` (every
// block redoing the whole histogram costs about twice as much at large T). A group's arrivals are in one pass, and
// a pass's shares follow block order, so the blocks before this one hold exactly the group's rows before its share.
__device__ inline void histogram_split(const Context& ctx, Receive& r, const Share* shares, int passes) {
  for (int p = 0; p < passes; ++p) histogram(ctx, r, shares[p], shares[p].begin, shares[p].end);  // `count` only
  __syncthreads();
  const int LG = ctx.s.local_experts * ctx.s.num_dp;
  const int blocks = gridDim.x, stride = (blocks + 3) / 4 * 4;  // block_counts[(l, g)][block]
  for (int i = threadIdx.x; i < LG; i += blockDim.x)
    ctx.block_counts[static_cast<size_t>(i) * stride + blockIdx.x] = r.count[i];
  __threadfence();
  cooperative_groups::this_grid().sync();
  for (int i = threadIdx.x; i < LG; i += blockDim.x) {
    const int4* row = reinterpret_cast<const int4*>(ctx.block_counts + static_cast<size_t>(i) * stride);
    int early = 0, all = 0;
#pragma unroll 8
    for (int v = 0; v < stride / 4; ++v) {
      const int4 c = __ldcg(row + v);  // L2: other SMs wrote them
      const int n[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int b = 4 * v + j;
        all += b < blocks ? n[j] : 0;
        early += b < static_cast<int>(blockIdx.x) ? n[j] : 0;
      }
    }
    r.before[i] = early;
    r.count[i] = all;
  }
  __syncthreads();
}

// 2b. The load of every expert of the layer (expert_counts): the histogram counts the local experts' slots (block 0
//     writes them in derive_layout); each block counts the other ranks' experts' slots in its own shares of the
//     arrivals here, adds them into ctx.expert_tally, and the last block copies the sums out (publish_expert_counts).
//     Every source's ids rows are on every rank already: nothing more travels, and every rank gets the same counts.
__device__ inline void tally_remote_experts(const Context& ctx, Receive& r, const Share* shares, int passes) {
  const Sizes& s = ctx.s;
  if (!has_remote_experts(s)) return;
  const int K = s.experts_per_token, E = s.num_experts, first_local = s.rank * s.local_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) r.remote[e] = 0;
  __syncthreads();
  for (int p = 0; p < passes; ++p) {
    const Share& sh = shares[p];
    for (int i = sh.begin + threadIdx.x; i < sh.end; i += blockDim.x) {
      const int g = group_of(sh.first, i);
      const int32_t* ids = ids_of(ctx, arrival_of(s, g, sh.token_base + i - sh.first[g]));
      const auto tally = [&](int e) {
        if (e < first_local || e >= first_local + s.local_experts) atomicAdd(&r.remote[e], 1);
      };
      if (K <= kUnrolledSlots) {  // the row in registers (as histogram)
        const IdsRow row = load_ids_row(ids, K);
        const unsigned live = live_mask(row, E);
#pragma unroll
        for (int k = 0; k < kUnrolledSlots; ++k)
          if (live >> k & 1u) tally(row.id[k]);
      } else {
        for (int k = 0; k < K; ++k)
          if (slot_is_live(ids, k, E)) tally(ids[k]);
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (r.remote[e] != 0) atomicAdd(ctx.expert_tally + e, r.remote[e]);
}

// The last block of the receive: the other ranks' experts' sums into expert_counts, the tally zeroed for the next
// round trip (the local experts' counts are block 0's, from the layout).
__device__ inline void publish_expert_counts(const Context& ctx, const DispatchRecvArgs& a) {
  const Sizes& s = ctx.s;
  if (!has_remote_experts(s)) return;
  const int first_local = s.rank * s.local_experts;
  for (int e = threadIdx.x; e < s.num_experts; e += blockDim.x)
    if (e < first_local || e >= first_local + s.local_experts) a.expert_counts[e] = atomicExch(ctx.expert_tally + e, 0);
}

// The rows local expert l keeps of the `rows` routed to it: all, or with a per-expert capacity the first
// expert_capacity in layout order (the others are dropped as overflow).
__device__ inline int kept_rows(const Sizes& s, int rows) {
  return s.expert_capacity > 0 ? min(rows, s.expert_capacity) : rows;
}

// 3. The layout from the counts: experts' padded starts (a block scan) of the rows each keeps, each (expert, group)'s
//    base; block 0 writes group_sizes and reports an overflow (unless the MoEComm drops overflow: then the rows are
//    dropped silently). expert_rows ends as the rows each expert keeps (unpadded).
__device__ inline void derive_layout(const Context& ctx, const DispatchRecvArgs& a, Receive& r) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  const Sizes& s = ctx.s;
  const int L = s.local_experts, G = s.num_dp;
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int rows = 0;
    for (int g = 0; g < G; ++g) rows += r.count[l * G + g];
    r.expert_rows[l] = (kept_rows(s, rows) + s.align - 1) / s.align * s.align;
  }
  __syncthreads();
  block_exclusive_sum<Scan>(scan_temp, r.expert_rows, r.expert_start, L);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int base = r.expert_start[l];
    for (int g = 0; g < G; ++g) {
      r.group_base[l * G + g] = base;
      base += r.count[l * G + g];
    }
    const int rows = base - r.expert_start[l];
    r.expert_rows[l] = kept_rows(s, rows);
    if (blockIdx.x == 0) a.expert_counts[s.rank * L + l] = rows;  // the load, before any drop
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) a.group_sizes[l] = r.expert_start[l + 1] - r.expert_start[l];
    if (threadIdx.x == 0 && !s.drop_overflow) {
      if (r.expert_start[L] > s.capacity) report(ctx, kDispatchRecv, kCapacityOverflow, r.expert_start[L], s.capacity);
      for (int l = 0; l < L && s.expert_capacity > 0; ++l) {  // the first expert over its capacity
        int rows = 0;
        for (int g = 0; g < G; ++g) rows += r.count[l * G + g];
        if (rows > s.expert_capacity) {
          report(ctx, kDispatchRecv, kCapacityOverflow, rows, s.expert_capacity);
          break;
        }
      }
    }
  }
}

// Slot k of token t of DP group g gets no row (capacity overflow): every replica of the group is told, in the slot's
// combine flag, so that its per-slot combine_recv waits for no row and adds nothing for that slot.
JMC_COLD void drop_slot(const Context& ctx, int g, int t, int k) {
  const Sizes& s = ctx.s;
  uint64_t* flag = ctx.combine_flags + static_cast<size_t>(t) * s.experts_per_token + k;
  const uint64_t dropped = tagged(current_epoch(ctx), kSlotDropped);
  for (int j = 0; j < s.dp_size; ++j) signal_peer(ctx, flag, dropped, g * s.dp_size + j);
}

// Where token t of DP group g's row (payload, scales) is read from: the slot it arrived in, in its source's window
// (its slots from `slot_base` on: a round of the windowed dispatch; else all of them).
struct FromSlots {
  static constexpr bool kRowPerToken = false;  // a warp per slot: the fan-out is for this rank's own rows (FromX)
  const Context& ctx;
  int slot_base = 0;
  __device__ const char* payload(int g, int t) const {
    const Arrival src = arrival_of(ctx.s, g, t);
    const size_t slot = static_cast<size_t>(src.src) * ctx.s.window_slots + (src.slot - slot_base);
    return ctx.dispatch_slots + slot * ctx.s.token_stride;
  }
  __device__ const void* scales(int g, int t) const { return payload(g, t) + scales_offset(ctx.s); }
  __device__ void copy(char* payload_to, float* scales_to, int g, int t, int /*k*/, int lane) const {
    warp_copy_pair(payload_to, payload(g, t), ctx.s.payload_bytes, scales_to, scales(g, t), 4 * ctx.s.scale_cols,
                   lane);
  }
};

// The staged path's rows (dispatch_send_staged_kernel): token t of DP group g's row at the place in its source's
// region where the source packed it for this rank, which its slot k's route names (Context::dispatch_routes).
struct FromRoutedSlots {
  static constexpr bool kRowPerToken = false;  // a row per slot (its route)
  const Context& ctx;
  __device__ void copy(char* payload_to, float* scales_to, int g, int t, int k, int lane) const {
    const Sizes& s = ctx.s;
    const Arrival src = arrival_of(s, g, t);
    const size_t slot = static_cast<size_t>(src.src) * s.slots_per_source + src.slot;
    // Clamped: a route of a failed round trip never addresses outside the source's region.
    const int at = min(max(ctx.dispatch_routes[slot * s.experts_per_token + k], 0), s.slots_per_source - 1);
    const char* row = ctx.dispatch_slots + (static_cast<size_t>(src.src) * s.slots_per_source + at) * s.token_stride;
    warp_copy_pair(payload_to, row, s.payload_bytes, scales_to, row + scales_offset(s), 4 * s.scale_cols, lane);
  }
};

// The low-latency path's rows (Context::flagged): token t of DP group g from the flagged words of the slot it
// arrived in, each polled until it holds this round trip's data.
struct FromFlagged {
  static constexpr bool kRowPerToken = false;  // words polled as they are copied
  const Context& ctx;
  __device__ void copy(char* payload_to, float* scales_to, int g, int t, int /*k*/, int lane) const {
    const Sizes& s = ctx.s;
    const Arrival src = arrival_of(s, g, t);
    const uint64_t* row =
        ctx.flagged_rows + (static_cast<size_t>(src.src) * s.slots_per_source + src.slot) * flagged_row_words(s);
    warp_copy_flagged(ctx, reinterpret_cast<uint2*>(payload_to), s.payload_bytes / 8,
                      reinterpret_cast<uint2*>(scales_to), flagged_row_words(s) / 2, row, current_epoch(ctx),
                      kDispatchRecv, src.src, lane);
  }
};

// 1b. The low-latency path (Context::flagged): every arrival's ids, polled from their flagged words into
//     dispatch_ids, where the stages below read them. Every block lands all of them (the same values, so the
//     blocks' stores never conflict), a thread per arrival, a row's words in flight together. A wait that gives up
//     leaves the arrival's ids -1: no row is copied for it.
__device__ inline void land_flagged_ids(const Context& ctx, const Receive& r) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, G = s.num_dp;
  const uint32_t epoch = current_epoch(ctx);
  const int* first = r.first[0];
  Patience patience;
  bool ok = true;
  for (int i = threadIdx.x; i < first[G]; i += blockDim.x) {
    const int g = group_of(first, i);
    const Arrival at = arrival_of(s, g, i - first[g]);
    const size_t row = (static_cast<size_t>(at.src) * s.slots_per_source + at.slot) * K;
    const volatile uint64_t* words = ctx.flagged_ids + row;
    for (int k0 = 0; k0 < K; k0 += kUnrolledSlots) {
      uint64_t w[kUnrolledSlots];
#pragma unroll
      for (int u = 0; u < kUnrolledSlots; ++u) w[u] = k0 + u < K ? words[k0 + u] : 0;
#pragma unroll
      for (int u = 0; u < kUnrolledSlots; ++u) {
        if (k0 + u >= K) continue;
        while (ok && epoch_of(w[u]) != epoch) {
          if (patience.gave_up(ctx, kDispatchRecv, at.src)) ok = false; else w[u] = words[k0 + u];
        }
        ctx.dispatch_ids[row + k0 + u] = ok ? static_cast<int32_t>(value_of(w[u])) : -1;
      }
    }
  }
  __syncthreads();
}

// A token's places in expert_x (-1: none), slot by slot.
struct Places {
  int at[kUnrolledSlots];
};

// A warp stores one row (payload and scales, 16-byte aligned: RowInRegisters::fits) at each of its places: loaded
// once, its stores to every place in flight together. Not inlined: the row's words then take registers of this call
// alone, not of the receive around it, which is at the register cap already.
static __device__ __noinline__ void fan_out_row(const void* payload, const void* scales, Places places, void* expert_x,
                                                float* expert_scales, int payload_bytes, int scale_cols) {
  const int lane = threadIdx.x % 32;
  RowInRegisters row;
  row.load(payload, payload_bytes, scales, 4 * scale_cols, lane);
#pragma unroll
  for (int k = 0; k < kUnrolledSlots; ++k) {
    const int p = places.at[k];
    if (p >= 0)
      row.store(static_cast<char*>(expert_x) + static_cast<size_t>(p) * payload_bytes, payload_bytes,
                expert_scales + static_cast<size_t>(p) * scale_cols, 4 * scale_cols, lane);
  }
}

// 4. A share's rows, a batch of blockDim arrivals at a time. A token's row for local expert l lands at
//    group_base[l, g] + the rows for l of the group's earlier tokens: those before the batch (`before`) and those
//    of the batch (bit masks). A warp per (token, slot) copies the row from `from` (FromSlots, FromFlagged, or this
//    rank's own x); this rank's own rows (From::kRowPerToken), a warp per token: its row loaded once, stored to each
//    of its slots here. The thread that reads a token's ids for the bits also notes its slots here (local_slots) and
//    their experts (slot_expert, slots below kUnrolledSlots), so a copy starts with its row's loads: reading the ids
//    again put an L2 round trip before every copy, and one more before every slot with no copy here.
template <typename From>
__device__ inline void copy_share(const Context& ctx, const DispatchRecvArgs& a, Receive& r, const Share& sh,
                                  const From& from) {
  const Sizes& s = ctx.s;
  const int L = s.local_experts, G = s.num_dp, K = s.experts_per_token, first_local = s.rank * L;
  const int* first = sh.first;
  const auto ids_at = [&](int i, int g) { return ids_of(ctx, arrival_of(s, g, sh.token_base + i - first[g])); };
  __shared__ unsigned local_slots[kThreads];
  __shared__ int16_t slot_expert[kThreads][kUnrolledSlots];
  const int lane = lane_index(), warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int batch = sh.begin; batch < sh.end; batch += blockDim.x) {
    const int mine = batch + threadIdx.x;  // this thread's arrival: its bits
    unsigned here = 0;
    if (mine < sh.end) {
      const int32_t* ids = ids_at(mine, group_of(first, mine));
      for (unsigned m = live_slots(ids, K, s.num_experts); m; m &= m - 1) {
        const int k = __ffs(m) - 1, l = ids[k] - first_local;
        if (l < 0 || l >= L) continue;  // an expert of another rank
        atomicOr(&r.hits[l * kBitWords + warp], 1u << lane);
        here |= 1u << k;
        if (k < kUnrolledSlots) slot_expert[threadIdx.x][k] = static_cast<int16_t>(l);
      }
    }
    local_slots[threadIdx.x] = here;
    __syncthreads();
    const int batch_tokens = min(static_cast<int>(blockDim.x), sh.end - batch);
    // Slot k of batch token j: where its row lands (-1: nowhere here; an overflow is dropped and its source told).
    const auto place_of = [&](int j, int k, int g, int t) {
      const int i = batch + j;
      // Slots past kUnrolledSlots read their id again: on the low-latency path a block whose wait gave up may have
      // rewritten it since (land_flagged_ids), so it is checked again.
      const int l = k < kUnrolledSlots ? slot_expert[j][k] : ids_at(i, g)[k] - first_local;
      if (l < 0 || l >= L) return -1;
      const int at = max(first[g] - batch, 0);  // the batch's first arrival of group g
      const int p = r.group_base[l * G + g] + r.before[l * G + g] + count_bits(r.hits + l * kBitWords, at, j);
      // Overflow (past capacity, or past the rows its expert keeps): never written (derive_layout reported it); its
      // source is told: no row comes.
      if (p >= s.capacity || p - r.expert_start[l] >= r.expert_rows[l]) {
        if (lane == 0) drop_slot(*ctx.on_device, g, t, k);
        return -1;
      }
      if (lane == 0) a.row_origin[p] = (g * s.max_tokens + t) * K + k;
      return p;
    };
    const auto payload_at = [&](int p) {
      return static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes;
    };
    const auto scales_at = [&](int p) { return a.expert_scales + static_cast<size_t>(p) * s.scale_cols; };
    // A warp per token when the batch has one for every warp and its rows fit in registers: the row is loaded once
    // and stored to each of its slots here (up to K rows from one load, its stores in flight together). Otherwise a
    // warp per (token, slot), so that a few tokens' rows still spread over every warp.
    bool per_token = false;
    if constexpr (From::kRowPerToken)
      per_token = batch_tokens >= warps && K <= kUnrolledSlots &&
                  RowInRegisters::fits(reinterpret_cast<uintptr_t>(a.expert_x) |
                                           (s.scale_cols ? reinterpret_cast<uintptr_t>(a.expert_scales) : 0),
                                       s.payload_bytes, 4 * s.scale_cols);
    if constexpr (From::kRowPerToken) {
      for (int j = warp; per_token && j < batch_tokens; j += warps) {
        const unsigned slots = local_slots[j];
        if (slots == 0) continue;  // no live slot here
        const int i = batch + j, g = group_of(first, i), t = sh.token_base + i - first[g];
        const char* payload = from.payload(g, t);
        const void* scales = from.scales(g, t);
        if (!RowInRegisters::fits(reinterpret_cast<uintptr_t>(payload) |
                                      (s.scale_cols ? reinterpret_cast<uintptr_t>(scales) : 0),
                                  s.payload_bytes, 4 * s.scale_cols)) {
          for (unsigned m = slots; m; m &= m - 1) {
            const int k = __ffs(m) - 1, p = place_of(j, k, g, t);
            if (p >= 0) from.copy(payload_at(p), scales_at(p), g, t, k, lane);
          }
          continue;
        }
        Places places;
        for (int k = 0; k < kUnrolledSlots; ++k) places.at[k] = slots >> k & 1u ? place_of(j, k, g, t) : -1;
        fan_out_row(payload, scales, places, a.expert_x, a.expert_scales, s.payload_bytes, s.scale_cols);
      }
    }
    for (int h = warp; !per_token && h < batch_tokens * K; h += warps) {  // a warp per (token, slot) of the batch
      const int j = h / K, k = h % K, i = batch + j;
      if (!(local_slots[j] >> k & 1u)) continue;  // not live, or an expert of another rank
      const int g = group_of(first, i), t = sh.token_base + i - first[g];
      const int p = place_of(j, k, g, t);
      if (p >= 0) from.copy(payload_at(p), scales_at(p), g, t, k, lane);
    }
    __syncthreads();  // every warp has read `before` and the bits: the next batch counts on
    for (int i = threadIdx.x; i < L * G; i += blockDim.x) {
      const int l = i / G, g = i % G;
      const int at = max(first[g] - batch, 0);
      const int to = min(min(first[g + 1], sh.end) - batch, static_cast<int>(blockDim.x));
      if (at < to) r.before[i] += count_bits(r.hits + l * kBitWords, at, to);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L * kBitWords; i += blockDim.x) r.hits[i] = 0;
    __syncthreads();
  }
}

// 5. Rows holding no token: origin -1 (a thread per row); alignment padding inside the packed region is zeroed.
//    Then the phase's end; with `send_status` (the low-latency kernel) the send's end first, in the same last block.
__device__ inline void finish_receive(const Context& ctx, const DispatchRecvArgs& a, const Receive& r,
                                      int32_t* send_status = nullptr) {
  const Sizes& s = ctx.s;
  // The padded runs may end past capacity (overflow="drop" cuts inside them): rows from capacity on do not exist.
  const int L = s.local_experts, packed_rows = min(r.expert_start[L], s.capacity);
  const int lane = lane_index(), warps = blockDim.x / 32;
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < s.capacity; p += gridDim.x * blockDim.x) {
    const int l = p < packed_rows ? find_run(r.expert_start, L, p) : L;
    if (l == L || p - r.expert_start[l] >= r.expert_rows[l]) a.row_origin[p] = -1;
  }
  if (s.align > 1) {
    const int gwarp = blockIdx.x * warps + threadIdx.x / 32, nwarps = gridDim.x * warps;
    for (int p = gwarp; p < packed_rows; p += nwarps) {
      const int l = find_run(r.expert_start, L, p);
      if (p - r.expert_start[l] < r.expert_rows[l]) continue;
      warp_zero(static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes, s.payload_bytes, lane);
      if (s.scale_cols) warp_zero(a.expert_scales + static_cast<size_t>(p) * s.scale_cols, 4 * s.scale_cols, lane);
    }
  }
  mark(ctx, kDispatchRecv, kClosed);
  if (send_status == nullptr) {
    if (finish_phase(ctx, kDispatchRecv, a.status)) {
      publish_expert_counts(ctx, a);
      mark(ctx, kDispatchRecv, kEnd, true);
    }
  } else if (last_block_done(ctx.local->blocks_done + kDispatchRecv)) {
    publish_expert_counts(ctx, a);
    close_phase(ctx, kDispatchSend, send_status, false, nullptr);
    mark(ctx, kDispatchSend, kEnd, true);
    close_phase(ctx, kDispatchRecv, a.status, true, nullptr);
    mark(ctx, kDispatchRecv, kEnd, true);
  }
}

// The phase after its protocol-order check (dispatch_recv.cu), or right after the send in the fused dispatch
// (dispatch.cu): every source's rows have landed once its ready word is set. Every block derives the whole layout
// (a histogram of every arrival), then copies its own share of the arrivals. (histogram_split is for the ids-first
// order alone: compiled into this kernel, even unused, its code slows the histogram and the copies at small T.)
template <bool Routed = false>
__device__ inline void receive_tokens(const Context& ctx, const DispatchRecvArgs& a) {
  extern __shared__ int smem[];
  Receive r = carve_receive(ctx.s, smem);
  read_token_counts(ctx, r, -1);
  mark(ctx, kDispatchRecv, kWaited);
  const Share sh = share_of(r.first[0], ctx.s.num_dp, 0, gridDim.x);
  histogram_all(ctx, r, sh);
  tally_remote_experts(ctx, r, &sh, 1);
  mark(ctx, kDispatchRecv, kStep1);  // histogram done
  derive_layout(ctx, a, r);
  mark(ctx, kDispatchRecv, kStep2);  // layout derived (scans done)
  if constexpr (Routed)
    copy_share(ctx, a, r, sh, FromRoutedSlots{ctx});
  else
    copy_share(ctx, a, r, sh, FromSlots{ctx});
  mark(ctx, kDispatchRecv, kWorked);
  finish_receive(ctx, a, r);
}

// A refused receive (out of protocol order) still leaves a valid, empty layout: no row holds a token (row_origin
// -1) and no expert has rows (nor counts). A combine given this handle then sends nothing, rather than reading
// row_origin's uninitialized memory as row addresses.
__device__ inline void receive_nothing(const Context& ctx, const DispatchRecvArgs& a) {
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < ctx.s.capacity; p += gridDim.x * blockDim.x)
    a.row_origin[p] = -1;
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < ctx.s.local_experts; l += blockDim.x) a.group_sizes[l] = 0;
    for (int e = threadIdx.x; e < ctx.s.num_experts; e += blockDim.x) a.expert_counts[e] = 0;
  }
}



// A block per arrived token (a warp per slot), up to two per SM (every block also redoes the histogram over all
// arrivals); at least enough blocks for the -1 / padding sweep over capacity.
inline int dispatch_recv_blocks(const Sizes& s) {
  return std::max(blocks_for(s.num_dp * s.max_tokens, 1, 2 * s.sm_count), blocks_for(s.capacity, kThreads, s.sm_count));
}

}  // namespace jmc
