// copy_floor_probe.cu: how fast the round trip's two large copies can run on this GPU, apart from the library's
// kernels (their lookups, layout, protocol and registers). At R1's sizes (T tokens, K = 8, H = 7168):
//   fan-out: each token's fp8 row (7,168 bytes) and fp32 scales (224) stored to its K places among T * K rows (a
//            random permutation: the dispatch's expert_x at world 1);
//   reduce:  each token's K bf16 rows (14,336 bytes each, at its K places) weighted and summed in fp32, slot order,
//            into one bf16 row (the combine's pre-reduction, whose one partial row at world 1 is the result).
// Each copy by several styles: registers (a warp per token or per segment, N rows' loads in flight per lane, as the
// library's copies are), cp.async into shared memory with S stages, and TMA bulk copies (sm_90) with S stages; with
// every SM (as many blocks per SM as fit) and under an SM budget (--sms blocks, one per SM, as MoEComm(max_sms=...)
// launches). Beside them each copy's floors: a memset of the written bytes, a read of the read bytes. Every
// variant's result is compared, bit for bit, with the host's. Prints µs (median of --reps), GB/s of the bytes the copy
// must move, warps per SM and registers. GPU 0.
// Build: nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/copy_floor_probe tests/gpu/copy_floor_probe.cu
// Run:   /tmp/copy_floor_probe [--tokens 4096] [--sms 24] [--reps 11]
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#define CHECK(call)                                                                                     \
  do {                                                                                                  \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));        \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

namespace ptx = cuda::ptx;

constexpr int kK = 8, kH = 7168;
constexpr int kPayload = kH;                    // fp8 row bytes
constexpr int kScaleBytes = kH / 128 * 4;       // fp32 scale per 128 columns
constexpr int kPayloadVecs = kPayload / 16;     // 16-byte words of a payload row
constexpr int kLaneVecs = kPayloadVecs / 32;    // ... per lane
constexpr int kScaleVecs = kScaleBytes / 16;    // lanes that hold one scale word
constexpr int kRowVecs = kH * 2 / 16;           // 16-byte words of a bf16 row
constexpr int kStageRow = (kPayload + kScaleBytes + 127) / 128 * 128;  // a fan-out stage: payload, scales
static_assert(kPayloadVecs % 32 == 0 && kScaleVecs <= 32 && kScaleBytes % 16 == 0, "R1 rows");

__device__ inline int lane_id() { return threadIdx.x % 32; }
__device__ inline int warp_id() { return (blockIdx.x * blockDim.x + threadIdx.x) / 32; }
__device__ inline int warp_count() { return gridDim.x * blockDim.x / 32; }

// ---- fan-out -----------------------------------------------------------------------------------------------------

// A warp per kTokens tokens: each token's row loaded once into registers (every load in flight before any store),
// then stored to each of its places; the places are read by lanes 0..K-1 before the row.
template <int kTokens>
__global__ void __launch_bounds__(256, 1) fan_out_registers(const int4* x, const int4* xs, const int* places, int4* ex, int4* es, int T) {
  const int lane = lane_id();
  for (int t0 = warp_id() * kTokens; t0 < T; t0 += warp_count() * kTokens) {
    int place[kTokens];
    int4 words[kTokens][kLaneVecs], scale[kTokens];
#pragma unroll
    for (int u = 0; u < kTokens; ++u) place[u] = t0 + u < T && lane < kK ? places[(t0 + u) * kK + lane] : 0;
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      if (t0 + u >= T) continue;
#pragma unroll
      for (int j = 0; j < kLaneVecs; ++j) words[u][j] = x[static_cast<size_t>(t0 + u) * kPayloadVecs + j * 32 + lane];
      if (lane < kScaleVecs) scale[u] = xs[(t0 + u) * kScaleVecs + lane];
    }
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      if (t0 + u >= T) continue;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const size_t p = __shfl_sync(0xffffffffu, place[u], k);
#pragma unroll
        for (int j = 0; j < kLaneVecs; ++j) ex[p * kPayloadVecs + j * 32 + lane] = words[u][j];
        if (lane < kScaleVecs) es[p * kScaleVecs + lane] = scale[u];
      }
    }
  }
}

