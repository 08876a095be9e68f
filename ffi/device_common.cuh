// Device helpers shared by the four kernel phases: bounded waits, warp copies, status reporting, routing rules.
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "context.h"

namespace jmc {

// The failure paths run rarely and are not inlined (inlined at every wait they raised the kernels' register use to
// spilling). They read the context from its copy in device memory (Context::on_device): a kernel's parameter passed
// by reference to a call would first be copied to the stack. Each has an inline wrapper of the same name without
// the suffix, taking the kernel's context.
#define JMC_COLD static __device__ __noinline__

__device__ inline uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// This thread's lane, its warp's index over the grid (block-major: the warps of block 0, then of block 1, ...) and
// the grid's warp count: how the copy loops split their rows among warps.
__device__ inline int lane_index() { return static_cast<int>(threadIdx.x % 32); }
__device__ inline int grid_warp_index() { return static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32); }
__device__ inline int grid_warps() { return static_cast<int>(gridDim.x * blockDim.x / 32); }

// Asks L2 for [p, p + bytes) (p 16-byte aligned, bytes a multiple of 16) without waiting: loads that follow find the
// bytes there instead of in HBM. One bulk request on sm_90 and newer; nothing before.
__device__ inline void prefetch_to_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(__cvta_generic_to_global(p)), "r"(bytes) : "memory");
#endif
}

// Kernels name peers by their rank in the MoEComm's EP group; NVSHMEM's calls take the PE of that rank.
__device__ inline int pe_of(const Context& ctx, int rank) { return ctx.pe_of_rank[rank]; }

// Symmetric `ptr` as rank r's copy of it, mapped here through NVLink (Context::p2p): an offset read from the kernel's
// parameters, where nvshmem_ptr loads NVSHMEM's device state from memory (a dependent load before the first store).
template <typename T>
__device__ inline T* peer_ptr(const Context& ctx, T* ptr, int r) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(ptr) + ctx.peer_offset[r]);
}

// Whether rank r is reached by stores through peer_ptr (Context::direct; all of them on the NVLink path).
__device__ inline bool is_direct(const Context& ctx, int r) {
  return ctx.p2p || (r < kMaxNvlinkPeers && ctx.direct[r]);
}

// Whether this rank writes rank r's buffers by stores: its own (also with staged=True, where no rank is direct), or
// a direct peer's.
__device__ inline bool stores_into(const Context& ctx, int r) { return r == ctx.s.rank || is_direct(ctx, r); }

// Where this rank stores into rank r's copy of `ptr` (stores_into): its own address for itself (its rank may be past
// kMaxNvlinkPeers), else peer_ptr.
template <typename T>
__device__ inline T* store_ptr(const Context& ctx, T* ptr, int r) {
  return r == ctx.s.rank ? ptr : peer_ptr(ctx, ptr, r);
}

// The staged pre-reduced combine's runs: in every replica of a DP group, the partial rows for the group's q-th source
// from rank r begin at this row of combine_partials (the group's sources one after another, each one's runs by
// rank). `group_counts`: [dp_size][world] the rows each of the group's sources sent each rank (dispatch_counts).
__device__ inline int partial_run_first(const int32_t* group_counts, int world, int q, int r) {
  int first = 0;
  for (int q2 = 0; q2 < q; ++q2)
    for (int r2 = 0; r2 < world; ++r2) first += group_counts[q2 * world + r2];
  for (int r2 = 0; r2 < r; ++r2) first += group_counts[q * world + r2];
  return first;
}

// Measurement builds: one put of `bytes` to rank r in `phase`, counted by one thread of the warp that issues it
// (take_traffic). Nothing in the product.
__device__ inline void count_put(const Context& ctx, Phase phase, int r, size_t bytes) {
#ifdef JMC_MEASUREMENT
  if (ctx.traffic == nullptr) return;
  auto* words = reinterpret_cast<unsigned long long*>(ctx.traffic) + (static_cast<size_t>(phase) * ctx.s.world + r) * 2;
  atomicAdd(words, 1ull);
  atomicAdd(words + 1, static_cast<unsigned long long>(bytes));
#endif
}

// A warp's nonblocking put of `bytes` from `src` here to `dest` on rank r (both symmetric), counted (count_put).
__device__ inline void put_warp(const Context& ctx, Phase phase, void* dest, const void* src, size_t bytes, int r,
                                int lane) {
  nvshmemx_putmem_nbi_warp(dest, src, bytes, pe_of(ctx, r));
  if (lane == 0) count_put(ctx, phase, r, bytes);
}

