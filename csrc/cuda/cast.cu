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

// W-element steps by array size (W = 8 or 4).
template <class T> __device__ __forceinline__ void loadv(const T* x, int64_t i, float (&r)[8]) { load8(x, i, r); }
template <class T> __device__ __forceinline__ void loadv(const T* x, int64_t i, float (&r)[4]) { load4(x, i, r); }
template <class T> __device__ __forceinline__ void storev(T* x, int64_t i, const float (&r)[8]) { store8(x, i, r); }
template <class T> __device__ __forceinline__ void storev(T* x, int64_t i, const float (&r)[4]) { store4(x, i, r); }

// Elements [0, head) and [head + vectors * W, n) one by one; the vectors in between W (8 or 4;
// 1: none) at a time. W = 8 moves 16-byte accesses on both sides (two fp32 loads -> one 16-bit
// store, or back); each thread has two vectors in flight per step (the loads of both issued
// before either store) so that enough bytes are in flight per SM to keep HBM busy, over a grid
// of exactly the resident blocks. (W is a template argument and the loops are not unrolled by
// the compiler: a 64-bit division by a runtime value is a slow subroutine with spills.)
template <class ST, class DT, int W>
__global__ void __launch_bounds__(kCastThreads) cast_kernel(const ST* __restrict__ src, DT* __restrict__ dst,
                                                            int64_t n, int64_t head) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCastThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCastThreads + threadIdx.x;
  const int64_t vectors = W > 1 ? (n - head) / W : 0;
  if constexpr (W > 1) {
    const ST* s = src + head;
    DT* d = dst + head;
#pragma unroll 1
    for (int64_t i = first; i < vectors; i += 2 * stride) {
      const bool two = i + stride < vectors;
      float a[W], b[W];
      loadv(s, i, a);
      if (two) loadv(s, i + stride, b);
      storev(d, i, a);
      if (two) storev(d, i + stride, b);
    }
  }
  const int64_t vec_end = head + vectors * W;
  const int64_t loose = W > 1 ? head + (n - vec_end) : n;
#pragma unroll 1
  for (int64_t j = first; j < loose; j += stride) {
    const int64_t i = W == 1 || j < head ? j : vec_end + (j - head);
    store_f(dst + i, load_f(src + i));
  }
}

// The widest step both pointers allow after a head of fewer than `width` elements: width 8
// needs both 16-byte aligned (for 16-bit <-> fp32 that means the same offset modulo 8 elements
// on the 16-bit side and 4 on the fp32 side, as views of aligned buffers at the same element
// offset have); width 4 needs 4-element alignment on both sides.
template <class ST, class DT>
void pick_width(const ST* s, DT* d, int64_t n, int& width, int64_t& head) {
  for (int w : {8, 4}) {
    const uintptr_t sa = w == 8 ? 16 : 4 * sizeof(ST), da = w == 8 ? 16 : 4 * sizeof(DT);
    for (int64_t k = 0; k < w && k + w <= n; ++k)
      if (aligned(s + k, sa) && aligned(d + k, da)) {
        width = w;
        head = k;
        return;
      }
  }
  width = 1;
  head = 0;
}

template <class ST, class DT, int W>
void launch_w(const ST* s, DT* d, int64_t n, int64_t head, cudaStream_t stream) {
  const int64_t work = W > 1 ? ceil_div((n - head) / W, 2) : n;
  int per_sm = 0;
  ZC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, cast_kernel<ST, DT, W>, kCastThreads, 0));
  const int64_t resident = int64_t(sm_count()) * std::max(per_sm, 1);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kCastThreads), resident));
  cast_kernel<ST, DT, W><<<static_cast<unsigned>(blocks), kCastThreads, 0, stream>>>(s, d, n, head);
  ZC_LAUNCH_CHECK("cast_kernel");
}

template <class ST, class DT>
void launch(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  const ST* s = static_cast<const ST*>(src);
  DT* d = static_cast<DT*>(dst);
  int width = 1;
  int64_t head = 0;
  pick_width(s, d, n, width, head);
  if (width == 8) return launch_w<ST, DT, 8>(s, d, n, head, stream);
  if (width == 4) return launch_w<ST, DT, 4>(s, d, n, head, stream);
  launch_w<ST, DT, 1>(s, d, n, 0, stream);
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
