// positions_count on CUDA: the mask's positions counted by group
// (cuda::tally: warp-aggregated, summed per block), where a scatter-add of the
// whole mask costs one contended atomic per position. An id outside
// [0, groups) under the mask is a device-side assert, as for torch's index
// ops: reading it back would cost a host sync.
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/cuda_utils.cuh"

namespace dynamicemb {
namespace {

__global__ void count_kernel(const int64_t* ids, const bool* mask, int64_t n, int64_t groups, int64_t* counts) {
  cuda::tally(
      n, groups,
      [&](int64_t i) {
        if (!mask[i]) return int64_t{-1};
        CUDA_KERNEL_ASSERT(ids[i] >= 0 && ids[i] < groups);
        return ids[i];
      },
      [&](int64_t g, int64_t count) { cuda::atomic_add_i64(counts + g, count); });
}

at::Tensor count_cuda(const at::Tensor& ids, const at::Tensor& mask, int64_t groups) {
  check_count_args(ids, mask, groups, ids.device());
  const c10::cuda::CUDAGuard guard(ids.device());
  at::Tensor counts = at::zeros({groups}, ids.options());
  const int64_t n = ids.numel();
  if (n == 0) return counts;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  count_kernel<<<cuda::tally_grid(n), cuda::kThreads, 0, stream>>>(
      ids.data_ptr<int64_t>(), mask.data_ptr<bool>(), n, groups, counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) { m.impl("positions_count", &count_cuda); }

}  // namespace dynamicemb
