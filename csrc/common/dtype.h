// Element types the kernels understand. Kernels see raw pointers plus one of these tags;
// the binding file maps torch dtypes onto them.
#pragma once
#include <cstdint>

namespace zc {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// Distinct 16-bit storage types so overloads can tell bf16 from fp16 at compile time.
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
// Tag for "no 16-bit parameter copy requested".
struct no_out_t {};

inline int dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  return t == DType::F32 ? "float32" : (t == DType::BF16 ? "bfloat16" : "float16");
}

}  // namespace zc
