// Memory roofline probe for the Adam benchmark: reads four fp32 arrays and writes three of
// them back in place (28 bytes per element), the same traffic as an fp32 Adam step, with
// trivial arithmetic so only memory bandwidth limits it.
#pragma once
#include <cstdint>

namespace zc {
void stream_rw4(float* a, const float* b, float* c, float* d, float s, int64_t n, int num_threads);
}  // namespace zc
