// The table clock on a GPU: its global timer (%globaltimer, ns), read by one
// thread in stream order, so a CUDA table's clock scores are GPU time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace dynamicemb {
namespace table {
namespace {

__global__ void read_global_timer(int64_t* out) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = static_cast<int64_t>(t);
}

at::Tensor clock_cuda(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), "dynamicemb: table_clock on CUDA takes a CUDA tensor, got ", like.device());
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor out = at::empty({1}, like.options().dtype(at::kLong));
  read_global_timer<<<1, 1, 0, c10::cuda::getCurrentCUDAStream(like.device().index())>>>(out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) { m.impl("table_clock", &clock_cuda); }

}  // namespace table
}  // namespace dynamicemb
