#include "cast.h"

#include <algorithm>
#include <cstring>

#include "../common/parallel.h"
#include "../isa/dispatch.h"

namespace zc {

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, int num_threads) {
  if (n <= 0) return;
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(src_dtype));
    return;
  }
  const KernelTable& k = active_kernels();
  const int64_t chunks = num_chunks(n);
  const int threads = threads_for(chunks, num_threads, n);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < chunks; ++c)
    k.cast(src, src_dtype, dst, dst_dtype, c * kChunkElems, std::min(n, (c + 1) * kChunkElems));
}

}  // namespace zc
