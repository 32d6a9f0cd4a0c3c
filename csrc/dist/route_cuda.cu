// CUDA kernels of the input distribution, with the semantics of route_cpu.cpp:
// values split by owning rank (route_rules.h owner()) into [rank][feature][bag],
// input order kept within a bag.
//
// Values already come ordered by bag, so ordering them by (rank, bag) is a
// stable sort by rank alone: one thread per value finds its bag and owner,
// counts it into its (rank, bag) length, then a stable sort by rank gives
// every value its output position.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/cuda_utils.cuh"
#include "common/radix_sort_cuda.cuh"
#include "dist/route_checks.h"
#include "dist/route_rules.h"

namespace dynamicemb {
namespace route {
namespace {

using at::Tensor;
using c10::IntArrayRef;
using namespace dynamicemb::cuda;

// err[0]: the first bag with a negative length; err[1]: the sum of lengths.
__global__ void check_lengths_kernel(const int64_t* len, const int64_t* ends, int64_t bags, int64_t* err) {
  if (thread_begin() == 0) err[1] = bags > 0 ? ends[bags - 1] : 0;
  for (int64_t j = thread_begin(); j < bags; j += thread_stride())
    if (len[j] < 0) flag_min(&err[0], j);
}

// Per value: its owner and routed key; counts it into out_len[rank * bags + bag].
// `ends` are the inclusive prefix sums of the lengths: the bag of value i is
// the first j with ends[j] > i.
__global__ void owners_by_bag_kernel(const int64_t* ends, int64_t bags, int64_t B, const int64_t* rules,
                                     const int64_t* params, int64_t world, const int64_t* values, int64_t n,
                                     int64_t* rank, int64_t* key, int64_t* out_len) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) {
    const int64_t j = upper_bound(ends, bags, i), f = j / B;
    int64_t k = values[i];
    const int64_t r = owner(rules[f], params[f], world, &k);
    rank[i] = r;
    key[i] = k;
    atomicAdd(reinterpret_cast<unsigned long long*>(out_len + r * bags + j), 1ull);
  }
}

// Output position j takes input value order[j] (the identity for one rank).
__global__ void scatter_kernel(const int64_t* order, const int64_t* key, const float* w, int64_t n, int64_t* ov,
                               float* ow, int64_t* perm) {
  for (int64_t j = thread_begin(); j < n; j += thread_stride()) {
    const int64_t i = order ? order[j] : j;
    ov[j] = key[i];
    if (ow) ow[j] = w[i];
    perm[i] = j;
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> route_cuda(const Tensor& lengths, const Tensor& values,
                                                      const std::optional<Tensor>& weights, IntArrayRef rules,
                                                      IntArrayRef params, int64_t world) {
  const int64_t F = check_route_args(lengths, values, rules, params, world);
  const at::Device dev = values.device();
  TORCH_CHECK(dev.is_cuda(), "dynamicemb: route on CUDA takes CUDA tensors, got ", dev);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index());
  const int64_t bags = lengths.numel(), B = bags / F, n = values.numel();
  const Tensor ends = at::cumsum(lengths, 0);
  {
    ErrorSlots err(2, dev, stream);
    check_lengths_kernel<<<blocks_for(bags, kThreads), kThreads, 0, stream>>>(
        lengths.data_ptr<int64_t>(), ends.data_ptr<int64_t>(), bags, err.ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const std::vector<int64_t> e = err.read();
    TORCH_CHECK(e[0] == kNoError, "dynamicemb: negative length at bag ", e[0]);
    TORCH_CHECK(e[1] == n, "dynamicemb: lengths sum to ", e[1], " but there are ", n, " values");
  }
  const float* w = checked_weights(weights, values);
  Tensor out_len = at::zeros({world * bags}, lengths.options());
  Tensor out_val = at::empty({n}, values.options());
  Tensor out_w = w ? at::empty({n}, weights->options()) : at::empty({0}, values.options().dtype(at::kFloat));
  Tensor permute = at::empty({n}, values.options());
  if (n == 0) return {out_len, out_val, out_w, permute};

  const Tensor rule_dev = upload(std::vector<int64_t>(rules.begin(), rules.end()), dev, stream);
  const Tensor param_dev = upload(std::vector<int64_t>(params.begin(), params.end()), dev, stream);
  Tensor rank = at::empty({n}, values.options()), key = at::empty({n}, values.options());
  owners_by_bag_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      ends.data_ptr<int64_t>(), bags, B, device_ptr<int64_t>(rule_dev), device_ptr<int64_t>(param_dev), world,
      values.data_ptr<int64_t>(), n, rank.data_ptr<int64_t>(), key.data_ptr<int64_t>(), out_len.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Stable by rank = ordered by (rank, bag), input order within a bag.
  std::optional<Tensor> order;
  if (world > 1) order = std::get<1>(stable_sort_low_bits(rank, bits_for(world - 1), stream));  // ranks < world
  scatter_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      order ? order->data_ptr<int64_t>() : nullptr, key.data_ptr<int64_t>(), w, n, out_val.data_ptr<int64_t>(),
      w ? out_w.data_ptr<float>() : nullptr, permute.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_len, out_val, out_w, permute};
}

__global__ void owners_kernel(const int64_t* keys, int64_t n, int64_t rule, int64_t param, int64_t world,
                              int64_t* out) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) {
    int64_t key = keys[i];
    out[i] = owner(rule, param, world, &key);
  }
}

// The owning rank of each key under one rule (checkpoint resharding, tests).
Tensor owners_cuda(const Tensor& keys, int64_t rule, int64_t param, int64_t world) {
  check_owner_args(keys, rule, param, world);
  const c10::cuda::CUDAGuard guard(keys.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(keys.device().index());
  Tensor out = at::empty_like(keys);
  const int64_t n = keys.numel();
  if (n == 0) return out;
  owners_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(keys.data_ptr<int64_t>(), n, rule, param, world,
                                                                  out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("route_keys", &route_cuda);
  m.impl("route_owners", &owners_cuda);
}

}  // namespace route
}  // namespace dynamicemb
