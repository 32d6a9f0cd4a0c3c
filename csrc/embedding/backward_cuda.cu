// CUDA backward of the embedding layer with the fused optimizer
// (emb_backward_update; embedding_cpu.cpp defines the semantics): the
// occurrences of each unique key grouped by a stable sort of inverse; one warp
// per unique key sums its gradient in input order, then optimizer_rules.h's
// update_row applies its rule to the row in place. A row-wise rule sums its
// pass over the row in element order (warp_sum_in_order), as the CPU's
// sequential loop.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/radix_sort_cuda.cuh"
#include "embedding/embedding_cuda.cuh"
#include "embedding/optimizer_rules.h"

namespace dynamicemb {
namespace embedding {
namespace {

// The bag of every index (pooled backward).
__global__ void index_bags_kernel(const int64_t* off, int64_t nb, int64_t n, int64_t* bag) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) bag[i] = bag_of(off, nb, i);
}

// Where the gradient of one occurrence comes from, as backward_update_cpu.
struct GradSource {
  const float* grad;
  const int64_t* occ;  // positions of the indices, grouped by unique key, input order within
  const int64_t* bag;  // bag of every index (pooled)
  const int64_t* off;
  const FeatureDev* feats;
  const float* psw;
  int64_t B, total_d, n;  // n: the indices' count, which bag lengths are clamped to (as the forward's)
  bool none, mean;

  // g[k] (element d0 + k * 32 + lane) = sum over occurrences [beg, end) in
  // order of scale * (their output gradient), from 0, rounded per step.
  __device__ __forceinline__ void sum(float (&g)[kPerLane], int64_t d0, int64_t D, int64_t beg, int64_t end,
                                      int lane) const {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) g[k] = 0.0f;
    for (int64_t j0 = beg; j0 < end; j0 += kWarp) {
      int64_t go = 0;
      float s = 0.0f;
      if (j0 + lane < end) {
        const int64_t i = occ[j0 + lane];
        s = psw ? psw[i] : 1.0f;
        if (none) {
          go = i * D;
        } else {
          const int64_t jb = bag[i];
          go = (jb % B) * total_d + feats[jb / B].col;
          if (mean) {  // the forward's length: offsets clamped to [0, n] (their check may be read later)
            int64_t beg, end;
            bag_range(off, jb, n, &beg, &end);
            if (end > beg) s = __fdiv_rn(s, static_cast<float>(end - beg));
          }
        }
      }
      const int cnt = end - j0 < kWarp ? static_cast<int>(end - j0) : kWarp;
      for (int q = 0; q < cnt; ++q) {
        const int64_t gq = __shfl_sync(kFullMask, go, q);
        const float sq = __shfl_sync(kFullMask, s, q);
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int64_t d = d0 + k * kWarp + lane;
          if (d < D) g[k] = mul_add(g[k], sq, grad[gq + d]);
        }
      }
    }
  }
};

// One row's gradient as optim::update_row walks it: chunk by chunk, element
// d0 + k * 32 + lane in g[k] of each lane. A row of one chunk keeps the
// gradient that a pass over the row summed for the next pass; a wider row
// sums it again (same order, same values) instead of staging it.
struct WarpWalk {
  const GradSource& src;
  int64_t D, beg, end;
  int lane;
  float g[kPerLane];
  bool held = false;  // g holds the row's only chunk

  template <class Fn>
  __device__ __forceinline__ void for_each(Fn fn) {
    for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
      if (!held) src.sum(g, d0, D, beg, end, lane);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t d = d0 + k * kWarp + lane;
        if (d < D) fn(d, g[k]);
      }
    }
    held = false;
  }
  // Whether every element of the row's gradient is finite (the CPU's
  // all_finite), in every lane: then a row of one chunk keeps it for the rule.
  __device__ __forceinline__ bool all_finite() {
    bool ok = true;
    for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
      src.sum(g, d0, D, beg, end, lane);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k)
        if (d0 + k * kWarp + lane < D && !optim::finite(g[k])) ok = false;
    }
    held = D <= kChunk;
    return __all_sync(kFullMask, ok);
  }
  // The terms summed in element order across the warp (the CPU's sequential sum).
  template <class Term>
  __device__ __forceinline__ float sum(Term term) {
    float total = 0.0f;
    for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
      if (!held) src.sum(g, d0, D, beg, end, lane);
      float v[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t d = d0 + k * kWarp + lane;
        v[k] = d < D ? term(d, g[k]) : 0.0f;
      }
      total = warp_sum_in_order(total, v, d0, D);
    }
    held = D <= kChunk;
    return total;
  }
  template <class Fn>
  __device__ __forceinline__ void once(Fn fn) {
    __syncwarp();  // every lane has read what fn writes
    if (lane == 0) fn();
  }
};

