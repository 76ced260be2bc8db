// Splitting [0, n) into fixed chunks for OpenMP. Chunks are multiples of 64 elements so
// every chunk starts cache-line aligned when the buffer is, and so that the SIMD main loops
// see whole vectors everywhere except the buffer's own tail.
#pragma once
#include <cstdint>

namespace zc {
constexpr int64_t kChunkElems = int64_t(1) << 16;

inline int64_t num_chunks(int64_t n, int64_t chunk = kChunkElems) { return (n + chunk - 1) / chunk; }

inline int threads_for(int64_t chunks, int num_threads) {
  if (num_threads < 1) num_threads = 1;
  return chunks < num_threads ? static_cast<int>(chunks < 1 ? 1 : chunks) : num_threads;
}
}  // namespace zc
