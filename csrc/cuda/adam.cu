// Multi-tensor Adam / AdamW on the GPU: fp32 master + m + v updated in place in one pass,
// gradient fp32 / bf16 / fp16 multiplied by a scale as it is read, optional bf16 / fp16
// copy of the updated parameter written in the same pass.
//
// Launch layout: the kernel arguments carry a table of the launch's tensors (five addresses,
// numel and the index of the tensor's first chunk: 52 bytes each). Block b finds its tensor
// by a binary search over the first-chunk indices and updates elements
// [chunk * kAdamChunkElems, +kAdamChunkElems) of it (64-bit element offsets), so one launch
// covers every chunk of its tensors however large they are. The kernel, its table and the lookup
// are in adam_kernel.cuh (shared with the device-time benchmark's alternative lookups); this file
// plans the launches and dispatches on the dtypes.
//
// Table size: the whole parameter list of a usual call should be one launch. Launches run one
// after the other and each ends with a partly filled last wave, so 200 tensors in 4 launches of
// 64 cost far more than one launch of 200. CUDA >= 12.1 accepts 32,764 bytes of kernel
// parameters (Volta and newer, with a driver >= 12.1): a table of kAdamTableLarge = 512 tensors.
// It stays in the parameters (not device memory) because that needs no allocation, no
// host-to-device copy and no lifetime tracking of a staging buffer, and the launch is queued at
// once. A launch of at most kAdamTableSmall tensors, or any launch when built with an older CUDA
// or run on an older driver, uses the 64-entry table under the old 4 KB limit (a small call
// does not ship 26 KB of parameters). __grid_constant__: blocks read the table where it lies
// instead of each thread copying it to local memory.
//
// Chunks of kAdamChunkElems = 4096 elements (4 vector steps per thread) keep a block short, so
// the drain at the end of a launch, when fewer and fewer blocks are left to keep memory busy, is
// short too (an H100, one 100M-element tensor: 95% of the copy rate, 87% with 16384-element
// chunks; benchmarks/results/gpu_h100_2026-11-26_issue35). Blocks
// whose pointers are all 16-byte aligned (fp32 arrays; 8-byte for 16-bit ones) use vector
// loads and stores of 4 elements, the others go one by one. (Peeling a scalar head to align
// views at odd offsets cost 2-16 registers in ptxas's allocation, i.e. fewer blocks per SM
// for every call; not done.)
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernel.cuh"
#include "common.cuh"

namespace zc {
namespace cuda {
namespace {

template <int N>
using Table = AdamTable<N>;  // the lookup adam_kernel.cuh's kernel uses (its header: the alternatives measured)
constexpr int kMinBlocks = 0;  // __launch_bounds__'s minimum blocks per SM: the compiler's choice

template <class GT, class OT, int N>
void launch_typed(const Table<N>& tab, const AdamScalars& s, const float* dgs, int64_t chunks, cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(chunks));
  if (s.l2_wd != 0.0f) adam_kernel<GT, OT, true, Table<N>, kMinBlocks><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
  else adam_kernel<GT, OT, false, Table<N>, kMinBlocks><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
}

template <class GT, int N>
void launch_by_out(const Table<N>& tab, const AdamTensor& t, const float* dgs, int64_t chunks, cudaStream_t st) {
  if (t.param_out == nullptr) return launch_typed<GT, no_out_t>(tab, t.s, dgs, chunks, st);
  if (t.out_dtype == DType::BF16) return launch_typed<GT, bf16_t>(tab, t.s, dgs, chunks, st);
  return launch_typed<GT, f16_t>(tab, t.s, dgs, chunks, st);
}

// One planned launch with a table of N entries (l.tensors.size() <= N).
template <int N>
void launch_table(const AdamTensor* tensors, const AdamLaunch& l, const float* dgs, cudaStream_t stream) {
  Table<N> tab;
  fill_adam_table(tab, tensors, l);
  const AdamTensor& first = tensors[l.tensors[0]];
  switch (first.grad_dtype) {
    case DType::F32: launch_by_out<float>(tab, first, dgs, l.chunks, stream); break;
    case DType::BF16: launch_by_out<bf16_t>(tab, first, dgs, l.chunks, stream); break;
    case DType::F16: launch_by_out<f16_t>(tab, first, dgs, l.chunks, stream); break;
  }
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

int adam_table_capacity() { return large_kernel_params() ? kAdamTableLarge : kAdamTableSmall; }

std::vector<AdamLaunch> plan_adam(const AdamTensor* tensors, int64_t n, int max_tensors) {
  if (max_tensors != kAdamTableSmall && max_tensors != kAdamTableLarge)
    throw std::invalid_argument("plan_adam: max_tensors must be kAdamTableSmall or kAdamTableLarge");
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
      if (static_cast<int>(l.tensors.size()) == max_tensors || l.chunks + chunks > max_chunks) {
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
  const std::vector<AdamLaunch> launches = plan_adam(tensors, n, adam_table_capacity());
  if (launches.empty()) return;
  DeviceGuard guard(device);
  for (const AdamLaunch& l : launches) {
#if ZC_LARGE_KERNEL_PARAMS
    if (l.tensors.size() > static_cast<size_t>(kAdamTableSmall)) {
      launch_table<kAdamTableLarge>(tensors, l, device_grad_scale, stream);
      ZC_LAUNCH_CHECK("adam_kernel");
      continue;
    }
#endif
    launch_table<kAdamTableSmall>(tensors, l, device_grad_scale, stream);
    ZC_LAUNCH_CHECK("adam_kernel");
  }
}

}  // namespace cuda
}  // namespace zc
