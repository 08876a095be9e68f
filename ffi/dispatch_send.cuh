// dispatch_send: send each of this replica's tokens once to every rank that hosts one of its experts (per-rank
// dedupe: the receiver fans a token out to its local experts), and every token's ids to every rank; then, once all
// of it has landed, SET the source's ready word (token count + 1) on every rank. Never waits on a peer.
//
// Token i of this replica (token index t = replica + i * dp_size) lands in slot i of this source's region on each
// destination: no sender-side prefix, no packing. The ids rows are dense (every i < count), so the receiver knows
// which slots hold a row and for which of its experts; its layout depends on the routing alone.
//
// The phase's device code, shared by its kernels (dispatch_send.cu) and the fused dispatch (dispatch.cu). Two ways,
// one protocol. With every peer reachable by loads/stores (NVLink, `Context::p2p`), a warp per token
// stores the row straight from x into each destination's slot. Otherwise tokens are packed once into symmetric
// staging (the source of a put must be symmetric off NVLink) and each row is a put; nvshmem_quiet completes them.
#pragma once

#include "device_common.cuh"
#include "quantize.cuh"

namespace jmc {

// Every token's routing is checked (each replica checks all, like the reference backend): a thread per token, its
// ids row in registers (live_slots). A slot that is not live and not -1 is an error: out of range, else a repeat.
// (Slot by slot, with a load per comparison, it would be a chain of dependent loads per thread.)
// `first_row`: this thread's first token's ids, already loaded (or null).
__device__ inline void validate_ids(const Context& ctx, const DispatchSendArgs& a, int num_tokens,
                                    const IdsRow* first_row) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, first = blockIdx.x * blockDim.x + threadIdx.x;
  for (int t = first; t < num_tokens; t += gridDim.x * blockDim.x) {
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    const unsigned live = t == first && first_row ? live_mask(*first_row, s.num_experts)
                                                  : live_slots(ids, K, s.num_experts);
    const unsigned all_slots = K < 32 ? (1u << K) - 1u : ~0u;
    if (live == all_slots) continue;  // the common case: no -1, no repeat, nothing out of range
    for (int k = 0; k < K; ++k) {
      const int e = ids[k];
      if (live >> k & 1u || e == -1) continue;
      report(ctx, kDispatchSend, e < -1 || e >= s.num_experts ? kBadExpertId : kRepeatedExpertId, t, e);
    }
  }
}

__device__ inline int replica_tokens(const Sizes& s, int raw_tokens, int* num_tokens) {
  *num_tokens = min(max(raw_tokens, 0), s.max_tokens);
  const int replica = s.rank % s.dp_size;
  return *num_tokens > replica ? (*num_tokens - replica + s.dp_size - 1) / s.dp_size : 0;
}

// The rank that hosts this lane's live slot of token t (lane < K), else -1.
__device__ inline int lane_dest(const Sizes& s, const int32_t* ids, int lane) {
  const bool live = live_slots(ids, s.experts_per_token, s.num_experts) >> lane & 1u;
  return lane < s.experts_per_token && live ? ids[lane] / s.local_experts : -1;
}

// Token t's bf16 row of x (a.quantize).
__device__ inline const __nv_bfloat16* bf16_row(const Sizes& s, const DispatchSendArgs& a, int t) {
  return static_cast<const __nv_bfloat16*>(a.x) + static_cast<size_t>(t) * s.hidden;
}

// The header of token t's stride at `row`: its index, then its ids row (lane k < K holds id k, `id`).
__device__ inline void store_header(char* row, const Sizes& s, int t, int id, int lane) {
  auto* header = reinterpret_cast<int32_t*>(row + header_offset(s));
  if (lane == 0) header[0] = t;
  if (lane < s.experts_per_token) header[1 + lane] = id;
}

