// Scalar fp32 <-> bf16 / fp16 conversions, round-to-nearest-even, NaN kept NaN (quieted,
// top payload bits kept), Inf kept Inf. The vector paths produce bit-identical results; the
// native tests check that.
#pragma once
#include <cstdint>
#include <cstring>

namespace zc {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  // Adding 0x7fff plus the lowest kept bit rounds half-way cases to even; a carry into the
  // exponent is the correct rounding up (to Inf at the top of the range).
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float bf16_bits_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16_bits(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)  // NaN: quiet bit set, top of the payload kept
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  if (x >= 0x477ff000u)  // >= 65520 rounds to Inf (includes Inf itself)
    return static_cast<uint16_t>(sign | 0x7c00u);
  if (x < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5f puts the half subnormal grid
    // (2^-24) at the float's last mantissa bit, so the FPU does the even rounding.
    float t = bits_f32(x) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(t) - 0x3f000000u));
  }
  // Normal: re-bias the exponent (127 -> 15) and round the 13 dropped bits to even.
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return static_cast<uint16_t>(sign | (x >> 13));
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Subnormal (or zero): exact as mant * 2^-24.
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return bits_f32(sign | f32_bits(v));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace zc
