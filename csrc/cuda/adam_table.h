// The multi-tensor Adam launch's table (in the kernel arguments: adam.cu's header says why) and how
// a block finds the tensor its chunk lies in. Host-compilable (the lookups are ZC_HD): the native host
// test checks every lookup against a linear scan without a GPU (csrc/cuda/test_cuda_host.cpp).
//
// A launch's blocks take one chunk of kAdamChunkElems elements each; block b updates chunk b of the
// launch, which lies in the tensor whose first chunk is the largest first-chunk index <= b.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "api.h"
#include "elementwise.h"

namespace zc {
namespace cuda {

// The resident-grid candidate's work split (adam_kernel.cuh's adam_kernel_resident): block b of `grid`
// takes chunks [first, end) of the launch's `chunks`, runs of ceil(chunks / grid) one after another
// (the last blocks' runs shorter or empty). 64-bit products: b * run may pass INT32_MAX.
ZC_HD void resident_run(int32_t chunks, int32_t grid, int32_t b, int32_t& first, int32_t& end) {
  const int64_t run = (static_cast<int64_t>(chunks) + grid - 1) / grid;
  const int64_t lo = static_cast<int64_t>(b) * run;
  const int64_t hi = lo + run;
  first = static_cast<int32_t>(lo < chunks ? lo : chunks);
  end = static_cast<int32_t>(hi < chunks ? hi : chunks);
}

// The tensor holding `chunk` when `k` holds chunk - 1 (or chunk): k, or the next tensor with chunks
// (tensors of no chunks are not in a launch: plan_adam leaves them out).
ZC_HD int next_owner(const int32_t* starts, int k, int count, int32_t chunk) {
  while (k + 1 < count && starts[k + 1] <= chunk) ++k;
  return k;
}

// The launch's tensors in the kernel arguments (see adam.cu's header for why there): five addresses,
// the size and the index of the first chunk of each.
template <int N>
struct AdamTable {
  static constexpr int kCapacity = N;
  float* p[N];
  const void* g[N];
  float* m[N];
  float* v[N];
  void* out[N];
  int64_t numel[N];
  int32_t chunk_start[N];
  int32_t count;

  // Elements [begin, begin + n) of tensor k are chunk `chunk`'s: consecutive kAdamChunkElems from the
  // tensor's first element, the last chunk shorter.
  ZC_HD void span(int k, int32_t chunk, int64_t& begin, int64_t& n) const {
    begin = static_cast<int64_t>(chunk - chunk_start[k]) * kAdamChunkElems;
    const int64_t rest = numel[k] - begin;
    n = rest < kAdamChunkElems ? rest : kAdamChunkElems;
  }

  // The tensor holding `chunk`: a binary search over the first-chunk indices (log2(count) dependent
  // reads of the parameter space before the block's first memory access).
  ZC_HD int find(int32_t chunk) const {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (chunk_start[mid] <= chunk) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }
};

// AdamTable plus a coarse index: hint[c] is the tensor holding chunk c << shift, so a block reads one
// hint and walks forward over the tensors that start between that chunk and its own (none for most
// blocks: at most 2^shift, the chunks one hint covers). Two dependent reads instead of log2(count).
template <int N, int H>
struct HintedAdamTable : AdamTable<N> {
  uint16_t hint[H];
  int32_t shift;

  ZC_HD int find(int32_t chunk) const {
    int k = hint[chunk >> shift];
    while (k + 1 < this->count && this->chunk_start[k + 1] <= chunk) ++k;
    return k;
  }
};

// AdamTable with each tensor's chunk grid moved back by `shift[k]` elements (its parameter's address
// modulo 128 bytes, in elements), so that every chunk but the first starts on a 128-byte line: the
// first chunk is kAdamChunkElems - shift elements long. For tensors packed at 16 bytes (views into one
// buffer), whose chunks otherwise all start 16-112 bytes into a line and make every warp's 512-byte
// access touch 5 lines instead of 4. The gradient, moments and output are aligned alike when they are
// laid out alike (views at the same offsets); where they are not, only the parameter's lines are.
// adam.cu's launch table (csrc/bench/cuda_variants.cu times it beside the plain grid; `chunks`: the
// launch's chunk count with the shifts, which may exceed the plan's by one per tensor).
template <int N>
struct LineAlignedAdamTable : AdamTable<N> {
  int32_t shift[N];
  int32_t chunks;

  ZC_HD void span(int k, int32_t chunk, int64_t& begin, int64_t& n) const {
    const int64_t start = static_cast<int64_t>(chunk - this->chunk_start[k]) * kAdamChunkElems - shift[k];
    begin = start > 0 ? start : 0;
    const int64_t stop = start + kAdamChunkElems < this->numel[k] ? start + kAdamChunkElems : this->numel[k];
    n = stop - begin;
  }
};

// The table of one planned launch (host side): tensors[l.tensors[k]] becomes entry k.
template <class Table>
inline void fill_adam_table(Table& tab, const AdamTensor* tensors, const AdamLaunch& l) {
  std::memset(&tab, 0, sizeof(tab));
  int32_t chunk = 0;
  for (size_t k = 0; k < l.tensors.size(); ++k) {
    const AdamTensor& t = tensors[l.tensors[k]];
    tab.p[k] = t.param;
    tab.g[k] = t.grad;
    tab.m[k] = t.exp_avg;
    tab.v[k] = t.exp_avg_sq;
    tab.out[k] = t.param_out;
    tab.numel[k] = t.numel;
    tab.chunk_start[k] = chunk;
    chunk += static_cast<int32_t>((t.numel + kAdamChunkElems - 1) / kAdamChunkElems);
  }
  tab.count = static_cast<int32_t>(l.tensors.size());
}

// fill_adam_table, then the coarse index over the launch's l.chunks chunks.
template <int N, int H>
inline void fill_adam_table(HintedAdamTable<N, H>& tab, const AdamTensor* tensors, const AdamLaunch& l) {
  fill_adam_table<AdamTable<N>>(tab, tensors, l);
  int32_t shift = 0;
  while ((l.chunks - 1) >> shift >= H) ++shift;
  tab.shift = shift;
  int k = 0;
  for (int c = 0; c < H && (static_cast<int64_t>(c) << shift) < l.chunks; ++c) {
    const int64_t first = static_cast<int64_t>(c) << shift;
    while (k + 1 < tab.count && tab.chunk_start[k + 1] <= first) ++k;
    tab.hint[c] = static_cast<uint16_t>(k);
  }
}

// fill_adam_table with the shifts: each tensor's first-chunk index and the launch's chunk count from its
// shifted grid.
template <int N>
inline void fill_adam_table(LineAlignedAdamTable<N>& tab, const AdamTensor* tensors, const AdamLaunch& l) {
  std::memset(&tab, 0, sizeof(tab));  // the shifts past `count` too: the kernel arguments are these bytes
  fill_adam_table<AdamTable<N>>(tab, tensors, l);
  int32_t chunk = 0;
  for (int k = 0; k < tab.count; ++k) {
    const int64_t line_elems = 128 / static_cast<int64_t>(sizeof(float));
    tab.shift[k] = static_cast<int32_t>((reinterpret_cast<uintptr_t>(tab.p[k]) / sizeof(float)) % line_elems);
    tab.chunk_start[k] = chunk;
    chunk += static_cast<int32_t>((tab.numel[k] + tab.shift[k] + kAdamChunkElems - 1) / kAdamChunkElems);
  }
  tab.chunks = chunk;
}

}  // namespace cuda
}  // namespace zc
