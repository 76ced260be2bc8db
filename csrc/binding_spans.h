// "No two tensors share memory" for the multi-tensor bindings, in C++: the check that cost
// ~1 ms of Python per 200-tensor Adam call (ops/_checks.py's check_disjoint) costs
// microseconds here. An op that writes one tensor while reading or writing another that
// overlaps it would give results depending on thread (or block) timing.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "binding_dtype.h"

namespace zc_bind {

struct Span {
  uintptr_t begin, end;
  const char* list;  // the argument's name, e.g. "params"
  int64_t index;     // position in that list (-1: a lone tensor, named without an index); the order key for
                     // naming a pair (argument order)
  int order;         // which list, in argument order
};

class Spans {
 public:
  explicit Spans(size_t reserve) { spans_.reserve(reserve); }

  // Empty tensors hold no memory and overlap nothing.
  void add(const at::Tensor& t, const char* list, int order, int64_t index) {
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    if (n <= 0) return;
    const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans_.push_back({b, b + static_cast<uintptr_t>(n), list, index, order});
  }

  // ValueError naming the first overlapping pair (by address), in argument order.
  void check_disjoint(const char* op) {
    if (spans_.size() < 2) return;
    std::sort(spans_.begin(), spans_.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < spans_.size(); ++i) {
      const Span& a = spans_[i - 1];
      const Span& b = spans_[i];
      if (b.begin < a.end) {
        const bool a_first = a.order != b.order ? a.order < b.order : a.index < b.index;
        const Span& x = a_first ? a : b;
        const Span& y = a_first ? b : a;
        ZC_CHECK_VALUE(false, op, ": '", name(x), "' and '", name(y), "' share memory; the op needs separate tensors");
      }
    }
  }

 private:
  static std::string name(const Span& s) {
    return s.index < 0 ? std::string(s.list) : std::string(s.list) + "[" + std::to_string(s.index) + "]";
  }

  std::vector<Span> spans_;
};

}  // namespace zc_bind
