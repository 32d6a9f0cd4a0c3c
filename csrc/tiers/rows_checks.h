// Host-side checks of store_gather / store_scatter, shared by the CPU
// (rows_cpu.cpp) and CUDA (rows_cuda.cu) kernels so that both raise the same
// messages: a backing store's rows [R, W] (contiguous), the rows moved [n, W]
// of the same dtype, and n positions in [0, R) (distinct for a scatter) as a
// 1-D int64 CPU tensor (a store's key index lives on the host). The store's
// rows are on the moved rows' device or, when those are on a CUDA device, in
// pinned host memory, which the kernels read and write in place (mapped).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <c10/util/Exception.h>

namespace dynamicemb {
namespace tiers {

// Returns n.
inline int64_t check_store_rows(const at::Tensor& store, const at::Tensor& positions, const at::Tensor& moved,
                                const char* moved_name) {
  TORCH_CHECK(store.dim() == 2 && store.is_contiguous(), "dynamicemb: the store's rows must be a contiguous 2-D "
              "tensor, got shape ", store.sizes());
  TORCH_CHECK(store.device() == moved.device() || (moved.is_cuda() && store.is_cpu() && store.is_pinned()),
              "dynamicemb: the store's rows must be on ", moved.device(), " (the device of ", moved_name,
              ")", moved.is_cuda() ? " or in pinned host memory" : "", ", got ", store.device(),
              store.is_cpu() && moved.is_cuda() ? " (not pinned)" : "");
  TORCH_CHECK(moved.scalar_type() == store.scalar_type(), "dynamicemb: ", moved_name, " must be ",
              store.scalar_type(), " (the store's dtype), got ", moved.scalar_type());
  TORCH_CHECK(positions.is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1,
              "dynamicemb: positions must be a 1-D int64 CPU tensor, got ", positions.scalar_type(), " ",
              positions.sizes(), " on ", positions.device());
  const int64_t n = positions.numel();
  TORCH_CHECK(moved.dim() == 2 && moved.is_contiguous() && moved.size(0) == n && moved.size(1) == store.size(1),
              "dynamicemb: ", moved_name, " must be a contiguous [", n, ", ", store.size(1),
              "] tensor (a row per position), got shape ", moved.sizes());
  if (n > 0) {
    const auto [lo, hi] = at::aminmax(positions);
    const int64_t first = lo.item<int64_t>(), last = hi.item<int64_t>();
    TORCH_CHECK(first >= 0 && last < store.size(0), "dynamicemb: a position is out of the store's rows [0, ",
                store.size(0), "): ", first < 0 ? first : last);
  }
  return n;
}

}  // namespace tiers
}  // namespace dynamicemb
