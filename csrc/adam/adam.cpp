#include "adam.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/parallel.h"
#include "../isa/dispatch.h"

namespace zc {

namespace {
// The message is only formatted when the check fails: this runs once per tensor per step.
[[noreturn]] void reject(const char* what, double got) {
  throw std::invalid_argument(std::string(what) + ", got " + std::to_string(got));
}
}  // namespace

AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, bool adamw, double grad_scale) {
  // Each test is written so that NaN fails it.
  if (!(std::isfinite(lr) && lr >= 0.0)) reject("lr must be a finite number >= 0", lr);
  if (!(beta1 >= 0.0 && beta1 < 1.0)) reject("betas[0] must be in [0, 1)", beta1);
  if (!(beta2 >= 0.0 && beta2 < 1.0)) reject("betas[1] must be in [0, 1)", beta2);
  if (!(std::isfinite(eps) && eps >= 0.0)) reject("eps must be a finite number >= 0", eps);
  if (!(std::isfinite(weight_decay) && weight_decay >= 0.0))
    reject("weight_decay must be a finite number >= 0", weight_decay);
  if (step < 1) reject("step must be >= 1 (the count after this update)", static_cast<double>(step));
  if (!(std::isfinite(grad_scale))) reject("grad_scale must be finite", grad_scale);
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.l2_wd = adamw ? 0.0f : static_cast<float>(weight_decay);
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

void adam_step_multi(const AdamTensor* tensors, int64_t n, int num_threads) {
  struct Span { int64_t t, begin, end; };
  std::vector<Span> spans;
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) total += tensors[t].numel;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < tensors[t].numel; b += kChunkElems)
      spans.push_back({t, b, std::min(tensors[t].numel, b + kChunkElems)});
  const KernelTable& k = active_kernels();
  const int64_t count = static_cast<int64_t>(spans.size());
  const int threads = threads_for(count, num_threads, total);
  // Static schedule: each thread walks one contiguous run of chunks, which keeps the
  // hardware prefetchers on long sequential streams.
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < count; ++i) k.adam(tensors[spans[i].t], spans[i].begin, spans[i].end);
}

}  // namespace zc
