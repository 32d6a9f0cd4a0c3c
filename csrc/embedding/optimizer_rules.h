// Fused optimizer rules (FBGEMM's update rules and hyper-parameter names),
// shared by the CPU and CUDA backends. A row of the value storage is
// [weights (dim) | optimizer state (state_width)], all in the storage dtype.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/hd.h"

namespace dynamicemb {
namespace optim {

// Values match dynamicemb's optimizer codes (optimizer.py).
enum Kind : int64_t { kSgd = 0, kAdam = 1, kAdagrad = 2, kRowwiseAdagrad = 3 };

DE_HD int64_t state_width(int64_t kind, int64_t dim) {
  switch (kind) {
    case kAdam: return 2 * dim;  // first and second moments
    case kAdagrad: return dim;   // sum of squared gradients
    case kRowwiseAdagrad: return 1;  // sum of mean squared gradients
    default: return 0;
  }
}

struct Params {
  float lr, eps, beta1, beta2, weight_decay;
  int64_t step;  // Adam: the global step count, >= 1 at the first update
};

// EXACT_SGD: w -= lr * g.
DE_HD float sgd(float w, float g, const Params& p) { return w - p.lr * g; }

// EXACT_ADAGRAD: m += g^2; w -= lr * g / (sqrt(m) + eps). weight_decay > 0
// adds L2 decay to the gradient (FBGEMM's WeightDecayMode.L2).
DE_HD void adagrad(float* w, float* m, float g, const Params& p) {
  g = g + p.weight_decay * *w;
  *m = *m + g * g;
  *w = *w - p.lr * g / (sqrtf(*m) + p.eps);
}

// EXACT_ROWWISE_ADAGRAD, in two parts: the row's new state from the sum of its
// squared (decayed) gradients, then the multiplier applied to each element.
DE_HD float rowwise_adagrad_state(float m, float sum_sq, int64_t dim) {
  return m + sum_sq / static_cast<float>(dim);
}
DE_HD float rowwise_adagrad_multiplier(float m, const Params& p) { return p.lr / (sqrtf(m) + p.eps); }

// ADAM (FBGEMM's, lazy: only rows in the batch move): bias-corrected moments,
// weight decay added to the update.
struct AdamBias {
  float c1, c2;  // 1 - beta1^step, 1 - beta2^step
};
DE_HD AdamBias adam_bias(const Params& p) {
  return AdamBias{1.0f - powf(p.beta1, static_cast<float>(p.step)),
                  1.0f - powf(p.beta2, static_cast<float>(p.step))};
}
DE_HD void adam(float* w, float* m1, float* m2, float g, const Params& p, const AdamBias& b) {
  *m1 = p.beta1 * *m1 + (1.0f - p.beta1) * g;
  *m2 = p.beta2 * *m2 + (1.0f - p.beta2) * g * g;
  const float m_hat = *m1 / b.c1, v_hat = *m2 / b.c2;
  *w = *w - p.lr * (m_hat / (sqrtf(v_hat) + p.eps) + p.weight_decay * *w);
}

}  // namespace optim
}  // namespace dynamicemb
