// CUDA kernels of the table ops that find keys (table_cuda.cuh has the
// design): table_lookup (with or without a gather of value rows),
// table_lookup_refresh, table_refresh (at known slots) and table_erase.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "table/table_cuda.cuh"

namespace dynamicemb {
namespace table {
namespace cuda_impl {
namespace {

// ---- lookup (read-only) --------------------------------------------------------------

struct LookupArgs {
  PlaceArgs place;
  int64_t n;
  int64_t* out;
  bool* found;
};

// A tile of kLanes lanes per key. 16 (lookup_refresh, erase, and a lookup
// of digests that are not 16-byte aligned): the 4-byte digest scan
// (tile_find_key); 8 or 4: 16-byte loads (find16). find: the global slot of
// `key` (digest d) in bucket b, -1 where missing or b < 0 (no bucket: a
// flagged error); every lane returns it.
template <int kLanes>
struct FindTile {
  static constexpr int kPerBlock = kThreads / kLanes;
  template <class Tile>
  static __device__ __forceinline__ int64_t find(const Tile& tile, const TableRef& ref, int32_t b, uint8_t d,
                                                 int64_t key) {
    if (b < 0) return -1;
    if constexpr (kLanes == kGroupSize) return ref.find(tile, ref.at_bucket(b, d), key);
    else return ref.find16<kLanes>(tile, ref.at_bucket(b, d), key);
  }
};

// The tile's lookup of key i: the global slot (-1 where missing), written out
// by lane 0; every lane returns it.
template <int kLanes, class Tile>
__device__ __forceinline__ int64_t tile_lookup(const Tile& tile, const LookupArgs& a, int64_t i) {
  const bool lead = tile.thread_rank() == 0;
  uint8_t d = 0;
  const int32_t b = place_key(a.place, i, &d, lead);
  const int64_t slot = FindTile<kLanes>::find(tile, a.place.ref, b, d, a.place.keys[i]);
  if (lead) {
    a.out[i] = slot;
    a.found[i] = slot >= 0;
  }
  return slot;
}

template <int kLanes>
__global__ void lookup_kernel(LookupArgs a) {
  const auto tile = cg::tiled_partition<kLanes>(cg::this_thread_block());
  const int64_t i = static_cast<int64_t>(blockIdx.x) * FindTile<kLanes>::kPerBlock + tile.meta_group_rank();
  if (i >= a.n) return;
  tile_lookup<kLanes>(tile, a, i);
}

// One tile per key: the tile finds the key, then its lanes copy the row in
// `Unit`s (zeros where the key is missing). row_units: Units per row.
template <int kLanes, class Unit>
__global__ void lookup_gather_kernel(LookupArgs a, const Unit* values, Unit* out, int64_t row_units) {
  const auto tile = cg::tiled_partition<kLanes>(cg::this_thread_block());
  const int64_t i = static_cast<int64_t>(blockIdx.x) * FindTile<kLanes>::kPerBlock + tile.meta_group_rank();
  if (i >= a.n) return;
  const int64_t slot = tile_lookup<kLanes>(tile, a, i);
  Unit* dst = out + i * row_units;
  const int64_t lane = tile.thread_rank();
  if (slot >= 0) {
    const Unit* src = values + slot * row_units;
    for (int64_t u = lane; u < row_units; u += kLanes) dst[u] = src[u];
  } else {
    for (int64_t u = lane; u < row_units; u += kLanes) dst[u] = Unit{};
  }
}

// Lanes per key (16-byte digest loads, measured on an H200 with 1M keys into
// 16M slots of 128-slot buckets, 2^30 keys/s): the lookup takes 4 (hits at
// LF 0.5: 16 lanes with 4-byte loads 4.4, 8 lanes 6.1, 4 lanes 7.6; LF 1.0:
// 3.6, 5.9, 6.0), the lookup with a gather of 256-byte rows 8 (LF 1.0: 2.2,
// 3.2, 2.9): its lanes then copy the row in two 128-byte loads. A table whose
// digests are not 16-byte aligned keeps the 4-byte loads of 16 lanes.
constexpr int kLookupLanes = 4;
constexpr int kGatherLanes = 8;

// Runs f(std::integral_constant<int, lanes>) with `wide` lanes, or 16 where
// the table's digests do not allow 16-byte loads.
template <int kWide, class F>
void with_lanes(const TableRef& r, F f) {
  if (r.wide_digests()) f(std::integral_constant<int, kWide>{});
  else f(std::integral_constant<int, kGroupSize>{});
}

// The checked inputs and new outputs of a read-only lookup.
struct LookupCall {
  TableRef ref;
  at::Device dev;
  Tensor indices, found;
  int64_t n;
};

LookupCall prepare_lookup(at::ArrayRef<Tensor> table, int64_t bucket_capacity, const Tensor& keys,
                          const std::optional<Tensor>& table_ids) {
  const TableRef r = make_ref(table, bucket_capacity, kFindMembers);
  const at::Device dev = table[kSlotKeys].device();
  const int64_t n = check_keys(keys, table_ids, std::nullopt, dev);
  return LookupCall{r, dev, new_tensor(n, at::kLong, dev), new_tensor(n, at::kBool, dev), n};
}

LookupArgs lookup_args(const LookupCall& c, const Tensor& keys, const std::optional<Tensor>& table_ids,
                       const ErrorSlots& flags) {
  return LookupArgs{PlaceArgs{c.ref, keys.data_ptr<int64_t>(), opt_ptr(table_ids), flags.ptr()}, c.n,
                    c.indices.data_ptr<int64_t>(), c.found.data_ptr<bool>()};
}

std::tuple<Tensor, Tensor> lookup(at::ArrayRef<Tensor> table, const Tensor& keys,
                                  const std::optional<Tensor>& table_ids, int64_t bucket_capacity) {
  const c10::cuda::CUDAGuard guard(table_device(table));
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids);
  if (c.n == 0) return {c.indices, c.found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ErrorSlots flags(2, c.dev, stream);
  with_lanes<kLookupLanes>(c.ref, [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    lookup_kernel<L><<<blocks_for(c.n, FindTile<L>::kPerBlock), kThreads, 0, stream>>>(
        lookup_args(c, keys, table_ids, flags));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without table ids nothing can be out of range but the layout; skipping
  // the read-back keeps this lookup free of host syncs.
  if (table_ids) check_flags(flags, table_ids, c.ref, table[kTableBuckets], stream);
  return {c.indices, c.found};
}

// Whether rows of row_bytes at both pointers can be copied in Units.
template <class Unit>
bool copies_in(int64_t row_bytes, const void* a, const void* b) {
  constexpr auto u = sizeof(Unit);
  return row_bytes % u == 0 && reinterpret_cast<uintptr_t>(a) % u == 0 && reinterpret_cast<uintptr_t>(b) % u == 0;
}

std::tuple<Tensor, Tensor> lookup_gather(at::ArrayRef<Tensor> table, const Tensor& keys,
                                         const std::optional<Tensor>& table_ids, int64_t bucket_capacity,
                                         const Tensor& values, const Tensor& out) {
  const c10::cuda::CUDAGuard guard(table_device(table));
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids);
  const int64_t row_bytes = check_gather(values, out, c.n, c.ref.num_buckets * c.ref.bucket_capacity, c.dev);
  if (c.n == 0) return {c.indices, c.found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ErrorSlots flags(2, c.dev, stream);
  const LookupArgs a = lookup_args(c, keys, table_ids, flags);
  const void* src = values.const_data_ptr();
  void* dst = out.data_ptr();
  with_lanes<kGatherLanes>(c.ref, [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const dim3 grid = blocks_for(c.n, FindTile<L>::kPerBlock);
    // The widest copy unit the row size and both pointers allow (rows of 2- or
    // 4-byte elements: 2 bytes always fits).
    if (copies_in<uint4>(row_bytes, src, dst)) {
      lookup_gather_kernel<L, uint4><<<grid, kThreads, 0, stream>>>(a, static_cast<const uint4*>(src),
                                                                    static_cast<uint4*>(dst), row_bytes / 16);
    } else if (copies_in<uint32_t>(row_bytes, src, dst)) {
      lookup_gather_kernel<L, uint32_t><<<grid, kThreads, 0, stream>>>(
          a, static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), row_bytes / 4);
    } else {
      lookup_gather_kernel<L, uint16_t><<<grid, kThreads, 0, stream>>>(
          a, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), row_bytes / 2);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (table_ids) check_flags(flags, table_ids, c.ref, table[kTableBuckets], stream);
  return {c.indices, c.found};
}

// ---- lookup that refreshes scores ----------------------------------------------------

// A mutating call's keys, placed (Placed) and their per-key scores.
struct KeysIn {
  const int64_t* keys;
  const uint8_t* digest;
  const int64_t* key_scores;  // null: Scoring::dflt for every key
};

__global__ void lookup_refresh_kernel(TableRef ref, KeysIn in, Scoring scoring, int64_t* out, bool* found,
                                      Segments segs) {
  for_each_key_of_run(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const int64_t slot = FindTile<kGroupSize>::find(tile, ref, b, in.digest[i], in.keys[i]);
    if (tile.thread_rank() != 0) return;
    out[i] = slot;
    found[i] = slot >= 0;
    if (slot >= 0) ref.refresh(slot, scoring, scoring.key_score(in.key_scores, i));
  });
}

std::tuple<Tensor, Tensor> lookup_refresh(at::ArrayRef<Tensor> table, const Tensor& keys,
                                          const std::optional<Tensor>& table_ids,
                                          const std::optional<Tensor>& key_scores, int64_t strategy,
                                          int64_t bucket_capacity, int64_t call_score) {
  check_strategy(strategy);
  const c10::cuda::CUDAGuard guard(table_device(table));
  const TableRef ref =
      make_ref(table, bucket_capacity, with_timestamps(kRefreshMembers, strategy));
  const at::Device dev = table[kSlotKeys].device();
  const int64_t n = check_keys(keys, table_ids, key_scores, dev);
  Tensor indices = new_tensor(n, at::kLong, dev);
  Tensor found = new_tensor(n, at::kBool, dev);
  if (n == 0) return {indices, found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Placed P = place_keys(ref, keys, table_ids, table[kTableBuckets], stream);
  const SortedKeys sorted = sort_by_bucket(P.bucket, stream);
  const Segments segs = sorted.segments();
  const unsigned int grid = runs_grid<lookup_refresh_kernel>(segs);
  lookup_refresh_kernel<<<grid, kThreads, 0, stream>>>(
      ref, KeysIn{keys.data_ptr<int64_t>(), P.digest.data_ptr<uint8_t>(), opt_ptr(key_scores)},
      Scoring::of(strategy, call_score), indices.data_ptr<int64_t>(), found.data_ptr<bool>(), segs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {indices, found};
}

// ---- refresh at known slots ------------------------------------------------------------

__global__ void refresh_kernel(TableRef ref, const int64_t* idx, int64_t n, const int64_t* ks, Scoring scoring,
                               int64_t slots, int* bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t s = idx[i];
  if (s < -1 || s >= slots) {
    *bad = 1;
    return;
  }
  if (s >= 0) ref.refresh(s, scoring, scoring.key_score(ks, i));
}

void refresh(at::ArrayRef<Tensor> table, const Tensor& indices, const std::optional<Tensor>& key_scores,
             int64_t strategy, int64_t call_score) {
  const TableRef ref = refresh_ref(table, indices, key_scores, strategy);
  const int64_t n = indices.numel(), slots = table[kSlotScores].numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Tensor bad = at::zeros({1}, indices.options().dtype(at::kInt));
  refresh_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      ref, indices.data_ptr<int64_t>(), n, opt_ptr(key_scores), Scoring::of(strategy, call_score), slots,
      bad.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(bad.item<int>() == 0, "dynamicemb: a slot index is out of range [-1, ", slots, ")");
}

// ---- erase -----------------------------------------------------------------------------

__global__ void erase_kernel(TableRef ref, KeysIn in, bool* erased, Segments segs) {
  for_each_key_of_run(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const int64_t slot = FindTile<kGroupSize>::find(tile, ref, b, in.digest[i], in.keys[i]);
    if (tile.thread_rank() != 0) return;
    erased[i] = slot >= 0 && ref.erase(slot);
  });
}

// The sizes less the erased keys, per table.
__global__ void tally_erase_kernel(TableRef ref, const bool* erased, const int64_t* tids, int64_t n) {
  cuda::tally(
      n, ref.num_tables, [&](int64_t i) { return erased[i] ? (tids ? tids[i] : 0) : int64_t{-1}; },
      [&](int64_t t, int64_t count) { ref.tally_erase(t, count, AtomicAdd{}); });
}

Tensor erase(at::ArrayRef<Tensor> table, const Tensor& keys, const std::optional<Tensor>& table_ids,
             int64_t bucket_capacity) {
  const c10::cuda::CUDAGuard guard(table_device(table));
  const TableRef ref = make_ref(table, bucket_capacity, kEraseMembers);
  const at::Device dev = table[kSlotKeys].device();
  const int64_t n = check_keys(keys, table_ids, std::nullopt, dev);
  Tensor erased = new_tensor(n, at::kBool, dev);
  if (n == 0) return erased;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Placed P = place_keys(ref, keys, table_ids, table[kTableBuckets], stream);
  const SortedKeys sorted = sort_by_bucket(P.bucket, stream);
  const Segments segs = sorted.segments();
  const unsigned int grid = runs_grid<erase_kernel>(segs);
  erase_kernel<<<grid, kThreads, 0, stream>>>(
      ref, KeysIn{keys.data_ptr<int64_t>(), P.digest.data_ptr<uint8_t>(), nullptr}, erased.data_ptr<bool>(), segs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  tally_erase_kernel<<<cuda::tally_grid(n), kThreads, 0, stream>>>(ref, erased.data_ptr<bool>(), opt_ptr(table_ids),
                                                                    n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return erased;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("table_lookup", &lookup);
  m.impl("table_lookup_gather", &lookup_gather);
  m.impl("table_lookup_refresh", &lookup_refresh);
  m.impl("table_refresh", &refresh);
  m.impl("table_erase", &erase);
}

}  // namespace cuda_impl
}  // namespace table
}  // namespace dynamicemb