// SETs rank r's copy of a signal word. For a direct peer a volatile store through peer_ptr, as nvshmemx_signal_op
// does there, without its first step: a load of the peer's heap base from NVSHMEM's device state (a dependent load
// on a kernel's first pass). The caller fences first (complete_remote_writes), as with nvshmemx_signal_op.
__device__ inline void signal_peer(const Context& ctx, uint64_t* word, uint64_t value, int r) {
  if (!is_direct(ctx, r)) {
#ifdef JMC_MEASUREMENT
    if (ctx.traffic != nullptr)
      atomicAdd(reinterpret_cast<unsigned long long*>(ctx.traffic) + kPhases * 2 * ctx.s.world + r, 1ull);
#endif
    return nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, pe_of(ctx, r));
  }
  *reinterpret_cast<volatile uint64_t*>(peer_ptr(ctx, word, r)) = value;
}

// Stores n int32 words into rank r's copy of the symmetric `dst` (stores to a direct peer, else puts of values).
__device__ inline void put_words(const Context& ctx, int32_t* dst, const int32_t* src, int n, int r) {
  if (is_direct(ctx, r)) {
    volatile int32_t* d = peer_ptr(ctx, dst, r);
    for (int i = 0; i < n; ++i) d[i] = src[i];
  } else {
    const int pe = pe_of(ctx, r);
    for (int i = 0; i < n; ++i) nvshmem_int32_p(dst + i, src[i], pe);
  }
}

// This thread's stores or puts to peers are complete (puts) or ordered before its later stores (direct peers).
__device__ inline void complete_remote_writes(const Context& ctx) {
  __threadfence_system();
  if (!ctx.p2p) nvshmem_quiet();
}

// The running round trip's epoch. Every kernel of round trip e reads e: only the end of combine_recv's last block
// advances it, after every other block of the kernel has finished, so it is read through the read-only cache (an L1
// hit after an SM's first read; it was written by an earlier kernel, and that cache starts empty in every kernel).
__device__ inline uint32_t current_epoch(const Context& ctx) { return __ldg(&ctx.local->epoch); }

// A word that peers SET, read with acquire semantics at system scope: the loads after it (a signalled row, a count)
// cannot be served before it. Acquire loads are performed one after the other: for several words at once, relaxed
// loads (in flight together), then one acquire fence.
__device__ inline uint64_t load_acquire(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}
__device__ inline uint64_t load_relaxed(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}
// Orders this thread's loads after the flags it loaded before: the words land in this GPU's memory (a peer stores
// them over NVLink after its system fence), so this GPU's scope suffices.
__device__ inline void acquire_fence() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Where a phase's kernel records errors while it runs.
__device__ inline int32_t* phase_status(const Context& ctx, Phase phase) { return ctx.local->scratch[phase]; }

// Records the first error of a call into its phase's scratch words; later errors add their code bits.
__device__ inline void record(int32_t* status, const int32_t* words) {
  if (atomicCAS(reinterpret_cast<int*>(&status[kCode]), 0, words[kCode]) == 0) {
    for (int i = 1; i < kStatusWords; ++i) status[i] = words[i];
  } else {
    atomicOr(reinterpret_cast<int*>(&status[kCode]), words[kCode]);
  }
}

__device__ inline void status_words(int32_t* words, const Context& ctx, int32_t code, Phase phase, int32_t a,
                                    int32_t b) {
  words[kCode] = code;
  words[kPhaseWord] = phase;
  words[kRankWord] = ctx.s.rank;
  words[kDetailA] = a;
  words[kDetailB] = b;
  words[kEpochWord] = static_cast<int32_t>(current_epoch(ctx));
  words[6] = words[7] = 0;
}

JMC_COLD void tell_host_cold(const Context& ctx, const int32_t* words);
JMC_COLD void fail_for_good_cold(const Context& ctx, const int32_t* words, bool publish);
JMC_COLD void adopt_peer_failure_cold(const Context& ctx);
JMC_COLD void report_cold(const Context& ctx, Phase phase, int32_t code, int32_t a, int32_t b);
JMC_COLD void refuse_cold(const Context& ctx, Phase phase);
JMC_COLD void publish_round_failure_cold(const Context& ctx, const int32_t* words);

