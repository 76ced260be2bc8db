// Host-side helpers shared by the .cu files: error checks that throw, a device guard, sizes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "api.h"
#include "elementwise.h"

namespace zc {
namespace cuda {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what) {
  (void)cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw std::runtime_error(std::string("zerocore CUDA: ") + what + " failed: " + cudaGetErrorName(err) + ": " +
                           cudaGetErrorString(err));
}

#define ZC_CUDA_CHECK(call)                           \
  do {                                                \
    const cudaError_t zc_err_ = (call);               \
    if (zc_err_ != cudaSuccess) throw_cuda(zc_err_, #call); \
  } while (0)

// After a launch: configuration errors (too many blocks, no kernel image for this device).
#define ZC_LAUNCH_CHECK(name)                                          \
  do {                                                                 \
    const cudaError_t zc_err_ = cudaGetLastError();                    \
    if (zc_err_ != cudaSuccess) throw_cuda(zc_err_, "launching " name); \
  } while (0)

// Makes `device` current for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    ZC_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      ZC_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Multiprocessors of the current device (for grid-stride launch sizes).
inline int sm_count() {
  int dev = 0, sms = 0;
  ZC_CUDA_CHECK(cudaGetDevice(&dev));
  ZC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms > 0 ? sms : 1;
}

inline bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// Kernel parameters of up to 32,764 bytes (CUDA >= 12.1 on Volta and newer; every arch nvcc 12+
// builds for here): a launch's whole table travels by value, with no device copy of it. The
// driver must be >= 12.1 too (an older one refuses such a launch), asked once.
#if CUDART_VERSION >= 12010
#define ZC_LARGE_KERNEL_PARAMS 1
#else
#define ZC_LARGE_KERNEL_PARAMS 0
#endif
constexpr size_t kLargeKernelParamBytes = 32764;
inline bool large_kernel_params() {
#if ZC_LARGE_KERNEL_PARAMS
  static const bool ok = [] {
    int driver = 0;
    return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace cuda
}  // namespace zc
