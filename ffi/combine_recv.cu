// combine_recv: per token, wait until all its live slots have landed, sum w[t,k] * row(t,k) in fp32 in slot order,
// write the output row, reset the token's counter. Then the one global barrier: wait for every peer's sync flag
// (it has finished reading the dispatch buffers this rank writes next) and reset it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "device_common.cuh"

namespace jmc {
namespace {



__device__ inline float load_elem(const char* row, int h, int dtype) {
  switch (dtype) {
    case 0: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[h]);
    case 1: return __half2float(reinterpret_cast<const __half*>(row)[h]);
    default: return reinterpret_cast<const float*>(row)[h];
  }
}

__device__ inline void store_elem(void* out, size_t i, float v, int dtype) {
  switch (dtype) {
    case 0: reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(v); break;
    case 1: reinterpret_cast<__half*>(out)[i] = __float2half(v); break;
    default: reinterpret_cast<float*>(out)[i] = v;
  }
}

__global__ void combine_recv_kernel(Context ctx, CombineRecvArgs a) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token;
  const int lane = threadIdx.x % 32;
  const int warps_per_block = blockDim.x / 32;
  const int gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int nwarps = gridDim.x * warps_per_block;
  const int num_tokens = min(max(*a.num_tokens, 0), s.max_tokens);

  for (int t = gwarp; t < s.max_tokens; t += nwarps) {
    const size_t out_row = static_cast<size_t>(t) * s.hidden;
    if (t >= num_tokens) {
      for (int h = lane; h < s.hidden; h += 32) store_elem(a.out, out_row + h, 0.f, a.out_dtype);
      continue;
    }
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    unsigned live_mask = 0;
    int first_remote_peer = s.rank;
    for (int k = 0; k < K; ++k) {
      if (!slot_is_live(ids, k, s.num_experts)) continue;
      live_mask |= 1u << k;
      if (first_remote_peer == s.rank) first_remote_peer = ids[k] / s.local_experts;
    }
    const int live = __popc(live_mask);
    bool landed = true;
    if (lane == 0)
      landed = wait_at_least(ctx.combine_arrived + t, live, s, a.status, kCombineRecv, first_remote_peer);
    landed = __shfl_sync(0xffffffffu, landed, 0);
    const char* slots = ctx.combine_slots + static_cast<size_t>(t) * K * s.combine_stride;
    for (int h = lane; h < s.hidden; h += 32) {
      float acc = 0.f;
      if (landed) {
        for (unsigned m = live_mask; m; m &= m - 1) {  // slots in order 0..K-1, like the reference
          const int k = __ffs(m) - 1;
          acc += a.topk_weights[static_cast<size_t>(t) * K + k] *
                 load_elem(slots + static_cast<size_t>(k) * s.combine_stride, h, a.in_dtype);
        }
      }
      store_elem(a.out, out_row + h, acc, a.out_dtype);
    }
    __syncwarp();
    if (lane == 0) ctx.combine_arrived[t] = 0;
  }

  // The global barrier (block 0, one thread per peer), after this block's tokens.
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x < s.world && threadIdx.x != s.rank) {
    if (wait_at_least(ctx.sync_flags + threadIdx.x, 1, s, a.status, kCombineRecv, threadIdx.x))
      ctx.sync_flags[threadIdx.x] = 0;
  }
}

}  // namespace

cudaError_t launch_combine_recv(const Context& ctx, const CombineRecvArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.status, 0, kStatusWords * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  combine_recv_kernel<<<ctx.s.num_blocks, ctx.s.threads, 0, stream>>>(ctx, a);
  return cudaGetLastError();
}

}  // namespace jmc
