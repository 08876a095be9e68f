// combine_recv: y[t] = sum over live slots k (in slot order) of w[t,k] * row(t,k), accumulated in fp32; or, when
// combine_send pre-reduced, the sum of the token's partial rows over the ranks that hold its experts.
// Each thread owns kChunk consecutive columns of one token row and waits for that token's live slots itself, so
// every SM works even when one token is live (a warp per token would walk the whole row serially). The last
// block to finish resets the arrival counters. Then the one global barrier: wait for every
// peer's sync flag (it has finished reading the dispatch buffers this rank writes next) and reset it.
#pragma once

#include "device_common.cuh"
#include "dtypes.cuh"

namespace jmc {

constexpr int kSlotBatch = 4;  // slots whose chunks a thread loads before it adds them (loads in flight)

// Pre-reduced rows: how many partial rows a token has, one per distinct rank hosting one of its live slots (they
// sit at [token][0, n): partial_place).
__device__ inline int partial_rows(const Sizes& s, const int32_t* ids) {
  int ranks[kMaxExpertsPerToken];
  int n = 0;
  for (unsigned live = live_slots(ids, s.experts_per_token, s.num_experts); live; live &= live - 1) {
    const int r = ids[__ffs(live) - 1] / s.local_experts;
    bool seen = false;
    for (int j = 0; j < n; ++j) seen |= ranks[j] == r;
    if (!seen) ranks[n++] = r;
  }
  return n;
}

// A walk over (token, kChunk columns) items `stride` apart from `first`, its place kept by additions: a 64-bit
// division per item is tens of instructions for each 16-byte load.
struct ChunkWalk {
  int token, chunk;  // the current item: its token (from the walk's first token) and chunk of the row
  int step_tokens, step_chunks, chunks_per_row;
  __device__ ChunkWalk(long long first, long long stride, int chunks_per_row)
      : token(static_cast<int>(first / chunks_per_row)),
        chunk(static_cast<int>(first % chunks_per_row)),
        step_tokens(static_cast<int>(stride / chunks_per_row)),
        step_chunks(static_cast<int>(stride % chunks_per_row)),
        chunks_per_row(chunks_per_row) {}
  __device__ void next() {
    token += step_tokens;
    chunk += step_chunks;
    if (chunk >= chunks_per_row) {
      chunk -= chunks_per_row;
      ++token;
    }
  }
};

// Pre-reduced rows, summed into out (partial rows of type In) in place order (their ranks ascending). A warp takes a
// contiguous range of (token, kChunk columns) items, lanes interleaved (coalesced), kPartialSteps steps' loads in
// flight per lane. A lane's steps stay within one token for many steps (28 at R1), so the token's ids row is read
// once and its count of partial rows kept (a grid-strided item per thread would meet a new token's ids row, a
// first-touch load, at every step, before the partial rows' loads).
// Tokens [first_token, first_token + tokens) (all, or a round of the windowed combine, whose partial rows sit at
// their places in the round's window: token t at t - first_token).
constexpr int kPartialSteps = 4;
template <typename In, typename Out>
__device__ inline void sum_partial_rows(const Context& ctx, const CombineRecvArgs& a, int num_tokens, bool vector,
                                        int first_token, int tokens) {
  const Sizes& s = ctx.s;
  const int chunks_per_row = (s.hidden + kChunk - 1) / kChunk;
  const long long items = static_cast<long long>(tokens) * chunks_per_row;
  const int lane = lane_index();
  const long long gwarp = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / 32;
  const long long nwarps = static_cast<long long>(gridDim.x) * blockDim.x / 32;
  const long long per_warp = ((items + nwarps - 1) / nwarps + 31) / 32 * 32;
  const long long first_item = gwarp * per_warp, end = min(items, first_item + per_warp);
  int rows_of = -1, n = 0;  // the token whose partial rows `n` counts
  const auto partial = [&](int j, int t, int c0) {  // token t's partial row from its j-th rank, from column c0
    const size_t at = static_cast<size_t>(t - first_token) * s.experts_per_token + j;
    return reinterpret_cast<const In*>(ctx.combine_partials + at * s.combine_stride) + c0;
  };
  ChunkWalk walk(first_item + lane, 32, chunks_per_row);  // the lane's next item
  for (long long base = first_item + lane; base < end; base += 32 * kPartialSteps) {
    Chunk<In> v[kPartialSteps][kSlotBatch];
    int t[kPartialSteps], c0[kPartialSteps], parts[kPartialSteps];
#pragma unroll
    for (int u = 0; u < kPartialSteps; ++u) {  // the counts, then the loads of every step
      const long long item = base + 32 * u;
      t[u] = first_token + walk.token;
      c0[u] = walk.chunk * kChunk;
      walk.next();
      parts[u] = 0;
      if (item >= end || t[u] >= num_tokens) continue;
      if (t[u] != rows_of) {
        n = partial_rows(s, a.topk_ids + static_cast<size_t>(t[u]) * s.experts_per_token);
        rows_of = t[u];
      }
      parts[u] = n;
      if (!vector || n > kSlotBatch) continue;  // added below from memory, one row at a time
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b)
        if (b < n) v[u][b] = *reinterpret_cast<const Chunk<In>*>(partial(b, t[u], c0[u]));
    }
#pragma unroll
    for (int u = 0; u < kPartialSteps; ++u) {
      if (base + 32 * u >= end) continue;
      const int cols = min(kChunk, s.hidden - c0[u]);
      float acc[kChunk] = {};
      if (vector && parts[u] <= kSlotBatch) {
#pragma unroll
        for (int b = 0; b < kSlotBatch; ++b)
          if (b < parts[u])
#pragma unroll
            for (int c = 0; c < kChunk; ++c) acc[c] += to_float(v[u][b].v[c]);
      } else if (parts[u] > 0) {
        if (t[u] != rows_of) {
          n = partial_rows(s, a.topk_ids + static_cast<size_t>(t[u]) * s.experts_per_token);
          rows_of = t[u];
        }
        for (int j = 0; j < n; ++j) add_chunk(acc, 1.f, partial(j, t[u], c0[u]), vector, cols);
      }
      store_chunk(static_cast<Out*>(a.out) + static_cast<size_t>(t[u]) * s.hidden + c0[u], acc, vector, cols);
    }
    mark(ctx, kCombineRecv, kStep2);  // block 0's (last) chunk summed
  }
}

