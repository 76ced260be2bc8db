// fp32 <-> bf16 / fp16 conversion (and bf16 <-> fp16), round-to-nearest-even, NaN and Inf kept.
#pragma once
#include <cstdint>
#include "../common/dtype.h"

namespace zc {
// Converts n elements from src (src_dtype) to dst (dst_dtype); equal dtypes copy.
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, int num_threads);
}  // namespace zc
