// Pack many tensors into one flat buffer at given byte offsets (every byte not covered by a
// tensor is zeroed, so padding never carries stale data into a reduction) and unpack back.
// Byte-based, so it serves every dtype; large buckets are copied by several threads.
#pragma once
#include <cstdint>

namespace zc {

struct Segment {
  void* data;            // the tensor's bytes (source for pack, destination for unpack)
  int64_t offset_bytes;  // where it sits in the flat buffer
  int64_t nbytes;
};

// Throws std::invalid_argument if a segment is out of bounds or overlaps another.
void pack(const Segment* segments, int64_t n, void* flat, int64_t flat_bytes, int num_threads);
void unpack(const void* flat, int64_t flat_bytes, const Segment* segments, int64_t n, int num_threads);

}  // namespace zc