// The split receive's pre-reduced rows (vector rows), summed into out as sum_partial_rows sums them. It runs after
// the work placed between the halves, which took L2, often under an SM budget that leaves it few warps: what bounds
// it is the bytes each warp has in flight. A warp takes a contiguous range of (token, segment) units, a segment being
// `steps` chunks per lane of one row (the row split evenly), and issues every load of a unit before it uses one:
// kSplitLoadBytes per lane (Steps chunks of each of up to Rows partial rows, Rows the most a token has). More bytes
// than these spill at the kernel's 128 registers.
constexpr int kSplitLoadBytes = 128;
template <typename In, typename Out, int Rows>
__device__ inline void sum_partial_segments(const Context& ctx, const CombineRecvArgs& a, int num_tokens) {
  constexpr int Steps = kSplitLoadBytes / (Rows * static_cast<int>(sizeof(Chunk<In>)));
  static_assert(Steps >= 1, "kSplitLoadBytes holds a chunk of every partial row");
  const Sizes& s = ctx.s;
  const int chunks_per_row = s.hidden / kChunk;  // vector rows: a whole number of chunks
  const int lane_chunks = (chunks_per_row + 31) / 32;  // per lane and row
  const int segments = (lane_chunks + Steps - 1) / Steps;  // per row, each of steps <= Steps chunks per lane
  const int steps = (lane_chunks + segments - 1) / segments;
  const int units = s.max_tokens * segments;
  const int nwarps = grid_warps(), per_warp = (units + nwarps - 1) / nwarps;
  const int first = grid_warp_index() * per_warp, end = min(units, first + per_warp);
  const int lane = lane_index();
  int t = first / segments, segment = first % segments;  // the current unit
  int rows_of = -1, n = 0;  // the token whose partial rows `n` counts
  for (int unit = first; unit < end; ++unit) {
    if (t != rows_of) {
      n = t < num_tokens ? partial_rows(s, a.topk_ids + static_cast<size_t>(t) * s.experts_per_token) : 0;
      rows_of = t;
    }
    // The lane's chunks are c_first + 32 * u: one address per row, the steps at constant offsets from it.
    const int c_first = segment * 32 * steps + lane;
    const Chunk<In>* row = reinterpret_cast<const Chunk<In>*>(
        ctx.combine_partials + static_cast<size_t>(t) * s.experts_per_token * s.combine_stride) + c_first;
    const size_t row_step = s.combine_stride / sizeof(Chunk<In>);  // from one partial row to the next
    Chunk<Out>* out = reinterpret_cast<Chunk<Out>*>(static_cast<Out*>(a.out) + static_cast<size_t>(t) * s.hidden) +
                      c_first;
    Chunk<In> v[Steps][Rows];
    if (n <= Rows) {
#pragma unroll
      for (int u = 0; u < Steps; ++u)
#pragma unroll
        for (int b = 0; b < Rows; ++b)
          if (b < n && u < steps && c_first + 32 * u < chunks_per_row) v[u][b] = row[b * row_step + 32 * u];
    }
#pragma unroll
    for (int u = 0; u < Steps; ++u) {
      if (u >= steps || c_first + 32 * u >= chunks_per_row) continue;
      float acc[kChunk] = {};
      if (n <= Rows) {
#pragma unroll
        for (int b = 0; b < Rows; ++b)
          if (b < n)
#pragma unroll
            for (int j = 0; j < kChunk; ++j) acc[j] += to_float(v[u][b].v[j]);
      } else {  // more partial rows than kept in flight: added from memory, one row at a time
        for (int j = 0; j < n; ++j) add_chunk(acc, 1.f, row[j * row_step + 32 * u].v, true, kChunk);
      }
      store_chunk(out[32 * u].v, acc, true, kChunk);
    }
    mark(ctx, kCombineRecv, kStep2);  // block 0's (last) segment summed
    if (++segment == segments) {
      segment = 0;
      ++t;
    }
  }
}