// A warp per token, its lane 0 driving the copy engine: the row into one of the warp's kStages stages of shared
// memory (one bulk copy each for payload and scales), then K bulk stores of each from there; the next row loads while
// this one stores. Lanes 0..K-1 read the next token's places while its row loads.
template <int kStages>
__global__ void fan_out_bulk(const char* x, const char* xs, const int* places, char* ex, char* es, int T) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t landed[32][kStages];
  const int lane = lane_id(), w = threadIdx.x / 32, warp = warp_id(), warps = warp_count();
  char* stages = smem + static_cast<size_t>(w) * kStages * kStageRow;
  const int mine = warp < T ? (T - warp + warps - 1) / warps : 0;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&landed[w][s], 1);
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncwarp();
  int place_next = 0, place_now = 0;
  for (int n = 0; n <= mine; ++n) {
    if (n < mine) {
      const int t = warp + n * warps;
      place_next = lane < kK ? places[t * kK + lane] : 0;
      if (lane == 0) {
        // The stage is free once the stores of the row it held (n - kStages) have read it: groups committed so far
        // run to n - 2, so kStages - 2 may still be pending.
        if (n >= kStages) ptx::cp_async_bulk_wait_group_read(ptx::n32_t<kStages - 2>{});
        char* stage = stages + (n % kStages) * kStageRow;
        uint64_t* bar = &landed[w][n % kStages];
        ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar,
                                       kPayload + kScaleBytes);
        ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, stage, x + static_cast<size_t>(t) * kPayload,
                           kPayload, bar);
        ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, stage + kPayload, xs + t * kScaleBytes,
                           kScaleBytes, bar);
      }
    }
    if (n >= 1) {
      const int m = n - 1;
      if (lane == 0) {
        while (!ptx::mbarrier_try_wait_parity(&landed[w][m % kStages], static_cast<uint32_t>(m / kStages) & 1u)) {
        }
      }
      const char* stage = stages + (m % kStages) * kStageRow;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const size_t p = __shfl_sync(0xffffffffu, place_now, k);
        if (lane == 0) {
          ptx::cp_async_bulk(ptx::space_global, ptx::space_shared, ex + p * kPayload, stage, kPayload);
          ptx::cp_async_bulk(ptx::space_global, ptx::space_shared, es + p * kScaleBytes, stage + kPayload,
                             kScaleBytes);
        }
      }
      if (lane == 0) ptx::cp_async_bulk_commit_group();
    }
    place_now = place_next;
  }
  if (lane == 0) ptx::cp_async_bulk_wait_group(ptx::n32_t<0>{});  // the stores done before the stages go
}

// ---- reduce ------------------------------------------------------------------------------------------------------

__device__ inline void add_bf16x8(float* acc, float w, const int4& v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}
__device__ inline int4 to_bf16x8(const float* acc) {
  int4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}

