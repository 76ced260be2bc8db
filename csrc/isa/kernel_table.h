// The per-ISA entry points. Each is single-threaded over [begin, end); the concern's
// dispatcher (adam/adam.cpp, ...) splits the work and spreads it over OpenMP threads.
#pragma once
#include <cstdint>
#include "../adam/adam.h"
#include "../common/dtype.h"

namespace zc {

struct KernelTable {
  const char* isa;
  void (*adam)(const AdamTensor& t, int64_t begin, int64_t end);
  void (*cast)(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t begin, int64_t end);
  double (*sumsq)(const void* src, DType dtype, int64_t begin, int64_t end);
  void (*stream)(float* a, const float* b, float* c, float* d, float s, int64_t begin, int64_t end);
};

const KernelTable* kernels_scalar();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();

}  // namespace zc