// The split receive's sum for every EP group size: as many steps of loads as a token's most partial rows (one per
// rank of the group, at most one per slot) leave room for.
template <typename In, typename Out>
__device__ inline void sum_split_partial_rows(const Context& ctx, const CombineRecvArgs& a, int num_tokens) {
  const int most = min(ctx.s.world, ctx.s.experts_per_token);
  if (most == 1)
    sum_partial_segments<In, Out, 1>(ctx, a, num_tokens);
  else if (most == 2)
    sum_partial_segments<In, Out, 2>(ctx, a, num_tokens);
  else
    sum_partial_segments<In, Out, 4>(ctx, a, num_tokens);
}

// Rows per slot: waits for each of token t's live slots' flags (this epoch's: landed, or dropped by the expert rank
// for capacity), then acc += w[k] * row(t, k) over the landed ones, slots in order 0..K-1 like the reference. The
// rows sit at token t - first_token of combine_slots (a round's window; first_token 0: all tokens).
template <typename In>
__device__ inline void add_slots(const Context& ctx, const int32_t* ids, const float* weights, int t, int first_token,
                                 int c0, float* acc, bool vector, int cols) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token;
  const uint64_t arrived = tagged(current_epoch(ctx), kSlotLanded);
  const uint64_t* flags = ctx.combine_flags + static_cast<size_t>(t) * K;
  const unsigned live = live_slots(ids, K, s.num_experts);
  // Every live slot's flag loaded at once (their loads in flight together), then a wait for any not there yet.
  uint64_t seen[kUnrolledSlots];
