// torch dtype -> zc::DType, shared by the binding files (bindings.cpp, bindings_cuda.cpp).
// Only binding files include this: it needs torch headers, the kernels must not.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>

#include "common/dtype.h"

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
  TORCH_CHECK_TYPE(d.has_value(), op, ": '", arg, "' has dtype ", t.scalar_type(),
                   "; expected float32, bfloat16 or float16");
  return *d;
}

}  // namespace zc_bind
