// dispatch_recv: wait for every source's ready word, then fan the arrived tokens out to this rank's experts:
// expert_x is packed by (local expert, source DP group, token), each expert padded to `align`; write group_sizes
// and row_origin. Every block derives the whole layout from the ids rows (a histogram, or in the fused dispatch with
// many arrivals the blocks' histograms of their shares summed after a grid barrier, and a block scan), then copies
// the rows of its own contiguous share of the arrived tokens: where each lands follows from the tokens before it,
// counted in the same histogram pass (before the share) and in shared bit masks (inside it). The ready words are
// reset by combine_send, which the stream runs after every block here has read them.
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

// Arrivals per block from which the fused dispatch's blocks histogram their own shares only (one grid barrier)
// instead of every arrival each.
constexpr int kSplitHistogramShare = 16;

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

// The phase after its protocol-order check (dispatch_recv.cu), or right after the send in the fused dispatch
// (dispatch.cu). Dynamic shared memory: dispatch_recv_shared_bytes. `grid_may_wait`: every block of the grid is
// resident (a cooperative launch), so blocks may wait for each other (a grid barrier).
__device__ inline void receive_tokens(const Context& ctx, const DispatchRecvArgs& a, bool grid_may_wait) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kDispatchRecv);
  const int L = s.local_experts, G = s.num_dp, K = s.experts_per_token, first_local = s.rank * L;
  extern __shared__ int smem[];
  int* group_tokens = smem;                  // [G] tokens of each DP group
  int* group_first = group_tokens + G;       // [G + 1] arrival number of each group's first token
  int* count = group_first + G + 1;          // [L * G] rows of (local expert, group)
  int* before = count + L * G;               // [L * G] of those, from arrivals before this block's next batch
  int* expert_rows = before + L * G;         // [L] padded, then unpadded, rows per expert
  int* expert_start = expert_rows + L;       // [L + 1] packed start of each expert
  int* group_base = expert_start + L + 1;    // [L * G] packed start of (local expert, group)
  auto* hits = reinterpret_cast<unsigned*>(group_base + L * G);  // [L][kBitWords] the batch's tokens per expert

  // 1. Every source's token count (ready word = count + 1; 0 = not yet).
  for (int g = threadIdx.x; g < G; g += blockDim.x) group_tokens[g] = 0;
  for (int i = threadIdx.x; i < L * G; i += blockDim.x) count[i] = before[i] = 0;
  for (int i = threadIdx.x; i < L * kBitWords; i += blockDim.x) hits[i] = 0;
  __syncthreads();
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) {
    const bool ok = wait_at_least(ctx.dispatch_ready + src, 1, s, status, kDispatchRecv, src);
    const int n = ok ? static_cast<int>(*reinterpret_cast<volatile uint64_t*>(ctx.dispatch_ready + src)) - 1 : 0;
    atomicAdd(&group_tokens[src / s.dp_size], min(max(n, 0), s.slots_per_source));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    group_first[0] = 0;
    for (int g = 0; g < G; ++g) group_first[g + 1] = group_first[g] + group_tokens[g];
  }
  __syncthreads();
  mark(ctx, kDispatchRecv, kWaited);

  // Arrived tokens are numbered group by group; this block copies the rows of arrivals [share_begin, share_end).
  const int arrivals = group_first[G];
  const int share = (arrivals + gridDim.x - 1) / gridDim.x;
  const int share_begin = min(blockIdx.x * share, arrivals), share_end = min(share_begin + share, arrivals);
  auto group_of = [&](int i) {
    int g = 0;
    while (i >= group_first[g + 1]) ++g;
    return g;
  };
  auto ids_of_arrival = [&](int i, int g) { return ids_of(ctx, arrival_of(s, g, i - group_first[g])); };

  // 2. Rows per (local expert, group), and how many of them come from arrivals before this block's share: a
  //    histogram over the arrived tokens' ids (counts, hence deterministic), a thread per arrival. Rows of up to
  //    kUnrolledSlots ids: several in flight per thread, then counted from registers (a load per slot between the
  //    shared atomics made this pass ~50 us of the T=4096 dispatch). One shared atomic per row: rows before the
  //    share go to `before`, the others to `count`, which takes `before` in after the pass.
  //    Every block histograms every arrival, unless the grid may wait for itself (the fused dispatch: a cooperative
  //    launch) and the shares are large: then each block histograms its own share, publishes it (block_counts), and
  //    after a grid barrier sums the published counts, those of the blocks before it into `before` (every block
  //    redoing the whole histogram took ~30 us at R1 T=4096).
  auto tally = [&](int e, int g, bool early) {
    const int l = e - first_local;
    if (l < 0 || l >= L) return;  // an expert of another rank
    atomicAdd(early ? &before[l * G + g] : &count[l * G + g], 1);
  };
  const auto histogram = [&](int first, int last) {  // arrivals [first, last)
    if (K <= kUnrolledSlots) {
      constexpr int kRowsInFlight = 4;
      for (int base = first + threadIdx.x; base < last; base += kRowsInFlight * blockDim.x) {
        IdsRow rows[kRowsInFlight];
        int group[kRowsInFlight];
#pragma unroll
        for (int r = 0; r < kRowsInFlight; ++r) {
          const int i = base + r * blockDim.x;
          group[r] = i < last ? group_of(i) : 0;
          rows[r] = i < last ? load_ids_row(ids_of_arrival(i, group[r]), K) : load_ids_row(nullptr, 0);  // all -1
        }
#pragma unroll
        for (int r = 0; r < kRowsInFlight; ++r) {
          const unsigned live = live_mask(rows[r], s.num_experts);
#pragma unroll
          for (int k = 0; k < kUnrolledSlots; ++k)
            if (live >> k & 1u) tally(rows[r].id[k], group[r], base + r * blockDim.x < share_begin);
        }
      }
    } else {
      for (int i = first + threadIdx.x; i < last; i += blockDim.x) {
        const int g = group_of(i);
        const int32_t* ids = ids_of_arrival(i, g);
        for (int k = 0; k < K; ++k)
          if (slot_is_live(ids, k, s.num_experts)) tally(ids[k], g, i < share_begin);
      }
    }
  };
  if (grid_may_wait && ctx.block_counts != nullptr && arrivals >= kSplitHistogramShare * static_cast<int>(gridDim.x)) {
    histogram(share_begin, share_end);  // `count` only: nothing here is before the share
    __syncthreads();
    const int blocks = gridDim.x, stride = (blocks + 3) / 4 * 4;  // block_counts[(l, g)][block]
    for (int i = threadIdx.x; i < L * G; i += blockDim.x)
      ctx.block_counts[static_cast<size_t>(i) * stride + blockIdx.x] = count[i];
    __threadfence();
    cooperative_groups::this_grid().sync();
    for (int i = threadIdx.x; i < L * G; i += blockDim.x) {
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
      before[i] = early;
      count[i] = all;
    }
  } else {
    histogram(0, arrivals);
    __syncthreads();
    for (int i = threadIdx.x; i < L * G; i += blockDim.x) count[i] += before[i];
  }
  __syncthreads();
  mark(ctx, kDispatchRecv, kStep1);  // histogram done
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int rows = 0;
    for (int g = 0; g < G; ++g) rows += count[l * G + g];
    expert_rows[l] = (rows + s.align - 1) / s.align * s.align;
  }
  __syncthreads();
  block_exclusive_sum<Scan>(scan_temp, expert_rows, expert_start, L);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int base = expert_start[l];
    for (int g = 0; g < G; ++g) {
      group_base[l * G + g] = base;
      base += count[l * G + g];
    }
    expert_rows[l] = base - expert_start[l];
  }
  __syncthreads();
  const int packed_rows = expert_start[L];
  mark(ctx, kDispatchRecv, kStep2);  // layout derived (scans done)
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) a.group_sizes[l] = expert_start[l + 1] - expert_start[l];
    if (threadIdx.x == 0 && packed_rows > s.capacity)
      report(status, kCapacityOverflow, kDispatchRecv, packed_rows, s.capacity);
  }

  // 3. This block's share, a batch of blockDim arrivals at a time. A token's row for local expert l lands at
  //    group_base[l, g] + the rows for l of the group's earlier tokens: those before the batch (`before`) and
  //    those of the batch (bit masks). A warp per (token, slot) copies the row. The thread that reads a token's ids
  //    for the bits also notes its slots here (local_slots) and their experts (slot_expert, slots below
  //    kUnrolledSlots), so a copy starts with its row's loads: reading the ids again put an L2 round trip before
  //    every copy, and one more before every slot with no copy here.
  __shared__ unsigned local_slots[kThreads];
  __shared__ int16_t slot_expert[kThreads][kUnrolledSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int batch = share_begin; batch < share_end; batch += blockDim.x) {
    const int mine = batch + threadIdx.x;  // this thread's arrival: its bits
    unsigned here = 0;
    if (mine < share_end) {
      const int32_t* ids = ids_of_arrival(mine, group_of(mine));
      for (unsigned m = live_slots(ids, K, s.num_experts); m; m &= m - 1) {
        const int k = __ffs(m) - 1, l = ids[k] - first_local;
        if (l < 0 || l >= L) continue;  // an expert of another rank
        atomicOr(&hits[l * kBitWords + warp], 1u << lane);
        here |= 1u << k;
        if (k < kUnrolledSlots) slot_expert[threadIdx.x][k] = static_cast<int16_t>(l);
      }
    }
    local_slots[threadIdx.x] = here;
    __syncthreads();
    const int batch_tokens = min(static_cast<int>(blockDim.x), share_end - batch);
    for (int h = warp; h < batch_tokens * K; h += warps) {  // a warp per (token, slot) of the batch
      const int j = h / K, k = h % K, i = batch + j;
      if (!(local_slots[j] >> k & 1u)) continue;  // not live, or an expert of another rank
      const int g = group_of(i), t = i - group_first[g];
      const int l = k < kUnrolledSlots ? slot_expert[j][k] : ids_of_arrival(i, g)[k] - first_local;
      const int from = max(group_first[g] - batch, 0);  // the batch's first arrival of group g
      const int p = group_base[l * G + g] + before[l * G + g] + count_bits(hits + l * kBitWords, from, j);
      if (p >= s.capacity) continue;  // overflow: reported above, never written
      const Arrival src = arrival_of(s, g, t);
      const char* row = ctx.dispatch_slots + (static_cast<size_t>(src.src) * s.slots_per_source + src.slot) *
                                                 s.token_stride;
      warp_copy_pair(static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes, row, s.payload_bytes,
                     a.expert_scales + static_cast<size_t>(p) * s.scale_cols, row + scales_offset(s),
                     4 * s.scale_cols, lane);
      if (lane == 0) a.row_origin[p] = (g * s.max_tokens + t) * K + k;
    }
    __syncthreads();  // every warp has read `before` and the bits: the next batch counts on
    for (int i = threadIdx.x; i < L * G; i += blockDim.x) {
      const int l = i / G, g = i % G;
      const int from = max(group_first[g] - batch, 0);
      const int to = min(min(group_first[g + 1], share_end) - batch, static_cast<int>(blockDim.x));
      if (from < to) before[i] += count_bits(hits + l * kBitWords, from, to);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L * kBitWords; i += blockDim.x) hits[i] = 0;
    __syncthreads();
  }

  mark(ctx, kDispatchRecv, kWorked);

  // 4. Rows holding no token: origin -1 (a thread per row); alignment padding inside the packed region is zeroed.
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < s.capacity; p += gridDim.x * blockDim.x) {
    const int l = p < packed_rows ? find_run(expert_start, L, p) : L;
    if (l == L || p - expert_start[l] >= expert_rows[l]) a.row_origin[p] = -1;
  }
  if (s.align > 1) {
    const int gwarp = blockIdx.x * warps + warp, nwarps = gridDim.x * warps;
    for (int p = gwarp; p < packed_rows; p += nwarps) {
      const int l = find_run(expert_start, L, p);
      if (p - expert_start[l] < expert_rows[l]) continue;
      warp_zero(static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes, s.payload_bytes, lane);
      if (s.scale_cols) warp_zero(a.expert_scales + static_cast<size_t>(p) * s.scale_cols, 4 * s.scale_cols, lane);
    }
  }
  mark(ctx, kDispatchRecv, kClosed);
  if (finish_phase(ctx, kDispatchRecv, a.status)) mark(ctx, kDispatchRecv, kEnd, true);
}

// A refused receive (out of protocol order) still leaves a valid, empty layout: no row holds a token (row_origin
// -1) and no expert has rows. A combine given this handle then sends nothing, rather than reading row_origin's
// uninitialized memory as row addresses.
__device__ inline void receive_nothing(const Context& ctx, const DispatchRecvArgs& a) {
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < ctx.s.capacity; p += gridDim.x * blockDim.x)
    a.row_origin[p] = -1;
  if (blockIdx.x == 0)
    for (int l = threadIdx.x; l < ctx.s.local_experts; l += blockDim.x) a.group_sizes[l] = 0;
}

inline size_t dispatch_recv_shared_bytes(const Sizes& s) {
  const int L = s.local_experts, G = s.num_dp;
  return sizeof(int) * (2 * G + 1 + 3 * L * G + 2 * L + 1 + L * kBitWords);
}


// A block per arrived token (a warp per slot), up to two per SM (every block also redoes the histogram over all
// arrivals); at least enough blocks for the -1 / padding sweep over capacity.
inline int dispatch_recv_blocks(const Sizes& s) {
  return std::max(blocks_for(s.num_dp * s.max_tokens, 1, 2 * s.sm_count), blocks_for(s.capacity, kThreads, s.sm_count));
}

}  // namespace jmc