#pragma unroll
  for (int k = 0; k < kUnrolledSlots; ++k) seen[k] = k < K && (live >> k & 1u) ? load_relaxed(flags + k) : 0;
  acquire_fence();  // the rows below are read after the flags that say they landed
  unsigned live_mask = 0;  // the live slots whose rows landed
  for (unsigned m = live; m; m &= m - 1) {
    const int k = __ffs(m) - 1;
    uint64_t flag = k < kUnrolledSlots ? seen[k] : 0;
    if (flag < arrived && !(flag = wait_for(ctx, flags + k, arrived, kCombineRecv, ids[k] / s.local_experts))) return;
    if (value_of(flag) == kSlotLanded) live_mask |= 1u << k;
  }
  mark(ctx, kCombineRecv, kStep1);  // block 0's (last) token's rows arrived
  const char* slots = ctx.combine_slots + static_cast<size_t>(t - first_token) * K * s.combine_stride;
  const auto slot_row = [&](int k) {
    return reinterpret_cast<const In*>(slots + static_cast<size_t>(k) * s.combine_stride) + c0;
  };
  if (!vector) {
    for (unsigned m = live_mask; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      add_chunk(acc, weights[k], slot_row(k), false, cols);
    }
    return;
  }
  // kSlotBatch slots' chunks are loaded before any is added (loads in flight); slots are still added in order.
  const auto is_live = [&](int k) { return k < K && (live_mask >> k & 1u); };
  for (int k0 = 0; k0 < K; k0 += kSlotBatch) {
    Chunk<In> v[kSlotBatch];
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b)
      if (is_live(k0 + b)) v[b] = *reinterpret_cast<const Chunk<In>*>(slot_row(k0 + b));
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      if (!is_live(k0 + b)) continue;
      const float w = weights[k0 + b];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) acc[j] += w * to_float(v[b].v[j]);
    }
  }
}

// The round trip's status on every rank alike: the lowest rank's first failure of this epoch, as every rank
// published it before its sync flag (which block 0 has waited for from every peer), into combine_recv's scratch.
JMC_COLD void merge_round_failures(const Context& ctx) {
  const uint32_t epoch = current_epoch(ctx);
  const int32_t* entries = ctx.round_failures + (epoch & 1u) * ctx.s.world * kStatusWords;
  for (int pe = 0; pe < ctx.s.world; ++pe) {
    const volatile int32_t* entry = entries + pe * kStatusWords;
    if (entry[kCode] == 0 || static_cast<uint32_t>(entry[kEpochWord]) != epoch) continue;
    int32_t words[kStatusWords];
    for (int i = 0; i < kStatusWords; ++i) words[i] = entry[i];
    record(phase_status(ctx, kCombineRecv), words);
    return;
  }
}

// Every byte of y as 0xff: NaN in every output dtype. The result of a round trip that failed, on every rank.
template <typename Out>
__device__ inline void fill_nan(const Context& ctx, void* out, bool whole_grid) {
  const size_t words = static_cast<size_t>(ctx.s.max_tokens) * ctx.s.hidden * sizeof(Out) / 4;
  const size_t first = whole_grid ? blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x : threadIdx.x;
  const size_t stride = whole_grid ? static_cast<size_t>(gridDim.x) * blockDim.x : blockDim.x;
  for (size_t i = first; i < words; i += stride) static_cast<uint32_t*>(out)[i] = 0xffffffffu;
  if (threadIdx.x == 0 && (!whole_grid || blockIdx.x == 0))  // a tail of less than 4 bytes (odd fp16/bf16 sizes)
    for (size_t b = words * 4; b < static_cast<size_t>(ctx.s.max_tokens) * ctx.s.hidden * sizeof(Out); ++b)
      static_cast<uint8_t*>(out)[b] = 0xff;
}

