// Device helpers shared by the four kernel phases: bounded waits, warp copies, status reporting, routing rules.
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "context.h"

namespace jmc {

__device__ inline uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Symmetric `ptr` as rank pe's copy of it, mapped here through NVLink (Context::p2p): an offset read from the kernel's
// parameters, where nvshmem_ptr loads NVSHMEM's device state from memory (dispatch_send's first row at R1 T=1: 7.2
// -> 6.6 us in the step marks, benchmarks/NOTES.md entry 14).
template <typename T>
__device__ inline T* peer_ptr(const Context& ctx, T* ptr, int pe) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(ptr) + ctx.peer_offset[pe]);
}

// SETs or ADDs to rank pe's copy of a signal word. On NVLink (Context::p2p) a volatile store or a system-scope atomic
// through peer_ptr, as nvshmemx_signal_op does there, without its first step: a load of the peer's heap base from
// NVSHMEM's device state (a dependent load, ~0.35 us on a kernel's first pass: benchmarks/NOTES.md, entry 14). The
// caller fences first, as with nvshmemx_signal_op.
__device__ inline void signal_peer(const Context& ctx, uint64_t* word, uint64_t value, int op, int pe) {
  if (!ctx.p2p) return nvshmemx_signal_op(word, value, op, pe);
  uint64_t* dest = peer_ptr(ctx, word, pe);
  if (op == NVSHMEM_SIGNAL_SET)
    *reinterpret_cast<volatile uint64_t*>(dest) = value;
  else
    atomicAdd_system(reinterpret_cast<unsigned long long*>(dest), value);
}

// A source's dispatch ready word: its token count + 1 in the low half (0: not yet) once its ids rows have landed,
// with kRowsLanded set once its rows have too (on the ids-first dispatch, dispatch.cu, a second SET; otherwise one
// SET of count + 1 says both).
constexpr uint64_t kRowsLanded = 1ull << 32;
__device__ inline int token_count(uint64_t ready) { return static_cast<int>(ready & 0xffffffffu) - 1; }

// Records the first error of a call into status (the phase's scratch words); later errors keep the first.
__device__ inline void report(int32_t* status, int32_t code, int32_t phase, int32_t a, int32_t b) {
  if (atomicCAS(reinterpret_cast<int*>(&status[0]), 0, code) == 0) {
    status[1] = phase;
    status[2] = a;
    status[3] = b;
  } else {
    atomicOr(reinterpret_cast<int*>(&status[0]), code);
  }
}

// Waits until *word >= value. Polls the local word with plain volatile loads so the wait can give up after
// timeout_ns (reporting kTimeout naming `peer`); once satisfied, nvshmem_uint64_wait_until (which then returns
// at once) gives the memory ordering that makes the signalled payload visible.
__device__ inline bool wait_at_least(uint64_t* word, uint64_t value, const Sizes& s, int32_t* status,
                                     Phase phase, int peer) {
  volatile uint64_t* v = word;
  if (*v < value) {
    const uint64_t deadline = now_ns() + s.timeout_ns;
    while (*v < value) {
      if (now_ns() > deadline) {
        report(status, kTimeout, phase, peer, s.rank);
        return false;
      }
      __nanosleep(32);
    }
  }
  nvshmem_uint64_wait_until(word, NVSHMEM_CMP_GE, value);
  return true;
}

// True if slot k of a token routes somewhere: a valid id not repeated in an earlier slot.
__device__ inline bool slot_is_live(const int32_t* ids, int k, int num_experts) {
  const int e = ids[k];
  if (e < 0 || e >= num_experts) return false;
  for (int j = 0; j < k; ++j)
    if (ids[j] == e) return false;
  return true;
}

