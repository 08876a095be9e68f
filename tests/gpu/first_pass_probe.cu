// first_pass_probe.cu: splits the first-pass cost of a small kernel into data latency, TLB misses and
// instruction fetch. Each sample is a fresh launch right after a kernel that rewrites a 64 MB buffer:
// dependent-load chases (L2 hit, HBM, one load per 2 MB page, within one 2 MB page, after a TLB thrash),
// S KB of straight-line code run twice, and %globaltimer itself. Prints medians of 21 launches; GPU 0.
// Build: nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/first_pass_probe tests/gpu/first_pass_probe.cu
// Run:   /tmp/first_pass_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) {                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kReps = 21;
constexpr int kChase = 32;  // dependent loads per chase
constexpr size_t kLine = 128, kSlot4K = 4096, kPage = 2ull << 20;
constexpr size_t kBigBytes = 1ull << 30, kEvictBytes = 64ull << 20, kL2Bytes = 64ull << 10;
constexpr size_t kThrashPages = 4096;  // 8 GB of 2 MB pages, one line each, for the TLB-thrash probe

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
  return t;
}
__device__ __forceinline__ uint64_t clock_cycles() {
  uint64_t c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) : : "memory");
  return c;
}
// L1 bypass, so a repeated chase measures an L2 hit (a cold chase misses L1 either way).
__device__ __forceinline__ uint64_t load_cg(uint64_t addr) {
  uint64_t v;
  asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

__global__ void evict_kernel(uint4* buf, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = buf[i];
    buf[i] = make_uint4(v.x ^ salt, v.y + v.x, v.z * 3u + v.w, v.w);
  }
}

// Every block touches one line in each 2 MB page of an 8 GB buffer, so every SM's TLBs turn over.
__global__ void tlb_thrash_kernel(const uint32_t* buf, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t p = threadIdx.x; p < kThrashPages; p += blockDim.x)
    acc += buf[(p * kPage + blockIdx.x % 16 * kLine) / sizeof(uint32_t)];
  if (acc == 0x9e3779b9u) *sink = acc;
}

// pairs[2i] = byte offset of node i, pairs[2i+1] = byte offset of the node it points to.
__global__ void write_nodes_kernel(char* base, const uint64_t* pairs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) *reinterpret_cast<uint64_t*>(base + pairs[2 * i]) = reinterpret_cast<uint64_t>(base + pairs[2 * i + 1]);
}

struct ChaseOut {
  uint64_t self_node;  // points to itself: pass 0 chases it to warm this kernel's code
  uint64_t sink;
  uint64_t ns[3], clk[3];
};

// Pass 0: warm-up on self_node. Pass 1: the probed chain, cold. Pass 2: the same chain again.
// Storing the final pointer makes the second timer read wait for the last load.
__global__ void chase_kernel(uint64_t head, ChaseOut* out) {
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    uint64_t p = pass == 0 ? reinterpret_cast<uint64_t>(&out->self_node) : head;
    const int n = pass == 0 ? 2 : kChase;
    const uint64_t t0 = globaltimer(), c0 = clock_cycles();
#pragma unroll 1
    for (int i = 0; i < n; ++i) p = load_cg(p);
    *reinterpret_cast<volatile uint64_t*>(&out->sink) = p;
    const uint64_t t1 = globaltimer(), c1 = clock_cycles();
    out->ns[pass] = t1 - t0, out->clk[pass] = c1 - c0;
  }
}

// One thread runs kBytes of straight-line FFMA (16 B of SASS each) twice; out = ns[2], clk[2], sinks[2].
// Four independent chains keep it issue-bound rather than FMA-latency-bound. The first store
// makes the parameter loads finish before the clock starts.
template <int kBytes>
__global__ void icache_kernel(float a, float b, uint64_t* out) {
  float x0 = threadIdx.x, x1 = x0 + 1.f, x2 = x0 + 2.f, x3 = x0 + 3.f;
  *reinterpret_cast<volatile float*>(&out[5]) = a + b;
  uint64_t t_prev = globaltimer(), c_prev = clock_cycles();
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int i = 0; i < kBytes / 64; ++i) {
      asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x0) : "f"(a), "f"(b));
      asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x1) : "f"(a), "f"(b));
      asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x2) : "f"(a), "f"(b));
      asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x3) : "f"(a), "f"(b));
    }
    const uint64_t t = globaltimer(), c = clock_cycles();
    out[pass] = t - t_prev, out[2 + pass] = c - c_prev;
    t_prev = t, c_prev = c;
  }
  out[4] = __float_as_uint(x0 + x1 + x2 + x3);
}