// Rows per slot into y for tokens [first_token, first_token + tokens) (all of them, or a round of the windowed
// combine), a thread per (token, kChunk columns), waiting for that token's rows. Rows past num_tokens are zero.
template <typename In, typename Out>
__device__ inline void sum_slot_rows(const Context& ctx, const CombineRecvArgs& a, int num_tokens, bool vector,
                                     int first_token, int tokens) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token;
  const int chunks_per_row = (s.hidden + kChunk - 1) / kChunk;
  const size_t items = static_cast<size_t>(tokens) * chunks_per_row;
  for (size_t item = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int t = first_token + static_cast<int>(item / chunks_per_row);
    const int c0 = static_cast<int>(item % chunks_per_row) * kChunk;
    const int cols = min(kChunk, s.hidden - c0);
    float acc[kChunk] = {};
    if (t < num_tokens)
      add_slots<In>(ctx, a.topk_ids + static_cast<size_t>(t) * K, a.topk_weights + static_cast<size_t>(t) * K, t,
                    first_token, c0, acc, vector, cols);
    store_chunk(static_cast<Out*>(a.out) + static_cast<size_t>(t) * s.hidden + c0, acc, vector, cols);
    mark(ctx, kCombineRecv, kStep2);  // block 0's (last) chunk summed
  }
}

// The low-latency path (Context::flagged): token t's chunk of columns [c0, c0 + kChunk) over its live slots, as
// add_slots sums them (acc += w[k] * row(t, k), slots in order 0..K-1), each slot's chunk polled from its flagged
// words; a slot whose flag says its expert rank dropped it (capacity) adds nothing. kSlotBatch slots' words are
// loaded before any is waited for. False when a wait gave up.
template <typename In>
__device__ inline bool add_flagged_slots(const Context& ctx, const int32_t* ids, const float* weights, int t, int c0,
                                         float* acc, Patience& patience) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token;
  constexpr int kPairs = kChunk * sizeof(In) / 8;  // flagged pairs of one chunk
  const uint32_t epoch = current_epoch(ctx);
  const uint64_t dropped = tagged(epoch, kSlotDropped);
  const unsigned live = live_slots(ids, K, s.num_experts);
  const auto words_of = [&](int k) {  // the chunk's flagged words in slot (t, k)'s row
    return ctx.flagged_combine + (static_cast<size_t>(t) * K + k) * flagged_combine_words(s) +
           c0 * sizeof(In) / 4;
  };
  for (int k0 = 0; k0 < K; k0 += kSlotBatch) {
    ulonglong2 w[kSlotBatch][kPairs];
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b)
      if (k0 + b < K && (live >> (k0 + b) & 1u))
#pragma unroll
        for (int q = 0; q < kPairs; ++q) w[b][q] = load_flagged_pair(words_of(k0 + b) + 2 * q);
#pragma unroll
    for (int b = 0; b < kSlotBatch; ++b) {
      const int k = k0 + b;
      if (k >= K || !(live >> k & 1u)) continue;
      const auto landed = [&] {
        bool all = true;
#pragma unroll
        for (int q = 0; q < kPairs; ++q) all = all && pair_landed(w[b][q], epoch);
        return all;
      };
      bool here = true;
      while (!landed()) {  // the chunk's words again, until they hold this round trip's data
        if (*reinterpret_cast<const volatile uint64_t*>(ctx.combine_flags + static_cast<size_t>(t) * K + k) ==
            dropped) {
          here = false;
          break;
        }
        if (patience.gave_up(ctx, kCombineRecv, ids[k] / s.local_experts)) return false;
#pragma unroll
        for (int q = 0; q < kPairs; ++q) w[b][q] = load_flagged_pair(words_of(k) + 2 * q);
      }
      if (!here) continue;
      union {
        uint32_t words[2 * kPairs];
        Chunk<In> chunk;
      } v;
#pragma unroll
      for (int q = 0; q < kPairs; ++q) {
        v.words[2 * q] = value_of(w[b][q].x);
        v.words[2 * q + 1] = value_of(w[b][q].y);
      }
      const float weight = weights[k];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) acc[j] += weight * to_float(v.chunk.v[j]);
    }
  }
  mark(ctx, kCombineRecv, kStep1);  // block 0's (last) token's rows summed
  return true;
}

