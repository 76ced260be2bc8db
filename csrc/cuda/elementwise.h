// Per-element math shared by the CUDA kernels, written so it compiles for the device (nvcc)
// and for the host (nvcc or plain g++): the native host test (csrc/cuda/test_cuda_host.cpp)
// checks these very functions, bit for bit, against the CPU kernels' csrc/common/half.h and
// zc::adam_step_multi.
//
// Every float operation is an explicitly rounded intrinsic on the device (__fadd_rn, ...):
// nvcc may not contract them into FMAs, so the device rounds exactly like the CPU kernels,
// which are built with -ffp-contract=off. The operation order is csrc/adam/adam_body.inc's.
#pragma once
#include <cstdint>
#include <cstring>

#include "../adam/adam.h"
#include "../common/dtype.h"

#if defined(__CUDACC__)
#define ZC_HD __host__ __device__ __forceinline__
#else
#define ZC_HD inline
#endif

namespace zc {
namespace cuda {

ZC_HD uint32_t as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
ZC_HD float as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

#if defined(__CUDA_ARCH__)
ZC_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
ZC_HD float fsub(float a, float b) { return __fsub_rn(a, b); }
ZC_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
ZC_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
ZC_HD float fsqrt(float a) { return __fsqrt_rn(a); }
#else
ZC_HD float fadd(float a, float b) { return a + b; }
ZC_HD float fsub(float a, float b) { return a - b; }
ZC_HD float fmul(float a, float b) { return a * b; }
ZC_HD float fdiv(float a, float b) { return a / b; }
ZC_HD float fsqrt(float a) { return __builtin_sqrtf(a); }
#endif

// ---- 16-bit conversions: the algorithms of csrc/common/half.h ---------------------------
// (Not the hardware cvt instructions: those return a canonical NaN, where the CPU kernels
// keep the payload's top bits. Integer ops are free in these memory-bound kernels.)
ZC_HD uint16_t f32_to_bf16(float f) {
  uint32_t x = as_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
ZC_HD float bf16_to_f32(uint16_t h) { return as_float(static_cast<uint32_t>(h) << 16); }

ZC_HD uint16_t f32_to_f16(float f) {
  uint32_t x = as_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (x < 0x38800000u) {
    const float t = fadd(as_float(x), 0.5f);
    return static_cast<uint16_t>(sign | (as_bits(t) - 0x3f000000u));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return static_cast<uint16_t>(sign | (x >> 13));
}
ZC_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return as_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) return as_float(sign | as_bits(fmul(static_cast<float>(mant), 5.9604644775390625e-08f)));
  return as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Element load / store by storage type.
ZC_HD float load_f(const float* p) { return *p; }
ZC_HD float load_f(const bf16_t* p) { return bf16_to_f32(p->bits); }
ZC_HD float load_f(const f16_t* p) { return f16_to_f32(p->bits); }
ZC_HD void store_f(float* p, float v) { *p = v; }
ZC_HD void store_f(bf16_t* p, float v) { p->bits = f32_to_bf16(v); }
ZC_HD void store_f(f16_t* p, float v) { p->bits = f32_to_f16(v); }
ZC_HD void store_f(no_out_t*, float) {}

// ---- One Adam element -------------------------------------------------------------------
// g: the gradient as read (already widened to fp32); gs: the effective gradient scale.
// Updates p, m, v; the order of operations is adam_body.inc's, operation for operation.
template <bool L2>
ZC_HD void adam_element(float& p, float g, float& m, float& v, float gs, const AdamScalars& s) {
  g = fmul(g, gs);
  if (L2) g = fadd(g, fmul(s.l2_wd, p));
  m = fadd(m, fmul(s.one_minus_beta1, fsub(g, m)));
  v = fadd(fmul(v, s.beta2), fmul(fmul(s.one_minus_beta2, g), g));
  if (!L2) p = fmul(p, s.decay);
  const float den = fadd(fmul(fsqrt(v), s.inv_bc2_sqrt), s.eps);
  p = fadd(p, fmul(s.neg_step_size, fdiv(m, den)));
}

}  // namespace cuda
}  // namespace zc