// A token's ids row in registers (rows of up to kUnrolledSlots; -1 past K), its loads in flight together: slot by
// slot, the repeat check made ~K^2/2 dependent loads, several microseconds per token at K = 8 even from L1.
constexpr int kUnrolledSlots = 8;
struct IdsRow {
  int id[kUnrolledSlots];
};
__device__ inline IdsRow load_ids_row(const int32_t* ids, int K) {
  IdsRow row;
#pragma unroll
  for (int k = 0; k < kUnrolledSlots; ++k) row.id[k] = k < K ? ids[k] : -1;
  return row;
}

// The live slots of a row in registers, as a bit mask (bit k: slot_is_live(ids, k)), compared in registers.
__device__ inline unsigned live_mask(const IdsRow& row, int num_experts) {
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < kUnrolledSlots; ++k) {
    bool live = row.id[k] >= 0 && row.id[k] < num_experts;
#pragma unroll
    for (int j = 0; j < k; ++j) live = live && row.id[j] != row.id[k];
    mask |= live ? 1u << k : 0u;
  }
  return mask;
}

// The live slots of a token's ids row, as a bit mask (bit k: slot_is_live(ids, k)). Longer rows than
// kUnrolledSlots walk slot by slot.
__device__ inline unsigned live_slots(const int32_t* ids, int K, int num_experts) {
  if (K <= kUnrolledSlots) return live_mask(load_ids_row(ids, K), num_experts);
  unsigned mask = 0;
  for (int k = 0; k < K; ++k) mask |= slot_is_live(ids, k, num_experts) ? 1u << k : 0u;
  return mask;
}

// 16-byte loads each lane has in flight before it stores them: 16 covers an R1 fp8 row (7,168 bytes) in one pass.
constexpr int kCopyDepth = 16;

// Warp-cooperative copy: 16-byte words when both ends are 16-byte aligned, then a byte tail. Each lane loads
// kCopyDepth words before storing any (the compiler may not reorder a load past a store that could alias it), so
// a row is not copied at the pace of one memory round trip per 512 bytes.
__device__ inline void warp_copy(void* dst, const void* src, int bytes, int lane) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
  const int vecs = aligned ? bytes / 16 : 0;
  auto* d4 = reinterpret_cast<int4*>(dst);
  auto* s4 = reinterpret_cast<const int4*>(src);
  for (int base = 0; base < vecs; base += 32 * kCopyDepth) {
    int4 words[kCopyDepth];
#pragma unroll
    for (int j = 0; j < kCopyDepth; ++j) {
      const int i = base + j * 32 + lane;
      if (i < vecs) words[j] = s4[i];
    }
#pragma unroll
    for (int j = 0; j < kCopyDepth; ++j) {
      const int i = base + j * 32 + lane;
      if (i < vecs) d4[i] = words[j];
    }
  }
  auto* d = reinterpret_cast<char*>(dst);
  auto* s = reinterpret_cast<const char*>(src);
  for (int i = vecs * 16 + lane; i < bytes; i += 32) d[i] = s[i];
}

// A row's payload and scales held by a warp in registers, 16-byte words: up to kCopyDepth per lane of the payload
// and one of the scales (R1's fp8 rows and V2-Lite's bf16 ones fit). Loaded in one pass, so every load is in
// flight before any store (a load may not pass a store that could alias it), and storable to several places.
struct RowInRegisters {
  int4 words[kCopyDepth];
  int4 scale_word;
  // Whether rows of these sizes fit, given the addresses involved OR-ed together (all must be 16-byte aligned).
  __device__ static bool fits(uintptr_t addresses, int payload_bytes, int scale_bytes) {
    return ((addresses | payload_bytes | scale_bytes) & 15) == 0 && payload_bytes / 16 <= 32 * kCopyDepth &&
           scale_bytes / 16 <= 32;
  }
  __device__ void load(const void* payload, int payload_bytes, const void* scales, int scale_bytes, int lane) {
    scale_word = make_int4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < kCopyDepth; ++j)
      if (j * 32 + lane < payload_bytes / 16) words[j] = static_cast<const int4*>(payload)[j * 32 + lane];
    if (lane < scale_bytes / 16) scale_word = static_cast<const int4*>(scales)[lane];
  }
  __device__ void store(void* payload, int payload_bytes, void* scales, int scale_bytes, int lane) const {
#pragma unroll
    for (int j = 0; j < kCopyDepth; ++j)
      if (j * 32 + lane < payload_bytes / 16) static_cast<int4*>(payload)[j * 32 + lane] = words[j];
    if (lane < scale_bytes / 16) static_cast<int4*>(scales)[lane] = scale_word;
  }
};