// The low-latency path's rows per slot into y, a thread per (token, kChunk columns) as sum_slot_rows (rows of a
// multiple of kChunk columns: Context::flagged). Rows past num_tokens are zero; after a wait gave up the thread's
// later chunks are left (y is NaN then).
template <typename In, typename Out>
__device__ inline void sum_flagged_slot_rows(const Context& ctx, const CombineRecvArgs& a, int num_tokens) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token, chunks_per_row = s.hidden / kChunk;
  const size_t items = static_cast<size_t>(s.max_tokens) * chunks_per_row;
  Patience patience;
  for (size_t item = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(item / chunks_per_row), c0 = static_cast<int>(item % chunks_per_row) * kChunk;
    float acc[kChunk] = {};
    if (t < num_tokens && !add_flagged_slots<In>(ctx, a.topk_ids + static_cast<size_t>(t) * K,
                                                 a.topk_weights + static_cast<size_t>(t) * K, t, c0, acc, patience))
      return;
    store_chunk(static_cast<Out*>(a.out) + static_cast<size_t>(t) * s.hidden + c0, acc, true, kChunk);
    mark(ctx, kCombineRecv, kStep2);  // block 0's (last) chunk summed
  }
}

// Whole-chunk vector loads/stores need every row start 16-byte aligned (slot rows are; output rows need this).
template <typename Out>
__device__ inline bool vector_rows(const Sizes& s) {
  return s.hidden % kChunk == 0 && (s.hidden * sizeof(Out)) % 16 == 0;
}

// The end of every combine_recv: the global barrier (block 0, a thread per peer: every peer has read its dispatch
// buffers, so our next dispatch_send may write them, and has published its failures of this round trip, which
// block 0 merges), then the round trip's status; a round trip that failed anywhere gives NaN here, on every rank
// alike.
// With `send_status` (the low-latency kernel) the send's end comes first, in the same last block.
template <typename Out>
__device__ inline void end_combine(const Context& ctx, const CombineRecvArgs& a, int32_t* send_status = nullptr) {
  const Sizes& s = ctx.s;
  const uint64_t signalled = tagged(current_epoch(ctx), 1);
  mark(ctx, kCombineRecv, kWorked);
  if (blockIdx.x == 0) {
    bool all_here = true, published = threadIdx.x == 0 && __ldg(&ctx.local->published) == current_epoch(ctx);
    for (int pe = threadIdx.x; pe < s.world; pe += blockDim.x) {
      if (pe == s.rank) continue;
      const uint64_t flag = wait_for(ctx, ctx.sync_flags + pe, signalled, kCombineRecv, pe);
      all_here &= flag != 0;
      published |= (value_of(flag) & kPublishedFailure) != 0;
    }
    const bool all = __syncthreads_and(all_here), any = __syncthreads_or(published);
    if (all && any && threadIdx.x == 0) merge_round_failures(*ctx.on_device);
  }
  if (!last_block_done(ctx.local->blocks_done + kCombineRecv)) return;
  if (send_status != nullptr) {
    close_phase(ctx, kCombineSend, send_status, false, nullptr);
    mark(ctx, kCombineSend, kEnd, true);
  }
  int32_t code;
  close_phase(ctx, kCombineRecv, a.status, true, &code);
  if (code != 0) fill_nan<Out>(ctx, a.out, false);
  mark(ctx, kCombineRecv, kEnd, true);
}


