// What the CUDA part was built for and what the runtime sees; for `zerocore env`, the
// Python dispatch's error messages and the tests. Nothing here throws without a device.
#include <string>
#include <vector>

#include "common.cuh"

namespace zc {
namespace cuda {
namespace {
__global__ void probe_kernel() {}
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_error() {
  int n = 0;
  const cudaError_t st = cudaGetDeviceCount(&n);
  if (st == cudaSuccess && n > 0) return "";
  (void)cudaGetLastError();
  if (st == cudaSuccess) return "the CUDA runtime sees no device";
  return std::string(cudaGetErrorName(st)) + ": " + cudaGetErrorString(st);
}

std::vector<int> compiled_archs() {
#if defined(__CUDA_ARCH_LIST__)
  return {__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

int runtime_version_compiled() { return CUDART_VERSION; }

std::vector<int> kernel_versions(int device) {
  DeviceGuard guard(device);
  cudaFuncAttributes attr;
  ZC_CUDA_CHECK(cudaFuncGetAttributes(&attr, probe_kernel));
  return {attr.binaryVersion, attr.ptxVersion};
}

}  // namespace cuda
}  // namespace zc
