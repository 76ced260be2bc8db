#include "flatten.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace zc {
namespace {

// Pieces of at most this many bytes are the unit of work spread over threads.
constexpr int64_t kPieceBytes = int64_t(1) << 20;
// Below this total a single thread is faster than waking a team.
constexpr int64_t kParallelBytes = int64_t(1) << 21;

struct Copy {
  char* dst;
  const char* src;  // nullptr: zero-fill
  int64_t nbytes;
};

// Segments sorted by offset, after checking bounds and overlap.
std::vector<int64_t> checked_order(const Segment* s, int64_t n, int64_t flat_bytes) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (s[i].offset_bytes < 0 || s[i].nbytes < 0 || s[i].offset_bytes + s[i].nbytes > flat_bytes)
      throw std::invalid_argument("tensor " + std::to_string(i) + " at byte offset " +
                                  std::to_string(s[i].offset_bytes) + " with " + std::to_string(s[i].nbytes) +
                                  " bytes does not fit in the flat buffer of " + std::to_string(flat_bytes) +
                                  " bytes");
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return s[a].offset_bytes < s[b].offset_bytes; });
  for (size_t k = 1; k < order.size(); ++k) {
    const Segment& prev = s[order[k - 1]];
    if (prev.offset_bytes + prev.nbytes > s[order[k]].offset_bytes)
      throw std::invalid_argument("tensors " + std::to_string(order[k - 1]) + " and " +
                                  std::to_string(order[k]) + " overlap in the flat buffer");
  }
  return order;
}

void split_into(std::vector<Copy>& out, char* dst, const char* src, int64_t nbytes) {
  for (int64_t b = 0; b < nbytes; b += kPieceBytes)
    out.push_back({dst + b, src ? src + b : nullptr, std::min(kPieceBytes, nbytes - b)});
}

void run(const std::vector<Copy>& copies, int64_t total, int num_threads) {
  const int64_t count = static_cast<int64_t>(copies.size());
  const int threads = (total >= kParallelBytes && num_threads > 1) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (threads > 1)
  for (int64_t i = 0; i < count; ++i) {
    const Copy& c = copies[i];
    if (c.src) std::memcpy(c.dst, c.src, static_cast<size_t>(c.nbytes));
    else std::memset(c.dst, 0, static_cast<size_t>(c.nbytes));
  }
}

}  // namespace

void pack(const Segment* segments, int64_t n, void* flat, int64_t flat_bytes, int num_threads) {
  const std::vector<int64_t> order = checked_order(segments, n, flat_bytes);
  char* base = static_cast<char*>(flat);
  std::vector<Copy> copies;
  int64_t cursor = 0;
  for (int64_t i : order) {
    const Segment& s = segments[i];
    if (s.offset_bytes > cursor) split_into(copies, base + cursor, nullptr, s.offset_bytes - cursor);
    split_into(copies, base + s.offset_bytes, static_cast<const char*>(s.data), s.nbytes);
    cursor = s.offset_bytes + s.nbytes;
  }
  if (flat_bytes > cursor) split_into(copies, base + cursor, nullptr, flat_bytes - cursor);
  run(copies, flat_bytes, num_threads);
}

void unpack(const void* flat, int64_t flat_bytes, const Segment* segments, int64_t n, int num_threads) {
  checked_order(segments, n, flat_bytes);
  const char* base = static_cast<const char*>(flat);
  std::vector<Copy> copies;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    split_into(copies, static_cast<char*>(segments[i].data), base + segments[i].offset_bytes, segments[i].nbytes);
    total += segments[i].nbytes;
  }
  run(copies, total, num_threads);
}

}  // namespace zc