// The inline wrappers of the failure paths (see JMC_COLD).
__device__ inline void tell_host(const Context& ctx, const int32_t* words) { tell_host_cold(*ctx.on_device, words); }
__device__ inline void fail_for_good(const Context& ctx, const int32_t* words, bool publish) {
  fail_for_good_cold(*ctx.on_device, words, publish);
}
__device__ inline void adopt_peer_failure(const Context& ctx) { adopt_peer_failure_cold(*ctx.on_device); }
__device__ inline void report(const Context& ctx, Phase phase, int32_t code, int32_t a, int32_t b) {
  report_cold(*ctx.on_device, phase, code, a, b);
}
__device__ inline void refuse(const Context& ctx, Phase phase) { refuse_cold(*ctx.on_device, phase); }
__device__ inline void publish_round_failure(const Context& ctx, const int32_t* words) {
  publish_round_failure_cold(*ctx.on_device, words);
}

// The first failure not yet raised, into the mapped host words the check handler reads: the first one wins, but a
// protocol failure replaces a routing error (the host must go on raising it until reset). The host reads the code
// word first: it is written last. Writers take a device-memory lock (no atomics on host memory, which PCIe may not
// provide); failures are rare, so a spin is fine.
JMC_COLD void tell_host_cold(const Context& ctx, const int32_t* words) {
  unsigned* lock = &ctx.local->host_lock;
  while (atomicCAS(lock, 0u, 1u) != 0u) __nanosleep(64);
  volatile int32_t* host = ctx.host_words->failure;
  const int32_t held = host[kCode], code = words[kCode] & ~kRefused;
  if (held == 0 || ((code & kFatalCodes) && !(held & kFatalCodes))) {
    host[kCode] = 0;
    __threadfence_system();
    for (int i = 1; i < kStatusWords; ++i) host[i] = words[i];
    __threadfence_system();
    host[kCode] = code;
    __threadfence_system();
  }
  atomicExch(lock, 0u);
}

// A protocol failure (timeout, out of order; `words`), found by this rank or adopted from a peer: kept in the local
// fatal words (every later phase refuses), told to the host, and (when this rank found it) published to every peer
// with its abort word SET, so that every rank's waits give up at once instead of timing out in turn.
JMC_COLD void fail_for_good_cold(const Context& ctx, const int32_t* words, bool publish) {
  int32_t* fatal = ctx.local->fatal;
  if (atomicCAS(reinterpret_cast<int*>(&fatal[kCode]), 0, words[kCode]) != 0) return;  // failed already
  for (int i = 1; i < kStatusWords; ++i) reinterpret_cast<volatile int32_t*>(fatal)[i] = words[i];
  __threadfence();
  tell_host(ctx, words);
  *reinterpret_cast<volatile uint64_t*>(ctx.abort_word) = 1;  // this kernel's other waits give up too
  if (!publish) return;
  int32_t* entry = ctx.fatal_failures + ctx.s.rank * kStatusWords;
  for (int pe = 0; pe < ctx.s.world; ++pe) put_words(ctx, entry, words, kStatusWords, pe);
  complete_remote_writes(ctx);
  for (int pe = 0; pe < ctx.s.world; ++pe)
    if (pe != ctx.s.rank) signal_peer(ctx, ctx.abort_word, 1, pe);
}

// The protocol failure that a peer published (the lowest rank's), adopted as this rank's own: after its abort word.
JMC_COLD void adopt_peer_failure_cold(const Context& ctx) {
  if (reinterpret_cast<volatile int32_t*>(ctx.local->fatal)[kCode] != 0) return;
  __threadfence_system();  // the entries were published before the abort word that sent us here
  for (int pe = 0; pe < ctx.s.world; ++pe) {
    const volatile int32_t* entry = ctx.fatal_failures + pe * kStatusWords;
    if (entry[kCode] == 0) continue;
    int32_t words[kStatusWords];
    for (int i = 0; i < kStatusWords; ++i) words[i] = entry[i];
    fail_for_good(ctx, words, false);
    return;
  }
}

// Records an error of `phase` found by this rank: routing errors stay in the call's status (and reach every rank
// with the phase's end, publish_round_failure); protocol failures also fail the MoEComm for good.
JMC_COLD void report_cold(const Context& ctx, Phase phase, int32_t code, int32_t a, int32_t b) {
  int32_t words[kStatusWords];
  status_words(words, ctx, code, phase, a, b);
  record(phase_status(ctx, phase), words);
  if (code & kFatalCodes) fail_for_good(ctx, words, true);
}

