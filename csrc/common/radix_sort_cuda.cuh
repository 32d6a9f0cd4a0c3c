// Stable radix sorts over the low bits only (cub): values known to lie in
// [0, 2^bits) need bits/8 passes where at::sort of int64 takes all eight
// (emb_unique's order key, the backward's inverse, route's ranks).
// cub's kernels live in a versioned inline namespace with hidden visibility,
// so they do not meet torch's own (at_cuda_detail) copies.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>

#include <cub/device/device_radix_sort.cuh>

#include "common/cuda_utils.cuh"

#include <cstdint>
#include <limits>
#include <tuple>

namespace dynamicemb {
namespace cuda {

// The bits that hold every value of [0, max_value] (at least one).
inline int bits_for(int64_t max_value) {
  int b = 1;
  while (b < 63 && (max_value >> b) != 0) ++b;
  return b;
}

// Stable ascending sort of a contiguous int64 tensor whose values lie in
// [0, 2^bits): (sorted values, their positions), equal values in input order.
// Past cub's int count, the full sort (cuda_utils.cuh stable_sort).
inline std::tuple<at::Tensor, at::Tensor> stable_sort_low_bits(const at::Tensor& keys, int bits,
                                                                cudaStream_t stream) {
  const int64_t n = keys.numel();
  TORCH_CHECK(keys.is_contiguous() && keys.scalar_type() == at::kLong, "dynamicemb: sort keys must be contiguous int64");
  if (n > std::numeric_limits<int>::max()) return stable_sort(keys);
  at::Tensor sorted = at::empty_like(keys), pos = at::empty_like(keys);
  const at::Tensor iota = at::arange(n, keys.options());
  if (n == 0) return {sorted, pos};
  const int64_t* kin = keys.data_ptr<int64_t>();
  int64_t* kout = sorted.data_ptr<int64_t>();
  const int64_t* vin = iota.data_ptr<int64_t>();
  int64_t* vout = pos.data_ptr<int64_t>();
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, kin, kout, vin, vout, static_cast<int>(n), 0,
                                                 bits, stream));
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes) + 1}, keys.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, kin, kout, vin, vout,
                                                 static_cast<int>(n), 0, bits, stream));
  return {sorted, pos};
}

}  // namespace cuda
}  // namespace dynamicemb
