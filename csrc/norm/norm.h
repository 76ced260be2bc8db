// One pass over a flat buffer: sum of squares (accumulated in double) and whether any
// element is Inf/NaN. In double, squares of finite fp32 values cannot overflow (3.4e38^2 is
// 1.2e77), so the sum is finite exactly when every element is: the flag comes for free.
#pragma once
#include <cstdint>
#include "../common/dtype.h"

namespace zc {
struct SumSquares {
  double sum_sq;
  bool nonfinite;
};
// Deterministic for a given ISA: fixed chunks, partial sums added in chunk order.
SumSquares sum_squares(const void* src, DType dtype, int64_t n, int num_threads);
}  // namespace zc
