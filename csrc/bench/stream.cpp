#include "stream.h"

#include <algorithm>

#include "../common/parallel.h"
#include "../isa/dispatch.h"

namespace zc {

void stream_rw4(float* a, const float* b, float* c, float* d, float s, int64_t n, int num_threads) {
  const KernelTable& k = active_kernels();
  const int64_t chunks = num_chunks(n);
  const int threads = threads_for(chunks, num_threads, n);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t ch = 0; ch < chunks; ++ch)
    k.stream(a, b, c, d, s, ch * kChunkElems, std::min(n, (ch + 1) * kChunkElems));
}

}  // namespace zc
