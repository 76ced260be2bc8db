// torch dtype -> zc::DType, shared by the binding files (bindings.cpp, bindings_cuda.cpp).
// Only binding files include this: it needs torch headers, the kernels must not.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "common/dtype.h"

// Argument checks for the binding files. They throw std::invalid_argument (ValueError in
// Python) and pybind11::type_error (TypeError), not c10::Error as TORCH_CHECK_* does: a
// c10::Error captures a C++ backtrace when it is built, and on the H100 machine a check failing
// in this extension killed the process inside that capture (unwinding through the extension's
// frames) where std::invalid_argument thrown by the same call raised cleanly
// (benchmarks/results/gpu_h100_2026-11-22). The Python layer (zerocore/ops/_checks.py) catches
// bad input before it gets here; these checks keep a direct call from crashing.
#define ZC_CHECK_VALUE(cond, ...) \
  do {                            \
    if (!(cond)) throw std::invalid_argument(c10::str(__VA_ARGS__)); \
  } while (0)
#define ZC_CHECK_TYPE(cond, ...) \
  do {                           \
    if (!(cond)) throw pybind11::type_error(c10::str(__VA_ARGS__)); \
  } while (0)

namespace zc_bind {

// The kernel dtype of `t`, or nothing if the kernels do not take it. Cheap: for hot paths
// that build an argument name only when the dtype is wrong.
inline std::optional<zc::DType> kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return zc::DType::F32;
    case at::kBFloat16: return zc::DType::BF16;
    case at::kHalf: return zc::DType::F16;
    default: return std::nullopt;
  }
}

// The kernel dtype of `t`; TypeError naming the op and argument if the kernels do not take it.
inline zc::DType to_zc(const at::Tensor& t, const std::string& op, const std::string& arg) {
  const std::optional<zc::DType> d = kernel_dtype(t);
  ZC_CHECK_TYPE(d.has_value(), op, ": '", arg, "' has dtype ", t.scalar_type(),
                   "; expected float32, bfloat16 or float16");
  return *d;
}

}  // namespace zc_bind