// A warp per (token, segment of kChunks 16-byte words per lane), kRows rows' words in flight per lane before any is
// added (the library's pre-reduction: 2 rows, 4 words, two blocks per SM). ptxas keeps that many loads ahead of the
// first add only with room for their registers: without a launch bound it interleaves them with the adds.
template <int kRows, int kChunks, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) reduce_registers(const int4* y, const int* places, const float* weights, int4* out, int T) {
  constexpr int kSegVecs = 32 * kChunks;
  static_assert(kRowVecs % kSegVecs == 0, "whole segments");
  constexpr int kSegments = kRowVecs / kSegVecs;
  const int lane = lane_id();
  for (int item = warp_id(); item < T * kSegments; item += warp_count()) {
    const int t = item / kSegments, seg = item % kSegments;
    const int my_place = lane < kK ? places[t * kK + lane] : 0;
    const float my_weight = lane < kK ? weights[t * kK + lane] : 0.f;
    float acc[kChunks][8] = {};
#pragma unroll
    for (int k0 = 0; k0 < kK; k0 += kRows) {
      const int4* row[kRows];
#pragma unroll
      for (int b = 0; b < kRows; ++b)
        row[b] = y + static_cast<size_t>(__shfl_sync(0xffffffffu, my_place, k0 + b)) * kRowVecs + seg * kSegVecs + lane;
      int4 v[kRows][kChunks];
#pragma unroll
      for (int b = 0; b < kRows; ++b)
#pragma unroll
        for (int u = 0; u < kChunks; ++u) v[b][u] = row[b][u * 32];
#pragma unroll
      for (int b = 0; b < kRows; ++b) {
        const float wt = __shfl_sync(0xffffffffu, my_weight, k0 + b);
#pragma unroll
        for (int u = 0; u < kChunks; ++u) add_bf16x8(acc[u], wt, v[b][u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kChunks; ++u) out[static_cast<size_t>(t) * kRowVecs + seg * kSegVecs + u * 32 + lane] =
        to_bf16x8(acc[u]);
  }
}

// A warp per token, its row walked 32 words (one per lane) at a time; each step's K rows' words copied by cp.async
// into the warp's stage (a lane's own words: no barrier between lanes), kStages steps in flight, then summed from
// there. A warp's steps run on across its tokens, so the pipeline never drains between them.
template <int kStages>
__global__ void reduce_cp_async(const int4* y, const int* places, const float* weights, int4* out, int T) {
  extern __shared__ __align__(128) int4 stage_words[];  // [warp][kStages][kK][32]
  constexpr int kSteps = kRowVecs / 32;
  const int lane = lane_id(), warp = warp_id(), warps = warp_count();
  int4* stages = stage_words + static_cast<size_t>(threadIdx.x / 32) * kStages * kK * 32;
  const int mine = warp < T ? (T - warp + warps - 1) / warps : 0, units = mine * kSteps;
  // The places of the token being issued (ahead by up to kStages - 1 steps) and of the one being summed.
  int ahead_token = -1, sum_token = -1;
  int ahead_place[kK];
  float weight[kK];
  const auto issue = [&](int v) {
    if (v < units) {
      const int t = warp + v / kSteps * warps, step = v % kSteps;
      if (t != ahead_token) {
        ahead_token = t;
#pragma unroll
        for (int k = 0; k < kK; ++k) ahead_place[k] = places[t * kK + k];
      }
      int4* stage = stages + (v % kStages) * kK * 32;
#pragma unroll
      for (int k = 0; k < kK; ++k)
        __pipeline_memcpy_async(stage + k * 32 + lane, y + static_cast<size_t>(ahead_place[k]) * kRowVecs + step * 32 + lane,
                                16);
    }
    __pipeline_commit();  // an empty group past the end keeps the count of groups in flight
  };
  for (int v = 0; v < kStages - 1; ++v) issue(v);
  for (int u = 0; u < units; ++u) {
    issue(u + kStages - 1);
    __pipeline_wait_prior(kStages - 1);
    const int t = warp + u / kSteps * warps, step = u % kSteps;
    if (t != sum_token) {
      sum_token = t;
#pragma unroll
      for (int k = 0; k < kK; ++k) weight[k] = weights[t * kK + k];
    }
    const int4* stage = stages + (u % kStages) * kK * 32;
    float acc[8] = {};
#pragma unroll
    for (int k = 0; k < kK; ++k) add_bf16x8(acc, weight[k], stage[k * 32 + lane]);
    out[static_cast<size_t>(t) * kRowVecs + step * 32 + lane] = to_bf16x8(acc);
  }
}

// As reduce_cp_async, with lane 0 driving the copy engine: each step's K row segments (kSegVecs words each) by one
// bulk copy apiece into the step's stage, an mbarrier per stage; every lane waits for it, sums its words, and the warp
// meets before lane 0 refills the stage.
template <int kStages, int kSegVecs>
__global__ void reduce_bulk(const int4* y, const int* places, const float* weights, int4* out, int T) {
  extern __shared__ __align__(128) int4 stage_words[];  // [warp][kStages][kK][kSegVecs]
  __shared__ uint64_t landed[32][kStages];
  constexpr int kSteps = kRowVecs / kSegVecs, kPerLane = kSegVecs / 32;
  static_assert(kRowVecs % kSegVecs == 0 && kSegVecs % 32 == 0, "whole segments");
  const int lane = lane_id(), w = threadIdx.x / 32, warp = warp_id(), warps = warp_count();
  int4* stages = stage_words + static_cast<size_t>(w) * kStages * kK * kSegVecs;
  const int mine = warp < T ? (T - warp + warps - 1) / warps : 0, units = mine * kSteps;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&landed[w][s], 1);
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncwarp();
  int issue_token = -1, issue_place[kK];
  const auto issue = [&](int v) {  // lane 0
    if (v >= units) return;
    const int t = warp + v / kSteps * warps, step = v % kSteps;
    if (t != issue_token) {
      issue_token = t;
#pragma unroll
      for (int k = 0; k < kK; ++k) issue_place[k] = places[t * kK + k];
    }
    int4* stage = stages + (v % kStages) * kK * kSegVecs;
    uint64_t* bar = &landed[w][v % kStages];
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar,
                                   kK * kSegVecs * 16);
#pragma unroll
    for (int k = 0; k < kK; ++k)
      ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, stage + k * kSegVecs,
                         y + static_cast<size_t>(issue_place[k]) * kRowVecs + step * kSegVecs, kSegVecs * 16, bar);
  };
  if (lane == 0)
    for (int v = 0; v < kStages - 1; ++v) issue(v);
  int sum_token = -1;
  float weight[kK];
  for (int u = 0; u < units; ++u) {
    if (lane == 0) issue(u + kStages - 1);
    const int t = warp + u / kSteps * warps, step = u % kSteps;
    if (t != sum_token) {
      sum_token = t;
#pragma unroll
      for (int k = 0; k < kK; ++k) weight[k] = weights[t * kK + k];
    }
    while (!ptx::mbarrier_try_wait_parity(&landed[w][u % kStages], static_cast<uint32_t>(u / kStages) & 1u)) {
    }
    const int4* stage = stages + (u % kStages) * kK * kSegVecs;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      float acc[8] = {};
#pragma unroll
      for (int k = 0; k < kK; ++k) add_bf16x8(acc, weight[k], stage[k * kSegVecs + j * 32 + lane]);
      out[static_cast<size_t>(t) * kRowVecs + step * kSegVecs + j * 32 + lane] = to_bf16x8(acc);
    }
    // Every lane's reads of this stage before lane 0's next copy into it (a write of the async proxy).
    __syncwarp();
    if (lane == 0) ptx::fence_proxy_async(ptx::space_shared);
  }
}

