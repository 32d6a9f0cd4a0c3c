// CPU kernel of the input distribution: splits a KeyedJaggedTensor's values by
// owning rank (per-feature rules in route_rules.h) into the layout TorchRec's
// KJTAllToAll sends: [rank][feature][bag], input order kept within a bag.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
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
  // Chunks of whole bags: per value its routed key and owner, per (rank,
  // bag) the output length, per (chunk, rank) the count; then each chunk
  // writes its values to its ranks' runs, in input order. A rank's values in
  // input order are its [feature][bag] layout: bags come in input order.
  std::vector<int64_t> key(n);
  std::vector<int32_t> rank_of(n);
  Tensor out_len = at::zeros({world * bags}, lengths.options());
  int64_t* ol = out_len.data_ptr<int64_t>();
  const int64_t C = std::max<int64_t>(1, std::min<int64_t>(cpu::num_chunks(n, 16384), bags));
  const int64_t S = (world + 7) / 8 * 8;  // a chunk's counters on lines of their own
  std::vector<int64_t> at_(C * S, 0);     // [chunk][rank]: count, then write cursor
  cpu::parallel_claim(C, [&](int64_t c) {
    // Locals: the stores below may alias integers read through a reference.
    const int64_t jb = bags * c / C, je = bags * (c + 1) / C, nbags = B, all = bags, ranks = world;
    const int64_t *o = off.data(), *vin = v;
    int64_t* k = key.data();
    int32_t* ro = rank_of.data();
    int64_t* lens = ol;
    for (int64_t j = jb; j < je; ++j) {
      const int64_t f = j / nbags, rule = rules[f], param = params[f];
      for (int64_t i = o[j], ie = o[j + 1]; i < ie; ++i) {
        int64_t kk = vin[i];
        const int64_t r = owner(rule, param, ranks, &kk);
        k[i] = kk;
        ro[i] = static_cast<int32_t>(r);
        ++lens[r * all + j];
      }
    }
    // The chunk's count per rank, from its bags' lengths (an increment per
    // value made a chain through one counter).
    int64_t* cnt = &at_[c * S];
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t j = jb; j < je; ++j) cnt[r] += lens[r * all + j];
  });
  cpu::counts_to_starts(at_, C, S);  // (the padding's parts are empty, after the ranks)
  Tensor out_val = at::empty({n}, values.options());
  Tensor out_w = w ? at::empty({n}, weights->options()) : at::empty({0}, values.options().dtype(at::kFloat));
  Tensor permute = at::empty({n}, values.options());
  int64_t* ov = out_val.data_ptr<int64_t>();
  float* ow = w ? out_w.data_ptr<float>() : nullptr;
  int64_t* perm = permute.data_ptr<int64_t>();
  cpu::parallel_claim(C, [&](int64_t c) {
    int64_t* cursor = &at_[c * S];
    for (int64_t i = off[bags * c / C]; i < off[bags * (c + 1) / C]; ++i) {
      const int64_t j = cursor[rank_of[i]]++;
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