// Token t's stride at `row` (a peer's slot or this rank's staging): payload | fp32 scales | int32 t | int32 ids[K].
// With a.quantize, `row` must be local memory (byte stores).
__device__ inline void write_token_row(char* row, const Sizes& s, const DispatchSendArgs& a, int t, int lane) {
  if (a.quantize) {
    warp_quantize_row(row, reinterpret_cast<float*>(row + scales_offset(s)), bf16_row(s, a, t), s, lane);
  } else {
    warp_copy(row, static_cast<const char*>(a.x) + static_cast<size_t>(t) * s.payload_bytes, s.payload_bytes, lane);
    if (s.scale_cols)
      warp_copy(row + scales_offset(s), a.scales + static_cast<size_t>(t) * s.scale_cols, 4 * s.scale_cols, lane);
  }
  const int K = s.experts_per_token;
  store_header(row, s, t, lane < K ? a.topk_ids[static_cast<size_t>(t) * K + lane] : 0, lane);
}

// Token t's row into slot `slot` of every rank that hosts one of its live experts (a lane's dest_of_lane), NVLink
// path. When the payload and the scales fit one pass of loads (kCopyDepth 16-byte words per lane for the payload,
// one for the scales: R1's fp8 rows, V2-Lite's bf16 ones) they are loaded once and stored to each rank: a
// write_token_row per rank reloaded them, after the first rank's stores (the loads may not pass stores that could
// alias them).
__device__ inline void store_token_row(const Context& ctx, size_t slot, const DispatchSendArgs& a, int t, int lane,
                                       int dest_of_lane) {
  const Sizes& s = ctx.s;
  char* row = ctx.dispatch_slots + slot * s.token_stride;  // this rank's copy; a peer's is peer_ptr(row, d)
  const char* x = static_cast<const char*>(a.x) + static_cast<size_t>(t) * s.payload_bytes;
  const float* scales = a.scales + static_cast<size_t>(t) * s.scale_cols;
  const int scale_bytes = 4 * s.scale_cols;
  const uintptr_t scales_at = s.scale_cols ? reinterpret_cast<uintptr_t>(scales) : 0;  // no scales: any pointer
  if (!RowInRegisters::fits(reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(x) | scales_at,
                            s.payload_bytes, scale_bytes)) {
    for (int d = 0; d < s.world; ++d)
      if (__any_sync(0xffffffffu, dest_of_lane == d)) write_token_row(peer_ptr(ctx, row, d), s, a, t, lane);
    return;
  }
  RowInRegisters words;
  words.load(x, s.payload_bytes, scales, scale_bytes, lane);
  const int K = s.experts_per_token;
  const int id = lane < K ? a.topk_ids[static_cast<size_t>(t) * K + lane] : 0;
  for (int d = 0; d < s.world; ++d) {
    if (!__any_sync(0xffffffffu, dest_of_lane == d)) continue;  // no expert of token t on rank d
    char* peer_row = peer_ptr(ctx, row, d);
    words.store(peer_row, s.payload_bytes, peer_row + scales_offset(s), scale_bytes, lane);
    store_header(peer_row, s, t, id, lane);
  }
}

// Quantizing (a.quantize): part `part` of `parts` of token t's row into slot `slot` of every rank that hosts one of
// its live experts, NVLink path. In the fast shape the parts are interleaved sets of 32-word iterations, so that at
// few tokens several warps share a row; otherwise part 0 quantizes the row once into this rank's copy of the slot
// and copies it to the peers' copies. Part 0 writes the header.
__device__ inline void store_quantized_token_row(const Context& ctx, size_t slot, const DispatchSendArgs& a, int t,
                                                 int lane, int dest_of_lane, int part, int parts) {
  const Sizes& s = ctx.s;
  char* row = ctx.dispatch_slots + slot * s.token_stride;  // this rank's copy; a peer's is peer_ptr(row, d)
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(bf16_row(s, a, t));
  if (!quantizes_by_words(s, addresses)) {
    if (part != 0) return;
    write_token_row(row, s, a, t, lane);
    __syncwarp();  // the lanes' bytes are visible to the whole warp before any lane copies them
    for (int d = 0; d < s.world; ++d)
      if (__any_sync(0xffffffffu, dest_of_lane == d) && d != s.rank)
        warp_copy(peer_ptr(ctx, row, d), row, s.token_stride, lane);
    return;
  }
  store_quantized_row(s, bf16_row(s, a, t), dest_of_lane, lane, part, parts,
                      [&](int d) { return peer_ptr(ctx, row, d); });
  if (part != 0) return;
  const int K = s.experts_per_token;
  const int id = lane < K ? a.topk_ids[static_cast<size_t>(t) * K + lane] : 0;
  for (int d = 0; d < s.world; ++d)
    if (__any_sync(0xffffffffu, dest_of_lane == d)) store_header(peer_ptr(ctx, row, d), s, t, id, lane);
}

