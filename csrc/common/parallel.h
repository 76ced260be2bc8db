// Splitting [0, n) into fixed chunks for OpenMP. Chunks are multiples of 64 elements so
// every chunk starts cache-line aligned when the buffer is, and so that the SIMD main loops
// see whole vectors everywhere except the buffer's own tail.
#pragma once
#include <cstdint>

namespace zc {
constexpr int64_t kChunkElems = int64_t(1) << 16;

inline int64_t num_chunks(int64_t n, int64_t chunk = kChunkElems) { return (n + chunk - 1) / chunk; }

// Elements below which another thread costs more than it saves: waking a team is a few
// microseconds on an idle machine, and milliseconds when a core is busy elsewhere.
constexpr int64_t kMinElemsPerThread = int64_t(1) << 15;

// Threads for `elems` elements split into `chunks` chunks: never more than the chunks, and
// only as many as the work can keep busy.
inline int threads_for(int64_t chunks, int num_threads, int64_t elems) {
  int64_t t = num_threads < 1 ? 1 : num_threads;
  if (chunks < t) t = chunks;
  const int64_t by_work = elems / kMinElemsPerThread;
  if (by_work < t) t = by_work;
  return t < 1 ? 1 : static_cast<int>(t);
}
}  // namespace zc
