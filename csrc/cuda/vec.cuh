// Four-element vector loads and stores by storage type (16 bytes for fp32, 8 for 16-bit),
// widening to / narrowing from fp32 with the conversions of elementwise.h.
#pragma once
#include <cstdint>

#include "elementwise.h"

namespace zc {
namespace cuda {

template <class T>
__device__ __forceinline__ bool aligned_dev(const T* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Element i*4 .. i*4+3 of x; x must be aligned to 4 elements.
__device__ __forceinline__ void load4(const float* x, int64_t i, float (&r)[4]) {
  const float4 v = reinterpret_cast<const float4*>(x)[i];
  r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
__device__ __forceinline__ void load4(const bf16_t* x, int64_t i, float (&r)[4]) {
  const uint2 v = reinterpret_cast<const uint2*>(x)[i];
  r[0] = bf16_to_f32(static_cast<uint16_t>(v.x)); r[1] = bf16_to_f32(static_cast<uint16_t>(v.x >> 16));
  r[2] = bf16_to_f32(static_cast<uint16_t>(v.y)); r[3] = bf16_to_f32(static_cast<uint16_t>(v.y >> 16));
}
__device__ __forceinline__ void load4(const f16_t* x, int64_t i, float (&r)[4]) {
  const uint2 v = reinterpret_cast<const uint2*>(x)[i];
  r[0] = f16_to_f32(static_cast<uint16_t>(v.x)); r[1] = f16_to_f32(static_cast<uint16_t>(v.x >> 16));
  r[2] = f16_to_f32(static_cast<uint16_t>(v.y)); r[3] = f16_to_f32(static_cast<uint16_t>(v.y >> 16));
}

__device__ __forceinline__ void store4(no_out_t*, int64_t, const float (&)[4]) {}
__device__ __forceinline__ void store4(float* x, int64_t i, const float (&r)[4]) {
  reinterpret_cast<float4*>(x)[i] = make_float4(r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void store4(bf16_t* x, int64_t i, const float (&r)[4]) {
  uint2 v;
  v.x = f32_to_bf16(r[0]) | (static_cast<uint32_t>(f32_to_bf16(r[1])) << 16);
  v.y = f32_to_bf16(r[2]) | (static_cast<uint32_t>(f32_to_bf16(r[3])) << 16);
  reinterpret_cast<uint2*>(x)[i] = v;
}
__device__ __forceinline__ void store4(f16_t* x, int64_t i, const float (&r)[4]) {
  uint2 v;
  v.x = f32_to_f16(r[0]) | (static_cast<uint32_t>(f32_to_f16(r[1])) << 16);
  v.y = f32_to_f16(r[2]) | (static_cast<uint32_t>(f32_to_f16(r[3])) << 16);
  reinterpret_cast<uint2*>(x)[i] = v;
}

}  // namespace cuda
}  // namespace zc