// Warps per quantized row: as many as the grid has per token, up to one per 32-word iteration (1 off the fast
// shape's uses, where part 0 does it all). The same in every warp.
__device__ inline int quantize_parts(const Sizes& s, int my_tokens, int nwarps) {
  const int iterations = (s.payload_bytes / 16 + 31) / 32;
  return max(1, min(nwarps / max(my_tokens, 1), iterations));
}

// Once every block is done (its stores fenced / its puts quiet): the last block SETs our ready word everywhere, tagged
// with the round trip's epoch (unless some block did not send: then peers give up on the abort word).
__device__ inline void signal_ready(const Context& ctx, const DispatchSendArgs& a, int my_tokens, bool advance) {
  int32_t code;
  if (finish_phase(ctx, kDispatchSend, a.status, advance, &code)) {
    __threadfence_system();
    if (completed(code)) {
      const uint64_t ready = tagged(current_epoch(ctx), static_cast<uint32_t>(my_tokens));
      for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x)
        signal_peer(ctx, ctx.dispatch_ready + ctx.s.rank, ready, pe);
    }
    mark(ctx, kDispatchSend, kEnd, true);
  }
}

// The start of both send kernels: the protocol-order check (false: the phase did not run), then this replica's
// token count and the validation of every live token's ids.
__device__ inline bool begin_send(const Context& ctx, const DispatchSendArgs& a, int* my_tokens) {
  // The token count and this thread's first ids row do not depend on the protocol word: their loads go out with
  // it, not after it (a kernel's first loads are dependent steps, each a memory latency). The row is read for any token
  // below max_tokens (the ids are [max_tokens, K]) and used only if the token counts.
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, first = blockIdx.x * blockDim.x + threadIdx.x;
  const int raw_tokens = *a.num_tokens;
  const bool preload = first < s.max_tokens && K <= kUnrolledSlots;
  IdsRow first_row;
  if (preload) first_row = load_ids_row(a.topk_ids + static_cast<size_t>(first) * K, K);
  if (!begin_phase(ctx, kDispatchSend, a.status)) return false;
  int num_tokens;
  *my_tokens = replica_tokens(s, raw_tokens, &num_tokens);
  validate_ids(ctx, a, num_tokens, preload ? &first_row : nullptr);
  mark(ctx, kDispatchSend, kWaited);
  return true;
}

// The NVLink send (Context::p2p): a warp per token stores its row straight from x into each destination's slot (with
// Quantize, a.quantize: quantized, several warps per row at few tokens); then the ready signal. Blocks never wait on
// each other. False when the phase did not run (out of protocol order). `advance`: move the protocol on at the end
// (finish_phase; false in the fused dispatch). Quantize is a template parameter so that the other kernels keep
// their registers.
template <bool Quantize>
__device__ inline bool dispatch_send_p2p(const Context& ctx, const DispatchSendArgs& a, bool advance) {
  int my_tokens;
  if (!begin_send(ctx, a, &my_tokens)) return false;
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const int parts = Quantize ? quantize_parts(s, my_tokens, nwarps) : 1;

  for (int item = gwarp; item < my_tokens * parts; item += nwarps) {
    const int i = item / parts, part = item % parts;
    const int t = replica + i * s.dp_size;
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    const int id = lane < K ? ids[lane] : -1;
    const int dest_of_lane = lane_dest(s, ids, lane);
    mark(ctx, kDispatchSend, kStep1);  // the token's ids read (block 0's last token)
    const size_t slot = static_cast<size_t>(s.rank) * s.slots_per_source + i;
    if (part == 0) {
      const bool weighs = a.topk_weights != nullptr && lane < K;
      const float weight = weighs ? a.topk_weights[static_cast<size_t>(t) * K + lane] : 0.f;
      for (int d = 0; d < s.world; ++d) {
        int32_t* ids_row = peer_ptr(ctx, ctx.dispatch_ids + slot * K, d);
        if (lane < K) ids_row[lane] = id;
        if (weighs) peer_ptr(ctx, ctx.combine_weights, d)[slot * K + lane] = weight;
      }
    }
    mark(ctx, kDispatchSend, kStep2);  // the ids rows stored
    if constexpr (Quantize) {
      store_quantized_token_row(ctx, slot, a, t, lane, dest_of_lane, part, parts);
    } else {
      store_token_row(ctx, slot, a, t, lane, dest_of_lane);
    }
  }
  mark(ctx, kDispatchSend, kWorked);
  __threadfence_system();  // this thread's stores reach every peer before the ready signal
  mark(ctx, kDispatchSend, kClosed);
  signal_ready(ctx, a, my_tokens, advance);
  return true;
}


