// The multi-tensor Adam kernel, written once: its launch table, how a block finds its tensor, and
// the update of one chunk. adam.cu launches it (the table choice, the dtype dispatch); the device-time
// benchmark (csrc/bench/cuda_variants.cu) instantiates the same kernel with other table lookups and
// occupancy bounds, so a layout it measures faster is a one-line change here, not a second kernel.
//
// A launch's blocks take one chunk of kAdamChunkElems elements each; block b updates chunk b of
// the launch, which lies in the tensor whose first chunk is the largest first-chunk index <= b.
#pragma once
#include <cstdint>
#include <cstring>

#include "api.h"
#include "common.cuh"
#include "vec.cuh"

namespace zc {
namespace cuda {

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

  // The tensor holding `chunk`: a binary search over the first-chunk indices (log2(count) dependent
  // reads of the parameter space before the block's first memory access).
  __device__ __forceinline__ int find(int32_t chunk) const {
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

  __device__ __forceinline__ int find(int32_t chunk) const {
    int k = hint[chunk >> shift];
    while (k + 1 < this->count && this->chunk_start[k + 1] <= chunk) ++k;
    return k;
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
    chunk += static_cast<int32_t>(ceil_div(t.numel, kAdamChunkElems));
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

// Elements [begin, begin + kAdamChunkElems) of tensor k (fewer at its end). Blocks whose pointers are
// all 16-byte aligned (fp32 arrays; 8-byte for 16-bit ones) use vector accesses of 4 elements, the
// others go one by one. A non-finite device coefficient skips the update: nothing is written (the
// engine's deferred Inf/NaN decision, zerocore/runtime/deferred_skip.py; a host scale is checked
// finite before the launch).
template <class GT, class OT, bool L2, class Table>
__device__ __forceinline__ void adam_chunk(const Table& tab, int k, int32_t chunk, const AdamScalars& s,
                                           const float* device_grad_scale) {
  const int64_t begin = static_cast<int64_t>(chunk - tab.chunk_start[k]) * kAdamChunkElems;
  const int64_t rest = tab.numel[k] - begin;
  const int64_t n = rest < kAdamChunkElems ? rest : kAdamChunkElems;
  float* p = tab.p[k] + begin;
  const GT* g = static_cast<const GT*>(tab.g[k]) + begin;
  float* m = tab.m[k] + begin;
  float* v = tab.v[k] + begin;
  OT* o = static_cast<OT*>(tab.out[k]);
  if (o != nullptr) o += begin;
  float gs = s.grad_scale;
  if (device_grad_scale != nullptr) {
    const float d = *device_grad_scale;
    if (!isfinite(d)) return;
    gs = fmul(gs, d);
  }

  int64_t scalar_from = 0;
  const bool vec = aligned_dev(p, 16) && aligned_dev(m, 16) && aligned_dev(v, 16) &&
                   aligned_dev(g, 4 * sizeof(GT)) && (o == nullptr || aligned_dev(o, 4 * sizeof(OT)));
  if (vec) {
    const int64_t nv = n >> 2;
    for (int64_t i = threadIdx.x; i < nv; i += kAdamThreads) {
      float4 pv = reinterpret_cast<const float4*>(p)[i];
      float4 mv = reinterpret_cast<const float4*>(m)[i];
      float4 vv = reinterpret_cast<const float4*>(v)[i];
      float gv[4];
      load4(g, i, gv);
      adam_element<L2>(pv.x, gv[0], mv.x, vv.x, gs, s);
      adam_element<L2>(pv.y, gv[1], mv.y, vv.y, gs, s);
      adam_element<L2>(pv.z, gv[2], mv.z, vv.z, gs, s);
      adam_element<L2>(pv.w, gv[3], mv.w, vv.w, gs, s);
      reinterpret_cast<float4*>(m)[i] = mv;
      reinterpret_cast<float4*>(v)[i] = vv;
      reinterpret_cast<float4*>(p)[i] = pv;
      const float out[4] = {pv.x, pv.y, pv.z, pv.w};
      store4(o, i, out);
    }
    scalar_from = nv << 2;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < n; i += kAdamThreads) {
    float pv = p[i], mv = m[i], vv = v[i];
    adam_element<L2>(pv, load_f(g + i), mv, vv, gs, s);
    m[i] = mv;
    v[i] = vv;
    p[i] = pv;
    if (o != nullptr) store_f(o + i, pv);
  }
}

// MIN_BLOCKS: __launch_bounds__'s minimum resident blocks per SM (0: the compiler's choice; 8 caps
// registers at 32, full occupancy with 256 threads).
template <class GT, class OT, bool L2, class Table, int MIN_BLOCKS>
__global__ void __launch_bounds__(kAdamThreads, MIN_BLOCKS) adam_kernel(const __grid_constant__ Table tab,
                                                                        const AdamScalars s,
                                                                        const float* device_grad_scale) {
  const int32_t chunk = static_cast<int32_t>(blockIdx.x);
  adam_chunk<GT, OT, L2>(tab, tab.find(chunk), chunk, s, device_grad_scale);
}

}  // namespace cuda
}  // namespace zc
