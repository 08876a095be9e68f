// dispatch_recv: wait for every source's ready word, then fan the arrived tokens out to this rank's experts:
// expert_x is packed by (local expert, source DP group, token), each expert padded to `align`; write group_sizes
// and row_origin. Every block derives the whole layout from the ids rows (a histogram and two block scans), then
// fills the (local expert, group) runs it owns. The ready words are reset by combine_send, which the stream runs
// after every block here has read them.
#pragma once

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

// The slot k of token `ids` that selects local expert l of this rank (the first with that id: live), else -1.
__device__ inline int slot_for_local_expert(const Sizes& s, const int32_t* ids, int l) {
  return first_slot_of(ids, s.experts_per_token, s.rank * s.local_experts + l);
}

// The phase after its protocol-order check (dispatch_recv.cu), or right after the send in the fused dispatch
// (dispatch.cu). Dynamic shared memory: dispatch_recv_shared_bytes.
__device__ inline void receive_tokens(const Context& ctx, const DispatchRecvArgs& a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  __shared__ int hit_token[kThreads], hit_slot[kThreads];
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kDispatchRecv);
  const int L = s.local_experts, G = s.num_dp, K = s.experts_per_token;
  extern __shared__ int smem[];
  int* group_tokens = smem;                  // [G] tokens of each DP group
  int* count = group_tokens + G;             // [L * G] rows of (local expert, group)
  int* expert_rows = count + L * G;          // [L] padded, then unpadded, rows per expert
  int* expert_start = expert_rows + L;       // [L + 1] packed start of each expert
  int* group_base = expert_start + L + 1;    // [L * G] packed start of (local expert, group)

  // 1. Every source's token count (ready word = count + 1; 0 = not yet).
  for (int g = threadIdx.x; g < G; g += blockDim.x) group_tokens[g] = 0;
  for (int i = threadIdx.x; i < L * G; i += blockDim.x) count[i] = 0;
  __syncthreads();
  for (int src = threadIdx.x; src < s.world; src += blockDim.x) {
    const bool ok = wait_at_least(ctx.dispatch_ready + src, 1, s, status, kDispatchRecv, src);
    const int n = ok ? static_cast<int>(*reinterpret_cast<volatile uint64_t*>(ctx.dispatch_ready + src)) - 1 : 0;
    atomicAdd(&group_tokens[src / s.dp_size], min(max(n, 0), s.slots_per_source));
  }
  __syncthreads();
  mark(ctx, kDispatchRecv, kWaited);

  // 2. Rows per (local expert, group): a histogram over every arrived token's ids (counts, hence deterministic), a
  //    thread per arrived token (numbered group by group).
  int arrivals = 0;
  for (int g = 0; g < G; ++g) arrivals += group_tokens[g];
  for (int i = threadIdx.x; i < arrivals; i += blockDim.x) {
    int g = 0, t = i;
    while (t >= group_tokens[g]) t -= group_tokens[g++];
    const int32_t* ids = ids_of(ctx, arrival_of(s, g, t));
    for (unsigned m = live_slots(ids, K, s.num_experts); m; m &= m - 1) {
      const int e = ids[__ffs(m) - 1];
      if (e / L == s.rank) atomicAdd(&count[(e % L) * G + g], 1);
    }
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

  // 3. A block per (local expert, group) run: its tokens in index order (a block scan per batch), copied by warps.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int run = blockIdx.x; run < L * G; run += gridDim.x) {
    const int l = run / G, g = run % G;
    int n = 0;
    for (int base = 0; base < group_tokens[g]; base += blockDim.x) {
      const int t = base + threadIdx.x;
      const int k = t < group_tokens[g] ? slot_for_local_expert(s, ids_of(ctx, arrival_of(s, g, t)), l) : -1;
      int pos, total;
      Scan(scan_temp).ExclusiveSum(k >= 0 ? 1 : 0, pos, total);
      if (k >= 0) {
        hit_token[pos] = t;
        hit_slot[pos] = k;
      }
      __syncthreads();
      for (int h = warp; h < total; h += warps) {
        const int t_h = hit_token[h], p = group_base[l * G + g] + n + h;
        if (p >= s.capacity) continue;  // overflow: reported above, never written
        const Arrival from = arrival_of(s, g, t_h);
        const char* row = ctx.dispatch_slots +
                          (static_cast<size_t>(from.src) * s.slots_per_source + from.slot) * s.token_stride;
        warp_copy(static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes, row, s.payload_bytes,
                  lane);
        if (s.scale_cols)
          warp_copy(a.expert_scales + static_cast<size_t>(p) * s.scale_cols, row + scales_offset(s),
                    4 * s.scale_cols, lane);
        if (lane == 0) a.row_origin[p] = (g * s.max_tokens + t_h) * K + hit_slot[h];
      }
      n += total;
      __syncthreads();  // hit lists and scan_temp are reused by the next batch
    }
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
  return sizeof(int) * (G + 2 * L * G + 2 * L + 1);
}


// A block per (local expert, DP group) run, at least enough blocks for the -1 / padding sweep over capacity.
inline int dispatch_recv_blocks(const Sizes& s) {
  return std::max(blocks_for(s.local_experts * s.num_dp, 1, 8 * s.sm_count),
                  blocks_for(s.capacity, kThreads, s.sm_count));
}

}  // namespace jmc
