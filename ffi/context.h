// The state of one MoEComm on one rank: static sizes plus pointers into the NVSHMEM symmetric heap.
// Created once (collectively) by MoEComm construction, reused by every call; handlers find it through the
// integer attribute `context` (the address of this struct).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define JMC_HOST_DEVICE __host__ __device__
#else
#define JMC_HOST_DEVICE
#endif

namespace jmc {

// Error codes shared with jax_moe_comm/errors.py (status[0] is a bit set).
enum ErrorCode : int32_t {
  kBadExpertId = 1,
  kRepeatedExpertId = 2,
  kCapacityOverflow = 4,
  kTimeout = 8,
  kOutOfOrder = 16,
};

// Phases, for timeout messages (status[1] when kTimeout is set).
enum Phase : int32_t { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };
constexpr int kPhases = 4;

// status[4] int32 written by every kernel: {code, phase, detail_a, detail_b}. For kTimeout detail_a is the
// peer waited for; for id errors (token, id); for overflow (rows needed, capacity); for kOutOfOrder (the phase
// the MoEComm expected next, the phase that ran).
constexpr int kStatusWords = 4;

// Kernel marks (JAX_MOE_COMM_KERNEL_MARKS=1): globaltimer stamps of each phase's steps, for the kernel harness's
// --marks table. Stamped by thread 0 of block 0, except kAllDone and kEnd (the last block) and the per-slot
// combine_send's kWaited (its last block, which resets the ready words and signals the sync flags). kStep1 and
// kStep2 are points inside a kernel's work (between kWaited and kWorked), each kernel says which; inside a loop the
// last iteration of thread 0 stamps them (at one token per rank, its only one).
enum Mark : int32_t { kStart = 0, kWaited = 1, kWorked = 2, kClosed = 3, kAllDone = 4, kEnd = 5, kStep1 = 6, kStep2 = 7 };
constexpr int kMarks = 8;

struct Sizes {
  int rank, world, dp_size, num_dp;
  int max_tokens, experts_per_token, hidden, num_experts, local_experts;
  int capacity, align;
  int payload_bytes;   // hidden * sizeof(dtype)
  int scale_cols;      // hidden / scale_block for fp8, else 0
  int token_stride;    // bytes of one staged token: payload | fp32 scales | int32 token | int32 ids[K], 16-aligned
  int slots_per_source;// ceil(max_tokens / dp_size): the tokens one replica sends (token i of it in slot i)
  int combine_stride;  // bytes of one combine row (hidden * the out dtype's bytes: slot and partial rows), 16-aligned
  int64_t timeout_ns;
  int sm_count;  // each launch sizes its grid from its work, capped by this
};

constexpr int kMaxNvlinkPeers = 72;  // ranks whose peer offsets a Context holds (an NVLink domain); more: staged
constexpr int kMaxExpertsPerToken = 32;  // jax_moe_comm/nvshmem_backend.py MAX_EXPERTS_PER_TOKEN
constexpr int kThreads = 256;  // threads per block of every kernel (8 warps)
constexpr int kMaxBlocksPerSm = 2048 / kThreads;  // resident blocks of kThreads an SM can hold
constexpr int kIdsFirstMinTokens = 1024;  // Context::ids_first: a grid barrier and a second signal more per dispatch

struct Context {
  Sizes s;
  // Symmetric (same offsets on every rank).
  char* dispatch_staging;     // [max_tokens] token strides, this rank's packed tokens (staged path)
  char* dispatch_slots;       // [world][slots_per_source] token strides: a source's token i, once per rank
  int32_t* dispatch_ids;      // [world][slots_per_source][K] every token's ids (which slots hold a row, and for
                              // which local experts)
  uint64_t* dispatch_ready;   // [world] source's token count + 1, SET once all its rows and ids have landed
  char* combine_staging;      // [capacity] combine rows, this rank's expert outputs
  char* combine_slots;        // [max_tokens][K] combine rows arriving here
  uint64_t* combine_arrived;  // [max_tokens] rows landed per token
  uint64_t* sync_flags;       // [world] 1 = that peer finished reading its dispatch buffers
  // The pre-reduced combine (weights given to combine_send; NVLink path): one row per (token, expert rank).
  float* combine_weights;     // [world][slots_per_source][K] a source's topk weights of its token i
  uint64_t* weights_ready;    // [world] 1 once that source's weights landed here
  char* combine_partials;     // [world][max_tokens] combine rows: rank r's weighted sum of token t's rows on r
  uint64_t* partials_ready;   // [world] 1 once every partial row from that rank landed here
  uint64_t* probe_ready;      // [world] the epoch of the last probe (ffi/probe.cu) whose bytes landed from that rank
  // Local only (never addressed by peers).
  int32_t* status_scratch;    // [4 phases][kStatusWords] errors of the running call; the phase's last block
                              // copies them to the call's status output and clears them (no memset per call)
  unsigned* blocks_done;      // [4 phases] blocks of the running call that have finished
  int32_t* next_phase;        // [1] the phase this MoEComm runs next: one round trip at a time, in phase order
  uint32_t* probe_epoch;      // [1] probes (ffi/probe.cu) this MoEComm has run
  unsigned* probe_blocks;     // [2] blocks of the running probe past its send, past its copy
  int32_t* row_of;            // [num_dp][max_tokens][K] packed row of (group, token, slot): row_origin inverted by
                              // the pre-reduced combine_send (entries are checked against row_origin before use)
  uint64_t* marks;            // [4 phases][kMarks] (device memory, not symmetric), or null: no stamps
  int32_t* block_counts;      // [L * num_dp][kMaxBlocksPerSm * sm_count] (device memory, not symmetric; with
                              // ids_first, else null): rows of each (local expert, group) in each block's shares of
                              // the arrivals (histogram_split)
  int64_t peer_offset[kMaxNvlinkPeers];  // with p2p: bytes from a local symmetric address to rank pe's copy of it
                                         // as this GPU maps it (peer_ptr; what nvshmem_ptr computes on the device)
  bool p2p;                   // every peer's symmetric memory is reachable by loads/stores (NVLink): rows are
                              // written straight into peers' slots instead of staged and put
  bool ids_first;             // the fused dispatch sends every ids row before any row (dispatch.cu): NVLink, one
                              // replica per DP group, and JAX_MOE_COMM_IDS_FIRST_MIN_TOKENS (default
                              // kIdsFirstMinTokens) tokens per rank or more (and block_counts allocated)
  size_t symmetric_bytes;
};

// Offsets into the staged token stride.
inline JMC_HOST_DEVICE int scales_offset(const Sizes& s) { return s.payload_bytes; }
inline JMC_HOST_DEVICE int header_offset(const Sizes& s) { return s.payload_bytes + 4 * s.scale_cols; }

}  // namespace jmc