// The low-latency send (Context::flagged; the fused dispatch, dispatch.cu): our token count into our ready word on
// every rank, then a warp per token: its ids to every rank and its row (payload, scales) to every rank that hosts one
// of its live experts, in flagged words (each carries the epoch, and receivers poll the words themselves), so nothing
// is fenced, counted or signalled after them. Slot i holds the replica's token replica + i * dp_size, as in
// dispatch_send_p2p. False when the phase did not run (out of protocol order).
__device__ inline bool dispatch_send_flagged(const Context& ctx, const DispatchSendArgs& a) {
  int my_tokens;
  if (!begin_send(ctx, a, &my_tokens)) return false;
  const Sizes& s = ctx.s;
  const uint32_t epoch = current_epoch(ctx);
  if (blockIdx.x == 0)
    for (int d = threadIdx.x; d < s.world; d += blockDim.x)
      signal_peer(ctx, ctx.dispatch_ready + s.rank, tagged(epoch, static_cast<uint32_t>(my_tokens)), d);
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const int payload_pairs = s.payload_bytes / 8, pairs = flagged_row_words(s) / 2;
  for (int i = gwarp; i < my_tokens; i += nwarps) {
    const int t = replica + i * s.dp_size;
    const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
    const int dest_of_lane = lane_dest(s, ids, lane);
    const size_t slot = static_cast<size_t>(s.rank) * s.slots_per_source + i;
    if (lane < K) {
      const uint64_t id = tagged(epoch, static_cast<uint32_t>(ids[lane]));
      for (int d = 0; d < s.world; ++d)
        *reinterpret_cast<volatile uint64_t*>(peer_ptr(ctx, ctx.flagged_ids + slot * K + lane, d)) = id;
    }
    mark(ctx, kDispatchSend, kStep2);  // the ids stored (block 0's last token)
    const auto* x = reinterpret_cast<const uint2*>(static_cast<const char*>(a.x) + static_cast<size_t>(t) *
                                                   s.payload_bytes);
    const auto* scales = reinterpret_cast<const uint2*>(a.scales + static_cast<size_t>(t) * s.scale_cols);
    uint64_t* row = ctx.flagged_rows + slot * flagged_row_words(s);  // this rank's copy; rank d's is peer_ptr
    warp_store_flagged(x, payload_pairs, scales, pairs, epoch, s.world, [&](int d) {
      return __any_sync(0xffffffffu, dest_of_lane == d) ? peer_ptr(ctx, row, d) : nullptr;
    }, lane);
  }
  mark(ctx, kDispatchSend, kWorked);
  return true;
}

