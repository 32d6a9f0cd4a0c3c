// CPU kernel of the input distribution: splits a KeyedJaggedTensor's values by
// owning rank (per-feature rules in route_rules.h) into the layout TorchRec's
// KJTAllToAll sends: [rank][feature][bag], input order kept within a bag.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "common/parallel_cpu.h"
#include "dist/route_checks.h"
#include "dist/route_rules.h"

namespace dynamicemb {
namespace route {
namespace {

using at::Tensor;
using c10::IntArrayRef;

// lengths [F * B] (feature-major), values [N], weights [N] or none.
// Returns (lengths [W * F * B], values, weights (or empty), permute): the
// position of each input value in the output (for sequence outputs).
std::tuple<Tensor, Tensor, Tensor, Tensor> route_cpu(const Tensor& lengths, const Tensor& values,
                                                     const std::optional<Tensor>& weights, IntArrayRef rules,
                                                     IntArrayRef params, int64_t world) {
  const int64_t F = check_route_args(lengths, values, rules, params, world);
  const int64_t bags = lengths.numel(), B = bags / F, n = values.numel();
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> off(bags + 1, 0);
  for (int64_t j = 0; j < bags; ++j) {
    TORCH_CHECK(len[j] >= 0, "dynamicemb: negative length at bag ", j);
    off[j + 1] = off[j] + len[j];
  }
  TORCH_CHECK(off[bags] == n, "dynamicemb: lengths sum to ", off[bags], " but there are ", n, " values");
  const float* w = checked_weights(weights, values);
  const int64_t* v = values.data_ptr<int64_t>();
  // Destination bucket (rank, feature, bag) and routed key of every value.
  std::vector<int64_t> bucket(n), key(n);
  at::parallel_for(0, bags, 256, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j) {
      const int64_t f = j / B;
      for (int64_t i = off[j]; i < off[j + 1]; ++i) {
        key[i] = v[i];
        const int64_t r = owner(rules[f], params[f], world, &key[i]);
        bucket[i] = r * bags + j;
      }
    }
  });
  const cpu::StablePartition sp(n, world * bags, [&](int64_t i) { return bucket[i]; });
  Tensor out_len = at::empty({world * bags}, lengths.options());
  Tensor out_val = at::empty({n}, values.options());
  Tensor out_w = w ? at::empty({n}, weights->options()) : at::empty({0}, values.options().dtype(at::kFloat));
  Tensor permute = at::empty({n}, values.options());
  int64_t* ol = out_len.data_ptr<int64_t>();
  int64_t* ov = out_val.data_ptr<int64_t>();
  float* ow = w ? out_w.data_ptr<float>() : nullptr;
  int64_t* perm = permute.data_ptr<int64_t>();
  if (sp.parts() == 1) {  // world * bags == 1
    ol[0] = n;
  } else {
    for (int64_t p = 0; p < world * bags; ++p) ol[p] = sp.end(p) - sp.begin(p);
  }
  at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const int64_t i = sp.pos(j);
      ov[j] = key[i];
      if (ow) ow[j] = w[i];
      perm[i] = j;
    }
  });
  return {out_len, out_val, out_w, permute};
}

// The owning rank of each key under one rule (checkpoint resharding, tests).
Tensor owners_cpu(const Tensor& keys, int64_t rule, int64_t param, int64_t world) {
  check_owner_args(keys, rule, param, world);
  Tensor out = at::empty_like(keys);
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, keys.numel(), 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t key = k[i];
      o[i] = owner(rule, param, world, &key);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("route_keys", &route_cpu);
  m.impl("route_owners", &owners_cpu);
}

}  // namespace route
}  // namespace dynamicemb