// Two warp_copy's (a row's payload and its scales) with the loads of both in flight before any store, when they fit
// a RowInRegisters; otherwise one after the other.
__device__ inline void warp_copy_pair(void* dst, const void* src, int bytes, void* dst2, const void* src2, int bytes2,
                                      int lane) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                              reinterpret_cast<uintptr_t>(dst2) | reinterpret_cast<uintptr_t>(src2);
  if (!RowInRegisters::fits(addresses, bytes, bytes2)) {
    warp_copy(dst, src, bytes, lane);
    if (bytes2 > 0) warp_copy(dst2, src2, bytes2, lane);
    return;
  }
  RowInRegisters row;
  row.load(src, bytes, src2, bytes2, lane);
  row.store(dst, bytes, dst2, bytes2, lane);
}

// Zeroes a row, in 16-byte words when dst is 16-byte aligned (padding rows of an unaligned row size are not).
__device__ inline void warp_zero(void* dst, int bytes, int lane) {
  const int vecs = (reinterpret_cast<uintptr_t>(dst) & 15) == 0 ? bytes / 16 : 0;
  auto* d4 = reinterpret_cast<int4*>(dst);
  for (int i = lane; i < vecs; i += 32) d4[i] = make_int4(0, 0, 0, 0);
  auto* d = reinterpret_cast<char*>(dst);
  for (int i = vecs * 16 + lane; i < bytes; i += 32) d[i] = 0;
}

// True in exactly one block, the last to get here; every block's earlier writes are visible to it.
__device__ inline bool last_block_done(unsigned* counter) {
  __shared__ bool last;
  __threadfence();  // this thread's writes (and reads) are done before the block counts as finished
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  return last;
}

// A kernel mark (when enabled: ctx.marks): block 0's thread 0 stamps it; `last` stamps it in any block (the
// caller is the last block). One branch on a null pointer otherwise.
__device__ inline void mark(const Context& ctx, Phase phase, Mark point, bool last = false) {
  if (ctx.marks != nullptr && threadIdx.x == 0 && (last || blockIdx.x == 0))
    ctx.marks[phase * kMarks + point] = now_ns();
}

// Where a phase's kernel records errors while it runs.
__device__ inline int32_t* phase_status(const Context& ctx, Phase phase) {
  return ctx.status_scratch + phase * kStatusWords;
}

// Called by every thread at the end of a phase's kernel: the last block to finish copies the errors recorded by
// all blocks to the call's status output, clears the scratch for the next call and, with `advance`, moves the
// protocol on (not when the phase did not run; nor after a fused kernel's send: its receive moves it on past both
// phases, so no two blocks' writes of next_phase race). Returns true in that block.
__device__ inline bool finish_phase(const Context& ctx, Phase phase, int32_t* out, bool advance = true) {
  if (!last_block_done(ctx.blocks_done + phase)) return false;
  mark(ctx, phase, kAllDone, true);
  volatile int32_t* scratch = phase_status(ctx, phase);
  if (threadIdx.x < kStatusWords) {
    out[threadIdx.x] = scratch[threadIdx.x];
    scratch[threadIdx.x] = 0;
  }
  if (threadIdx.x == 0) {
    ctx.blocks_done[phase] = 0;
    if (advance) *ctx.next_phase = (phase + 1) % kPhases;
  }
  return true;
}

