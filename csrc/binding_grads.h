// Which `.grad`s pack_grads may copy into a reduction bucket in one pass, decided once for the CPU
// pack (csrc/params/param_bindings.h) and the CUDA one (csrc/bindings_cuda.cpp): both refuse, touching
// nothing, unless every present gradient has the bucket's dtype and device, is dense and contiguous
// with memory behind it, fits at its (ascending) offset and shares no memory with the bucket (itself
// contiguous and backed). The caller then packs through the checked op, which names what is wrong.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "binding_memory.h"

namespace zc_bind {

struct GradPiece {
  void* data;      // the gradient's elements (read by the pack)
  int64_t offset;  // elements into the bucket
  int64_t numel;
};

// The present gradients of `params` (at `offsets`) as pieces of `flat`, or false (and `pieces`
// unspecified) when any rule above fails.
inline bool packable_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                           const at::Tensor& flat, std::vector<GradPiece>& pieces) {
  pieces.clear();
  if (!flat.defined() || flat.layout() != at::kStrided || !flat.is_contiguous() || !holds_memory(flat)) return false;
  const int64_t total = flat.numel(), esize = flat.element_size();
  const auto* lo = static_cast<const char*>(flat.data_ptr());
  const auto* hi = lo + total * esize;
  pieces.reserve(params.size());
  int64_t end = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].grad();
    if (!g.defined()) continue;
    const int64_t o = offsets[i], n = g.numel();
    if (o < end || o + n > total || g.scalar_type() != flat.scalar_type() || g.device() != flat.device() ||
        g.layout() != at::kStrided || !g.is_contiguous() || !holds_memory(g))
      return false;
    const auto* p = static_cast<const char*>(g.data_ptr());
    if (n && p < hi && lo < p + n * esize) return false;
    pieces.push_back({g.data_ptr(), o, n});
    end = o + n;
  }
  return true;
}

// Drops every present gradient (after a pack; the caller's launch or copy has read them).
inline void drop_grads(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
  }
}

}  // namespace zc_bind