// True once this MoEComm has failed for good (its own failure or a peer's, whose abort word is set).
__device__ inline bool failed_for_good(const Context& ctx) {
  return reinterpret_cast<volatile int32_t*>(ctx.local->fatal)[kCode] != 0 ||
         *reinterpret_cast<volatile uint64_t*>(ctx.abort_word) != 0;
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

// Pre-reduced rows: a token's partial rows sit at [token][j], j = 0, 1, ... over the distinct ranks of its live
// slots in ascending order (at most K of them, whatever the world size). Called by a whole warp, lane k holding
// slot k's rank (`slot_rank`, for k < K): the place of `rank` (the number of distinct ranks below it).
__device__ inline int partial_place(unsigned live, int slot_rank, int rank) {
  const int lane = lane_index();
  const bool is_live = live >> lane & 1u;
  const int key = is_live ? slot_rank : -1 - lane;  // dead lanes match no other lane
  const unsigned same_rank = __match_any_sync(0xffffffffu, key);  // every lane (not behind the && below)
  const bool first_of_rank = is_live && __ffs(same_rank) - 1 == lane;
  return __popc(__ballot_sync(0xffffffffu, first_of_rank && slot_rank < rank));
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

// A kernel mark (measurement builds: ctx.marks): block 0's thread 0 stamps it; `last` stamps it in any block (the
// caller is the last block). Nothing in other builds.
__device__ inline void mark(const Context& ctx, Phase phase, Mark point, bool last = false) {
#ifdef JMC_MEASUREMENT
  if (ctx.marks != nullptr && threadIdx.x == 0 && (last || blockIdx.x == 0))
    ctx.marks[phase * kMarks + point] = now_ns();
#endif
}

// True when a finished phase's status lets its completion signals go (see finish_phase).
__device__ inline bool completed(int32_t code) { return !(code & (kFatalCodes | kRefused)); }

// A routing error of this round trip (the first this rank found: `words`, in the last block of the phase that found
// it) to every rank's round_failures entry of this rank, before the phase's completion signals (the caller's, after
// this returns in every thread of the block). Every rank then merges every rank's entries at its combine_recv's end
// (merge_round_failures), so all of them end the round trip with the same status.
JMC_COLD void publish_round_failure_cold(const Context& ctx, const int32_t* words) {
  if (threadIdx.x == 0) {
    const uint32_t epoch = static_cast<uint32_t>(words[kEpochWord]);
    volatile uint32_t* published = &ctx.local->published;
    if (*published != epoch) {
      *published = epoch;
      int32_t* entry = ctx.round_failures + ((epoch & 1u) * ctx.s.world + ctx.s.rank) * kStatusWords;
      for (int pe = 0; pe < ctx.s.world; ++pe) put_words(ctx, entry, words, kStatusWords, pe);
      complete_remote_writes(ctx);
    }
  }
  __syncthreads();
}

// A phase that does not run because the MoEComm has failed for good: its status is the failure, with kRefused.
JMC_COLD void refuse_cold(const Context& ctx, Phase phase) {
  adopt_peer_failure(ctx);
  int32_t words[kStatusWords];
  const volatile int32_t* fatal = ctx.local->fatal;
  for (int i = 0; i < kStatusWords; ++i) words[i] = fatal[i];
  words[kCode] |= kRefused;
  record(phase_status(ctx, phase), words);
}

// Waits until *word >= `least` (a tagged value: this epoch's word, with at least that value) and returns the word
// (0 when the wait gave up). Polls with acquire loads (a satisfied wait orders the loads after it) and gives up: at
// once when the abort word is set (another wait of this kernel, or another rank, failed: a dead peer costs one
// timeout, not one per waiting thread), and after timeout_ns (kTimeout naming `peer`).
__device__ inline uint64_t wait_for(const Context& ctx, const uint64_t* word, uint64_t least, Phase phase, int peer) {
  uint64_t value = load_acquire(word);
  if (value >= least) return value;
  const volatile uint64_t* abort = ctx.abort_word;
  const uint64_t deadline = now_ns() + ctx.s.timeout_ns;
  while ((value = load_acquire(word)) < least) {
    if (*abort != 0) {
      refuse(ctx, phase);
      return 0;
    }
    if (now_ns() > deadline) {
      report(ctx, phase, kTimeout, peer, ctx.s.rank);
      return 0;
    }
    __nanosleep(32);
  }
  return value;
}

// Flagged words (the low-latency path, Context::flagged; the floor probe): 8 bytes holding 4 data bytes and the
// round trip's epoch, tagged(epoch, data), stored and loaded in pairs by one 16-byte vector access (each element of a
// vector access is single-copy atomic on its own). A word that holds this epoch holds its data, so the receiver
// polls the data itself: no fence, count or signal orders it.
__device__ inline void store_flagged_pair(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ inline ulonglong2 load_flagged_pair(const uint64_t* p) {
  ulonglong2 w;
  asm volatile("ld.volatile.v2.u64 {%0, %1}, [%2];" : "=l"(w.x), "=l"(w.y) : "l"(p) : "memory");
  return w;
}
__device__ inline bool pair_landed(const ulonglong2& w, uint32_t epoch) {
  return epoch_of(w.x) == epoch && epoch_of(w.y) == epoch;
}

// The bound of a thread's polls of flagged words (one row's, or all of a thread's work), as wait_for's: it gives up
// at once when the abort word is set and timeout_ns after its first poll that found nothing (kTimeout naming
// `peer`). The first wait that times out sets the abort word, so a dead peer costs one timeout in all.
struct Patience {
  uint64_t deadline = 0;
  __device__ bool gave_up(const Context& ctx, Phase phase, int peer) {
    if (deadline == 0) deadline = now_ns() + ctx.s.timeout_ns;
    if (*reinterpret_cast<const volatile uint64_t*>(ctx.abort_word) != 0) {
      refuse(ctx, phase);
      return true;
    }
    if (now_ns() > deadline) {
      report(ctx, phase, kTimeout, peer, ctx.s.rank);
      return true;
    }
    return false;
  }
};

// 8-byte data words per lane whose loads a flagged copy has in flight together.
constexpr int kFlaggedBatch = 16;

// A warp stores `pairs` 8-byte data words as flagged pairs (tagged with `epoch`) into row_of(d) for d < dests
// (null: none there; the same in every lane). Data word p is a[p] below a_pairs, else b[p - a_pairs] (a row's payload,
// then its scales). Every load of a batch is in flight before its stores.
template <typename RowOf>
__device__ inline void warp_store_flagged(const uint2* a, int a_pairs, const uint2* b, int pairs, uint32_t epoch,
                                          int dests, RowOf row_of, int lane) {
  // 16-byte loads, two pairs each, where both parts allow (an R1 row's in one batch: its loads in flight together).
  const bool quads = ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0 &&
                     a_pairs % 2 == 0 && pairs % 2 == 0;
  for (int base = 0; quads && base < pairs / 2; base += 32 * kFlaggedBatch) {
    uint4 v[kFlaggedBatch];
#pragma unroll
    for (int u = 0; u < kFlaggedBatch; ++u) {
      const int q = base + u * 32 + lane;
      if (q < pairs / 2) v[u] = q < a_pairs / 2 ? reinterpret_cast<const uint4*>(a)[q]
                                                : reinterpret_cast<const uint4*>(b)[q - a_pairs / 2];
    }
    for (int d = 0; d < dests; ++d) {
      uint64_t* row = row_of(d);
      if (row == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kFlaggedBatch; ++u) {
        const int q = base + u * 32 + lane;
        if (q >= pairs / 2) continue;
        store_flagged_pair(row + 4 * q, tagged(epoch, v[u].x), tagged(epoch, v[u].y));
        store_flagged_pair(row + 4 * q + 2, tagged(epoch, v[u].z), tagged(epoch, v[u].w));
      }
    }
  }
  for (int base = 0; !quads && base < pairs; base += 32 * kFlaggedBatch) {
    uint2 v[kFlaggedBatch];
#pragma unroll
    for (int u = 0; u < kFlaggedBatch; ++u) {
      const int p = base + u * 32 + lane;
      if (p < pairs) v[u] = p < a_pairs ? a[p] : b[p - a_pairs];
    }
    for (int d = 0; d < dests; ++d) {
      uint64_t* row = row_of(d);
      if (row == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kFlaggedBatch; ++u) {
        const int p = base + u * 32 + lane;
        if (p < pairs) store_flagged_pair(row + 2 * p, tagged(epoch, v[u].x), tagged(epoch, v[u].y));
      }
    }
  }
}

// A warp copies a flagged row of `pairs` data pairs at `src` into a[p] below a_pairs, else b[p - a_pairs], each pair
// polled until it holds this epoch's data. False in every lane when a lane's wait gave up (the rest is not copied).
__device__ inline bool warp_copy_flagged(const Context& ctx, uint2* a, int a_pairs, uint2* b, int pairs,
                                         const uint64_t* src, uint32_t epoch, Phase phase, int peer, int lane) {
  Patience patience;
  bool ok = true;
  for (int base = 0; base < pairs && __all_sync(0xffffffffu, ok); base += 32 * kFlaggedBatch) {
    ulonglong2 w[kFlaggedBatch];
#pragma unroll
    for (int u = 0; u < kFlaggedBatch; ++u) {
      const int p = base + u * 32 + lane;
      if (p < pairs) w[u] = load_flagged_pair(src + 2 * p);
    }
#pragma unroll
    for (int u = 0; u < kFlaggedBatch; ++u) {
      const int p = base + u * 32 + lane;
      if (p >= pairs || !ok) continue;
      while (!pair_landed(w[u], epoch)) {
        if (patience.gave_up(ctx, phase, peer)) {
          ok = false;
          break;
        }
        w[u] = load_flagged_pair(src + 2 * p);
      }
      const uint2 v = make_uint2(value_of(w[u].x), value_of(w[u].y));
      if (!ok) continue;
      if (p < a_pairs) a[p] = v; else b[p - a_pairs] = v;
    }
  }
  return __all_sync(0xffffffffu, ok);
}

// Every thread of a block: waits (a thread per rank) until every rank's entry of `words` (a word per rank) is at
// least `least`; true in every thread when all came, false when some wait gave up.
__device__ inline bool wait_for_every_rank(const Context& ctx, const uint64_t* words, uint64_t least, Phase phase) {
  bool came = true;
  for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x)
    came &= wait_for(ctx, words + pe, least, phase, pe) != 0;
  return __syncthreads_and(came);
}

// One block, after a grid barrier that followed every block's writes: SETs this rank's entry of `words` on every rank
// (this one included) to `value`, unless the MoEComm has failed for good (its peers give up on the abort word
// instead of reading what this rank did not finish).
__device__ inline void signal_every_rank(const Context& ctx, uint64_t* words, uint64_t value) {
  __threadfence_system();
  if (failed_for_good(ctx)) return;
  for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x) signal_peer(ctx, words + ctx.s.rank, value, pe);
}

// Called by every thread at the end of a phase's kernel: the last block to finish copies the errors recorded by
// all blocks to the call's status output (and, when `code` is given, to *code in each of its threads), clears the
// scratch for the next call, publishes a routing error to every rank, and, with `advance`, moves the protocol on
// (not after a fused kernel's send: its receive moves it on past both phases, so no two blocks' writes race). The
// end of combine_recv ends the round trip: its status (every rank's, merged) goes to the host words if it is an
// error, the host words' `done` becomes this epoch, and the next round trip gets the next epoch.
// Returns true in that block. A status with kFatalCodes or kRefused means some block did not do its work: the caller
// then sends no completion signal (peers give up on this rank's abort word instead of reading partial data).
// close_phase is its work in that block, for a kernel whose last block ends two phases after one count (the
// low-latency kernels: their send's end, then their receive's).
__device__ inline void close_phase(const Context& ctx, Phase phase, int32_t* out, bool advance, int32_t* code);
__device__ inline bool finish_phase(const Context& ctx, Phase phase, int32_t* out, bool advance = true,
                                    int32_t* code = nullptr) {
  if (!last_block_done(ctx.local->blocks_done + phase)) return false;
  close_phase(ctx, phase, out, advance, code);
  return true;
}
__device__ inline void close_phase(const Context& ctx, Phase phase, int32_t* out, bool advance, int32_t* code) {
  mark(ctx, phase, kAllDone, true);
  __shared__ int32_t words[kStatusWords];
  __syncthreads();  // a close_phase just before in this block has read `words`
  volatile int32_t* scratch = phase_status(ctx, phase);
  const bool failed = threadIdx.x == 0 && failed_for_good(ctx);  // its loads in flight with the scratch's
  if (threadIdx.x < kStatusWords) {
    words[threadIdx.x] = scratch[threadIdx.x];
    out[threadIdx.x] = words[threadIdx.x];
    scratch[threadIdx.x] = 0;
  }
  __syncthreads();
  if (phase <= kDispatchRecv && words[kCode] != 0 && completed(words[kCode])) publish_round_failure(ctx, words);
  if (threadIdx.x == 0) {
    LocalWords* local = ctx.local;
    local->blocks_done[phase] = 0;
    if (advance) local->next_phase = (phase + 1) % kPhases;
    if (phase == kCombineRecv) {  // the round trip's end (run or refused): the host learns how far the device got
      if (words[kCode] != 0) tell_host(ctx, words);  // fenced: before `done` below
      const uint32_t epoch = current_epoch(ctx);
      reinterpret_cast<volatile uint32_t*>(&ctx.host_words->done)[0] = epoch;  // posted: nothing waits for it here
      local->epoch = epoch + 1;
    }
    local->refusing = failed || failed_for_good(ctx);
  }
  if (code != nullptr) *code = words[kCode];
}


// Called by every thread at the start of a phase's kernel: true when the phase runs. It does not run when the
// MoEComm has failed for good (refused: the failure, with kRefused) or when its protocol expects another phase now
// (one round trip at a time: dispatch_send, dispatch_recv, combine_send, combine_recv): that reports kOutOfOrder, a
// failure for good, so interleaved round trips on one buffer set fail with a message instead of hanging or mixing
// rows. Either way the phase finishes at once (no waits, and no writes but an empty layout from a refused receive:
// see receive_nothing). Every block of a kernel decides alike (a cooperative kernel's blocks must): the words read
// here change only in a kernel's last block (finish_phase). A failure that comes while a kernel runs reaches it
// through its waits (wait_for), and its completion signals are not sent.
__device__ inline bool begin_phase(const Context& ctx, Phase phase, int32_t* out) {
  mark(ctx, phase, kStart);
  const LocalWords* local = ctx.local;  // written by an earlier kernel's last block only: plain loads
  const int32_t expected = local->next_phase;
  if (local->refusing) {
    if (threadIdx.x == 0) refuse(ctx, phase);
  } else if (expected != phase) {
    if (threadIdx.x == 0) report(ctx, phase, kOutOfOrder, expected, phase);
  } else {
    return true;
  }
  finish_phase(ctx, phase, out);
  return false;
}

// Blocks for `work` items at `per_block` items each, at least 1 and at most `cap`.
inline int blocks_for(long long work, int per_block, int cap) {
  const long long b = (work + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

// A launch's grid within the MoEComm's SM budget (Sizes::max_blocks): at most that many blocks, so at most that many
// SMs run the kernel and the others stay free for the caller's compute. Every kernel strides its work over its grid
// (a grid of one block does it all), and the cooperative ones wait only on blocks of a grid that is all resident.
inline int within_budget(const Sizes& s, int blocks) {
  return s.max_blocks > 0 && blocks > s.max_blocks ? s.max_blocks : blocks;
}

// Launch helpers (host side), one per phase and one per fused direction; each returns the CUDA error of its launch.
struct DispatchSendArgs {
  const void* x; const float* scales; const int32_t* topk_ids; const int32_t* num_tokens; int32_t* status;
  const float* topk_weights = nullptr;  // [T, K] the combine's weights, given to dispatch (NVLink path): stored with
                                        // the ids rows into every rank's combine_weights (null: none)
  bool quantize = false;  // x is bf16 [T, H] and the payload fp8: each row is quantized as it is sent (no scales)
};
struct DispatchRecvArgs {
  void* expert_x; float* expert_scales; int32_t* group_sizes; int32_t* row_origin; int32_t* status;
  int32_t* expert_counts;  // [E] live slots routed to each expert of the layer over the EP group
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
#ifdef JMC_MEASUREMENT
// The bench's floor (probe.cu, NVLink path only; measurement builds): bytes of x to the next rank, the previous
// rank's into out; `flagged`: in words that carry their own validity instead of a fence and a signal.
cudaError_t launch_probe(const Context& ctx, const void* x, void* out, long long bytes, int32_t* status,
                         bool flagged, cudaStream_t stream);
#endif

}  // namespace jmc
