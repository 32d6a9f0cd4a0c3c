// Small CUDA building blocks of the kernels: launch shapes for warp-per-item
// kernels, host <-> device copies of kernel metadata, a device error record
// (TORCH_CHECK after the kernel ran, with the CPU's messages), a stable sort
// by key, segment begins of sorted ids and a lane-over-elements in-order sum.
//
// Only light headers: the current stream comes from c10/cuda/CUDAStream.h
// (ATen/cuda/CUDAContext.h needs cuBLAS headers); ATen ops by per-op headers.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace dynamicemb {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // threads per block of every kernel here
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kNoError = std::numeric_limits<int64_t>::max();

// Blocks for `items` items at `per_block` items per block; kernels loop with a
// grid stride, so the grid is capped (the cap only bounds the launch).
inline unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, int64_t{1} << 20)));
}

// Warp-per-item loops: the warp's first item and the stride between items.
__device__ __forceinline__ int64_t warp_begin() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}
__device__ __forceinline__ int64_t warp_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
}
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % kWarp); }
// Thread-per-item loops.
__device__ __forceinline__ int64_t thread_begin() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// The first position in a[0, n) whose value is > x (a sorted ascending).
__device__ __forceinline__ int64_t upper_bound(const int64_t* a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}
// The first position in a[0, n) whose value is >= x.
__device__ __forceinline__ int64_t lower_bound(const int64_t* a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}
// The bag of position i, from offsets off[0 .. nb] (non-decreasing, i < off[nb]):
// the last j with off[j] <= i, which skips empty bags.
__device__ __forceinline__ int64_t bag_of(const int64_t* off, int64_t nb, int64_t i) {
  return upper_bound(off, nb + 1, i) - 1;
}

// Records the smallest offending position in an error slot.
__device__ __forceinline__ void flag_min(int64_t* slot, int64_t pos) {
  atomicMin(reinterpret_cast<long long*>(slot), static_cast<long long>(pos));
}

// Host array -> device tensor of bytes (kernel metadata). A copy from pageable
// memory is staged before cudaMemcpyAsync returns, so `v` may go right away.
template <class T>
at::Tensor upload(const std::vector<T>& v, at::Device dev, cudaStream_t stream) {
  const int64_t bytes = static_cast<int64_t>(v.size() * sizeof(T));
  at::Tensor out = at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte).device(dev));
  if (bytes > 0)
    C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), v.data(), bytes, cudaMemcpyHostToDevice, stream));
  return out;
}
template <class T>
const T* device_ptr(const at::Tensor& bytes) {
  return reinterpret_cast<const T*>(bytes.data_ptr());
}

// `count` elements at `src` (device or host memory) -> host (synchronizes).
template <class T>
std::vector<T> download(const T* src, int64_t count, bool on_device, cudaStream_t stream) {
  std::vector<T> out(static_cast<size_t>(count));
  if (count == 0) return out;
  if (!on_device) {
    std::memcpy(out.data(), src, count * sizeof(T));
    return out;
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}
template <class T>
T download_one(const T* src, cudaStream_t stream) {
  return download(src, 1, true, stream)[0];
}

// Error slots on the device, each kNoError until a kernel records a position
// (flag_min) or a value; read() brings them back in one synchronizing copy.
class ErrorSlots {
 public:
  ErrorSlots(int count, at::Device dev, cudaStream_t stream)
      : count_(count), stream_(stream), buf_(upload(std::vector<int64_t>(count, kNoError), dev, stream)) {}
  int64_t* ptr() const { return reinterpret_cast<int64_t*>(buf_.data_ptr()); }
  std::vector<int64_t> read() const { return download(ptr(), count_, true, stream_); }

 private:
  int count_;
  cudaStream_t stream_;
  at::Tensor buf_;
};

// Stable ascending sort of a 1-D tensor: (sorted values, positions), equal
// values in input order.
inline std::tuple<at::Tensor, at::Tensor> stable_sort(const at::Tensor& keys) {
  return at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
}

namespace {
__global__ void segment_begins_kernel(const int64_t* sorted, int64_t n, int64_t num_segments, int64_t* begin) {
  for (int64_t s = thread_begin(); s <= num_segments; s += thread_stride()) begin[s] = lower_bound(sorted, n, s);
}
}  // namespace

// begin[s] = the first position of id s in `sorted` (ascending ids), for s in
// [0, num_segments]: segment s is [begin[s], begin[s + 1]), empty ones included.
inline at::Tensor segment_begins(const at::Tensor& sorted, int64_t num_segments, cudaStream_t stream) {
  at::Tensor begin = at::empty({num_segments + 1}, sorted.options().dtype(at::kLong));
  segment_begins_kernel<<<grid_for(num_segments + 1, kThreads), kThreads, 0, stream>>>(
      sorted.data_ptr<int64_t>(), sorted.numel(), num_segments, begin.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return begin;
}

// Adds the K * 32 values v[k] of a warp (element d0 + k * 32 + lane) to `sum`
// in element order, skipping elements >= D: every lane gets the same sum,
// rounded as a sequential loop over the elements would round it.
template <int K>
__device__ __forceinline__ float warp_sum_in_order(float sum, const float (&v)[K], int64_t d0, int64_t D) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int l = 0; l < kWarp; ++l) {
      const float x = __shfl_sync(kFullMask, v[k], l);
      if (d0 + k * kWarp + l < D) sum = __fadd_rn(sum, x);
    }
  }
  return sum;
}

}  // namespace cuda
}  // namespace dynamicemb
