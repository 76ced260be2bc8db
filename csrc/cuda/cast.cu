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

// Elements [0, head) and [head + vectors * W, n) one by one (by the grid's first threads); the
// vectors in between W at a time, one vector per thread over a grid that covers them (a
// grid-stride loop only past kMaxBlocks blocks' worth). W = 4 when one side is fp32 (a 16-byte
// load or store there, 8 bytes on the 16-bit side), 8 between 16-bit types (16 bytes each side);
// 1: none. Measured on an H100 (csrc/bench/cuda_variants.cu, 256M fp32 -> bf16): this layout,
// plainly coalesced (consecutive threads, consecutive vectors), ran at 3,045 GB/s where the earlier
// one (8-wide, two vectors in flight per thread over a grid of just the resident blocks, grid-stride)
// ran at 2,831: ~1.0x torch's copy_ against 0.92x. (W is a template argument and the loop is not
// unrolled: a 64-bit division by a runtime value is a slow subroutine with spills.)
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
    for (int64_t i = first; i < vectors; i += stride) {
      float a[W];
      loadv(s, i, a);
      storev(d, i, a);
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

// The step width for this pair of types (see cast_kernel) and the head of fewer than `width`
// elements after which both pointers are aligned for it (16-bit <-> fp32 at width 4: the fp32 side
// 16-byte aligned, the 16-bit side 8-byte, as views of aligned buffers at the same element offset
// are); a narrower step where no head allows it.
template <class ST, class DT>
void pick_width(const ST* s, DT* d, int64_t n, int& width, int64_t& head) {
  constexpr bool has_f32 = sizeof(ST) == 4 || sizeof(DT) == 4;
  for (int w : {8, 4}) {
    if (has_f32 && w == 8) continue;
    const uintptr_t sa = w * sizeof(ST), da = w * sizeof(DT);
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

constexpr int64_t kMaxBlocks = int64_t(1) << 30;  // grid.x allows 2^31 - 1; past it the kernel strides

template <class ST, class DT, int W>
void launch_w(const ST* s, DT* d, int64_t n, int64_t head, cudaStream_t stream) {
  const int64_t vectors = W > 1 ? (n - head) / W : 0;
  const int64_t loose = W > 1 ? n - vectors * W : n;
  const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(std::max(vectors, loose), kCastThreads), kMaxBlocks));
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
