// "The tensor has the memory its elements need" for the binding files, checked before any
// data pointer is taken (the same rules as zerocore/ops/_checks.py's check_dense/check_memory,
// for a caller that bypasses Python):
// - dense: a sparse tensor has no element array;
// - backed: a storage freed or shrunk under the tensor (`untyped_storage().resize_(0)`, as stage 3
//   frees a partitioned parameter) leaves a null or dangling pointer that a kernel would write
//   through: a segfault on the CPU, an illegal address that ends the CUDA context on a GPU. Also
//   `data_ptr<T>()` of such a tensor throws a c10::Error from inside this extension, the kind of
//   throw that killed the process on the H100 (see binding_dtype.h): it must not be reached;
// - aligned (CUDA kernels that load whole elements): the address is a multiple of the element size.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "binding_dtype.h"

namespace zc_bind {

// Cheap enough for the per-tensor fast paths: a few loads, no allocation.
inline bool holds_memory(const at::Tensor& t) {
  const int64_t n = t.numel();
  if (n == 0) return true;
  if (!t.has_storage()) return false;
  const at::Storage& s = t.storage();
  const auto need = static_cast<uint64_t>(t.storage_offset() + n) * static_cast<uint64_t>(t.element_size());
  return s.data() != nullptr && static_cast<uint64_t>(s.nbytes()) >= need;
}

inline bool element_aligned(const at::Tensor& t) {
  return t.numel() == 0 ||
         reinterpret_cast<uintptr_t>(t.data_ptr()) % static_cast<uintptr_t>(t.element_size()) == 0;
}

// ValueError naming the op and argument; call after the device and contiguity checks.
inline void check_memory(const at::Tensor& t, const std::string& op, const std::string& arg, bool aligned = false) {
  ZC_CHECK_VALUE(t.layout() == at::kStrided, op, ": '", arg, "' is a ", t.layout(),
                 " tensor; zerocore's kernels take dense tensors (call .to_dense())");
  if (!holds_memory(t)) {
    const int64_t have = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
    ZC_CHECK_VALUE(false, op, ": '", arg, "' has ", t.numel(), " elements but its storage holds ", have, " of the ",
                   (t.storage_offset() + t.numel()) * static_cast<int64_t>(t.element_size()),
                   " bytes they need: its memory was freed or shrunk (e.g. a stage-3 parameter outside "
                   "zerocore.gathered())");
  }
  ZC_CHECK_VALUE(!aligned || element_aligned(t), op, ": '", arg, "' starts at an address that is not a multiple of ",
                 "its element size (", t.element_size(), " bytes); the CUDA kernels need element-aligned tensors "
                 "(call .clone())");
}

}  // namespace zc_bind
