// Four- and eight-element vector loads and stores by storage type (4: 16 bytes for fp32, 8 for
// 16-bit; 8: two 16-byte accesses for fp32, one for 16-bit), widening to / narrowing from fp32
// with the conversions of elementwise.h.
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

// Element i*8 .. i*8+7 of x; x must be 16-byte aligned.
__device__ __forceinline__ void load8(const float* x, int64_t i, float (&r)[8]) {
  const float4 a = reinterpret_cast<const float4*>(x)[2 * i];
  const float4 b = reinterpret_cast<const float4*>(x)[2 * i + 1];
  r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
  r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
}
__device__ __forceinline__ float widen(const bf16_t*, uint32_t h) { return bf16_to_f32(static_cast<uint16_t>(h)); }
__device__ __forceinline__ float widen(const f16_t*, uint32_t h) { return f16_to_f32(static_cast<uint16_t>(h)); }
template <class H>  // bf16_t / f16_t: one 16-byte load
__device__ __forceinline__ void load8(const H* x, int64_t i, float (&r)[8]) {
  const uint4 v = reinterpret_cast<const uint4*>(x)[i];
  r[0] = widen(x, v.x); r[1] = widen(x, v.x >> 16); r[2] = widen(x, v.y); r[3] = widen(x, v.y >> 16);
  r[4] = widen(x, v.z); r[5] = widen(x, v.z >> 16); r[6] = widen(x, v.w); r[7] = widen(x, v.w >> 16);
}
__device__ __forceinline__ void store8(float* x, int64_t i, const float (&r)[8]) {
  reinterpret_cast<float4*>(x)[2 * i] = make_float4(r[0], r[1], r[2], r[3]);
  reinterpret_cast<float4*>(x)[2 * i + 1] = make_float4(r[4], r[5], r[6], r[7]);
}
__device__ __forceinline__ uint32_t pack2(bf16_t*, float lo, float hi) {
  return f32_to_bf16(lo) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack2(f16_t*, float lo, float hi) {
  return f32_to_f16(lo) | (static_cast<uint32_t>(f32_to_f16(hi)) << 16);
}
template <class H>  // bf16_t / f16_t: one 16-byte store
__device__ __forceinline__ void store8(H* x, int64_t i, const float (&r)[8]) {
  uint4 v;
  v.x = pack2(x, r[0], r[1]);
  v.y = pack2(x, r[2], r[3]);
  v.z = pack2(x, r[4], r[5]);
  v.w = pack2(x, r[6], r[7]);
  reinterpret_cast<uint4*>(x)[i] = v;
}

}  // namespace cuda
}  // namespace zc
