// store_gather / store_scatter on CUDA: a backing store's rows at positions
// its key index gave (rows_checks.h), moved between the store, in device
// memory or in pinned host memory read and written in place (mapped), and
// rows on the device. The positions come from the host; the copy is
// coalesced over each row, in the widest word its bytes and addresses allow.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "common/cuda_utils.cuh"
#include "tiers/rows_checks.h"

namespace dynamicemb {
namespace tiers {
namespace {

using namespace dynamicemb::cuda;

// Gather: out[i] = store[pos[i]]; scatter: store[pos[i]] = rows[i]; rows of
// `words` words of type W.
template <class W, bool kScatter>
__global__ void move_rows_kernel(W* store, W* rows, const int64_t* pos, int64_t n, int64_t words) {
  for (int64_t i = thread_begin(); i < n * words; i += thread_stride()) {
    const int64_t r = i / words, c = i - r * words;
    W* s = store + pos[r] * words + c;
    if (kScatter) *s = rows[i]; else rows[i] = *s;
  }
}

template <bool kScatter>
void move_rows(const at::Tensor& store, const at::Tensor& positions, const at::Tensor& rows, int64_t n) {
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor pos = upload(std::vector<int64_t>(positions.data_ptr<int64_t>(),
                                                     positions.data_ptr<int64_t>() + n),
                                rows.device(), stream);
  char* s = static_cast<char*>(kernel_ptr(store));
  char* r = static_cast<char*>(rows.data_ptr());
  const int64_t row_bytes = store.size(1) * store.element_size();
  // The widest word that divides a row and both base addresses.
  const uint64_t align = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uint64_t>(s) |
                         reinterpret_cast<uint64_t>(r);
  const int64_t total = n * row_bytes;
  auto launch = [&](auto word) {
    using W = decltype(word);
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
    move_rows_kernel<W, kScatter><<<blocks_for(total / sizeof(W), kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<W*>(s), reinterpret_cast<W*>(r), device_ptr<int64_t>(pos), n, words);
  };
  if (row_bytes == 0) return;
  if (align % 16 == 0) launch(uint4{});
  else if (align % 8 == 0) launch(uint64_t{});
  else if (align % 4 == 0) launch(uint32_t{});
  else if (align % 2 == 0) launch(uint16_t{});
  else launch(uint8_t{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_cuda(const at::Tensor& store, const at::Tensor& positions, at::Tensor& out) {
  move_rows<false>(store, positions, out, check_store_rows(store, positions, out, "out"));
}

void scatter_cuda(at::Tensor& store, const at::Tensor& positions, const at::Tensor& rows) {
  move_rows<true>(store, positions, rows, check_store_rows(store, positions, rows, "rows"));
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("store_gather", &gather_cuda);
  m.impl("store_scatter", &scatter_cuda);
}

}  // namespace tiers
}  // namespace dynamicemb
