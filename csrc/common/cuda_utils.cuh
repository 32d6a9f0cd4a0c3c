// The small CUDA building blocks shared by the kernels (table, embedding,
// dist), one helper per concept:
//  - launch shapes: blocks_for, and the thread / warp loop indices;
//  - host <-> device copies: upload (kernel metadata), download; kernel_ptr
//    (pinned host memory, mapped);
//  - errors found on the device: ErrorSlots + flag_min, which keep the
//    smallest offending position (kNoError: none), so that the position a
//    host check reports does not depend on scheduling;
//  - stable_sort, segment_begins, binary searches over sorted arrays;
//  - atomic_add_i64, warp_aggregate, tally (counts by group), warp_sum_in_order.
//
// Only light headers: the current stream comes from c10/cuda/CUDAStream.h
// (ATen/cuda/CUDAContext.h needs cuBLAS headers); ATen ops by per-op headers.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace dynamicemb {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // threads per block of every kernel here
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- launch shapes -----------------------------------------------------------------

// Blocks that cover `items` work items at `per_block` items per block (at
// least one). The grid covers every item, so kernels may take one item per
// thread / tile / warp without a stride loop; grid-stride loops run once.
inline unsigned int blocks_for(int64_t items, int64_t per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  TORCH_CHECK(b <= std::numeric_limits<int32_t>::max(), "dynamicemb: too many items for one launch (",
              items, ")");
  return static_cast<unsigned int>(b < 1 ? 1 : b);
}

// The current device's multiprocessors (asked once per device).
inline int device_sms() {
  static int per_device[64] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  int& sms = per_device[dev % 64];
  if (sms == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Warp-per-item loops: the warp's first item and the stride between items.
__device__ __forceinline__ int64_t warp_begin() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}
__device__ __forceinline__ int64_t warp_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
}
// The thread's lane in its warp (1-D blocks).
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % kWarp); }
// Thread-per-item loops: the thread's first item and the stride between items.
__device__ __forceinline__ int64_t thread_begin() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---- searches over sorted arrays ----------------------------------------------------

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
__device__ __forceinline__ int64_t clamp_index(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : v > hi ? hi : v;
}
// The bag of position i, from offsets off[0 .. nb] (non-decreasing, i < off[nb]):
// the last j with off[j] <= i, which skips empty bags. Clamped to [0, nb):
// offsets whose check is read later (emb_unique_padded) give some bag, never
// one out of bounds. Without bags, -1: no kernel reads it (every key of such
// a padded step is padding, with no row).
__device__ __forceinline__ int64_t bag_of(const int64_t* off, int64_t nb, int64_t i) {
  return clamp_index(upper_bound(off, nb + 1, i) - 1, 0, nb - 1);
}
// Bag j's positions [*beg, *end), clamped to [0, n] for the same offsets:
// the forward pools and the backward scales by this range.
__device__ __forceinline__ void bag_range(const int64_t* off, int64_t j, int64_t n, int64_t* beg, int64_t* end) {
  *beg = clamp_index(off[j], 0, n);
  *end = clamp_index(off[j + 1], *beg, n);
}

// ---- host <-> device copies ---------------------------------------------------------

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
// The typed device address of an upload()ed array.
template <class T>
const T* device_ptr(const at::Tensor& bytes) {
  return reinterpret_cast<const T*>(bytes.data_ptr());
}

// `count` values at `src` -> host. Device memory (the default) is copied on
// `stream`, which is then synchronized; with on_device false, `src` is host
// memory and is copied as is.
template <class T>
std::vector<T> download(const T* src, int64_t count, cudaStream_t stream, bool on_device = true) {
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

// The address kernels use for a tensor on the device or in pinned host
// memory: the device pointer of the latter (mapped; the same address under
// unified addressing), so that kernels read and write it in place.
inline void* kernel_ptr(const at::Tensor& t) {
  if (t.is_cuda() || t.numel() == 0) return t.data_ptr();
  void* dev = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&dev, t.data_ptr(), 0));
  return dev;
}

// ---- errors found on the device -----------------------------------------------------

