// dispatch_recv: wait for every source's count, then for its rows; pack them by (local expert, source DP group,
// token) into expert_x at offsets every block derives from the counts; write group_sizes and row_origin. The
// counters are reset by combine_send, which the stream runs after every block here has read them.
#include <cub/block/block_scan.cuh>

#include "device_common.cuh"

namespace jmc {
namespace {

// Last index i in [0, n) with starts[i] <= value (starts ascending, starts[0] == 0).
__device__ inline int find_run(const int* starts, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ inline int token_of(const Context& ctx, size_t region, int n) {
  const char* row = ctx.dispatch_slots + (region * ctx.s.slots_per_region + n) * ctx.s.token_stride;
  return reinterpret_cast<const int32_t*>(row + header_offset(ctx.s))[0];
}

// Rows of `region` whose token index is < t (the region's tokens ascend).
__device__ inline int tokens_before(const Context& ctx, size_t region, int count, int t) {
  int lo = 0, hi = count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (token_of(ctx, region, mid) < t) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// out[i] = sum of in[j] for j < i, for i in [0, n], with the whole block (in smem or global, out in smem).
template <typename Scan>
__device__ void block_exclusive_sum(typename Scan::TempStorage& temp, const int* in, int* out, int n) {
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

__global__ void dispatch_recv_kernel(Context ctx, DispatchRecvArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kDispatchRecv);
  if (!in_protocol_order(ctx, kDispatchRecv)) {
    finish_phase(ctx, kDispatchRecv, a.status, false);
    return;
  }
  const int L = s.local_experts, W = s.world, regions = L * W;
  extern __shared__ int smem[];
  int* count = smem;                       // [L * W] rows from each (local expert, source rank)
  int* region_start = count + regions;     // [L * W + 1] flat prefix of count (rows in arrival order)
  int* expert_start = region_start + regions + 1;  // [L + 1] packed (aligned) start of each expert
  int* expert_rows = expert_start + L + 1; // [L] unpadded rows, then padded rows, per expert
  int* group_base = expert_rows + L;       // [L * num_dp] packed start of (expert, source group)

  // 1. Counts: every block waits for all of them (count + 1 arrives; 0 means not yet).
  for (int i = threadIdx.x; i < regions; i += blockDim.x) {
    const bool ok = wait_at_least(ctx.dispatch_count + i, 1, s, status, kDispatchRecv, i % W);
    const int c = ok ? static_cast<int>(*reinterpret_cast<volatile uint64_t*>(ctx.dispatch_count + i)) - 1 : 0;
    count[i] = min(max(c, 0), s.slots_per_region);
  }
  __syncthreads();
  // Regions are ordered (expert, source), so one prefix gives both the flat order and each expert's rows.
  block_exclusive_sum<Scan>(scan_temp, count, region_start, regions);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const int rows = region_start[(l + 1) * W] - region_start[l * W];
    expert_rows[l] = (rows + s.align - 1) / s.align * s.align;  // padded, for the prefix below
  }
  __syncthreads();
  block_exclusive_sum<Scan>(scan_temp, expert_rows, expert_start, L);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    expert_rows[l] = region_start[(l + 1) * W] - region_start[l * W];
    for (int g = 0; g < s.num_dp; ++g)
      group_base[l * s.num_dp + g] = expert_start[l] + region_start[l * W + g * s.dp_size] - region_start[l * W];
  }
  __syncthreads();
  const int packed_rows = expert_start[L];
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) a.group_sizes[l] = expert_start[l + 1] - expert_start[l];
    if (threadIdx.x == 0 && packed_rows > s.capacity)
      report(status, kCapacityOverflow, kDispatchRecv, packed_rows, s.capacity);
  }

