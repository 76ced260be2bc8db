// fp32 <-> bf16 / fp16 (and bf16 <-> fp16) on the GPU, round-to-nearest-even with NaN and
// Inf kept exactly as the CPU kernels keep them (csrc/common/half.h's algorithms), so the
// GPU and CPU casts agree bit for bit. Equal dtypes are a cudaMemcpyAsync.
//
// Either pointer may be pinned host memory: the kernel then reads or writes it over the
// bus through its UVA device address, fusing the cast with the host<->device copy (e.g.
// fp16 gradients on the GPU -> fp32 in a pinned buffer for CPU Adam, in one pass).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "vec.cuh"

namespace zc {
namespace cuda {
namespace {

constexpr int kCastThreads = 256;

template <class ST, class DT>
__global__ void __launch_bounds__(kCastThreads) cast_kernel(const ST* __restrict__ src, DT* __restrict__ dst,
                                                            int64_t n, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCastThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCastThreads + threadIdx.x;
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t nv = n >> 2;
    for (int64_t i = first; i < nv; i += stride) {
      float r[4];
      load4(src, i, r);
      store4(dst, i, r);
    }
    scalar_from = nv << 2;
  }
  for (int64_t i = scalar_from + first; i < n; i += stride) store_f(dst + i, load_f(src + i));
}

template <class ST, class DT>
void launch(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  const ST* s = static_cast<const ST*>(src);
  DT* d = static_cast<DT*>(dst);
  const bool vec = aligned(s, 4 * sizeof(ST)) && aligned(d, 4 * sizeof(DT));
  const int64_t work = vec ? ceil_div(n, 4) : n;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kCastThreads), int64_t(sm_count()) * 16));
  cast_kernel<ST, DT><<<static_cast<unsigned>(blocks), kCastThreads, 0, stream>>>(s, d, n, vec);
  ZC_LAUNCH_CHECK("cast_kernel");
}

template <class ST>
void launch_to(const void* src, void* dst, DType dt, int64_t n, cudaStream_t stream) {
  switch (dt) {
    case DType::F32: return launch<ST, float>(src, dst, n, stream);
    case DType::BF16: return launch<ST, bf16_t>(src, dst, n, stream);
    case DType::F16: return launch<ST, f16_t>(src, dst, n, stream);
  }
  throw std::invalid_argument("cast (CUDA): unknown destination dtype");
}

// The address a kernel may use for ptr: itself for device memory, the UVA mapping for
// pinned host memory; throws for pageable host memory.
void* device_address(const void* ptr, const char* what) {
  cudaPointerAttributes attr;
  ZC_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return const_cast<void*>(ptr);
  if (attr.type == cudaMemoryTypeHost) {
    if (attr.devicePointer == nullptr)
      throw std::invalid_argument(std::string("cast (CUDA): '") + what + "' is pinned host memory not mapped for the device");
    return attr.devicePointer;
  }
  throw std::invalid_argument(std::string("cast (CUDA): '") + what +
                              "' is pageable host memory; use a pinned buffer (tensor.pin_memory() or the pinned pool)");
}

}  // namespace

void* host_device_pointer(const void* host) { return device_address(host, "host buffer"); }

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, int device, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("cast (CUDA): negative size");
  if (n == 0) return;
  DeviceGuard guard(device);
  const void* s = device_address(src, "src");
  void* d = device_address(dst, "dst");
  if (src_dtype == dst_dtype) {
    ZC_CUDA_CHECK(cudaMemcpyAsync(d, s, static_cast<size_t>(n) * dtype_size(src_dtype), cudaMemcpyDefault, stream));
    return;
  }
  switch (src_dtype) {
    case DType::F32: return launch_to<float>(s, d, dst_dtype, n, stream);
    case DType::BF16: return launch_to<bf16_t>(s, d, dst_dtype, n, stream);
    case DType::F16: return launch_to<f16_t>(s, d, dst_dtype, n, stream);
  }
  throw std::invalid_argument("cast (CUDA): unknown source dtype");
}

}  // namespace cuda
}  // namespace zc
