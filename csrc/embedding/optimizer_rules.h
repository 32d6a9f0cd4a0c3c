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

// FBGEMM's WeightDecayMode values that EXACT_ROWWISE_ADAGRAD takes.
enum WeightDecayMode : int64_t { kDecayNone = 0, kDecayL2 = 1, kDecayDecoupled = 2 };

struct Params {
  float lr, eps, beta1, beta2, weight_decay;
  int64_t step;  // Adam: the global step count, >= 1 at the first update
  int64_t weight_decay_mode;  // EXACT_ROWWISE_ADAGRAD only (WeightDecayMode)
};

// EXACT_SGD: w -= lr * g.
DE_HD float sgd(float w, float g, const Params& p) { return w - p.lr * g; }

// EXACT_ADAGRAD: m += g^2; w -= lr * g / (sqrt(m) + eps). FBGEMM's rule has
// no weight decay (the module refuses weight_decay != 0 with it).
DE_HD void adagrad(float* w, float* m, float g, const Params& p) {
  *m = *m + g * g;
  *w = *w - p.lr * g / (sqrtf(*m) + p.eps);
}

// EXACT_ROWWISE_ADAGRAD, FBGEMM's rule in three parts: the row's new state m
// from the mean of its squared gradients (with L2 decay, of g + wd * w); the
// multiplier lr / (sqrt(m) + eps) and the decay's correction of the old
// weight; then w = correction * w - multiplier * g for each element.
DE_HD float rowwise_adagrad_state_grad(float g, float w, const Params& p) {
  return p.weight_decay_mode == kDecayL2 ? g + p.weight_decay * w : g;
}
DE_HD float rowwise_adagrad_state(float m, float sum_sq, int64_t dim) {
  return m + sum_sq / static_cast<float>(dim);
}
DE_HD float rowwise_adagrad_multiplier(float m, const Params& p) { return p.lr / (sqrtf(m) + p.eps); }
DE_HD float rowwise_adagrad_correction(float multiplier, const Params& p) {
  if (p.weight_decay_mode == kDecayL2) return 1.0f - multiplier * p.weight_decay;
  if (p.weight_decay_mode == kDecayDecoupled) return 1.0f - p.lr * p.weight_decay;
  return 1.0f;
}
DE_HD float rowwise_adagrad_update(float w, float g, float multiplier, float correction) {
  return correction * w - multiplier * g;
}

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

// Element d of a row [w (D) | state] under an element-wise optimizer (SGD,
// ADAGRAD, ADAM): read in float, updated, written back in the storage dtype
// W. ROWWISE_ADAGRAD needs the whole row's gradient first (see above).
template <int64_t kKind, class W>
DE_HD void update_element(W* row, int64_t D, int64_t d, float g, const Params& p, const AdamBias& bias) {
  float w = static_cast<float>(row[d]);
  if constexpr (kKind == kSgd) {
    w = sgd(w, g, p);
  } else if constexpr (kKind == kAdagrad) {
    float m = static_cast<float>(row[D + d]);
    adagrad(&w, &m, g, p);
    row[D + d] = static_cast<W>(m);
  } else if constexpr (kKind == kAdam) {
    float m1 = static_cast<float>(row[D + d]), m2 = static_cast<float>(row[2 * D + d]);
    adam(&w, &m1, &m2, g, p, bias);
    row[D + d] = static_cast<W>(m1);
    row[2 * D + d] = static_cast<W>(m2);
  }
  row[d] = static_cast<W>(w);
}

}  // namespace optim
}  // namespace dynamicemb