// The ids-first and windowed orders of the fused dispatch (dispatch.cu): every ids row of this replica (and its
// weights, if given) to every rank first, a thread per id. Slot i holds the replica's token replica + i * dp_size
// (AnyReplica, the windowed order), or token i (one replica per DP group, the ids-first order: its index arithmetic
// alone, for that kernel's registers).
template <bool AnyReplica>
__device__ inline void store_ids_rows(const Context& ctx, const DispatchSendArgs& a, int my_tokens) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const size_t first = static_cast<size_t>(s.rank) * s.slots_per_source * K;
  const int ids = my_tokens * K;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < ids; j += gridDim.x * blockDim.x) {
    const size_t from = AnyReplica ? (static_cast<size_t>(replica) + j / K * s.dp_size) * K + j % K : j;
    const int32_t id = a.topk_ids[from];
    for (int d = 0; d < s.world; ++d) peer_ptr(ctx, ctx.dispatch_ids + first, d)[j] = id;
    if (a.topk_weights != nullptr) {
      const float w = a.topk_weights[from];
      for (int d = 0; d < s.world; ++d) peer_ptr(ctx, ctx.combine_weights + first, d)[j] = w;
    }
  }
}

// Then (blocks [0, blocks)) each token's row to every other rank that hosts one of its live experts, a warp per
// token; this rank's own rows are read from x by its receive.
__device__ inline void store_remote_rows(const Context& ctx, const DispatchSendArgs& a, int my_tokens, int blocks) {
  const Sizes& s = ctx.s;
  const int lane = lane_index(), warps = blockDim.x / 32;
  for (int i = blockIdx.x * warps + threadIdx.x / 32; i < my_tokens; i += blocks * warps) {
    const int dest = lane_dest(s, a.topk_ids + static_cast<size_t>(i) * s.experts_per_token, lane);
    const int remote = dest == s.rank ? -1 : dest;
    if (!__any_sync(0xffffffffu, remote >= 0)) continue;  // every live expert is here: no row is loaded
    store_token_row(ctx, static_cast<size_t>(s.rank) * s.slots_per_source + i, a, i, lane, remote);
  }
}

// And once every block is past its rows (the senders' stores fenced), the last block SETs kRowsLanded in our ready
// word on every other rank.
__device__ inline void signal_rows_landed(const Context& ctx, const DispatchSendArgs& a, int my_tokens) {
  int32_t code;
  if (finish_phase(ctx, kDispatchSend, a.status, false, &code)) {
    __threadfence_system();
    if (completed(code)) {
      const uint64_t ready = tagged(current_epoch(ctx), kRowsLanded | static_cast<uint32_t>(my_tokens));
      for (int pe = threadIdx.x; pe < ctx.s.world; pe += blockDim.x)
        if (pe != ctx.s.rank) signal_peer(ctx, ctx.dispatch_ready + ctx.s.rank, ready, pe);
    }
    mark(ctx, kDispatchSend, kEnd, true);
  }
}

// A round of the windowed dispatch (dispatch.cu): this replica's slots [round * W, (round + 1) * W) (W =
// window_slots), slot i's token into slot (rank, i - round * W) of every rank that hosts one of its live experts,
// this rank included; a warp per token, or with Quantize per part of one (as dispatch_send_p2p).
template <bool Quantize>
__device__ inline void store_window_rows(const Context& ctx, const DispatchSendArgs& a, int my_tokens, int round) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, replica = s.rank % s.dp_size;
  const int lane = lane_index(), gwarp = grid_warp_index(), nwarps = grid_warps();
  const int first = round * s.window_slots, tokens = min(my_tokens - first, s.window_slots);  // <= 0: none
  const int parts = Quantize ? quantize_parts(s, max(tokens, 1), nwarps) : 1;
  for (int item = gwarp; item < tokens * parts; item += nwarps) {
    const int i = first + item / parts, part = item % parts, t = replica + i * s.dp_size;
    const int dest_of_lane = lane_dest(s, a.topk_ids + static_cast<size_t>(t) * K, lane);
    const size_t slot = static_cast<size_t>(s.rank) * s.window_slots + (i - first);
    if constexpr (Quantize) {
      store_quantized_token_row(ctx, slot, a, t, lane, dest_of_lane, part, parts);
    } else {
      store_token_row(ctx, slot, a, t, lane, dest_of_lane);
    }
  }
}

// A warp per token this replica sends.
inline int dispatch_send_blocks(const Sizes& s) {
  return blocks_for(s.slots_per_source, kThreads / 32, 8 * s.sm_count);
}

}  // namespace jmc
