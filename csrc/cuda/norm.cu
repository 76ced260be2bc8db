// Sum of squares (accumulated in double) and an Inf/NaN flag over a flat buffer, results
// left in device memory: no host sync unless the caller reads them.
//
// Two launches on the caller's stream: a grid-stride pass writes one partial sum per block,
// then one block adds the partials in a fixed order and writes the sum and the flag. The
// block count depends on n only, so the answer is the same on every run and every GPU.
// As in the CPU kernel, squares of finite fp32 values cannot overflow a double, so the sum
// is finite exactly when every element is: the flag is !isfinite(sum).
#include <cstdint>
#include <stdexcept>

#include "common.cuh"
#include "vec.cuh"

namespace zc {
namespace cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kNormMaxBlocks = 1024;
constexpr int64_t kNormElemsPerBlock = 16384;  // below this many elements per block, use fewer blocks

int norm_blocks(int64_t n) {
  const int64_t b = ceil_div(n, kNormElemsPerBlock);
  return static_cast<int>(b < 1 ? 1 : (b > kNormMaxBlocks ? kNormMaxBlocks : b));
}

// Block-wide sum in a fixed order (warp shuffles, then warp 0 over the warp sums).
__device__ __forceinline__ double block_sum(double x) {
  __shared__ double warp_sums[kNormThreads / 32];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = threadIdx.x < kNormThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  return x;  // valid in thread 0
}

template <class T>
__global__ void __launch_bounds__(kNormThreads) sumsq_partial(const T* __restrict__ x, int64_t n, bool vec,
                                                              double* __restrict__ partial) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kNormThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kNormThreads + threadIdx.x;
  double acc = 0.0;
  int64_t scalar_from = 0;
  if (vec) {
    const int64_t nv = n >> 2;
    for (int64_t i = first; i < nv; i += stride) {
      float r[4];
      load4(x, i, r);
      const double a = r[0], b = r[1], c = r[2], d = r[3];
      acc += a * a + b * b + c * c + d * d;
    }
    scalar_from = nv << 2;
  }
  for (int64_t i = scalar_from + first; i < n; i += stride) {
    const double a = load_f(x + i);
    acc += a * a;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kNormThreads) sumsq_finish(const double* __restrict__ partial, int count,
                                                             double* out_sum, bool* out_nonfinite) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kNormThreads) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    *out_sum = acc;
    *out_nonfinite = !isfinite(acc);
  }
}

template <class T>
void launch(const void* src, int64_t n, double* ws, double* out_sum, bool* out_nonfinite, cudaStream_t stream) {
  const T* x = static_cast<const T*>(src);
  const int blocks = norm_blocks(n);
  sumsq_partial<T><<<blocks, kNormThreads, 0, stream>>>(x, n, aligned(x, 4 * sizeof(T)), ws);
  ZC_LAUNCH_CHECK("sumsq_partial");
  sumsq_finish<<<1, kNormThreads, 0, stream>>>(ws, blocks, out_sum, out_nonfinite);
  ZC_LAUNCH_CHECK("sumsq_finish");
}

}  // namespace

int64_t sum_squares_workspace(int64_t n) { return norm_blocks(n); }

void sum_squares(const void* src, DType dtype, int64_t n, double* workspace, double* out_sum, bool* out_nonfinite,
                 int device, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("sum_squares (CUDA): negative size");
  DeviceGuard guard(device);
  switch (dtype) {
    case DType::F32: return launch<float>(src, n, workspace, out_sum, out_nonfinite, stream);
    case DType::BF16: return launch<bf16_t>(src, n, workspace, out_sum, out_nonfinite, stream);
    case DType::F16: return launch<f16_t>(src, n, workspace, out_sum, out_nonfinite, stream);
  }
  throw std::invalid_argument("sum_squares (CUDA): unknown dtype");
}

}  // namespace cuda
}  // namespace zc