  // 2. Rows: one warp per arrived row, in flat order; wait for its region (and its replicas') to land.
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int nwarps = gridDim.x * warps_per_block;
  for (int r = gwarp; r < region_start[regions]; r += nwarps) {
    const int region = find_run(region_start, regions, r);
    const int n = r - region_start[region];
    const int l = region / W, src = region % W, g = src / s.dp_size;
    bool landed = true;
    if (lane == 0) {
      for (int j = 0; j < s.dp_size; ++j) {
        const int peer_region = l * W + g * s.dp_size + j;
        landed &= wait_at_least(ctx.dispatch_arrived + peer_region, count[peer_region], s, status, kDispatchRecv,
                                g * s.dp_size + j);
      }
    }
    landed = __shfl_sync(0xffffffffu, landed, 0);
    if (!landed) continue;
    const char* row = ctx.dispatch_slots + (static_cast<size_t>(region) * s.slots_per_region + n) * s.token_stride;
    const int32_t* header = reinterpret_cast<const int32_t*>(row + header_offset(s));
    const int t = header[0];
    int pos = group_base[l * s.num_dp + g] + n;
    for (int j = 0; j < s.dp_size; ++j) {  // merge replicas' ascending token lists
      const int other = l * W + g * s.dp_size + j;
      if (other != region) pos += tokens_before(ctx, other, count[other], t);
    }
    if (pos >= s.capacity) continue;  // overflow: reported above, never written
    warp_copy(static_cast<char*>(a.expert_x) + static_cast<size_t>(pos) * s.payload_bytes, row, s.payload_bytes, lane);
    if (s.scale_cols)
      warp_copy(a.expert_scales + static_cast<size_t>(pos) * s.scale_cols, row + scales_offset(s), 4 * s.scale_cols,
                lane);
    if (lane == 0) {
      const int e = s.rank * L + l;
      int k = 0;
      while (k < s.experts_per_token - 1 && header[1 + k] != e) ++k;
      a.row_origin[pos] = (g * s.max_tokens + t) * s.experts_per_token + k;
    }
  }

  // 3. Rows holding no token: origin -1 (a thread per row); alignment padding inside the packed region is zeroed.
  // The counters are reset by combine_send, once every block of this kernel has read them.
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < s.capacity; p += gridDim.x * blockDim.x) {
    const int l = p < packed_rows ? find_run(expert_start, L, p) : L;
    if (l == L || p - expert_start[l] >= expert_rows[l]) a.row_origin[p] = -1;
  }
  if (s.align > 1) {
    for (int p = gwarp; p < packed_rows; p += nwarps) {
      const int l = find_run(expert_start, L, p);
      if (p - expert_start[l] < expert_rows[l]) continue;
      warp_zero(static_cast<char*>(a.expert_x) + static_cast<size_t>(p) * s.payload_bytes, s.payload_bytes, lane);
      if (s.scale_cols) warp_zero(a.expert_scales + static_cast<size_t>(p) * s.scale_cols, 4 * s.scale_cols, lane);
    }
  }
  finish_phase(ctx, kDispatchRecv, a.status);
}

}  // namespace

size_t dispatch_recv_shared_bytes(const Sizes& s) {
  const int regions = s.local_experts * s.world;
  return sizeof(int) * (2 * regions + 1 + 2 * s.local_experts + 1 + s.local_experts * s.num_dp);
}

cudaError_t launch_dispatch_recv(const Context& ctx, const DispatchRecvArgs& a, cudaStream_t stream) {
  const size_t shared = dispatch_recv_shared_bytes(ctx.s);
  if (shared > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(dispatch_recv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  // A warp per received row; blocks only wait on peers' sends, never on each other, so any grid is safe.
  const int blocks = blocks_for(ctx.s.capacity, kThreads / 32, 4 * ctx.s.sm_count);
  Context c = ctx;
  DispatchRecvArgs args = a;
  void* params[] = {&c, &args};
  return cudaLaunchKernel(reinterpret_cast<void*>(dispatch_recv_kernel), blocks, kThreads, params, shared, stream);
}

}  // namespace jmc
