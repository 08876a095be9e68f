// dispatch_send's in-kernel quantization (DispatchSendArgs::quantize): bf16 rows to float8_e4m3fn with one fp32
// scale per block of B = hidden / scale_cols elements, as the rows are sent. The arithmetic of the reference
// quantizer (jax_moe_comm/quantize.py), in fp32, bit for bit: scale = amax * float(1 / 448) (1 for an all-zero
// block), then x * (1 / scale) clamped to +-448 and rounded to nearest even. NaN propagates as in XLA's max and
// clamp: a block with a NaN has amax NaN (scale 1) and keeps its NaN; an infinity gives scale inf and NaN for itself
// (inf * 0), so no non-finite input turns into finite rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "device_common.cuh"

namespace jmc {

constexpr float kFp8Max = 448.f;
constexpr int kQuantBatch = 8;  // 16-byte fp8 words per lane whose bf16 loads the fast shape issues together

__device__ inline float block_scale(float amax) { return amax > 0.f ? amax * (1.f / kFp8Max) : 1.f; }

// max(a, b), NaN if either is (fmaxf ignores a NaN).
__device__ inline float nan_max(float a, float b) { return a > b || a != a ? a : b; }

// x clamped to +-448, NaN kept (fminf/fmaxf would turn it into a bound).
__device__ inline float clamp_fp8(float x) { return x != x ? x : fminf(fmaxf(x, -kFp8Max), kFp8Max); }

// Two quantized values, packed low first (the byte order of a float8 array).
__device__ inline uint32_t fp8_pair(float a, float b) {
  const float2 v = make_float2(clamp_fp8(a), clamp_fp8(b));
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
}

// Any shape: a warp quantizes bf16 row `x` into `payload` (fp8) and `scales`, block by block, with byte stores (for
// local memory: this rank's copy of a slot, or staging).
__device__ inline void warp_quantize_row(char* payload, float* scales, const __nv_bfloat16* x, const Sizes& s,
                                         int lane) {
  const int block = s.hidden / s.scale_cols;
  for (int b = 0; b < s.scale_cols; ++b) {
    const __nv_bfloat16* xb = x + static_cast<size_t>(b) * block;
    float amax = 0.f;
    for (int i = lane; i < block; i += 32) amax = nan_max(amax, fabsf(__bfloat162float(xb[i])));
    for (int offset = 16; offset; offset >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = block_scale(amax), inverse = 1.f / scale;
    for (int i = lane; i < block; i += 32)
      payload[static_cast<size_t>(b) * block + i] = static_cast<char>(fp8_pair(__bfloat162float(xb[i]) * inverse, 0.f));
    if (lane == 0) scales[b] = scale;
  }
}

// The fast shape: the row addresses and sizes are 16-byte aligned, and a block spans a power of two of 16-element
// words, at most a warp's (B = 16 .. 512).
__device__ inline bool quantizes_by_words(const Sizes& s, uintptr_t addresses) {
  const int block = s.hidden / s.scale_cols, words = block / 16;
  return ((addresses | s.payload_bytes) & 15) == 0 && block % 16 == 0 && words <= 32 && (words & (words - 1)) == 0;
}

// The fast shape: a warp quantizes its part of bf16 row `x` (of `parts`: interleaved 32-word iterations) 16-byte word
// by word (payload word w = j * 32 + lane: fp8 elements
// 16w .. 16w + 15) and stores each word, and each block's scale (from the block's first lane), into the row of every
// rank `dest_of_lane` names (a lane's live expert's rank), at `row`'s offset in that rank's copy. The lanes of one
// block (B / 16 consecutive lanes) reduce its amax by shuffles. kQuantBatch words in registers at a time: the fused
// dispatch's other paths keep their register budget.
template <typename PeerRow>
__device__ inline void store_quantized_row(const Sizes& s, const __nv_bfloat16* x, int dest_of_lane, int lane,
                                           int part, int parts, PeerRow peer_row) {
  const int lanes_per_block = s.hidden / s.scale_cols / 16;
  const int words = s.payload_bytes / 16;
  const int4* x4 = reinterpret_cast<const int4*>(x);
  // This part's iterations: part, part + parts, ... (iteration j: words j * 32 .. j * 32 + 31).
  for (int j0 = part; j0 * 32 < words; j0 += kQuantBatch * parts) {  // uniform across the warp
    // kQuantBatch words' loads in flight at once: one memory latency per batch, not per word.
    int4 raw[kQuantBatch][2];
#pragma unroll
    for (int u = 0; u < kQuantBatch; ++u) {
      const int w = (j0 + u * parts) * 32 + lane;
      if (w < words) {
        raw[u][0] = x4[2 * w];
        raw[u][1] = x4[2 * w + 1];
      }
    }
#pragma unroll
    for (int u = 0; u < kQuantBatch; ++u) {
      if ((j0 + u * parts) * 32 >= words) break;  // uniform across the warp
      const int w = (j0 + u * parts) * 32 + lane;
      float v[16];
      float amax = 0.f;
      if (w < words) {
        const auto* lo = reinterpret_cast<const __nv_bfloat16*>(&raw[u][0]);
        const auto* hi = reinterpret_cast<const __nv_bfloat16*>(&raw[u][1]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          v[e] = __bfloat162float(lo[e]);
          v[8 + e] = __bfloat162float(hi[e]);
        }
#pragma unroll
        for (int e = 0; e < 16; ++e) amax = nan_max(amax, fabsf(v[e]));
      }
      for (int offset = 1; offset < lanes_per_block; offset <<= 1)
        amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      const float scale = block_scale(amax), inverse = 1.f / scale;
      uint32_t packed[4] = {};
      if (w < words) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          packed[q] = fp8_pair(v[4 * q] * inverse, v[4 * q + 1] * inverse) |
                      fp8_pair(v[4 * q + 2] * inverse, v[4 * q + 3] * inverse) << 16;
      }
      const int4 word = make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]),
                                  static_cast<int>(packed[2]), static_cast<int>(packed[3]));
      const bool first_of_block = w < words && w % lanes_per_block == 0;
      for (int d = 0; d < s.world; ++d) {
        if (!__any_sync(0xffffffffu, dest_of_lane == d)) continue;  // no expert of the token on rank d
        char* dst = peer_row(d);
        if (w < words) reinterpret_cast<int4*>(dst)[w] = word;
        if (first_of_block) reinterpret_cast<float*>(dst + scales_offset(s))[w / lanes_per_block] = scale;
      }
    }
  }
}

}  // namespace jmc
