// The multi-tensor Adam kernel, written once: the update of one chunk, and the kernel whose block b
// finds the tensor of chunk b in the launch table (adam_table.h) and updates that chunk. adam.cu
// launches it (the table choice, the dtype dispatch); the device-time benchmark
// (csrc/bench/cuda_variants.cu) instantiates the same kernel with other table lookups and occupancy
// bounds, so a layout it measures faster is a one-line change in adam.cu, not a second kernel.
#pragma once
#include <cstdint>

#include "adam_table.h"
#include "api.h"
#include "common.cuh"
#include "vec.cuh"

namespace zc {
namespace cuda {

// Elements [begin, begin + n) of tensor k (the table's span: kAdamChunkElems, fewer at its end).
// Blocks whose pointers are all 16-byte aligned (fp32 arrays; 8-byte for 16-bit ones) use vector
// accesses of 4 elements, the others go one by one. A non-finite device coefficient skips the
// update: nothing is written (the engine's deferred Inf/NaN decision,
// zerocore/runtime/deferred_skip.py; a host scale is checked finite before the launch).
template <class GT, class OT, bool L2, class Table>
__device__ __forceinline__ void adam_chunk(const Table& tab, int k, int32_t chunk, const AdamScalars& s,
                                           const float* device_grad_scale) {
  int64_t begin, n;
  tab.span(k, chunk, begin, n);
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

// A candidate layout measured by csrc/bench/cuda_variants.cu, not launched by adam.cu: a resident grid
// (as many blocks as the device holds at once) whose block b updates a contiguous run of the launch's
// chunks (resident_run). The block finds its first chunk's tensor once (the binary search) and walks
// forward from there: the next chunk's tensor is the same one or a later neighbour, one read of the
// table whose address rarely changes (a constant-cache hit) instead of a search per 4096 elements, and
// the tensor's five addresses and size are re-read from the same table entry, not from a new one.
template <class GT, class OT, bool L2, class Table, int MIN_BLOCKS>
__global__ void __launch_bounds__(kAdamThreads, MIN_BLOCKS) adam_kernel_resident(const __grid_constant__ Table tab,
                                                                                 const int32_t chunks,
                                                                                 const AdamScalars s,
                                                                                 const float* device_grad_scale) {
  int32_t chunk, end;
  resident_run(chunks, static_cast<int32_t>(gridDim.x), static_cast<int32_t>(blockIdx.x), chunk, end);
  if (chunk >= end) return;
  int k = tab.find(chunk);
  for (; chunk < end; ++chunk) {
    k = next_owner(tab.chunk_start, k, tab.count, chunk);
    adam_chunk<GT, OT, L2>(tab, k, chunk, s, device_grad_scale);
  }
}

}  // namespace cuda
}  // namespace zc
