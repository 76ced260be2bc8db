// Adam / AdamW on flat fp32 shards: fp32 master, m and v updated in place in one pass; the
// gradient may be fp32, bf16 or fp16 and is multiplied by a scale factor as it is read
// (loss-scale unscaling and the clip coefficient); optionally the updated parameter is also
// written as bf16/fp16 in the same pass. No torch headers: raw pointers and sizes.
#pragma once
#include <cstdint>
#include "../common/dtype.h"

namespace zc {

// Per-tensor scalars, folded on the host in double and rounded to float once, the same way
// torch.optim.Adam(W) folds its Python-float hyper-parameters.
struct AdamScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
  float decay;          // 1 - lr*wd for AdamW (decoupled), 1 for Adam
  float l2_wd;          // wd for Adam (L2, added to the gradient), 0 for AdamW
  float grad_scale;     // multiplies the gradient as it is read
};

struct AdamTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;  // nullptr, or numel elements of out_dtype (BF16 / F16)
  int64_t numel;
  DType grad_dtype;
  DType out_dtype;
  AdamScalars s;
  // Out of place: where the step reads the old master, m and v (nullptr: the three above, in place).
  // The values written are the same bits either way; the sources are left as they were, so a step
  // taken before it is known to be wanted (offload/speculation.py) can be dropped by not using it.
  // The host kernels only (the CUDA table reads the fields above).
  const float* param_src = nullptr;
  const float* exp_avg_src = nullptr;
  const float* exp_avg_sq_src = nullptr;
};

// Validates and folds hyper-parameters; throws std::invalid_argument naming the bad one.
AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, bool adamw, double grad_scale);

// Steps n tensors in one call, split into chunks spread over num_threads OpenMP threads.
void adam_step_multi(const AdamTensor* tensors, int64_t n, int num_threads);

}  // namespace zc