// The staged path's pre-reduced rows (combine_send_reduced_staged) into y, a thread per (token, kChunk columns) as
// sum_slot_rows: token t's partial rows, one per distinct rank of its live slots, ranks ascending (as
// sum_partial_rows adds them), each row `route` (the token's, Context::group_routes) of the run of (t's source,
// that rank). Dynamic shared memory: [dp_size][world] int, where each run of this DP group's sources begins in
// combine_partials (the group's sources in order, each one's runs by rank, Context::group_counts: partial_run_first).
template <typename In, typename Out>
__device__ inline void sum_staged_partial_rows(const Context& ctx, const CombineRecvArgs& a, int num_tokens,
                                               bool vector) {
  const Sizes& s = ctx.s;
  const int K = s.experts_per_token;
  extern __shared__ int run_first[];
  for (int item = threadIdx.x; item < s.dp_size * s.world; item += blockDim.x)
    run_first[item] = partial_run_first(ctx.group_counts, s.world, item / s.world, item % s.world);
  __syncthreads();
  const int chunks_per_row = (s.hidden + kChunk - 1) / kChunk, last_row = s.max_tokens * K - 1;
  const size_t items = static_cast<size_t>(s.max_tokens) * chunks_per_row;
  for (size_t item = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; item < items;
       item += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(item / chunks_per_row), c0 = static_cast<int>(item % chunks_per_row) * kChunk;
    const int cols = min(kChunk, s.hidden - c0);
    float acc[kChunk] = {};
    if (t < num_tokens) {
      const int q = t % s.dp_size, i = t / s.dp_size;
      const int32_t* ids = a.topk_ids + static_cast<size_t>(t) * K;
      const int32_t* routes = ctx.group_routes + (static_cast<size_t>(q) * s.slots_per_source + i) * K;
      const unsigned live = live_slots(ids, K, s.num_experts);
      for (int last = -1;;) {  // the smallest rank above the last one added, until none is left
        int next = s.world, route = 0;
        for (unsigned m = live; m; m &= m - 1) {
          const int k = __ffs(m) - 1, r = ids[k] / s.local_experts;
          if (r > last && r < next) {
            next = r;
            route = routes[k];
          }
        }
        if (next == s.world) break;
        last = next;
        // Clamped: a failed round trip's routes never address outside the rows (its y is NaN anyway).
        const int row = min(max(run_first[q * s.world + next] + route, 0), last_row);
        add_chunk(acc, 1.f, reinterpret_cast<const In*>(ctx.combine_partials +
                                                        static_cast<size_t>(row) * s.combine_stride) + c0,
                  vector, cols);
      }
    }
    store_chunk(static_cast<Out*>(a.out) + static_cast<size_t>(t) * s.hidden + c0, acc, vector, cols);
    mark(ctx, kCombineRecv, kStep2);  // block 0's (last) chunk summed
  }
}

// The phase after its protocol-order check (combine_recv.cu), or right after the send in the fused combine
// (combine.cu). StagedPartials: the staged path's pre-reduced rows (combine_recv.cu alone; a.reduced).
// Split: the split receive (combine_recv.cu), whose vector rows sum_split_partial_rows sums.
template <typename In, typename Out, bool StagedPartials = false, bool Split = false>
__device__ inline void receive_combined(const Context& ctx, const CombineRecvArgs& a) {
  const Sizes& s = ctx.s;
  const int num_tokens = min(max(*a.num_tokens, 0), s.max_tokens);
  if (StagedPartials || a.reduced) {  // one partial row per expert rank, all signalled at once by each combine_send
    for (int pe = threadIdx.x; pe < s.world; pe += blockDim.x)
      wait_for(ctx, ctx.partials_ready + pe, tagged(current_epoch(ctx), 1), kCombineRecv, pe);
    __syncthreads();
    mark(ctx, kCombineRecv, kWaited);
    if constexpr (StagedPartials) {
      sum_staged_partial_rows<In, Out>(ctx, a, num_tokens, vector_rows<Out>(s));
    } else if constexpr (Split) {
      if (vector_rows<Out>(s))
        sum_split_partial_rows<In, Out>(ctx, a, num_tokens);
      else
        sum_partial_rows<In, Out>(ctx, a, num_tokens, false, 0, s.max_tokens);
    } else {
      sum_partial_rows<In, Out>(ctx, a, num_tokens, vector_rows<Out>(s), 0, s.max_tokens);
    }
  } else {
    sum_slot_rows<In, Out>(ctx, a, num_tokens, vector_rows<Out>(s), 0, s.max_tokens);
  }
  end_combine<Out>(ctx, a);
}

// A thread per (token, kChunk columns).
inline int combine_recv_blocks(const Sizes& s) {
  return blocks_for(static_cast<long long>(s.max_tokens) * ((s.hidden + kChunk - 1) / kChunk), kThreads,
                    8 * s.sm_count);
}

}  // namespace jmc
