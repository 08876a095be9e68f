// The protocol's floor, for the bench's `floor` backend (jax_moe_comm/bench.py): one cooperative kernel that stores
// x's bytes into the next rank's landing region (NVLink stores), fences, SETs that rank's probe word to this call's
// epoch, waits for its own word from the previous rank and copies what landed into out. No routing, no layout, no
// protocol-order check: what one direction of any round trip must at least do on this machine (a launch, the bytes
// on the link, a fence, a signal and its wait, the bytes into an XLA buffer), timed under the same XLA chain as the
// real calls. A MoEComm used for probes carries no round trips (the landing region is its pre-reduced partial rows).
// Nor does a probe wait before reusing the peer's landing region: in a chain, the next probe's stores may reach the
// peer while it still copies the last one's bytes out. Its result is then not the bytes sent (the bench checks none),
// and the time stays a lower bound: a real protocol's handshake for that reuse is work the probe leaves out.
// Compiled into the measurement build only (JAX_MOE_COMM_MEASUREMENT, which defines JMC_MEASUREMENT).
#include <algorithm>

#include "device_common.cuh"

namespace jmc {
namespace {

// Waits until *word >= value, or timeout_ns: then a kTimeout status naming `peer` (the probe's own: no protocol).
__device__ inline void probe_wait(const Context& ctx, uint64_t* word, uint64_t value, int32_t* status, int peer) {
  volatile uint64_t* v = word;
  const uint64_t deadline = now_ns() + ctx.s.timeout_ns;
  while (*v < value) {
    if (now_ns() > deadline) {
      if (atomicCAS(reinterpret_cast<int*>(status), 0, kTimeout) == 0) {
        status[kPhaseWord] = kCombineRecv;
        status[kRankWord] = ctx.s.rank;
        status[kDetailA] = peer;
        status[kDetailB] = ctx.s.rank;
      }
      return;
    }
    __nanosleep(32);
  }
  nvshmem_uint64_wait_until(word, NVSHMEM_CMP_GE, value);
}

__global__ void probe_kernel(Context ctx, const int4* x, int4* out, long long words, int32_t* status) {
  const Sizes& s = ctx.s;
  if (blockIdx.x == 0 && threadIdx.x < kStatusWords) status[threadIdx.x] = 0;  // before any block can report
  const int next = (s.rank + 1) % s.world, prev = (s.rank + s.world - 1) % s.world;
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&ctx.local->probe_epoch) + 1;
  const size_t region = static_cast<size_t>(s.max_tokens) * s.combine_stride / 16;  // int4 words per source
  auto* landing = reinterpret_cast<int4*>(ctx.combine_partials);
  int4* to = peer_ptr(ctx, landing + s.rank * region, next);
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = first; i < words; i += stride) to[i] = x[i];
  __threadfence_system();  // this thread's stores reach the next rank before the signal
  if (last_block_done(ctx.local->probe_blocks) && threadIdx.x == 0) {
    __threadfence_system();
    signal_peer(ctx, ctx.probe_ready + s.rank, epoch, next);
  }
  if (threadIdx.x == 0) probe_wait(ctx, ctx.probe_ready + prev, epoch, status, prev);
  __syncthreads();
  const int4* from = landing + prev * region;
  for (long long i = first; i < words; i += stride) out[i] = from[i];
  if (last_block_done(ctx.local->probe_blocks + 1) && threadIdx.x == 0) {  // every block has read the epoch, waited
    ctx.local->probe_epoch = epoch;
    ctx.local->probe_blocks[0] = ctx.local->probe_blocks[1] = 0;
  }
}

// The floor with flagged words (`flagged`): what a low-latency protocol would pay instead of the fence, the
// last-block count, the signal and its wait. Each 8-byte word carries 4 bytes of x and this call's epoch
// (store_flagged_pair), so the receiver polls the words themselves: a word whose flag has reached the epoch holds
// its data. Twice the bytes on the link. It lands in the combine slots (K times the partial rows' room). A flag past
// the epoch is the next call's word (the probe does not wait before reusing the peer's region, as above): taken
// too, as landed.
__global__ void probe_flagged_kernel(Context ctx, const uint2* x, uint2* out, long long pairs, int32_t* status) {
  const Sizes& s = ctx.s;
  if (blockIdx.x == 0 && threadIdx.x < kStatusWords) status[threadIdx.x] = 0;
  const int next = (s.rank + 1) % s.world, prev = (s.rank + s.world - 1) % s.world;
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&ctx.local->probe_epoch) + 1;
  auto* landing = reinterpret_cast<uint64_t*>(ctx.combine_slots);  // one source: the previous rank
  uint64_t* to = peer_ptr(ctx, landing, next);
  const long long first = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = first; i < pairs; i += stride) {
    const uint2 v = x[i];
    store_flagged_pair(to + 2 * i, tagged(epoch, v.x), tagged(epoch, v.y));
  }
  const uint64_t deadline = now_ns() + s.timeout_ns;
  for (long long i = first; i < pairs; i += stride) {
    ulonglong2 w = load_flagged_pair(landing + 2 * i);
    while ((w.x >> 32) < epoch || (w.y >> 32) < epoch) {
      if (now_ns() > deadline) {
        if (atomicCAS(reinterpret_cast<int*>(status), 0, kTimeout) == 0) {
          status[kPhaseWord] = kCombineRecv;
          status[kRankWord] = s.rank;
          status[kDetailA] = prev;
        }
        break;
      }
      w = load_flagged_pair(landing + 2 * i);
    }
    out[i] = make_uint2(static_cast<uint32_t>(w.x), static_cast<uint32_t>(w.y));
  }
  if (last_block_done(ctx.local->probe_blocks + 1) && threadIdx.x == 0) {  // every block has read the epoch
    ctx.local->probe_epoch = epoch;
    ctx.local->probe_blocks[0] = ctx.local->probe_blocks[1] = 0;
  }
}

}  // namespace

cudaError_t launch_probe(const Context& ctx, const void* x, void* out, long long bytes, int32_t* status,
                         bool flagged, cudaStream_t stream) {
  // The plain probe lands a source's bytes at [rank][max_tokens] rows of the combine rows ([max_tokens][K]): a
  // windowed context holds fewer.
  if (!ctx.p2p || windowed(ctx.s) || (!flagged && ctx.s.world > ctx.s.experts_per_token))
    return cudaErrorNotSupported;
  const long long room = static_cast<long long>(ctx.s.max_tokens) * ctx.s.combine_stride *
                         (flagged ? ctx.s.experts_per_token / 2 : 1);  // flagged: twice the bytes, in the slots
  if (bytes % 16 != 0 || bytes > room) return cudaErrorInvalidValue;
  void* kernel = flagged ? reinterpret_cast<void*>(probe_flagged_kernel) : reinterpret_cast<void*>(probe_kernel);
  int per_sm = 0;  // cooperative: every block reads the epoch before the last one advances it
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  long long items = flagged ? bytes / 8 : bytes / 16;  // 8-byte pairs of words, or 16-byte words
  const int blocks = within_budget(ctx.s, std::min(blocks_for(items, kThreads * 4, ctx.s.sm_count),
                                                    std::max(per_sm, 1) * ctx.s.sm_count));
  Context c = ctx;
  const void* src = x;
  void* dst = out;
  void* params[] = {&c, &src, &dst, &items, &status};
  return cudaLaunchCooperativeKernel(kernel, blocks, kThreads, params, 0, stream);
}

}  // namespace jmc
