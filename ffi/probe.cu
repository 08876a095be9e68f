// The protocol's floor, for the bench's `floor` backend (jax_moe_comm/bench.py): one cooperative kernel that stores
// x's bytes into the next rank's landing region (NVLink stores), fences, SETs that rank's probe word to this call's
// epoch, waits for its own word from the previous rank and copies what landed into out. No routing, no layout, no
// protocol-order check: what one direction of any round trip must at least do on this machine (a launch, the bytes
// on the link, a fence, a signal and its wait, the bytes into an XLA buffer), timed under the same XLA chain as the
// real calls. A MoEComm used for probes carries no round trips (the landing region is its pre-reduced partial rows).
// Nor does a probe wait before reusing the peer's landing region: in a chain, the next probe's stores may reach the
// peer while it still copies the last one's bytes out. Its result is then not the bytes sent (the bench checks none),
// and the time stays a lower bound: a real protocol's handshake for that reuse is work the probe leaves out.
#include <algorithm>

#include "device_common.cuh"

namespace jmc {
namespace {

__global__ void probe_kernel(Context ctx, const int4* x, int4* out, long long words, int32_t* status) {
  const Sizes& s = ctx.s;
  if (blockIdx.x == 0 && threadIdx.x < kStatusWords) status[threadIdx.x] = 0;  // before any block can report
  const int next = (s.rank + 1) % s.world, prev = (s.rank + s.world - 1) % s.world;
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(ctx.probe_epoch) + 1;
  const size_t region = static_cast<size_t>(s.max_tokens) * s.combine_stride / 16;  // int4 words per source
  auto* landing = reinterpret_cast<int4*>(ctx.combine_partials);
  int4* to = peer_ptr(ctx, landing + s.rank * region, next);
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = first; i < words; i += stride) to[i] = x[i];
  __threadfence_system();  // this thread's stores reach the next rank before the signal
  if (last_block_done(ctx.probe_blocks) && threadIdx.x == 0) {
    __threadfence_system();
    signal_peer(ctx, ctx.probe_ready + s.rank, epoch, NVSHMEM_SIGNAL_SET, next);
  }
  if (threadIdx.x == 0) wait_at_least(ctx.probe_ready + prev, epoch, s, status, kCombineRecv, prev);
  __syncthreads();
  const int4* from = landing + prev * region;
  for (long long i = first; i < words; i += stride) out[i] = from[i];
  if (last_block_done(ctx.probe_blocks + 1) && threadIdx.x == 0) {  // every block has read the epoch and waited
    *ctx.probe_epoch = epoch;
    ctx.probe_blocks[0] = ctx.probe_blocks[1] = 0;
  }
}

}  // namespace

cudaError_t launch_probe(const Context& ctx, const void* x, void* out, long long bytes, int32_t* status,
                         cudaStream_t stream) {
  if (!ctx.p2p) return cudaErrorNotSupported;
  if (bytes % 16 != 0 || bytes > static_cast<long long>(ctx.s.max_tokens) * ctx.s.combine_stride)
    return cudaErrorInvalidValue;
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe_kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  long long words = bytes / 16;
  const int blocks = std::min(blocks_for(words, kThreads * 4, ctx.s.sm_count), std::max(per_sm, 1) * ctx.s.sm_count);
  Context c = ctx;
  auto* src = static_cast<const int4*>(x);
  auto* dst = static_cast<int4*>(out);
  void* params[] = {&c, &src, &dst, &words, &status};
  return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(probe_kernel), blocks, kThreads, params, 0, stream);
}

}  // namespace jmc
