// The state of one MoEComm on one rank: static sizes plus pointers into the NVSHMEM symmetric heap.
// Created once (collectively) by MoEComm construction, reused by every call; handlers find it through the
// integer attribute `context`: its id in the extension's registry (runtime.h), never an address.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>  // the send stream and its events (SendStream)

#include "status.h"  // the status words and error codes

#ifdef __CUDACC__
#define JMC_HOST_DEVICE __host__ __device__
#else
#define JMC_HOST_DEVICE
#endif

namespace jmc {

// Phases, for messages (status[1]).
enum Phase : int32_t { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };
constexpr int kPhases = 4;

// Every word a rank waits for carries the round trip's epoch in its high 32 bits (a per-MoEComm count of round
// trips, 1 for the first, the same on every rank): a write of an earlier round trip can never satisfy a later wait,
// and no word is ever reset. The low 32 bits carry a value (a token count, a slot's state).
JMC_HOST_DEVICE inline uint64_t tagged(uint32_t epoch, uint32_t value) {
  return static_cast<uint64_t>(epoch) << 32 | value;
}
JMC_HOST_DEVICE inline uint32_t epoch_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
JMC_HOST_DEVICE inline uint32_t value_of(uint64_t word) { return static_cast<uint32_t>(word); }
// A dispatch ready word's value: the source's token count, with kRowsLanded once its rows have landed too (the
// ids-first dispatch SETs it twice; otherwise one SET says both).
constexpr uint32_t kRowsLanded = 1u << 31;
JMC_HOST_DEVICE inline int token_count(uint64_t ready) { return static_cast<int>(value_of(ready) & ~kRowsLanded); }
// A combine slot flag's value: the row landed, or it was dropped by the expert rank (capacity): no row comes.
constexpr uint32_t kSlotLanded = 1, kSlotDropped = 2;
// A sync flag's value besides 1: its rank published a failure of this round trip (round_failures).
constexpr uint32_t kPublishedFailure = 2;

// Kernel marks (measurement builds only: JAX_MOE_COMM_MEASUREMENT, which defines JMC_MEASUREMENT): globaltimer stamps
// of each phase's steps, for the kernel harness's --marks table. Stamped by thread 0 of block 0, except kAllDone and
// kEnd (the last block) and the per-slot combine_send's kWaited (its last block, which signals the sync flags).
// kStep1 and kStep2 are points inside a kernel's work (between kWaited and kWorked), each kernel says which; inside
// a loop the last iteration of thread 0 stamps them (at one token per rank, its only one). All enumerators, so that
// a product build holds no symbol of them.
enum Mark : int32_t {
  kStart = 0, kWaited = 1, kWorked = 2, kClosed = 3, kAllDone = 4, kEnd = 5, kStep1 = 6, kStep2 = 7, kMarks = 8
};

struct Sizes {
  int rank, world, dp_size, num_dp;
  int max_tokens, experts_per_token, hidden, num_experts, local_experts;
  int capacity, align;
  int payload_bytes;   // hidden * sizeof(dtype)
  int scale_cols;      // hidden / scale_block for fp8, else 0
  int token_stride;    // bytes of one staged token: payload | fp32 scales | int32 token | int32 ids[K], 16-aligned
  int slots_per_source;// ceil(max_tokens / dp_size): the tokens one replica sends (token i of it in slot i)
  int window_slots;    // slots per source a round of rows goes through (windowed: below slots_per_source, see
                       // window_rounds; else slots_per_source); a round's tokens: window_slots * dp_size per group
  int combine_stride;  // bytes of one combine row (hidden * the out dtype's bytes: slot and partial rows), 16-aligned
  int64_t timeout_ns;
  int sm_count;  // each launch sizes its grid from its work, capped by this
  int max_blocks;  // MoEComm(max_sms=...): every launch's grid at most this many blocks (0: no bound); see
                   // within_budget
  int drop_overflow;  // rows past capacity are dropped without an error (MoECommConfig(overflow="drop"))
  int expert_capacity;  // MoECommConfig(capacity_per="expert"): rows each local expert keeps, the first in layout
                        // order (a multiple of align); 0: no per-expert bound (the capacity is pooled)
};

// The element types of combine rows, by the codes the launch helpers take (handlers.cu derives them from XLA's
// element types; jax_moe_comm asks the extension for them: constants()).
enum RowType : int { kBf16 = 0, kF16 = 1, kF32 = 2 };

constexpr int kMaxNvlinkPeers = 72;  // ranks whose peer offsets a Context holds (an NVLink domain); more: staged
constexpr int kMaxExpertsPerToken = 32;  // jax_moe_comm/nvshmem_backend.py MAX_EXPERTS_PER_TOKEN
constexpr int kThreads = 256;  // threads per block (8 warps)
// The pre-reduced combine's blocks under an SM budget that binds (kernels fused or split): as many warps per SM as
// without the budget, on no more SMs.
constexpr int kWideThreads = 2 * kThreads;
constexpr int kMaxBlocksPerSm = 2048 / kThreads;  // resident blocks of kThreads an SM can hold

// The local words of a MoEComm (device memory, never addressed by peers), in one struct at the end of the
// allocation.
struct LocalWords {
  int32_t scratch[kPhases][kStatusWords];  // errors of the running call; the phase's last block copies them to the
                                           // call's status output and clears them (no memset per call)
  unsigned blocks_done[kPhases];           // blocks of the running call that have finished
  int32_t next_phase;                      // the phase this MoEComm runs next: one round trip at a time, in order
  uint32_t epoch;                          // the running round trip's epoch (1 for the first)
  uint32_t published;                      // the last epoch whose first failure this rank published to its peers
  int32_t fatal[kStatusWords];             // the first protocol failure (own or a peer's): every later phase refuses
  unsigned host_lock;                      // held while a thread writes HostWords::failure
  int32_t refusing;                        // set by a kernel's last block once `fatal` is or the abort word is: the
                                           // next kernels refuse (every block of a kernel reads the same value)
#ifdef JMC_MEASUREMENT
  uint32_t probe_epoch;                    // probes (ffi/probe.cu) this MoEComm has run
  unsigned probe_blocks[2];                // blocks of the running probe past its send, past its copy
#endif
};

// Mapped pinned host memory (read by the host with no synchronisation; the device writes it).
struct HostWords {
  int32_t failure[kStatusWords];  // the first failure not yet raised (routing or protocol), its epoch included
  uint32_t done;                  // the epoch of the last round trip whose combine_recv has finished
};

// Host-only state of a context (the FFI check handler's; never read by a kernel).
struct HostState {
  uint32_t launched = 0;   // round trips this process has launched (checked) since creation or reset
  int64_t execution = -1;  // the XLA execution (run id) of the last check
  bool raised = false;     // the protocol failure in HostWords has been raised (it stays there until reset)
};

// The send halves' own stream (MoEComm(send_stream="own"); handlers.cu, forked and joined): a send half launched
// there starts after what XLA queued before it (`inputs`, recorded on XLA's stream) and runs beside what XLA queues
// next, until the receive half makes XLA's stream wait for `sent`. Created with the context, shared with its shared
// contexts (one protocol sequence), destroyed with its owner. Host-only.
struct SideStream {
  cudaStream_t stream = nullptr;  // non-blocking, the device's highest priority: its blocks go first
  cudaEvent_t inputs = nullptr;   // recorded on XLA's stream right before a send is forked
  cudaEvent_t sent = nullptr;     // recorded on `stream` after the send's kernel
  bool pending = false;           // a send ran on `stream` and no handler has made XLA's stream wait for it yet
};

struct Context {
  Sizes s;
  // Symmetric (same offsets on every rank).
  char* dispatch_staging;     // [max_tokens * (min(K, world) + 1)] token strides (staged path; else null): the rows
                              // this rank sends each rank off NVLink, one contiguous run per rank (the source of its
                              // put), then [max_tokens] each token's quantized row (dispatch(quantize=...))
  char* dispatch_slots;       // [world][window_slots] token strides: a source's token i (of the round), once per rank
  int32_t* dispatch_ids;      // [world][slots_per_source][K] every token's ids (which slots hold a row, and for
                              // which local experts)
  uint64_t* dispatch_ready;   // [world] tagged(epoch, token count [| kRowsLanded]), SET once its rows and ids landed
  // The staged path's packed rows (null on the NVLink path): a source sends each rank the rows of its tokens bound
  // there as one run at the start of its region of dispatch_slots, in the order it chose, and says where each went.
  int32_t* dispatch_routes;   // [world][slots_per_source][K] source s's token i, slot k: the row of token i in s's
                              // region of dispatch_slots on the rank hosting slot k's expert (-1: no live expert)
  int32_t* dispatch_counts;   // [world][world] rows source s sent each rank
  int32_t* dest_rows;         // [world] local: the running staged dispatch_send's rows for each rank (zero between
                              // calls: its last pass zeroes them)
  int32_t* group_routes;      // [dp_size][slots_per_source][K] local: this DP group's sources' dispatch_routes, and
  int32_t* group_counts;      // [dp_size][world] their dispatch_counts, copied by the staged pre-reduced
                              // combine_send before it lets peers write those buffers again (combine_recv reads
                              // them after)
  char* combine_staging;      // [max(capacity, world * slots_per_source)] combine rows (staged path; else null): this
                              // rank's expert outputs per slot, or its pre-reduced rows in runs (PartialRuns)
  char* combine_slots;        // [window tokens][K] combine rows arriving here (the bytes of combine_partials: a
                              // combine uses one layout or the other); window tokens: max_tokens, or a round's
  uint64_t* combine_flags;    // [max_tokens][K] tagged(epoch, kSlotLanded | kSlotDropped), SET after the slot's row
  uint64_t* sync_flags;       // [world] tagged(epoch, 1): that peer finished reading its dispatch buffers
  // The pre-reduced combine (weights given to combine_send): one row per (token, expert rank).
  float* combine_weights;     // [world][slots_per_source][K] a source's topk weights of its token i
  uint64_t* weights_ready;    // [world] tagged(epoch, 1) once that source's weights landed here
  char* combine_partials;     // [window tokens][K] combine rows: at [t][j] the weighted sum of token t's rows on
                              // the j-th (ascending) distinct rank of its live slots (t counted from the round's
                              // first); on the staged path the runs of PartialRuns instead
  uint64_t* partials_ready;   // [world] tagged(epoch, round + 1) once every partial row (of that round) from that
                              // rank landed here
  // Windowed round trips (Sizes::window_slots below slots_per_source; NVLink, fused calls): rows go in rounds.
  uint64_t* window_ready;     // [world] tagged(epoch, round + 1) once that source's rows of the round landed here
  uint64_t* dispatch_window_free;  // [world] tagged(epoch, round + 1) once that rank has copied its dispatch window
                                   // of the round (our rows in it may be overwritten by the next round's)
  uint64_t* combine_window_free;   // [world] the same for that rank's combine window
  // The low-latency path (Context::flagged): every 8-byte word holds 4 data bytes and the round trip's epoch
  // (tagged), so a receiver polls the data itself. Only in layouts of a low-latency MoEComm (else null).
  uint64_t* flagged_rows;     // [world][slots_per_source][flagged_row_words] a source's token i: payload | scales
  uint64_t* flagged_ids;      // [world][slots_per_source][K] a source's token i's ids
  uint64_t* flagged_combine;  // [max_tokens][K][flagged_combine_words] the slot rows arriving here
#ifdef JMC_MEASUREMENT
  uint64_t* probe_ready;      // [world] the epoch of the last probe (ffi/probe.cu) whose bytes landed from that rank
#endif
  int32_t* round_failures;    // [2][world][kStatusWords] by epoch parity: source s's first failure of that round trip
                              // (a routing error or overflow), published before its next signal
  int32_t* fatal_failures;    // [world][kStatusWords] source s's protocol failure, published before the abort word
  uint64_t* abort_word;       // [1] non-zero once some rank has failed for good: every wait gives up at once
  // Local only (never addressed by peers).
  int32_t* row_of;            // [num_dp][max_tokens][K] packed row of (group, token, slot): row_origin inverted by
                              // the pre-reduced combine_send (entries are checked against row_origin before use)
  int32_t* expert_tally;      // [E] the blocks' sums of other ranks' experts' slots of the running dispatch_recv
                              // (local: its last block copies them out and zeroes them; expert_counts)
  LocalWords* local;
  HostWords* host_words;      // device address of the mapped pinned host words
  HostWords* host_view;       // the same words, host address (the check handler reads them)
  HostState* host_state;
  SideStream* side;           // the send halves' own stream (null in a context that failed to create it)
#ifdef JMC_MEASUREMENT
  uint64_t* marks;            // [4 phases][kMarks] (device memory), or null: no stamps
  uint64_t* traffic;          // [traffic_words(world)] (device memory), or null: what this rank sent peers by NVSHMEM
                              // (not by stores) since take_traffic: [phase][rank] {puts, bytes}, then [rank] signals
#endif
  int32_t* block_counts;      // [L * num_dp][kMaxBlocksPerSm * sm_count] (device memory, not symmetric; with
                              // ids_first or windowed, else null): rows of each (local expert, group) in each block's
                              // shares of the arrivals (histogram_split)
  int32_t* pe_of_rank;        // [world] (device memory) the NVSHMEM PE of each rank of this MoEComm's EP group: the
                              // ranks of a kernel are the group's, the PEs NVSHMEM's (every process of the job)
  int64_t peer_offset[kMaxNvlinkPeers];  // where direct[r]: bytes from a local symmetric address to rank r's copy of
                                         // it as this GPU maps it (peer_ptr; what nvshmem_ptr computes on the device)
  bool direct[kMaxNvlinkPeers];  // rank r's symmetric memory is reachable by loads/stores (NVLink, same node): the
                                 // staged path stores into it instead of putting (ranks from kMaxNvlinkPeers on: puts)
  bool p2p;                   // every peer is direct: rows are written straight into peers' slots, nothing staged
  bool flagged;               // the fused calls take the low-latency path (flagged words; dispatch.cu, combine.cu):
                              // the layout has its buffers, NVLink, unwindowed
  bool ids_first;             // the fused dispatch sends every ids row before any row (dispatch.cu): NVLink, one
                              // replica per DP group, and MoEComm's ids_first_min_tokens tokens per rank or more
                              // (and block_counts allocated)
  char* base;                 // the symmetric allocation
  size_t symmetric_bytes;     // bytes this context allocated (0 for a shared context: its owner's)
  Context* owner;             // share_context: the context whose buffers, words and host state these are; else null
  const Context* on_device;   // this struct's copy in device memory, for the kernels' failure paths (JMC_COLD)
};

#ifdef JMC_MEASUREMENT
inline JMC_HOST_DEVICE size_t traffic_words(int world) { return static_cast<size_t>(kPhases * 2 + 1) * world; }
#endif

// Rounds of a windowed round trip (1 when not windowed): each moves window_slots slots per source, the tokens
// [round * window_tokens, (round + 1) * window_tokens) of every DP group.
inline JMC_HOST_DEVICE bool windowed(const Sizes& s) { return s.window_slots < s.slots_per_source; }
inline JMC_HOST_DEVICE int window_rounds(const Sizes& s) {
  return (s.slots_per_source + s.window_slots - 1) / s.window_slots;
}
inline JMC_HOST_DEVICE int window_tokens(const Sizes& s) { return s.window_slots * s.dp_size; }

// The low-latency path's rows in flagged words (Context::flagged): a dispatch row's payload and scales, 4 bytes a
// word, and a combine slot row of combine_stride bytes.
inline JMC_HOST_DEVICE int flagged_row_words(const Sizes& s) { return (s.payload_bytes + 4 * s.scale_cols) / 4; }
inline JMC_HOST_DEVICE int flagged_combine_words(const Sizes& s) { return s.combine_stride / 4; }

// Offsets into the staged token stride.
inline JMC_HOST_DEVICE int scales_offset(const Sizes& s) { return s.payload_bytes; }
inline JMC_HOST_DEVICE int header_offset(const Sizes& s) { return s.payload_bytes + 4 * s.scale_cols; }

}  // namespace jmc