// One warp per unique key with a row: the rule of `kind` on the row in place
// (backward_update_cpu's loop). skipped (nullptr: no check): per table, the
// rows left as they were because their gradient is not finite.
template <class W>
__global__ void backward_update_kernel(GradSource src, const TableDev* tabs, const int64_t* rows, const int64_t* utids,
                                       const int64_t* occ_begin, int64_t U, int64_t kind, optim::Params p,
                                       unsigned long long* skipped) {
  const int lane = lane_id();
  for (int64_t u = warp_begin(); u < U; u += warp_stride()) {
    const int64_t r = rows[u];
    if (r < 0) continue;
    const TableDev& tab = tabs[utids[u]];
    W* row = row_at<W>(tab.rows, r);
    WarpWalk walk{src, tab.dim, occ_begin[u], occ_begin[u + 1], lane};
    if (skipped != nullptr && !walk.all_finite()) {
      if (lane == 0) atomicAdd(skipped + utids[u], 1ull);
      continue;
    }
    optim::dispatch(kind, [&](auto rule) { optim::update_row<decltype(rule)>(row, tab.dim, walk, p); });
  }
}

Tensor backward_update_cuda(const Tensor& grad_output, TensorList weights, const Tensor& rows,
                            const Tensor& unique_table_ids, const Tensor& inverse, const Tensor& offsets,
                            IntArrayRef feature_table, IntArrayRef dims,
                            const std::optional<Tensor>& per_sample_weights, int64_t pooling, int64_t optimizer,
                            double lr, double eps, double beta1, double beta2, double weight_decay, int64_t step,
                            int64_t weight_decay_mode, double max_gradient, bool skip_nonfinite) {
  const Rows R = check_rows(weights, dims, rows);
  const at::Device dev = R.device;
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index());
  check_1d(rows, at::kLong, "rows", dev);
  check_1d(unique_table_ids, at::kLong, "unique_table_ids", dev);
  check_1d(inverse, at::kLong, "inverse", dev);
  const int64_t U = rows.numel(), n = inverse.numel();
  TORCH_CHECK(unique_table_ids.numel() == U, "dynamicemb: rows and unique_table_ids differ in length");
  check_inverse(inverse, U, stream);
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables(), dev, stream, /*clamps=*/true);
  const float* psw = opt_weights(per_sample_weights, n, dev);
  TORCH_CHECK(grad_output.device() == dev && grad_output.scalar_type() == at::kFloat && grad_output.is_contiguous() &&
                  grad_output.dim() == 2,
              "dynamicemb: grad_output must be a contiguous float32 2-D tensor on ", dev);
  const GradColumns cols = check_backward(grad_output, n, bags.B, bags.table, R.dim, R.stride, pooling, optimizer,
                                          weight_decay_mode, max_gradient);
  const optim::Params p = optim::make_params(optimizer, lr, eps, beta1, beta2, weight_decay, step, weight_decay_mode);
  Tensor skipped = at::zeros({R.num_tables()}, rows.options());
  if (U == 0) return skipped;

  // The occurrences of each unique key, in input order (stable sort of
  // inverse, checked to lie in [0, U): only its low bits are sorted).
  const auto L = inverse.options();
  Tensor occ = at::empty({0}, L), sorted_inv = at::empty({0}, L), bag = at::empty({0}, L);
  if (n > 0) std::tie(sorted_inv, occ) = stable_sort_low_bits(inverse, bits_for(U - 1), stream);
  const Tensor occ_begin = segment_begins(sorted_inv, U, stream);
  if (pooling != kNone && n > 0) {
    bag = at::empty({n}, L);
    index_bags_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(bags.off, bags.num_bags(), n,
                                                                       bag.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const Tensor tabs = upload(table_facts(R, {}), dev, stream);
  const Tensor feats = upload(feature_facts(bags, cols.col), dev, stream);
  const GradSource src{cols.grad.data_ptr<float>(),
                       occ.data_ptr<int64_t>(),
                       bag.data_ptr<int64_t>(),
                       bags.off,
                       device_ptr<FeatureDev>(feats),
                       psw,
                       bags.B,
                       cols.width,
                       n,
                       pooling == kNone,
                       pooling == kMean};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_backward_cuda", [&] {
    backward_update_kernel<scalar_t><<<blocks_for(U, kWarpsPerBlock), kThreads, 0, stream>>>(
        src, device_ptr<TableDev>(tabs), rows.data_ptr<int64_t>(), unique_table_ids.data_ptr<int64_t>(),
        occ_begin.data_ptr<int64_t>(), U, optimizer, p,
        skip_nonfinite ? reinterpret_cast<unsigned long long*>(skipped.data_ptr<int64_t>()) : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return skipped;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("emb_backward_update", &backward_update_cuda);
}

}  // namespace embedding
}  // namespace dynamicemb