// out = {two consecutive globaltimer reads (ns), two consecutive clock64 reads (cycles), timer tick (ns)}.
__global__ void timer_kernel(uint64_t* out) {
  const uint64_t t0 = globaltimer(), t1 = globaltimer();
  const uint64_t c0 = clock_cycles(), c1 = clock_cycles();
  uint64_t a = globaltimer(), b, c;
  do b = globaltimer(); while (b == a);
  do c = globaltimer(); while (c == b);
  out[0] = t1 - t0, out[1] = c1 - c0, out[2] = c - b;
}

struct Row {
  std::string name;
  double units;  // per_unit_ns = median_ns / units
  std::vector<double> ns = {}, clk = {};
};
static double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int main() {
  CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf("device: %s, SM clock %.0f MHz, %d SMs\n", prop.name, clock_khz / 1e3, prop.multiProcessorCount);

  char *big, *l2buf;
  uint4* evict_buf;
  uint32_t* thrash_buf;
  uint64_t* d_out;
  ChaseOut* d_chase;
  CHECK(cudaMalloc(&big, kBigBytes));
  CHECK(cudaMalloc(&l2buf, kPage));  // own 2 MB allocation; the chain uses its first 64 KB
  CHECK(cudaMalloc(&evict_buf, kEvictBytes));
  CHECK(cudaMalloc(&thrash_buf, kThrashPages * kPage));
  CHECK(cudaMalloc(&d_chase, sizeof(ChaseOut)));
  CHECK(cudaMalloc(&d_out, 8 * sizeof(uint64_t)));
  CHECK(cudaMemset(evict_buf, 0, kEvictBytes));
  ChaseOut init{};
  init.self_node = reinterpret_cast<uint64_t>(&d_chase->self_node);
  CHECK(cudaMemcpy(d_chase, &init, sizeof(init), cudaMemcpyHostToDevice));

  // Chains: each node on its own 128 B line, kChase nodes in a random cycle.
  std::mt19937_64 rng(12345);
  std::vector<uint8_t> big_used(kBigBytes / kLine), l2_used(kL2Bytes / kLine);
  auto pick = [&](std::vector<uint8_t>& used, size_t base, size_t slots, size_t stride) {
    size_t off;
    do off = base + rng() % slots * stride; while (used[off / kLine]);
    used[off / kLine] = 1;
    return off;
  };
  std::vector<uint64_t> big_pairs, l2_pairs;
  auto add_chain = [](const std::vector<size_t>& offs, std::vector<uint64_t>& pairs) {
    for (size_t i = 0; i < offs.size(); ++i) pairs.insert(pairs.end(), {offs[i], offs[(i + 1) % offs.size()]});
    return offs[0];
  };
  std::vector<size_t> offs(kChase), pages(kBigBytes / kPage);
  for (auto& o : offs) o = pick(l2_used, 0, kL2Bytes / kLine, kLine);
  const uint64_t l2_head = reinterpret_cast<uint64_t>(l2buf) + add_chain(offs, l2_pairs);

  // Probe 0 chases the L2-resident chain; probes 1-4 get a fresh chain in the 1 GB buffer per repetition.
  const char* names[5] = {"l2_chase_32", "hbm_chase_32", "tlb_2mb_pages_32", "same_page_32", "tlb_thrashed_32"};
  std::vector<uint64_t> heads[5];
  for (int r = 0; r < kReps; ++r) {
    for (int probe = 1; probe < 5; ++probe) {
      if (probe == 1) {  // random 4 KB slots
        for (auto& o : offs) o = pick(big_used, 0, kBigBytes / kSlot4K, kSlot4K);
      } else if (probe == 3) {  // 32 lines of one 2 MB page
        const size_t page = rng() % pages.size();
        for (auto& o : offs) o = pick(big_used, page * kPage, kPage / kLine, kLine);
      } else {  // one line in each of 32 distinct 2 MB pages
        for (size_t i = 0; i < pages.size(); ++i) pages[i] = i;
        std::shuffle(pages.begin(), pages.end(), rng);
        for (int i = 0; i < kChase; ++i) offs[i] = pick(big_used, pages[i] * kPage, kPage / kLine, kLine);
      }
      heads[probe].push_back(reinterpret_cast<uint64_t>(big) + add_chain(offs, big_pairs));
    }
  }
  const int n_big = int(big_pairs.size() / 2), n_l2 = int(l2_pairs.size() / 2);
  uint64_t *d_big_pairs, *d_l2_pairs;
  CHECK(cudaMalloc(&d_big_pairs, big_pairs.size() * sizeof(uint64_t)));
  CHECK(cudaMalloc(&d_l2_pairs, l2_pairs.size() * sizeof(uint64_t)));
  CHECK(cudaMemcpy(d_big_pairs, big_pairs.data(), big_pairs.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_l2_pairs, l2_pairs.data(), l2_pairs.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
  write_nodes_kernel<<<(n_big + 255) / 256, 256>>>(big, d_big_pairs, n_big);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());

  uint32_t salt = 1;
  auto evict = [&] {
    evict_kernel<<<4 * prop.multiProcessorCount, 512>>>(evict_buf, kEvictBytes / sizeof(uint4), salt++);
    CHECK(cudaGetLastError());
  };
  const int icache_kb[4] = {4, 16, 32, 64};
  void (*icache_kernels[4])(float, float, uint64_t*) = {icache_kernel<4 << 10>, icache_kernel<16 << 10>,
                                                        icache_kernel<32 << 10>, icache_kernel<64 << 10>};
  std::vector<Row> rows;
  for (const char* name : names)
    for (const char* pass : {" pass1", " pass2"}) rows.push_back({std::string(name) + pass, double(kChase)});
  const size_t icache_row = rows.size();
  for (int kb : icache_kb)
    for (const char* pass : {" pass1", " pass2"})
      rows.push_back({"icache_" + std::to_string(kb) + "KB" + pass, double(kb)});
  const size_t timer_row = rows.size();
  for (const char* name : {"globaltimer_delta", "clock64_delta", "globaltimer_tick"}) rows.push_back({name, 1.0});
  auto record = [&](size_t row, uint64_t ns, uint64_t clk) {
    rows[row].ns.push_back(double(ns));
    rows[row].clk.push_back(double(clk));
  };

  for (int r = 0; r < kReps; ++r) {
    for (int probe = 0; probe < 5; ++probe) {
      evict();
      if (probe == 0)  // the L2 chain is written by the kernel just before the chase
        write_nodes_kernel<<<1, 256>>>(l2buf, d_l2_pairs, n_l2);
      if (probe == 4)
        tlb_thrash_kernel<<<2 * prop.multiProcessorCount, 256>>>(thrash_buf, reinterpret_cast<uint32_t*>(d_out));
      CHECK(cudaGetLastError());
      chase_kernel<<<1, 1>>>(probe == 0 ? l2_head : heads[probe][r], d_chase);
      CHECK(cudaGetLastError());
      ChaseOut h;
      CHECK(cudaMemcpy(&h, d_chase, sizeof(h), cudaMemcpyDeviceToHost));
      for (int pass = 1; pass <= 2; ++pass) record(2 * probe + pass - 1, h.ns[pass], h.clk[pass]);
    }
    for (int k = 0; k < 4; ++k) {
      evict();
      icache_kernels[k]<<<1, 1>>>(1.0001f, 0.5f, d_out);
      CHECK(cudaGetLastError());
      uint64_t h[4];
      CHECK(cudaMemcpy(h, d_out, sizeof(h), cudaMemcpyDeviceToHost));
      for (int pass = 0; pass < 2; ++pass) record(icache_row + 2 * k + pass, h[pass], h[2 + pass]);
    }
    evict();
    timer_kernel<<<1, 1>>>(d_out);
    CHECK(cudaGetLastError());
    uint64_t h[3];
    CHECK(cudaMemcpy(h, d_out, sizeof(h), cudaMemcpyDeviceToHost));
    record(timer_row, h[0], 0);
    record(timer_row + 1, 0, h[1]);
    record(timer_row + 2, h[2], 0);
  }

  std::printf("medians of %d launches; per_unit_ns is per load for chases, per KB for icache\n", kReps);
  std::printf("%-24s %12s %12s %12s\n", "probe", "median_ns", "per_unit_ns", "median_clk");
  for (const Row& row : rows) {
    const double ns = median(row.ns);
    std::printf("%-24s %12.0f %12.1f %12.0f\n", row.name.c_str(), ns, ns / row.units, median(row.clk));
  }
  return 0;
}