// Called by every thread at the start of a phase's kernel: true when this MoEComm's protocol expects `phase` now
// (one round trip at a time: dispatch_send, dispatch_recv, combine_send, combine_recv). Otherwise it reports
// kOutOfOrder and finishes the phase without running it; the kernel then returns at once (no waits, and no writes
// but an empty layout from a refused receive: see receive_nothing), so interleaved round trips on one buffer set
// fail with a message instead of hanging or mixing rows. Every block reads
// the same value: only the last block of the kernel advances it (finish_phase), after all have read it.
__device__ inline bool begin_phase(const Context& ctx, Phase phase, int32_t* out) {
  mark(ctx, phase, kStart);
  const int32_t expected = *reinterpret_cast<volatile int32_t*>(ctx.next_phase);
  if (expected == phase) return true;
  if (blockIdx.x == 0 && threadIdx.x == 0) report(phase_status(ctx, phase), kOutOfOrder, phase, expected, phase);
  finish_phase(ctx, phase, out, false);
  return false;
}

// Blocks for `work` items at `per_block` items each, at least 1 and at most `cap`.
inline int blocks_for(long long work, int per_block, int cap) {
  const long long b = (work + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

// Launch helpers (host side), one per phase and one per fused direction; each returns the CUDA error of its launch.
struct DispatchSendArgs {
  const void* x; const float* scales; const int32_t* topk_ids; const int32_t* num_tokens; int32_t* status;
  const float* topk_weights = nullptr;  // [T, K] the combine's weights, given to dispatch (NVLink path): stored with
                                        // the ids rows into every rank's combine_weights (null: none)
};
struct DispatchRecvArgs {
  void* expert_x; float* expert_scales; int32_t* group_sizes; int32_t* row_origin; int32_t* status;
};
struct CombineSendArgs {
  const void* expert_y; int elem_bytes; const int32_t* row_origin; int32_t* status;
  const float* topk_weights;  // [T, K] this rank's weights: pre-reduce (null: send rows per slot)
  int in_dtype, partial_dtype;  // dtype codes of expert_y and of the partial rows (pre-reduced only)
  bool weights_sent = false;    // the round trip's dispatch stored the weights everywhere: no exchange here
};
struct CombineRecvArgs {
  const int32_t* topk_ids; const float* topk_weights; const int32_t* num_tokens; void* out;
  int in_dtype, out_dtype; int32_t* status;  // dtype codes: 0 bf16, 1 fp16, 2 fp32
  bool reduced;  // the rows arrived pre-reduced (one per expert rank, in_dtype the partial dtype)
};

cudaError_t launch_dispatch_send(const Context& ctx, const DispatchSendArgs& a, cudaStream_t stream);
cudaError_t launch_dispatch_recv(const Context& ctx, const DispatchRecvArgs& a, cudaStream_t stream);
cudaError_t launch_combine_send(const Context& ctx, const CombineSendArgs& a, cudaStream_t stream);
cudaError_t launch_combine_recv(const Context& ctx, const CombineRecvArgs& a, cudaStream_t stream);
// The fused halves (NVLink path only, else cudaErrorNotSupported): one cooperative kernel per direction.
cudaError_t launch_dispatch(const Context& ctx, const DispatchSendArgs& send, const DispatchRecvArgs& recv,
                            cudaStream_t stream);
cudaError_t launch_combine(const Context& ctx, const CombineSendArgs& send, const CombineRecvArgs& recv,
                           cudaStream_t stream);
// The bench's floor (probe.cu, NVLink path only): bytes of x to the next rank, the previous rank's into out;
// `flagged`: in words that carry their own validity instead of a fence and a signal.
cudaError_t launch_probe(const Context& ctx, const void* x, void* out, long long bytes, int32_t* status,
                         bool flagged, cudaStream_t stream);

}  // namespace jmc
