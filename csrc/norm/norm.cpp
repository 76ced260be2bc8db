#include "norm.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "../common/parallel.h"
#include "../isa/dispatch.h"

namespace zc {

SumSquares sum_squares(const void* src, DType dtype, int64_t n, int num_threads) {
  if (n <= 0) return {0.0, false};
  const KernelTable& k = active_kernels();
  const int64_t chunks = num_chunks(n);
  std::vector<double> partial(static_cast<size_t>(chunks));
  const int threads = threads_for(chunks, num_threads, n);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < chunks; ++c)
    partial[c] = k.sumsq(src, dtype, c * kChunkElems, std::min(n, (c + 1) * kChunkElems));
  double total = 0.0;
  for (double p : partial) total += p;  // chunk order: same answer for any thread count
  return {total, !std::isfinite(total)};
}

}  // namespace zc
