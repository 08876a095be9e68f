// combine_recv: y[t] = sum over live slots k (in slot order) of w[t,k] * row(t,k), accumulated in fp32.
// Each thread owns kChunk consecutive columns of one token row and waits for that token's live slots itself, so
// every SM works even when one token is live (a warp per token walked 7168 columns serially: ~750 us). The last
// block to finish resets the arrival counters. Then the one global barrier: wait for every
// peer's sync flag (it has finished reading the dispatch buffers this rank writes next) and reset it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "device_common.cuh"

namespace jmc {
namespace {

constexpr int kChunk = 8;      // columns per thread: one 16-byte load of bf16/fp16 rows
constexpr int kSlotBatch = 4;  // slots whose chunks a thread loads before it adds them (loads in flight)

__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(float v) { return v; }
template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ inline __half from_float(float v) { return __float2half(v); }
template <> __device__ inline float from_float(float v) { return v; }

// kChunk elements of type T as raw 16-byte words (sizeof(T) * kChunk is 16 or 32 bytes).
template <typename T>
struct alignas(16) Chunk {
  T v[kChunk];
};

template <typename In, typename Out>
__global__ void combine_recv_kernel(Context ctx, CombineRecvArgs a) {
  const Sizes& s = ctx.s;
  int32_t* status = phase_status(ctx, kCombineRecv);
  if (!begin_phase(ctx, kCombineRecv, a.status)) return;
  const int K = s.experts_per_token;
  const int num_tokens = min(max(*a.num_tokens, 0), s.max_tokens);
  const int chunks_per_row = (s.hidden + kChunk - 1) / kChunk;
  // Whole-chunk vector loads/stores need every row start 16-byte aligned (slot rows are; output rows need this).
  const bool vector_ok = s.hidden % kChunk == 0 && (s.hidden * sizeof(Out)) % 16 == 0;
  const size_t items = static_cast<size_t>(s.max_tokens) * chunks_per_row;

  for (size_t item = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(item / chunks_per_row);
    const int c0 = static_cast<int>(item % chunks_per_row) * kChunk;
    const int cols = min(kChunk, s.hidden - c0);
    float acc[kChunk] = {};
    if (t < num_tokens) {
      const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
      unsigned live_mask = 0;
      int first_remote_peer = s.rank;
      for (int k = 0; k < K; ++k) {
        if (!slot_is_live(ids, k, s.num_experts)) continue;
        live_mask |= 1u << k;
        const int peer = ids[k] / s.local_experts;
        if (first_remote_peer == s.rank) first_remote_peer = peer;
      }
      if (wait_at_least(ctx.combine_arrived + t, __popc(live_mask), s, status, kCombineRecv, first_remote_peer)) {
        const char* slots = ctx.combine_slots + static_cast<size_t>(t) * K * s.combine_stride;
        const float* weights = a.topk_weights + static_cast<size_t>(t) * K;
        const auto is_live = [&](int k) { return k < K && (live_mask >> k & 1u); };
        const auto row_of = [&](int k) {
          return reinterpret_cast<const In*>(slots + static_cast<size_t>(k) * s.combine_stride) + c0;
        };
        if (vector_ok) {  // kSlotBatch slots' chunks loaded before any is added; slots still added in order
          for (int k0 = 0; k0 < K; k0 += kSlotBatch) {
            Chunk<In> v[kSlotBatch];
#pragma unroll
            for (int b = 0; b < kSlotBatch; ++b)
              if (is_live(k0 + b)) v[b] = *reinterpret_cast<const Chunk<In>*>(row_of(k0 + b));
#pragma unroll
            for (int b = 0; b < kSlotBatch; ++b) {
              if (!is_live(k0 + b)) continue;
              const float w = weights[k0 + b];
#pragma unroll
              for (int j = 0; j < kChunk; ++j) acc[j] += w * to_float(v[b].v[j]);
            }
          }
        } else {
          for (unsigned m = live_mask; m; m &= m - 1) {  // slots in order 0..K-1, like the reference
            const int k = __ffs(m) - 1;
            for (int j = 0; j < cols; ++j) acc[j] += weights[k] * to_float(row_of(k)[j]);
          }
        }
      }
    }
    Out* out = static_cast<Out*>(a.out) + static_cast<size_t>(t) * s.hidden + c0;
    if (vector_ok) {
      Chunk<Out> v;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v.v[j] = from_float<Out>(acc[j]);
      *reinterpret_cast<Chunk<Out>*>(out) = v;
    } else {
      for (int j = 0; j < cols; ++j) out[j] = from_float<Out>(acc[j]);
    }
  }

  // The global barrier (block 0, one thread per peer).
  if (blockIdx.x == 0 && threadIdx.x < s.world && threadIdx.x != s.rank) {
    if (wait_at_least(ctx.sync_flags + threadIdx.x, 1, s, status, kCombineRecv, threadIdx.x))
      ctx.sync_flags[threadIdx.x] = 0;
  }

  // Every block has read its tokens' counters: the last one resets them for the next round trip (peers add to
  // them again only after our next dispatch_send, which the stream runs after this kernel).
  if (finish_phase(ctx, kCombineRecv, a.status)) {
    for (int t = threadIdx.x; t < s.max_tokens; t += blockDim.x) ctx.combine_arrived[t] = 0;
  }
}

template <typename In>
void* kernel_for_out(int out_dtype) {
  switch (out_dtype) {
    case 0: return reinterpret_cast<void*>(combine_recv_kernel<In, __nv_bfloat16>);
    case 1: return reinterpret_cast<void*>(combine_recv_kernel<In, __half>);
    default: return reinterpret_cast<void*>(combine_recv_kernel<In, float>);
  }
}

void* kernel_for(int in_dtype, int out_dtype) {
  switch (in_dtype) {
    case 0: return kernel_for_out<__nv_bfloat16>(out_dtype);
    case 1: return kernel_for_out<__half>(out_dtype);
    default: return kernel_for_out<float>(out_dtype);
  }
}

}  // namespace

cudaError_t launch_combine_recv(const Context& ctx, const CombineRecvArgs& a, cudaStream_t stream) {
  const size_t items = static_cast<size_t>(ctx.s.max_tokens) * ((ctx.s.hidden + kChunk - 1) / kChunk);
  Context c = ctx;
  CombineRecvArgs args = a;
  void* params[] = {&c, &args};
  return cudaLaunchKernel(kernel_for(a.in_dtype, a.out_dtype), blocks_for(items, kThreads, 8 * ctx.s.sm_count),
                          kThreads, params, 0, stream);
}

}  // namespace jmc
