// Host-side argument checks of the routing ops, shared by route_cpu.cpp and
// route_cuda.cu so that both refuse the same inputs with the same messages.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

#include "dist/route_rules.h"

namespace dynamicemb {
namespace route {

// A rule's parameter must be valid before owner() divides by it.
inline void check_rule(int64_t rule, int64_t param, const char* what, int64_t index) {
  TORCH_CHECK(rule == kHashRoundRobin || rule == kRoundRobin ||
                  ((rule == kBlock || rule == kContinuous) && param > 0),
              "dynamicemb: ", what, index, ": bad routing rule ", rule, " / param ", param);
}

// route_keys: contiguous 1-D int64 lengths [F * B] and values on one device,
// one rule and param per feature. Returns F.
inline int64_t check_route_args(const at::Tensor& lengths, const at::Tensor& values, c10::IntArrayRef rules,
                                c10::IntArrayRef params, int64_t world) {
  TORCH_CHECK(lengths.scalar_type() == at::kLong && values.scalar_type() == at::kLong && lengths.dim() == 1 &&
                  values.dim() == 1 && lengths.is_contiguous() && values.is_contiguous(),
              "dynamicemb: route takes contiguous 1-D int64 lengths and values");
  TORCH_CHECK(lengths.device() == values.device(), "dynamicemb: route takes lengths and values on one device, got ",
              lengths.device(), " and ", values.device());
  TORCH_CHECK(world >= 1, "dynamicemb: world size must be >= 1");
  const int64_t F = static_cast<int64_t>(rules.size());
  TORCH_CHECK(F > 0 && static_cast<int64_t>(params.size()) == F && lengths.numel() % F == 0,
              "dynamicemb: route needs one rule and param per feature; lengths hold ", lengths.numel(),
              " entries for ", F, " features");
  for (int64_t f = 0; f < F; ++f) check_rule(rules[f], params[f], "feature ", f);
  return F;
}

// Per-value weights: contiguous float32, one per value, beside the values.
inline const float* checked_weights(const std::optional<at::Tensor>& weights, const at::Tensor& values) {
  if (!weights) return nullptr;
  TORCH_CHECK(weights->scalar_type() == at::kFloat && weights->is_contiguous() &&
                  weights->numel() == values.numel() && weights->device() == values.device(),
              "dynamicemb: weights must be contiguous float32 with one entry per value, on ", values.device());
  return weights->data_ptr<float>();
}

// route_owners: contiguous 1-D int64 keys under one valid rule.
inline void check_owner_args(const at::Tensor& keys, int64_t rule, int64_t param, int64_t world) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.is_contiguous(),
              "dynamicemb: keys must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(world >= 1, "dynamicemb: world size must be >= 1");
  check_rule(rule, param, "rule of ", 0);
}

}  // namespace route
}  // namespace dynamicemb
