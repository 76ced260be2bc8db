// Multi-tensor Adam / AdamW on the GPU: fp32 master + m + v updated in place in one pass,
// gradient fp32 / bf16 / fp16 multiplied by a scale as it is read, optional bf16 / fp16
// copy of the updated parameter written in the same pass.
//
// Launch layout: the kernel arguments carry a table of up to kAdamMaxTensors tensors
// (five addresses, numel and the index of the tensor's first chunk each: 3.3 KB, under the
// 4 KB kernel-parameter limit every CUDA version accepts). Block b finds its tensor by a
// binary search over the first-chunk indices and updates elements
// [chunk * kAdamChunkElems, +kAdamChunkElems) of it, so one launch covers every chunk of up
// to 64 tensors however large they are (64-bit element offsets), and any number of tensors
// takes ceil(n / 64) launches. Blocks whose pointers are all 16-byte aligned (fp32 arrays;
// 8-byte for 16-bit ones) use vector loads and stores of 4 elements.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "vec.cuh"

namespace zc {
namespace cuda {
namespace {

struct AdamTable {
  float* p[kAdamMaxTensors];
  const void* g[kAdamMaxTensors];
  float* m[kAdamMaxTensors];
  float* v[kAdamMaxTensors];
  void* out[kAdamMaxTensors];
  int64_t numel[kAdamMaxTensors];
  int32_t chunk_start[kAdamMaxTensors];
  int32_t count;
};
static_assert(sizeof(AdamTable) + sizeof(AdamScalars) + sizeof(float*) <= 4000,
              "Adam kernel arguments must stay under the 4 KB parameter limit");

template <class GT, class OT, bool L2>
__global__ void __launch_bounds__(kAdamThreads) adam_kernel(const AdamTable tab, const AdamScalars s,
                                                            const float* device_grad_scale) {
  const int32_t chunk = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = tab.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tab.chunk_start[mid] <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const int64_t begin = static_cast<int64_t>(chunk - tab.chunk_start[lo]) * kAdamChunkElems;
  const int64_t rest = tab.numel[lo] - begin;
  const int64_t n = rest < kAdamChunkElems ? rest : kAdamChunkElems;
  float* p = tab.p[lo] + begin;
  const GT* g = static_cast<const GT*>(tab.g[lo]) + begin;
  float* m = tab.m[lo] + begin;
  float* v = tab.v[lo] + begin;
  OT* o = static_cast<OT*>(tab.out[lo]);
  if (o != nullptr) o += begin;
  float gs = s.grad_scale;
  if (device_grad_scale != nullptr) gs = fmul(gs, *device_grad_scale);

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

template <class GT, class OT>
void launch_typed(const AdamTable& tab, const AdamScalars& s, const float* dgs, int64_t chunks, cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(chunks));
  if (s.l2_wd != 0.0f) adam_kernel<GT, OT, true><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
  else adam_kernel<GT, OT, false><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
}

template <class GT>
void launch_by_out(const AdamTable& tab, const AdamTensor& t, const float* dgs, int64_t chunks, cudaStream_t st) {
  if (t.param_out == nullptr) return launch_typed<GT, no_out_t>(tab, t.s, dgs, chunks, st);
  if (t.out_dtype == DType::BF16) return launch_typed<GT, bf16_t>(tab, t.s, dgs, chunks, st);
  return launch_typed<GT, f16_t>(tab, t.s, dgs, chunks, st);
}

// Tensors that may share a launch: same gradient dtype, same output dtype (or none) and
// bit-identical scalars.
bool same_launch_key(const AdamTensor& a, const AdamTensor& b) {
  return a.grad_dtype == b.grad_dtype && (a.param_out == nullptr) == (b.param_out == nullptr) &&
         (a.param_out == nullptr || a.out_dtype == b.out_dtype) && std::memcmp(&a.s, &b.s, sizeof(AdamScalars)) == 0;
}

void check_tensor(const AdamTensor& t, int64_t i) {
  const std::string where = "adam_step_multi (CUDA): tensor " + std::to_string(i);
  if (t.numel < 0) throw std::invalid_argument(where + " has a negative size");
  if (t.numel > 0 && (t.param == nullptr || t.grad == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr))
    throw std::invalid_argument(where + " has a null pointer");
  if (t.grad_dtype != DType::F32 && t.grad_dtype != DType::BF16 && t.grad_dtype != DType::F16)
    throw std::invalid_argument(where + ": unknown gradient dtype");
  if (t.param_out != nullptr && t.out_dtype != DType::BF16 && t.out_dtype != DType::F16)
    throw std::invalid_argument(where + ": param_out must be bfloat16 or float16");
  if (ceil_div(t.numel, kAdamChunkElems) > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument(where + " has " + std::to_string(t.numel) + " elements, more than one launch can index");
}

}  // namespace

std::vector<AdamLaunch> plan_adam(const AdamTensor* tensors, int64_t n) {
  std::vector<AdamLaunch> launches;
  std::vector<int64_t> open;  // index into launches of the open launch of each key seen
  const int64_t max_chunks = std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < n; ++i) {
    const AdamTensor& t = tensors[i];
    check_tensor(t, i);
    if (t.numel == 0) continue;
    const int64_t chunks = ceil_div(t.numel, kAdamChunkElems);
    int64_t slot = -1;
    for (size_t k = 0; k < open.size(); ++k)
      if (same_launch_key(tensors[launches[open[k]].tensors[0]], t)) slot = static_cast<int64_t>(k);
    if (slot >= 0) {
      AdamLaunch& l = launches[open[slot]];
      if (static_cast<int>(l.tensors.size()) == kAdamMaxTensors || l.chunks + chunks > max_chunks) {
        launches.push_back({});
        open[slot] = static_cast<int64_t>(launches.size()) - 1;
      }
    } else {
      launches.push_back({});
      open.push_back(static_cast<int64_t>(launches.size()) - 1);
      slot = static_cast<int64_t>(open.size()) - 1;
    }
    AdamLaunch& l = launches[open[slot]];
    l.tensors.push_back(i);
    l.chunks += chunks;
  }
  return launches;
}

void adam_step_multi(const AdamTensor* tensors, int64_t n, const float* device_grad_scale, int device,
                     cudaStream_t stream) {
  const std::vector<AdamLaunch> launches = plan_adam(tensors, n);
  if (launches.empty()) return;
  DeviceGuard guard(device);
  for (const AdamLaunch& l : launches) {
    AdamTable tab;
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
    const AdamTensor& first = tensors[l.tensors[0]];
    switch (first.grad_dtype) {
      case DType::F32: launch_by_out<float>(tab, first, device_grad_scale, l.chunks, stream); break;
      case DType::BF16: launch_by_out<bf16_t>(tab, first, device_grad_scale, l.chunks, stream); break;
      case DType::F16: launch_by_out<f16_t>(tab, first, device_grad_scale, l.chunks, stream); break;
    }
    ZC_LAUNCH_CHECK("adam_kernel");
  }
}

}  // namespace cuda
}  // namespace zc
