// Multi-tensor Adam / AdamW on the GPU: fp32 master + m + v updated in place in one pass,
// gradient fp32 / bf16 / fp16 multiplied by a scale as it is read, optional bf16 / fp16
// copy of the updated parameter written in the same pass.
//
// Launch layout: the kernel arguments carry a table of the launch's tensors (five addresses,
// numel, the index of the tensor's first chunk and its line shift: 56 bytes each). Block b finds
// its tensor by a binary search over the first-chunk indices and updates one chunk of it: each
// tensor's chunk grid starts `shift` elements before its first element, where shift is the
// parameter's offset into a 128-byte line, so every chunk but the first (kAdamChunkElems - shift
// elements) starts on a line (LineAlignedAdamTable). Tensors packed at 16 bytes (views into one
// buffer) otherwise start every chunk 16-112 bytes into a line, and each warp's 512-byte access
// touches 5 lines instead of 4: on an H100, 200 such tensors ran at 85.5% of the copy rate with
// the plain grid and 93.1% with this one through adam_step_multi (bit-exact: the grid only decides
// which block updates an element); tensors at 512-byte boundaries (torch's allocator) have shift 0, the plain grid
// (95.0%; flat 96.6%; benchmarks/results/gpu_h100_2026-11-27_issue35_stop47). 64-bit element
// offsets: one launch covers every chunk of its tensors however large they are. The kernel, its table and the lookup
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
using Table = LineAlignedAdamTable<N>;  // the grid adam_kernel.cuh's kernel walks (cuda_variants.cu: the others measured)
constexpr int kMinBlocks = 0;  // __launch_bounds__'s minimum blocks per SM: the compiler's choice
// The kernel's parameters: the table, the scalars and the device scale's pointer, under the limits the
// launch_table callers choose between (32,764 bytes with CUDA >= 12.1, 4,096 before).
static_assert(sizeof(Table<kAdamTableLarge>) + sizeof(AdamScalars) + sizeof(float*) <= 32764,
              "the large Adam table must fit CUDA 12.1's kernel parameter limit");
static_assert(sizeof(Table<kAdamTableSmall>) + sizeof(AdamScalars) + sizeof(float*) <= 4096,
              "the small Adam table must fit the 4 KB kernel parameter limit");
// The shifted grid has at most one chunk per tensor more than the plan counts (plan_adam keeps room).
constexpr int64_t kMaxPlannedChunks = std::numeric_limits<int32_t>::max() - kAdamTableLarge;

template <class GT, class OT, int N>
void launch_typed(const Table<N>& tab, const AdamScalars& s, const float* dgs, cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(tab.chunks));  // the shifted grid's count (the plan's + at most one a tensor)
  if (s.l2_wd != 0.0f) adam_kernel<GT, OT, true, Table<N>, kMinBlocks><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
  else adam_kernel<GT, OT, false, Table<N>, kMinBlocks><<<grid, kAdamThreads, 0, st>>>(tab, s, dgs);
}

template <class GT, int N>
void launch_by_out(const Table<N>& tab, const AdamTensor& t, const float* dgs, cudaStream_t st) {
  if (t.param_out == nullptr) return launch_typed<GT, no_out_t>(tab, t.s, dgs, st);
  if (t.out_dtype == DType::BF16) return launch_typed<GT, bf16_t>(tab, t.s, dgs, st);
  return launch_typed<GT, f16_t>(tab, t.s, dgs, st);
}

// One planned launch with a table of N entries (l.tensors.size() <= N).
template <int N>
void launch_table(const AdamTensor* tensors, const AdamLaunch& l, const float* dgs, cudaStream_t stream) {
  Table<N> tab;
  fill_adam_table(tab, tensors, l);
  const AdamTensor& first = tensors[l.tensors[0]];
  switch (first.grad_dtype) {
    case DType::F32: launch_by_out<float>(tab, first, dgs, stream); break;
    case DType::BF16: launch_by_out<bf16_t>(tab, first, dgs, stream); break;
    case DType::F16: launch_by_out<f16_t>(tab, first, dgs, stream); break;
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
  if (ceil_div(t.numel, kAdamChunkElems) > kMaxPlannedChunks)
    throw std::invalid_argument(where + " has " + std::to_string(t.numel) + " elements, more than one launch can index");
}

}  // namespace

int adam_table_capacity() { return large_kernel_params() ? kAdamTableLarge : kAdamTableSmall; }

std::vector<AdamLaunch> plan_adam(const AdamTensor* tensors, int64_t n, int max_tensors) {
  if (max_tensors != kAdamTableSmall && max_tensors != kAdamTableLarge)
    throw std::invalid_argument("plan_adam: max_tensors must be kAdamTableSmall or kAdamTableLarge");
  std::vector<AdamLaunch> launches;
  std::vector<int64_t> open;  // index into launches of the open launch of each key seen
  const int64_t max_chunks = kMaxPlannedChunks;
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
