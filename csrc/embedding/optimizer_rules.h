// Fused optimizer rules (FBGEMM's update rules and hyper-parameter names),
// shared by the CPU and CUDA backends and exported to Python (csrc/rules.cpp
// -> dynamicemb/rules.py), so that codes, state widths and hyper-parameters
// are written here only.
//
// A row of the value storage is [weights (D) | per-element state
// (kStatePerDim * D) | per-row state (kStateFixed)], all in the storage dtype.
// A new row's state starts at 0, or, for a rule with kAccumulator (Adagrad's
// sum of squares), at initial_accumulator_value (init_rules.h: Args::state).
//
// An optimizer is one rule struct plus its entry in Registry. A rule is either
// element-wise (element: one weight and its state from its gradient) or
// row-wise (kSums passes that each sum term(k, ...) over the row, row() on
// the row's state and those sums, then a pass of apply()). update_row walks
// a row through either form on both backends; dispatch() is the one switch
// from a code to its rule.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/hd.h"

namespace dynamicemb {
namespace optim {

// FBGEMM's WeightDecayMode values that the rules take.
enum WeightDecayMode : int64_t { kDecayNone = 0, kDecayL2 = 1, kDecayDecoupled = 2, kDecayModes = 3 };
constexpr const char* kDecayModeNames[kDecayModes] = {"NONE", "L2", "DECOUPLE"};

// The hyper-parameters, by FBGEMM's names (emb_backward_update takes them,
// with the step). A rule names those it reads (kHyper): the module refuses a
// weight decay or a weight decay mode that its optimizer would ignore.
enum Hyper : uint32_t {
  kLearningRate = 1u << 0,
  kEps = 1u << 1,
  kBeta1 = 1u << 2,
  kBeta2 = 1u << 3,
  kWeightDecay = 1u << 4,
  kWeightDecayMode = 1u << 5,
};
constexpr int kNumHyper = 6;
constexpr const char* kHyperNames[kNumHyper] = {"learning_rate", "eps", "beta1", "beta2", "weight_decay",
                                                "weight_decay_mode"};

struct Params {
  float lr, eps, beta1, beta2, weight_decay;
  int64_t step;               // the module's update count, >= 1 at the first update
  int64_t weight_decay_mode;  // WeightDecayMode
  float derived[2];           // per-call constants of the rule (its prepare()), computed on the host
};

// (FBGEMM's gradient_clipping clamps the output gradient before it is
// reduced per key: bag_checks.h's check_backward.)

// emb_backward_update's skip_nonfinite: a row takes its update only if every
// element of its reduced gradient is finite (after clipping); else a NaN /
// inf reached the row, or its sum overflowed. g - g is exactly 0 for a
// finite g and NaN for an inf or a NaN (the CPU sums it in vectors).
DE_HD bool finite(float g) { return g - g == 0.0f; }

// ---- the rules ---------------------------------------------------------------------
// kCode: the kernel code, which checkpoints record (never reuse one). kName,
// kValues: FBGEMM's EmbOptimType member and the values it accepts (space
// separated, the member's own first). prepare(): per-call constants, on the
// host (device powf may differ from the host's in the last bit).

// EXACT_SGD: w -= lr * g. (FBGEMM's SGD computes the same here.)
struct ExactSgd {
  static constexpr int64_t kCode = 0;
  static constexpr const char* kName = "EXACT_SGD";
  static constexpr const char* kValues = "exact_sgd sgd";
  static constexpr int64_t kStatePerDim = 0, kStateFixed = 0;
  static constexpr uint32_t kHyper = kLearningRate;
  static constexpr bool kRowwise = false, kAccumulator = false;
  static void prepare(Params&) {}
  DE_HD static void element(float& w, float*, float g, const Params& p) { w = w - p.lr * g; }
};

// ADAM (FBGEMM's, lazy: only rows in the batch move): bias-corrected moments
// (state: first, second), weight decay added to the update.
struct Adam {
  static constexpr int64_t kCode = 1;
  static constexpr const char* kName = "ADAM";
  static constexpr const char* kValues = "adam";
  static constexpr int64_t kStatePerDim = 2, kStateFixed = 0;
  static constexpr uint32_t kHyper = kLearningRate | kEps | kBeta1 | kBeta2 | kWeightDecay;
  static constexpr bool kRowwise = false, kAccumulator = false;
  static void prepare(Params& p) {  // 1 - beta^step
    p.derived[0] = 1.0f - powf(p.beta1, static_cast<float>(p.step));
    p.derived[1] = 1.0f - powf(p.beta2, static_cast<float>(p.step));
  }
  // The moments m moved by g, and the element's step direction r (LAMB's too).
  DE_HD static float direction(float w, float* m, float g, const Params& p) {
    m[0] = p.beta1 * m[0] + (1.0f - p.beta1) * g;
    m[1] = p.beta2 * m[1] + (1.0f - p.beta2) * g * g;
    const float m_hat = m[0] / p.derived[0], v_hat = m[1] / p.derived[1];
    return m_hat / (sqrtf(v_hat) + p.eps) + p.weight_decay * w;
  }
  DE_HD static void element(float& w, float* m, float g, const Params& p) { w = w - p.lr * direction(w, m, g, p); }
};

// EXACT_ADAGRAD: m += g^2; w -= lr * g / (sqrt(m) + eps). FBGEMM's rule has
// no weight decay.
struct ExactAdagrad {
  static constexpr int64_t kCode = 2;
  static constexpr const char* kName = "EXACT_ADAGRAD";
  static constexpr const char* kValues = "exact_adagrad";
  static constexpr int64_t kStatePerDim = 1, kStateFixed = 0;
  static constexpr uint32_t kHyper = kLearningRate | kEps;
  static constexpr bool kRowwise = false, kAccumulator = true;
  static void prepare(Params&) {}
  DE_HD static void element(float& w, float* m, float g, const Params& p) {
    m[0] = m[0] + g * g;
    w = w - p.lr * g / (sqrtf(m[0]) + p.eps);
  }
};

// EXACT_ROWWISE_ADAGRAD, FBGEMM's rule: the row's state m gains the mean of
// its squared gradients (with L2 decay, of g + wd * w); then every weight
// w = correction * w - multiplier * g, multiplier = lr / (sqrt(m) + eps),
// correction the decay's (L2: 1 - multiplier * wd; DECOUPLE: 1 - lr * wd).
struct ExactRowwiseAdagrad {
  static constexpr int64_t kCode = 3;
  static constexpr const char* kName = "EXACT_ROWWISE_ADAGRAD";
  static constexpr const char* kValues = "exact_row_wise_adagrad";
  static constexpr int64_t kStatePerDim = 0, kStateFixed = 1;
  static constexpr uint32_t kHyper = kLearningRate | kEps | kWeightDecay | kWeightDecayMode;
  static constexpr bool kRowwise = true, kAccumulator = true;
  static constexpr int kSums = 1;
  static void prepare(Params&) {}
  struct Step {
    float mult, corr;
  };
  DE_HD static float term(int, float g, float w, const float*, const Params& p) {
    const float gs = p.weight_decay_mode == kDecayL2 ? g + p.weight_decay * w : g;
    return gs * gs;
  }
  DE_HD static Step row(float* m, const float* sums, int64_t dim, const Params& p) {
    m[0] = m[0] + sums[0] / static_cast<float>(dim);
    const float mult = p.lr / (sqrtf(m[0]) + p.eps);
    float corr = 1.0f;
    if (p.weight_decay_mode == kDecayL2) corr = 1.0f - mult * p.weight_decay;
    if (p.weight_decay_mode == kDecayDecoupled) corr = 1.0f - p.lr * p.weight_decay;
    return Step{mult, corr};
  }
  DE_HD static void apply(float& w, float*, float g, const Step& s, const Params&) { w = s.corr * w - s.mult * g; }
};

// PARTIAL_ROWWISE_ADAM, FBGEMM's rule (lazy, like ADAM): a first moment m1
// per element and one second moment v per row, v = beta2 * v + (1 - beta2)
// * mean(g^2) over the row; then every weight w -= lr * (m1 / (1 - beta1^t)
// / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w), m1 = beta1 * m1 +
// (1 - beta1) * g. State: D + 1 columns (ADAM's: 2 D).
struct PartialRowwiseAdam {
  static constexpr int64_t kCode = 4;
  static constexpr const char* kName = "PARTIAL_ROWWISE_ADAM";
  static constexpr const char* kValues = "partial_row_wise_adam";
  static constexpr int64_t kStatePerDim = 1, kStateFixed = 1;
  static constexpr uint32_t kHyper = kLearningRate | kEps | kBeta1 | kBeta2 | kWeightDecay;
  static constexpr bool kRowwise = true, kAccumulator = false;
  static constexpr int kSums = 1;
  static void prepare(Params& p) { Adam::prepare(p); }
  struct Step {
    float denom;  // sqrt(v_hat) + eps
  };
  DE_HD static float term(int, float g, float, const float*, const Params&) { return g * g; }
  DE_HD static Step row(float* v, const float* sums, int64_t dim, const Params& p) {
    v[0] = p.beta2 * v[0] + (1.0f - p.beta2) * (sums[0] / static_cast<float>(dim));
    return Step{sqrtf(v[0] / p.derived[1]) + p.eps};
  }
  DE_HD static void apply(float& w, float* m1, float g, const Step& s, const Params& p) {
    m1[0] = p.beta1 * m1[0] + (1.0f - p.beta1) * g;
    w = w - p.lr * (m1[0] / p.derived[0] / s.denom + p.weight_decay * w);
  }
};

// LAMB, FBGEMM's rule: Adam's moments per element (state: m1, m2) give
// r = m1 / (1 - beta1^t) / (sqrt(m2 / (1 - beta2^t)) + eps) + weight_decay * w;
// then w -= lr * (||w|| / ||r||) * r, the norms over the row before the update
// (two sums). Where ||r|| = 0 (no gradient, no moment, no decay: r = 0) the
// ratio is 0 rather than FBGEMM's NaN; a zero row (||w|| = 0) stays, as in FBGEMM.
struct Lamb {
  static constexpr int64_t kCode = 5;
  static constexpr const char* kName = "LAMB";
  static constexpr const char* kValues = "lamb";
  static constexpr int64_t kStatePerDim = 2, kStateFixed = 0;
  static constexpr uint32_t kHyper = kLearningRate | kEps | kBeta1 | kBeta2 | kWeightDecay;
  static constexpr bool kRowwise = true, kAccumulator = false;
  static constexpr int kSums = 2;  // ||w||^2, ||r||^2
  static void prepare(Params& p) { Adam::prepare(p); }
  struct Step {
    float ratio;  // ||w|| / ||r||
  };
  DE_HD static float term(int k, float g, float w, const float* s, const Params& p) {
    if (k == 0) return w * w;
    float m[2] = {s[0], s[1]};  // the pass only reads the state; apply() writes it
    const float r = Adam::direction(w, m, g, p);
    return r * r;
  }
  DE_HD static Step row(float*, const float* sums, int64_t, const Params&) {
    const float rn = sqrtf(sums[1]);
    return Step{rn > 0.0f ? sqrtf(sums[0]) / rn : 0.0f};
  }
  DE_HD static void apply(float& w, float* m, float g, const Step& s, const Params& p) {
    const float r = Adam::direction(w, m, g, p);
    w = w - (p.lr * s.ratio) * r;
  }
};

// ---- the registry ----------------------------------------------------------------------

template <class... R>
struct RuleList {};
// Every optimizer, once.
using Registry = RuleList<ExactSgd, Adam, ExactAdagrad, ExactRowwiseAdagrad, PartialRowwiseAdam, Lamb>;

// fn(Rule{}) for the rule whose code is `code`; false when there is none.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Fn, class... R>
DE_HD bool dispatch_in(RuleList<R...>, int64_t code, Fn& fn) {
  return ((code == R::kCode ? (fn(R{}), true) : false) || ...);
}
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Fn>
DE_HD bool dispatch(int64_t code, Fn fn) {
  return dispatch_in(Registry{}, code, fn);
}

// fn(Rule{}) for every rule, in registry order (host: the exporter).
template <class Fn, class... R>
void for_each_in(RuleList<R...>, Fn& fn) {
  (fn(R{}), ...);
}
template <class Fn>
void for_each_rule(Fn fn) {
  for_each_in(Registry{}, fn);
}

inline bool known(int64_t code) {
  return dispatch(code, [](auto) {});
}

template <class Rule>
constexpr int64_t state_width_of(int64_t dim) {
  return Rule::kStatePerDim * dim + Rule::kStateFixed;
}

// Columns of optimizer state next to a row of `dim` weights (0: unknown code).
inline int64_t state_width(int64_t code, int64_t dim) {
  int64_t w = 0;
  dispatch(code, [&](auto r) { w = state_width_of<decltype(r)>(dim); });
  return w;
}

// The kernels' parameters of one update call (emb_backward_update's arguments).
inline Params make_params(int64_t code, double lr, double eps, double beta1, double beta2, double weight_decay,
                          int64_t step, int64_t weight_decay_mode) {
  Params p{static_cast<float>(lr),
           static_cast<float>(eps),
           static_cast<float>(beta1),
           static_cast<float>(beta2),
           static_cast<float>(weight_decay),
           step,
           weight_decay_mode,
           {1.0f, 1.0f}};
  dispatch(code, [&](auto r) { decltype(r)::prepare(p); });
  return p;
}

// ---- one row's update ------------------------------------------------------------------

// Element d's state, in float.
template <int64_t S, class W>
DE_HD void load_state(const W* row, int64_t D, int64_t d, float* s) {
  for (int64_t k = 0; k < S; ++k) s[k] = static_cast<float>(row[(k + 1) * D + d]);
}

// Element d of a row through fn(w, state) in float, written back in W.
template <int64_t S, class W, class Fn>
DE_HD void on_element(W* row, int64_t D, int64_t d, Fn fn) {
  float w = static_cast<float>(row[d]);
  float s[S > 0 ? S : 1];
  for (int64_t k = 0; k < S; ++k) s[k] = static_cast<float>(row[(k + 1) * D + d]);
  fn(w, s);
  for (int64_t k = 0; k < S; ++k) row[(k + 1) * D + d] = static_cast<W>(s[k]);
  row[d] = static_cast<W>(w);
}

// One row's update by Rule, for both backends. `walk` visits the row's
// elements with their gradients: walk.for_each(fn) calls fn(d, g) for every
// element d; walk.sum(term) is the sum of term(d, g) over the elements in
// element order, rounded per step (a sequential loop's result); walk.once(fn)
// runs fn once, after every element has been visited. A row-wise rule's sums
// read each element's weight and state as they were before the update.
template <class Rule, class W, class Walk>
DE_HD void update_row(W* row, int64_t D, Walk& walk, const Params& p) {
  constexpr int64_t S = Rule::kStatePerDim;
  if constexpr (Rule::kRowwise) {
    constexpr int64_t R = Rule::kStateFixed;
    W* row_state = row + (S + 1) * D;
    float sums[Rule::kSums];
    for (int k = 0; k < Rule::kSums; ++k) {
      sums[k] = walk.sum([&](int64_t d, float g) {
        float s[S > 0 ? S : 1];
        load_state<S>(row, D, d, s);
        return Rule::term(k, g, static_cast<float>(row[d]), s, p);
      });
    }
    float rs[R > 0 ? R : 1];
    for (int64_t j = 0; j < R; ++j) rs[j] = static_cast<float>(row_state[j]);
    const typename Rule::Step step = Rule::row(rs, sums, D, p);
    walk.for_each([&](int64_t d, float g) {
      on_element<S>(row, D, d, [&](float& w, float* s) { Rule::apply(w, s, g, step, p); });
    });
    walk.once([&] {
      for (int64_t j = 0; j < R; ++j) row_state[j] = static_cast<W>(rs[j]);
    });
  } else {
    walk.for_each([&](int64_t d, float g) {
      on_element<S>(row, D, d, [&](float& w, float* s) { Rule::element(w, s, g, p); });
    });
  }
}

}  // namespace optim
}  // namespace dynamicemb