// An error slot holds the smallest offending position; kNoError: none.
constexpr int64_t kNoError = std::numeric_limits<int64_t>::max();

// Records `pos` (>= 0) in an error slot, which keeps the smallest one.
__device__ __forceinline__ void flag_min(int64_t* slot, int64_t pos) {
  atomicMin(reinterpret_cast<long long*>(slot), static_cast<long long>(pos));
}

// Error slots on the device, each kNoError until a kernel records a position
// (flag_min) or a value; read() brings them back in one synchronizing copy.
// Filled by a kernel on the current stream (no host copy, no sync).
class ErrorSlots {
 public:
  ErrorSlots(int count, at::Device dev, cudaStream_t stream)
      : count_(count),
        stream_(stream),
        buf_(at::full({count}, kNoError, at::TensorOptions().dtype(at::kLong).device(dev))) {}
  int64_t* ptr() const { return buf_.data_ptr<int64_t>(); }
  const at::Tensor& tensor() const { return buf_; }  // for a caller that reads the slots later
  std::vector<int64_t> read() const { return download(ptr(), count_, stream_); }

 private:
  int count_;
  cudaStream_t stream_;
  at::Tensor buf_;
};

// ---- sorting and segments -----------------------------------------------------------

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
  segment_begins_kernel<<<blocks_for(num_segments + 1, kThreads), kThreads, 0, stream>>>(
      sorted.data_ptr<int64_t>(), sorted.numel(), num_segments, begin.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return begin;
}

// ---- atomics and warp collectives ---------------------------------------------------

// Adds `amount` to a signed 64-bit counter (two's complement wraps alike).
__device__ __forceinline__ void atomic_add_i64(int64_t* p, int64_t amount) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(amount));
}

// Warp-aggregated counting: among the warp's lanes with `active`, one lane
// per distinct `group` calls add(group, count of lanes in that group). Every
// lane of the warp must reach the call (1-D blocks, multiple of 32 threads):
// exit lanes past the end only after it.
template <class Add>
__device__ __forceinline__ void warp_aggregate(bool active, unsigned long long group, Add add) {
  const unsigned int lanes = __ballot_sync(kFullMask, active);
  if (!active) return;
  const unsigned int peers = __match_any_sync(lanes, group);
  if (lane_id() == __ffs(peers) - 1) add(group, __popc(peers));
}

// Counts of n positions by group: each block sums its positions' groups in
// shared memory (warp-aggregated), then adds each non-zero sum once.
// Warp-aggregated atomics alone sent every warp of a one-table call to the
// same counters (25-50 us of a 1M-key table insert's tally on an H200).
// Over kTallyGroups groups, the warps add directly. group_of(i): position
// i's group in [0, groups), -1 when it is not counted; add(group, count)
// adds to the result (atomically). Launch on tally_grid(n) blocks of kThreads.
constexpr int kTallyGroups = 1024;

template <class GroupOf, class Add>
__device__ __forceinline__ void tally(int64_t n, int64_t groups, GroupOf group_of, Add add) {
  __shared__ unsigned long long sums[kTallyGroups];
  const bool in_block = groups <= kTallyGroups;  // uniform over the grid
  if (in_block) {
    for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) sums[g] = 0;
    __syncthreads();
  }
  // Whole blocks take each turn, so every lane reaches warp_aggregate.
  for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * blockDim.x; i0 < n; i0 += thread_stride()) {
    const int64_t i = i0 + threadIdx.x;
    const int64_t g = i < n ? group_of(i) : -1;
    warp_aggregate(g >= 0, static_cast<unsigned long long>(g < 0 ? 0 : g), [&](unsigned long long group, int count) {
      if (in_block)
        atomicAdd(&sums[group], static_cast<unsigned long long>(count));
      else
        add(static_cast<int64_t>(group), count);
    });
  }
  if (!in_block) return;
  __syncthreads();
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x)
    if (sums[g]) add(g, static_cast<int64_t>(sums[g]));
}

// The grid of a tally kernel over n positions: a few blocks per SM, each looping.
inline unsigned int tally_grid(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>(blocks_for(n, kThreads), 4 * device_sms()));
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
