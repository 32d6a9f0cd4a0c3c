// Small helpers shared by the CUDA kernels: grid sizes, device-to-host reads,
// a "first bad position" error flag, warp-aggregated counters.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace dynamicemb {
namespace cuda {

// Blocks needed for `items` work items at `per_block` items per block.
inline unsigned int blocks_for(int64_t items, int64_t per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  TORCH_CHECK(b <= std::numeric_limits<int32_t>::max(), "dynamicemb: too many items for one launch (",
              items, ")");
  return static_cast<unsigned int>(b < 1 ? 1 : b);
}

// Copies `count` values from device memory to the host and waits for them.
template <class T>
std::vector<T> to_host(const T* device_ptr, int64_t count, cudaStream_t stream) {
  std::vector<T> out(count);
  if (count == 0) return out;
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data(), device_ptr, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

// An error flag holds the lowest offending position (INT64_MAX: none), so
// that the position a host check reports does not depend on scheduling.
constexpr int64_t kNoError = std::numeric_limits<int64_t>::max();

__device__ __forceinline__ void flag_position(int64_t* flag, int64_t pos) {
  atomicMin(reinterpret_cast<unsigned long long*>(flag), static_cast<unsigned long long>(pos));
}

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
  const unsigned int lanes = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned int peers = __match_any_sync(lanes, group);
  if (static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) add(group, __popc(peers));
}

}  // namespace cuda
}  // namespace dynamicemb