// ---- floors and helpers ------------------------------------------------------------------------------------------

// Reads every 16-byte word of `words`, 4 in flight per thread; a sum no one sees keeps the loads.
__global__ void read_all(const int4* words, size_t n, int* sink) {
  int acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = words[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) acc ^= words[i].x;
  if (acc == 0x5eed1234) *sink = acc;
}

// Rewrites a buffer larger than L2 between timed runs, so no run finds the last one's lines there.
__global__ void scrub(int4* words, size_t n, int salt) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    words[i] = make_int4(salt, static_cast<int>(i), salt, 0);
}

static uint16_t bf16_bits(float f) {  // round to nearest even, as __floats2bfloat162_rn (no NaN here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
}
static float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Launch {
  int blocks, threads;
  size_t shared;
  int warps_per_sm;
};

int main(int argc, char** argv) {
  int T = 4096, budget = 24, reps = 11;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") T = std::atoi(argv[i + 1]);
    else if (a == "--sms") budget = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else return std::fprintf(stderr, "usage: %s [--tokens T] [--sms N] [--reps R]\n", argv[0]), 2;
  }
  if (T < 1 || budget < 1 || reps < 1) return std::fprintf(stderr, "need --tokens, --sms, --reps >= 1\n"), 2;
  CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t N = static_cast<size_t>(T) * kK;
  std::printf("%s, %d SMs, L2 %d MB; T=%d K=%d H=%d; budget %d SMs; median of %d\n", prop.name, sms,
              prop.l2CacheSize >> 20, T, kK, kH, budget, reps);

  // Inputs: random rows, a random permutation of the T * K places, weights in [0, 1).
  std::mt19937 rng(1234);
  std::vector<int> places(N);
  std::iota(places.begin(), places.end(), 0);
  std::shuffle(places.begin(), places.end(), rng);
  std::vector<uint8_t> hx(static_cast<size_t>(T) * kPayload), hxs(static_cast<size_t>(T) * kScaleBytes);
  for (auto& b : hx) b = static_cast<uint8_t>(rng());
  for (auto& b : hxs) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> unit(-1.f, 1.f), positive(0.f, 1.f);
  std::vector<uint16_t> hy(N * kH);
  for (auto& h : hy) h = bf16_bits(unit(rng));
  std::vector<float> hw(N);
  for (auto& w : hw) w = positive(rng);

  // The host's results: every row at each of its places; the fp32 sums in slot order, rounded to bf16.
  std::vector<uint8_t> want_ex(N * kPayload), want_es(N * kScaleBytes);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < kK; ++k) {
      const size_t p = places[static_cast<size_t>(t) * kK + k];
      std::memcpy(&want_ex[p * kPayload], &hx[static_cast<size_t>(t) * kPayload], kPayload);
      std::memcpy(&want_es[p * kScaleBytes], &hxs[static_cast<size_t>(t) * kScaleBytes], kScaleBytes);
    }
  std::vector<uint16_t> want_out(static_cast<size_t>(T) * kH);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < kH; ++c) {
      float acc = 0.f;
      for (int k = 0; k < kK; ++k) {
        const size_t slot = static_cast<size_t>(t) * kK + k;
        acc = std::fmaf(hw[slot], bf16_value(hy[static_cast<size_t>(places[slot]) * kH + c]), acc);
      }
      want_out[static_cast<size_t>(t) * kH + c] = bf16_bits(acc);
    }

  char *x, *xs, *ex, *es;
  int4 *y, *out, *scrub_buf;
  int *d_places, *sink;
  float* d_w;
  const size_t scrub_words = (3ull * prop.l2CacheSize) / 16;
  CHECK(cudaMalloc(&x, hx.size()));
  CHECK(cudaMalloc(&xs, hxs.size()));
  CHECK(cudaMalloc(&ex, want_ex.size()));
  CHECK(cudaMalloc(&es, want_es.size()));
  CHECK(cudaMalloc(&y, hy.size() * 2));
  CHECK(cudaMalloc(&out, want_out.size() * 2));
  CHECK(cudaMalloc(&scrub_buf, scrub_words * 16));
  CHECK(cudaMalloc(&d_places, N * 4));
  CHECK(cudaMalloc(&d_w, N * 4));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemcpy(x, hx.data(), hx.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(xs, hxs.data(), hxs.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(y, hy.data(), hy.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_places, places.data(), N * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w, hw.data(), N * 4, cudaMemcpyHostToDevice));

  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // Median µs of `reps` runs of `body`, each after a scrub of L2.
  const auto time_us = [&](const std::function<void()>& body) {
    std::vector<float> ms;
    for (int r = 0; r < reps + 1; ++r) {
      scrub<<<2 * sms, 1024>>>(scrub_buf, scrub_words, r);
      CHECK(cudaEventRecord(start));
      body();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      CHECK(cudaGetLastError());
      float m = 0;
      CHECK(cudaEventElapsedTime(&m, start, stop));
      if (r > 0) ms.push_back(m);  // the first run loads the code
    }
    std::sort(ms.begin(), ms.end());
    return 1e3 * ms[ms.size() / 2];
  };
  // Every SM, as many blocks of `threads` as fit; or the budget: one block per SM on `budget` SMs, the largest block
  // (up to 1024 threads) that fits one per SM. `shared_per_warp`: the kernel's dynamic shared memory per warp.
  const auto launch_for = [&](const void* kernel, bool on_budget, int threads, size_t shared_per_warp) {
    if (on_budget) {
      cudaFuncAttributes attributes{};
      CHECK(cudaFuncGetAttributes(&attributes, kernel));
      for (int t = 1024; t >= 32; t /= 2) {
        if (t > attributes.maxThreadsPerBlock) continue;  // __launch_bounds__: the occupancy API does not check it
        int per_sm = 0;
        const size_t shared = shared_per_warp * (t / 32);
        if (shared > 0 &&
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)) !=
                cudaSuccess) {
          cudaGetLastError();
          continue;
        }
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, t, shared) == cudaSuccess && per_sm >= 1)
          return Launch{budget, t, shared, t / 32};
        cudaGetLastError();
      }
      return Launch{0, 0, 0, 0};
    }
    const size_t shared = shared_per_warp * (threads / 32);
    if (shared > 0)
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared));
    return Launch{per_sm * sms, threads, shared, per_sm * threads / 32};
  };
  const double fan_out_bytes = static_cast<double>(T) * (kPayload + kScaleBytes) * (1 + kK);
  const double reduce_bytes = static_cast<double>(T) * kH * 2 * (kK + 1);
  int failures = 0;
  const auto report = [&](const char* copy, const char* style, const char* where, const Launch& l, int regs,
                          double us, double bytes, bool ok) {
    std::printf("%-8s %-26s %-8s %5d x %4d  %3d warps/SM  %3d regs  %9.1f us  %7.1f GB/s  %s\n", copy, style, where,
                l.blocks, l.threads, l.warps_per_sm, regs, us, bytes / us * 1e-3, ok ? "ok" : "WRONG");
    failures += !ok;
  };

  // Floors: the fan-out's writes (a memset of its rows) and reads; the reduce's reads (a read of y) and writes.
  {
    const double us_w = time_us([&] {
      CHECK(cudaMemsetAsync(ex, 1, N * kPayload));
      CHECK(cudaMemsetAsync(es, 1, N * kScaleBytes));
    });
    std::printf("%-8s %-26s %-8s %52.1f us  %7.1f GB/s\n", "fan-out", "floor: memset of the rows", "all", us_w,
                N * (kPayload + kScaleBytes) / us_w * 1e-3);
    const double us_r = time_us([&] { read_all<<<4 * sms, 512>>>(y, N * kRowVecs, sink); });
    std::printf("%-8s %-26s %-8s %52.1f us  %7.1f GB/s\n", "reduce", "floor: read of the rows", "all", us_r,
                N * kH * 2 / us_r * 1e-3);
    const double us_rw = time_us([&] { CHECK(cudaMemsetAsync(out, 1, static_cast<size_t>(T) * kH * 2)); });
    std::printf("%-8s %-26s %-8s %52.1f us  %7.1f GB/s\n", "reduce", "floor: memset of the result", "all", us_rw,
                static_cast<double>(T) * kH * 2 / us_rw * 1e-3);
  }

  // A copy style: its kernel, a launch of it on the copy's buffers, its block size with every SM and its dynamic
  // shared memory per warp.
  struct Variant {
    const char* style;
    const void* kernel;
    std::function<void(const Launch&)> run;
    int threads;
    size_t shared_per_warp;
  };
  // Each variant with every SM and on the budget: its result (from a cleared output) checked, then timed.
  const auto run_variants = [&](const char* copy, const std::vector<Variant>& variants,
                                const std::function<void()>& clear, const std::function<bool()>& right,
                                double bytes) {
    for (const auto& v : variants) {
      cudaFuncAttributes attributes{};
      CHECK(cudaFuncGetAttributes(&attributes, v.kernel));
      for (const bool on_budget : {false, true}) {
        const char* where = on_budget ? "budget" : "all";
        const Launch l = launch_for(v.kernel, on_budget, v.threads, v.shared_per_warp);
        if (l.blocks == 0) continue;
        clear();
        v.run(l);
        if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {  // a launch refused: say so, go on
          std::printf("%s %s: launch %d x %d failed: %s\n", where, v.style, l.blocks, l.threads, cudaGetErrorString(e));
          ++failures;
          continue;
        }
        CHECK(cudaDeviceSynchronize());
        const bool ok = right();
        report(copy, v.style, where, l, attributes.numRegs, time_us([&] { v.run(l); }), bytes, ok);
      }
    }
  };

  const auto in_words = [&](auto kernel) {  // the fan-out's kernels on 16-byte words
    return [=](const Launch& l) {
      kernel<<<l.blocks, l.threads, l.shared>>>(reinterpret_cast<int4*>(x), reinterpret_cast<int4*>(xs), d_places,
                                                reinterpret_cast<int4*>(ex), reinterpret_cast<int4*>(es), T);
    };
  };
  const auto in_bytes = [&](auto kernel) {  // ... and on bytes (bulk copies)
    return [=](const Launch& l) { kernel<<<l.blocks, l.threads, l.shared>>>(x, xs, d_places, ex, es, T); };
  };
  std::vector<uint8_t> got_ex(want_ex.size()), got_es(want_es.size());
  run_variants(
      "fan-out",
      {{"registers, 1 token/warp", reinterpret_cast<const void*>(fan_out_registers<1>),
        in_words(fan_out_registers<1>), 256, 0},
       {"registers, 2 tokens/warp", reinterpret_cast<const void*>(fan_out_registers<2>),
        in_words(fan_out_registers<2>), 256, 0},
       {"bulk, 2 stages", reinterpret_cast<const void*>(fan_out_bulk<2>), in_bytes(fan_out_bulk<2>), 128,
        2 * kStageRow},
       {"bulk, 3 stages", reinterpret_cast<const void*>(fan_out_bulk<3>), in_bytes(fan_out_bulk<3>), 128,
        3 * kStageRow},
       {"bulk, 4 stages", reinterpret_cast<const void*>(fan_out_bulk<4>), in_bytes(fan_out_bulk<4>), 64,
        4 * kStageRow}},
      [&] {
        CHECK(cudaMemset(ex, 0, N * kPayload));
        CHECK(cudaMemset(es, 0, N * kScaleBytes));
      },
      [&] {
        CHECK(cudaMemcpy(got_ex.data(), ex, got_ex.size(), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(got_es.data(), es, got_es.size(), cudaMemcpyDeviceToHost));
        return got_ex == want_ex && got_es == want_es;
      },
      fan_out_bytes);

  const auto plain = [&](auto kernel) {
    return [=](const Launch& l) { kernel<<<l.blocks, l.threads, l.shared>>>(y, d_places, d_w, out, T); };
  };
  std::vector<uint16_t> got_out(want_out.size());
  run_variants(
      "reduce",
      {{"registers, 2 rows x 4, 2/SM", reinterpret_cast<const void*>(reduce_registers<2, 4, 2>),
        plain(reduce_registers<2, 4, 2>), 256, 0},
       {"registers, 4 rows x 4", reinterpret_cast<const void*>(reduce_registers<4, 4, 1>),
        plain(reduce_registers<4, 4, 1>), 256, 0},
       {"registers, 8 rows x 2", reinterpret_cast<const void*>(reduce_registers<8, 2, 1>),
        plain(reduce_registers<8, 2, 1>), 256, 0},
       {"registers, 8 rows x 2, 2/SM", reinterpret_cast<const void*>(reduce_registers<8, 2, 2>),
        plain(reduce_registers<8, 2, 2>), 256, 0},
       {"registers, 8 rows x 4", reinterpret_cast<const void*>(reduce_registers<8, 4, 1>),
        plain(reduce_registers<8, 4, 1>), 256, 0},
       {"cp.async, 2 stages", reinterpret_cast<const void*>(reduce_cp_async<2>), plain(reduce_cp_async<2>), 256,
        2 * kK * 32 * 16},
       {"cp.async, 3 stages", reinterpret_cast<const void*>(reduce_cp_async<3>), plain(reduce_cp_async<3>), 256,
        3 * kK * 32 * 16},
       {"cp.async, 4 stages", reinterpret_cast<const void*>(reduce_cp_async<4>), plain(reduce_cp_async<4>), 256,
        4 * kK * 32 * 16},
       {"cp.async, 8 stages", reinterpret_cast<const void*>(reduce_cp_async<8>), plain(reduce_cp_async<8>), 128,
        8 * kK * 32 * 16},
       {"bulk, 2 stages x 1 KB", reinterpret_cast<const void*>(reduce_bulk<2, 64>), plain(reduce_bulk<2, 64>), 128,
        2 * kK * 64 * 16},
       {"bulk, 4 stages x 1 KB", reinterpret_cast<const void*>(reduce_bulk<4, 64>), plain(reduce_bulk<4, 64>), 128,
        4 * kK * 64 * 16},
       {"bulk, 4 stages x 512 B", reinterpret_cast<const void*>(reduce_bulk<4, 32>), plain(reduce_bulk<4, 32>), 128,
        4 * kK * 32 * 16}},
      [&] { CHECK(cudaMemset(out, 0, got_out.size() * 2)); },
      [&] {
        CHECK(cudaMemcpy(got_out.data(), out, got_out.size() * 2, cudaMemcpyDeviceToHost));
        return got_out == want_out;
      },
      reduce_bytes);
  std::printf("%d wrong\n", failures);
  return failures == 0 ? 0 : 1;
}
