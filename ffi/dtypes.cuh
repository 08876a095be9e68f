// Row element types of combine (bf16, fp16, fp32) and fp32 accumulation: conversions and 16-byte chunks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "context.h"

namespace jmc {

constexpr int kChunk = 8;  // columns per thread: one 16-byte load of bf16/fp16 rows

__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(float v) { return v; }
template <typename T> __device__ inline T from_float(float v);
template <> __device__ inline __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ inline __half from_float(float v) { return __float2half(v); }
template <> __device__ inline float from_float(float v) { return v; }

// kChunk elements of type T as raw 16-byte words (sizeof(T) * kChunk is 16 or 32 bytes).
template <typename T>
struct alignas(16) Chunk {
  T v[kChunk];
};

// acc[0..cols) += w * row[0..cols): one chunk load when `vector` (row 16-byte aligned, cols == kChunk).
template <typename In>
__device__ inline void add_chunk(float* acc, float w, const In* row, bool vector, int cols) {
  if (vector) {
    const Chunk<In> v = *reinterpret_cast<const Chunk<In>*>(row);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc[j] += w * to_float(v.v[j]);
  } else {
    for (int j = 0; j < cols; ++j) acc[j] += w * to_float(row[j]);
  }
}

// Calls f with a value of the row type of a RowType code: the host picks a kernel's instantiation, e.g.
// with_row_type(in, [](auto i) { return kernel<decltype(i)>; }).
template <typename F>
inline void* with_row_type(int code, F&& f) {
  switch (code) {
    case kBf16: return f(__nv_bfloat16{});
    case kF16: return f(__half{});
    default: return f(float{});
  }
}

// out[0..cols) = acc, converted to Out.
template <typename Out>
__device__ inline void store_chunk(Out* out, const float* acc, bool vector, int cols) {
  if (vector) {
    Chunk<Out> v;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v.v[j] = from_float<Out>(acc[j]);
    *reinterpret_cast<Chunk<Out>*>(out) = v;
  } else {
    for (int j = 0; j < cols; ++j) out[j] = from_float<Out>(acc[j]);
  }
}

}  // namespace jmc
