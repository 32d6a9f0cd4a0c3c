// CUDA kernels of the scored hash table: the same ops, schemas and results as
// table_cpu.cpp, on the rules of table_rules.h (hash, bucket, digest, scores,
// and the 16-lane tile forms of the slot scan and the victim choice).
//
// Design. A 16-lane tile (cooperative_groups::tiled_partition<16>) works on
// one bucket at a time: lane l reads slot g + l of each group of 16, so a
// group's digests are one coalesced load and the scan is a ballot.
//  - table_lookup (read-only): one tile per key, no ordering needed.
//  - table_lookup_refresh, table_insert, table_erase: API.md §6 wants the
//    result of processing the keys one at a time in input order. Each key's
//    global bucket is computed, key positions are stably sorted by bucket,
//    and the tile at the head of each run of equal buckets processes that
//    bucket's keys in input order. No two tiles touch one bucket, so slots
//    need no atomics and the result is deterministic.
//  - Sizes and counters are tallied afterwards from the per-key results.
//  - table_export_range: a live mask over the range, compacted in slot order.
//  - table_rehash: one thread per old bucket re-inserts its live slots in slot
//    order into the new buckets it scales to (only it writes those).
// A call's clock score comes in as call_score: Python reads the table clock
// (table_clock, clock_cuda.cu: the GPU global timer) once per call, so every
// key of a call gets the same score, as on the CPU (one rule for both).
//
// Errors: out-of-range table ids are flagged on the device (lowest position)
// and raised on the host with the CPU message before any slot changes (a
// sync, only when table ids are given). table_buckets stays on the device:
// the kernels never leave the slot arrays, and flag a table whose bucket range
// does not fit them; insert raises that (it syncs anyway), as do export and
// rehash, which check the layout on the host exactly as the CPU does. Lookup,
// refresh and erase without table ids skip the read-back (no sync): there such
// keys are simply not found.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/cuda_utils.cuh"
#include "table/table_checks.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace table {
namespace {

namespace cg = cooperative_groups;
using at::Tensor;
using cuda::blocks_for;
using cuda::download;
using cuda::ErrorSlots;
using cuda::kNoError;
using cuda::kThreads;  // threads per block

constexpr int kTilesPerBlock = kThreads / kGroupSize;

// ---- validation ------------------------------------------------------------------

// The table's device (that of slot_keys): every other tensor must be on it.
at::Device table_device(const Tensor& slot_keys) {
  TORCH_CHECK(slot_keys.device().is_cuda(), "dynamicemb: slot_keys must be on a CUDA device, got ",
              slot_keys.device());
  return slot_keys.device();
}

// The layout as the kernels see it: table_buckets stays on the device, the
// bucket count comes from the slot arrays (reading tb[T] would cost a sync).
struct Layout {
  at::Device dev;
  const int64_t* tb;  // device
  int64_t num_tables;
  int64_t cap;
  int64_t num_buckets;
  int64_t num_slots() const { return num_buckets * cap; }
};

Layout make_layout(const Tensor& table_buckets, int64_t bucket_capacity, const Tensor& slot_keys) {
  const at::Device dev = table_device(slot_keys);
  check_tensor(table_buckets, at::kLong, "table_buckets", dev);
  TORCH_CHECK(table_buckets.dim() == 1 && table_buckets.numel() >= 2,
              "dynamicemb: table_buckets must be 1-D with num_tables + 1 entries");
  TORCH_CHECK(bucket_capacity > 0 && bucket_capacity % kGroupSize == 0,
              "dynamicemb: bucket_capacity must be a positive multiple of ", kGroupSize, ", got ",
              bucket_capacity);
  const int64_t S = slot_keys.numel();
  TORCH_CHECK(S % bucket_capacity == 0, "dynamicemb: slot_keys must hold whole buckets of ",
              bucket_capacity, " slots, got ", S);
  // Buckets are sorted as int32 (half the radix passes); 2^31 buckets would
  // be terabytes of slots.
  TORCH_CHECK(S / bucket_capacity <= INT32_MAX, "dynamicemb: too many buckets for the CUDA table");
  return Layout{dev, table_buckets.data_ptr<int64_t>(), table_buckets.numel() - 1, bucket_capacity,
                S / bucket_capacity};
}

void check_slots(const Tensor& t, at::ScalarType dtype, const char* name, const Layout& L) {
  check_tensor(t, dtype, name, L.dev);
  TORCH_CHECK(t.dim() == 1 && t.numel() == L.num_slots(), "dynamicemb: ", name, " must hold ",
              L.num_slots(), " slots, got shape ", t.sizes());
}

const int64_t* opt_ptr(const std::optional<Tensor>& t) {
  return t ? t->data_ptr<int64_t>() : nullptr;
}

Tensor new_tensor(int64_t n, at::ScalarType dtype, const at::Device& dev) {
  return at::empty({n}, at::TensorOptions().dtype(dtype).device(dev));
}

// ---- key placement -----------------------------------------------------------------

// flags[0]: lowest key position with a table id out of range; flags[1]: lowest
// position whose table's bucket range does not fit the slot arrays.
struct PlaceArgs {
  const int64_t* keys;
  const int64_t* tids;  // null: every key in table 0
  const int64_t* tb;
  int64_t num_tables;
  int64_t num_buckets;
  int64_t* flags;
};

PlaceArgs place_args(const Layout& L, const Tensor& keys, const std::optional<Tensor>& tids,
                     const ErrorSlots& flags) {
  return PlaceArgs{keys.data_ptr<int64_t>(), opt_ptr(tids), L.tb, L.num_tables, L.num_buckets,
                   flags.ptr()};
}

// Global bucket of key i (-1 when it has none; then `report` flags why).
__device__ __forceinline__ int32_t place_key(const PlaceArgs& a, int64_t i, uint8_t* digest,
                                             bool report) {
  const int64_t t = a.tids ? a.tids[i] : 0;
  if (t < 0 || t >= a.num_tables) {
    if (report) cuda::flag_min(&a.flags[0], i);
    return -1;
  }
  const int64_t lo = a.tb[t], hi = a.tb[t + 1];
  if (lo < 0 || hi <= lo || hi > a.num_buckets) {  // never reads or writes out of bounds
    if (report) cuda::flag_min(&a.flags[1], i);
    return -1;
  }
  const uint64_t h = key_hash(a.keys[i]);
  *digest = digest_of(h);
  return static_cast<int32_t>(lo + bucket_in_table(h, hi - lo));
}

__global__ void place_kernel(PlaceArgs a, int64_t n, int32_t* bucket, uint8_t* digest) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint8_t d = 0;
  bucket[i] = place_key(a, i, &d, true);
  digest[i] = d;
}

// Raises the CPU's error for a flagged table id, or a layout mismatch.
void check_flags(const ErrorSlots& flags, const std::optional<Tensor>& table_ids, const Layout& L,
                 cudaStream_t stream) {
  const std::vector<int64_t> f = flags.read();
  if (f[0] != kNoError) {
    const int64_t t = download(table_ids->data_ptr<int64_t>() + f[0], 1, stream)[0];
    TORCH_CHECK(false, "dynamicemb: table id ", t, " (key position ", f[0],
                ") is out of range [0, ", L.num_tables, ")");
  }
  TORCH_CHECK(f[1] == kNoError, "dynamicemb: table_buckets does not fit the slot arrays (",
              L.num_buckets, " buckets; key position ", f[1], ")");
}

// Every key's bucket and digest; checks table ids before any slot changes.
struct Placed {
  Tensor bucket;  // int32 [n], -1: no bucket (only with a flagged error)
  Tensor digest;  // uint8 [n]
  ErrorSlots flags;  // the two flags of PlaceArgs
};

Placed place_keys(const Layout& L, const Tensor& keys, const std::optional<Tensor>& table_ids,
                  cudaStream_t stream) {
  const int64_t n = keys.numel();
  Placed p{new_tensor(n, at::kInt, L.dev), new_tensor(n, at::kByte, L.dev), ErrorSlots(2, L.dev, stream)};
  place_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      place_args(L, keys, table_ids, p.flags), n, p.bucket.data_ptr<int32_t>(),
      p.digest.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Only table ids can be out of range before the slots change; without them
  // the (layout) flags are read where the op syncs anyway, if it does.
  if (table_ids) check_flags(p.flags, table_ids, L, stream);
  return p;
}

// ---- bucket segments ---------------------------------------------------------------

// Key positions stably sorted by bucket: each run of equal buckets is one
// bucket's keys in input order.
struct Segments {
  const int32_t* bucket;  // sorted
  const int64_t* order;   // key positions
  int64_t n;
};

struct SortedKeys {
  Tensor bucket, order;
  Segments segments() const {
    return Segments{bucket.data_ptr<int32_t>(), order.data_ptr<int64_t>(), bucket.numel()};
  }
};

SortedKeys sort_by_bucket(const Tensor& bucket) {
  auto [sorted, order] = cuda::stable_sort(bucket);
  return SortedKeys{sorted, order};
}

// Tile j runs the segment that starts at sorted position j, if one does:
// op(tile, key position, bucket) for each of its keys, in input order. The
// tile syncs between keys so that every lane sees the previous key's writes.
template <class Op>
__device__ __forceinline__ void for_each_key_of_segment(const Segments& s, Op op) {
  const auto tile = cg::tiled_partition<kGroupSize>(cg::this_thread_block());
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTilesPerBlock + tile.meta_group_rank();
  if (j >= s.n) return;
  const int32_t b = s.bucket[j];
  if (j > 0 && s.bucket[j - 1] == b) return;  // not the head of a segment
  for (int64_t q = j; q < s.n && s.bucket[q] == b; ++q) {
    op(tile, s.order[q], b);
    tile.sync();
  }
}

// ---- lookup (read-only) --------------------------------------------------------------

struct LookupArgs {
  PlaceArgs place;
  int64_t n;
  int64_t cap;
  const int64_t* sk;
  const uint8_t* sd;
  int64_t* out;
  bool* found;
};

// The global slot of `key` (digest d) in bucket b, -1 where missing or b < 0
// (no bucket: a flagged error); every lane returns it.
template <class Tile>
__device__ __forceinline__ int64_t tile_find_slot(const Tile& tile, const uint8_t* sd, const int64_t* sk,
                                                  int64_t cap, int32_t b, uint8_t d, int64_t key) {
  if (b < 0) return -1;
  const int64_t base = static_cast<int64_t>(b) * cap;
  const int s = tile_find_key(tile, sd + base, sk + base, static_cast<int>(cap), d, key);
  return s >= 0 ? base + s : -1;
}

// The tile's lookup of key i: the global slot (-1 where missing), written out
// by lane 0; every lane returns it.
template <class Tile>
__device__ __forceinline__ int64_t tile_lookup(const Tile& tile, const LookupArgs& a, int64_t i) {
  const bool lead = tile.thread_rank() == 0;
  uint8_t d = 0;
  const int32_t b = place_key(a.place, i, &d, lead);
  const int64_t slot = tile_find_slot(tile, a.sd, a.sk, a.cap, b, d, a.place.keys[i]);
  if (lead) {
    a.out[i] = slot;
    a.found[i] = slot >= 0;
  }
  return slot;
}

__global__ void lookup_kernel(LookupArgs a) {
  const auto tile = cg::tiled_partition<kGroupSize>(cg::this_thread_block());
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kTilesPerBlock + tile.meta_group_rank();
  if (i >= a.n) return;
  tile_lookup(tile, a, i);
}

// One tile per key: the tile finds the key, then its 16 lanes copy the row in
// `Unit`s (zeros where the key is missing). row_units: Units per row.
template <class Unit>
__global__ void lookup_gather_kernel(LookupArgs a, const Unit* values, Unit* out, int64_t row_units) {
  const auto tile = cg::tiled_partition<kGroupSize>(cg::this_thread_block());
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kTilesPerBlock + tile.meta_group_rank();
  if (i >= a.n) return;
  const int64_t slot = tile_lookup(tile, a, i);
  Unit* dst = out + i * row_units;
  const int64_t lane = tile.thread_rank();
  if (slot >= 0) {
    const Unit* src = values + slot * row_units;
    for (int64_t u = lane; u < row_units; u += kGroupSize) dst[u] = src[u];
  } else {
    for (int64_t u = lane; u < row_units; u += kGroupSize) dst[u] = Unit{};
  }
}

// The checked inputs and new outputs of a read-only lookup.
struct LookupCall {
  Layout L;
  Tensor indices, found;
  int64_t n;
};

LookupCall prepare_lookup(const Tensor& slot_keys, const Tensor& slot_digests,
                          const Tensor& table_buckets, const Tensor& keys,
                          const std::optional<Tensor>& table_ids, int64_t bucket_capacity) {
  const Layout L = make_layout(table_buckets, bucket_capacity, slot_keys);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  const int64_t n = check_keys(keys, table_ids, std::nullopt, L.dev);
  return LookupCall{L, new_tensor(n, at::kLong, L.dev), new_tensor(n, at::kBool, L.dev), n};
}

LookupArgs lookup_args(const LookupCall& c, const Tensor& slot_keys, const Tensor& slot_digests,
                       const Tensor& keys, const std::optional<Tensor>& table_ids,
                       const ErrorSlots& flags) {
  return LookupArgs{place_args(c.L, keys, table_ids, flags), c.n, c.L.cap,
                    slot_keys.data_ptr<int64_t>(), slot_digests.data_ptr<uint8_t>(),
                    c.indices.data_ptr<int64_t>(), c.found.data_ptr<bool>()};
}

std::tuple<Tensor, Tensor> lookup_cuda(const Tensor& slot_keys, const Tensor& slot_digests,
                                       const Tensor& table_buckets, const Tensor& keys,
                                       const std::optional<Tensor>& table_ids,
                                       int64_t bucket_capacity) {
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  if (c.n == 0) return {c.indices, c.found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ErrorSlots flags(2, c.L.dev, stream);
  lookup_kernel<<<blocks_for(c.n, kTilesPerBlock), kThreads, 0, stream>>>(
      lookup_args(c, slot_keys, slot_digests, keys, table_ids, flags));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without table ids nothing can be out of range but the layout; skipping
  // the read-back keeps this lookup free of host syncs.
  if (table_ids) check_flags(flags, table_ids, c.L, stream);
  return {c.indices, c.found};
}

// Whether rows of row_bytes at both pointers can be copied in Units.
template <class Unit>
bool copies_in(int64_t row_bytes, const void* a, const void* b) {
  constexpr auto u = sizeof(Unit);
  return row_bytes % u == 0 && reinterpret_cast<uintptr_t>(a) % u == 0 &&
         reinterpret_cast<uintptr_t>(b) % u == 0;
}

std::tuple<Tensor, Tensor> lookup_gather_cuda(const Tensor& slot_keys, const Tensor& slot_digests,
                                              const Tensor& table_buckets, const Tensor& keys,
                                              const std::optional<Tensor>& table_ids,
                                              int64_t bucket_capacity, const Tensor& values,
                                              const Tensor& out) {
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  const int64_t row_bytes = check_gather(values, out, c.n, c.L.num_slots(), c.L.dev);
  if (c.n == 0) return {c.indices, c.found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ErrorSlots flags(2, c.L.dev, stream);
  const LookupArgs a = lookup_args(c, slot_keys, slot_digests, keys, table_ids, flags);
  const void* src = values.const_data_ptr();
  void* dst = out.data_ptr();
  const dim3 grid = blocks_for(c.n, kTilesPerBlock);
  // The widest copy unit the row size and both pointers allow (rows of 2- or
  // 4-byte elements: 2 bytes always fits).
  if (copies_in<uint4>(row_bytes, src, dst)) {
    lookup_gather_kernel<uint4><<<grid, kThreads, 0, stream>>>(
        a, static_cast<const uint4*>(src), static_cast<uint4*>(dst), row_bytes / 16);
  } else if (copies_in<uint32_t>(row_bytes, src, dst)) {
    lookup_gather_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
        a, static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), row_bytes / 4);
  } else {
    lookup_gather_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
        a, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), row_bytes / 2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (table_ids) check_flags(flags, table_ids, c.L, stream);
  return {c.indices, c.found};
}

// ---- lookup that refreshes scores ----------------------------------------------------

struct RefreshArgs {
  const int64_t* keys;
  const uint8_t* digest;
  const int64_t* key_scores;  // null: dflt for every key
  int64_t dflt;
  int64_t strategy;
  int64_t call_score;
  int64_t cap;
  const int64_t* sk;
  const uint8_t* sd;
  int64_t* sc;
  int64_t* ts;  // null unless the strategy keeps timestamps
  int64_t* out;
  bool* found;
};

__global__ void lookup_refresh_kernel(RefreshArgs a, Segments segs) {
  for_each_key_of_segment(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const int64_t slot = tile_find_slot(tile, a.sd, a.sk, a.cap, b, a.digest[i], a.keys[i]);
    if (tile.thread_rank() != 0) return;
    a.out[i] = slot;
    a.found[i] = slot >= 0;
    if (slot >= 0) refresh_slot(a.strategy, a.sc, a.ts, slot, a.call_score, a.key_scores ? a.key_scores[i] : a.dflt);
  });
}

std::tuple<Tensor, Tensor> lookup_refresh_cuda(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& table_buckets, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score) {
  check_strategy(strategy);
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const Layout L = make_layout(table_buckets, bucket_capacity, slot_keys);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  const bool with_ts = keeps_timestamps(strategy);
  if (with_ts) check_slots(slot_timestamps, at::kLong, "slot_timestamps", L);
  const int64_t n = check_keys(keys, table_ids, key_scores, L.dev);
  Tensor indices = new_tensor(n, at::kLong, L.dev);
  Tensor found = new_tensor(n, at::kBool, L.dev);
  if (n == 0) return {indices, found};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Placed P = place_keys(L, keys, table_ids, stream);
  const SortedKeys sorted = sort_by_bucket(P.bucket);
  const RefreshArgs a{keys.data_ptr<int64_t>(),
                      P.digest.data_ptr<uint8_t>(),
                      opt_ptr(key_scores),
                      default_key_score(strategy, call_score),
                      strategy,
                      call_score,
                      L.cap,
                      slot_keys.data_ptr<int64_t>(),
                      slot_digests.data_ptr<uint8_t>(),
                      slot_scores.data_ptr<int64_t>(),
                      with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr,
                      indices.data_ptr<int64_t>(),
                      found.data_ptr<bool>()};
  lookup_refresh_kernel<<<blocks_for(n, kTilesPerBlock), kThreads, 0, stream>>>(a, sorted.segments());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {indices, found};
}

// ---- refresh at known slots ------------------------------------------------------------

__global__ void refresh_kernel(const int64_t* idx, int64_t n, const int64_t* ks, int64_t dflt, int64_t strategy,
                               int64_t call_score, int64_t slots, int64_t* sc, int64_t* ts, int* bad) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t s = idx[i];
  if (s < -1 || s >= slots) {
    *bad = 1;
    return;
  }
  if (s >= 0) refresh_slot(strategy, sc, ts, s, call_score, ks ? ks[i] : dflt);
}

void refresh_cuda(const Tensor& slot_scores, const Tensor& slot_timestamps, const Tensor& indices,
                  const std::optional<Tensor>& key_scores, int64_t strategy, int64_t call_score) {
  check_strategy(strategy);
  const c10::cuda::CUDAGuard guard(slot_scores.device());
  const bool with_ts = keeps_timestamps(strategy);
  const int64_t n = check_refresh(slot_scores, slot_timestamps, indices, key_scores, with_ts);
  if (n == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Tensor bad = at::zeros({1}, indices.options().dtype(at::kInt));
  constexpr int kBlock = 256;
  refresh_kernel<<<static_cast<unsigned>((n + kBlock - 1) / kBlock), kBlock, 0, stream>>>(
      indices.data_ptr<int64_t>(), n, opt_ptr(key_scores), default_key_score(strategy, call_score), strategy,
      call_score, slot_scores.numel(), slot_scores.data_ptr<int64_t>(),
      with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr, bad.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(bad.item<int>() == 0, "dynamicemb: a slot index is out of range [-1, ", slot_scores.numel(), ")");
}

// ---- insert --------------------------------------------------------------------------

struct InsertArgs {
  const int64_t* keys;
  const uint8_t* digest;
  const int64_t* key_scores;  // null: dflt for every key
  int64_t dflt;
  int64_t strategy;
  int64_t call_score;
  Epoch epoch;
  int64_t cap;
  int64_t* sk;
  uint8_t* sd;
  int64_t* sc;
  int64_t* ts;  // null unless the strategy keeps timestamps
  Epoch* ep;
  int64_t* out;
  int8_t* res;
  int64_t* ev_key;    // the displaced key and score, by key position
  int64_t* ev_score;
  const bool* evictable;  // per table, null: every table may evict
  const int64_t* tids;    // null: every key in table 0
};

__global__ void insert_kernel(InsertArgs a, Segments segs) {
  for_each_key_of_segment(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const bool lead = tile.thread_rank() == 0;
    if (b < 0) {  // no bucket (a flagged layout error)
      if (lead) {
        a.out[i] = -1;
        a.res[i] = kFailed;
      }
      return;
    }
    const int64_t base = static_cast<int64_t>(b) * a.cap;
    const int cap = static_cast<int>(a.cap);
    int free_slot;
    int s = tile_find_in_bucket<true>(tile, a.sd + base, a.sk + base, cap, a.digest[i], a.keys[i],
                                      &free_slot);
    int8_t r = kAssigned;
    if (s < 0) {
      s = free_slot;
      r = kInserted;
      // Uniform over the tile (it depends on the key only): the collective
      // victim search is entered by all lanes or none.
      if (s < 0 && may_evict(a.strategy) && (!a.evictable || a.evictable[a.tids ? a.tids[i] : 0])) {
        s = tile_pick_victim(tile, a.sc + base, a.ep + base, cap, a.epoch);
        r = kEvicted;
      }
    }
    if (!lead) return;  // one lane writes; the tile syncs before the next key
    if (s < 0) {
      a.out[i] = -1;
      a.res[i] = kFailed;
      return;
    }
    const int64_t slot = base + s;
    const int64_t key_score = a.key_scores ? a.key_scores[i] : a.dflt;
    if (r == kAssigned) {
      a.sc[slot] = score_on_access(a.strategy, a.sc[slot], a.call_score, key_score);
    } else {
      if (r == kEvicted) {
        a.ev_key[i] = a.sk[slot];
        a.ev_score[i] = a.sc[slot];
      }
      a.sk[slot] = a.keys[i];
      a.sd[slot] = a.digest[i];
      a.sc[slot] = score_on_insert(a.strategy, a.call_score, key_score);
    }
    if (a.ts) a.ts[slot] = a.call_score;
    a.ep[slot] = a.epoch;
    a.out[i] = slot;
    a.res[i] = r;
  });
}

// Per table: size += INSERTED; counters += (INSERTED + EVICTED, EVICTED,
// FAILED), as the CPU tallies them. Warp-aggregated: few atomics per warp.
__global__ void tally_insert_kernel(const int8_t* res, const int64_t* tids, int64_t n,
                                    int64_t* sizes, int64_t* counters) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = i < n && res[i] != kAssigned;
  const unsigned long long group =
      active ? static_cast<unsigned long long>(tids ? tids[i] : 0) * 4 + res[i] : 0;
  cuda::warp_aggregate(active, group, [&](unsigned long long g, int count) {
    const int64_t t = static_cast<int64_t>(g / 4);
    switch (static_cast<int>(g % 4)) {
      case kInserted:
        cuda::atomic_add_i64(&sizes[t], count);
        cuda::atomic_add_i64(&counters[t * 3 + 0], count);
        break;
      case kEvicted:
        cuda::atomic_add_i64(&counters[t * 3 + 0], count);
        cuda::atomic_add_i64(&counters[t * 3 + 1], count);
        break;
      case kFailed:
        cuda::atomic_add_i64(&counters[t * 3 + 2], count);
        break;
    }
  });
}

// The evicted entries, compacted in input order (pos: evicting key positions).
__global__ void gather_evicted_kernel(const int64_t* pos, int64_t m, const int64_t* ev_key,
                                      const int64_t* ev_score, const int64_t* tids,
                                      const int64_t* out, int64_t* e_keys, int64_t* e_tids,
                                      int64_t* e_idx, int64_t* e_scores) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= m) return;
  const int64_t i = pos[o];
  e_keys[o] = ev_key[i];
  e_tids[o] = tids ? tids[i] : 0;
  e_idx[o] = out[i];
  e_scores[o] = ev_score[i];
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> insert_cuda(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& slot_epochs, const Tensor& table_buckets,
    const Tensor& sizes, const Tensor& counters, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score, int64_t epoch,
    const std::optional<Tensor>& evictable) {
  check_strategy(strategy);
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const Layout L = make_layout(table_buckets, bucket_capacity, slot_keys);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  check_slots(slot_epochs, at::kByte, "slot_epochs", L);
  if (evictable) {
    check_tensor(*evictable, at::kBool, "evictable", L.dev);
    TORCH_CHECK(evictable->numel() == L.num_tables, "dynamicemb: evictable must hold one flag per table");
  }
  const bool with_ts = keeps_timestamps(strategy);
  if (with_ts) check_slots(slot_timestamps, at::kLong, "slot_timestamps", L);
  check_tensor(sizes, at::kLong, "sizes", L.dev);
  check_tensor(counters, at::kLong, "counters", L.dev);
  TORCH_CHECK(sizes.numel() == L.num_tables && counters.numel() == 3 * L.num_tables,
              "dynamicemb: sizes / counters must hold 1 / 3 entries per table");
  TORCH_CHECK(epoch > 0 && epoch <= kMaxEpoch, "dynamicemb: epoch must be in [1, ", kMaxEpoch, "], got ", epoch);
  const int64_t n = check_keys(keys, table_ids, key_scores, L.dev);

  Tensor indices = new_tensor(n, at::kLong, L.dev);
  Tensor results = new_tensor(n, at::kChar, L.dev);
  if (n == 0) {
    auto none = [&] { return new_tensor(0, at::kLong, L.dev); };
    return {indices, results, none(), none(), none(), none()};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* tids = opt_ptr(table_ids);
  const Placed P = place_keys(L, keys, table_ids, stream);
  const SortedKeys sorted = sort_by_bucket(P.bucket);
  Tensor ev_key = new_tensor(n, at::kLong, L.dev), ev_score = new_tensor(n, at::kLong, L.dev);
  const InsertArgs a{keys.data_ptr<int64_t>(),
                     P.digest.data_ptr<uint8_t>(),
                     opt_ptr(key_scores),
                     default_key_score(strategy, call_score),
                     strategy,
                     call_score,
                     static_cast<Epoch>(epoch),
                     L.cap,
                     slot_keys.data_ptr<int64_t>(),
                     slot_digests.data_ptr<uint8_t>(),
                     slot_scores.data_ptr<int64_t>(),
                     with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr,
                     slot_epochs.data_ptr<Epoch>(),
                     indices.data_ptr<int64_t>(),
                     results.data_ptr<int8_t>(),
                     ev_key.data_ptr<int64_t>(),
                     ev_score.data_ptr<int64_t>(),
                     evictable ? evictable->data_ptr<bool>() : nullptr,
                     tids};
  insert_kernel<<<blocks_for(n, kTilesPerBlock), kThreads, 0, stream>>>(a, sorted.segments());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without table ids every key is in table 0, so a layout error leaves every
  // key without a bucket and the slots untouched: raise it before the tally.
  if (!table_ids) check_flags(P.flags, table_ids, L, stream);
  tally_insert_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      a.res, tids, n, sizes.data_ptr<int64_t>(), counters.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const Tensor pos = at::nonzero(at::eq(results, static_cast<int64_t>(kEvicted))).view({-1});  // syncs
  const int64_t m = pos.numel();
  Tensor e_keys = new_tensor(m, at::kLong, L.dev), e_tids = new_tensor(m, at::kLong, L.dev);
  Tensor e_idx = new_tensor(m, at::kLong, L.dev), e_scores = new_tensor(m, at::kLong, L.dev);
  if (m > 0) {
    gather_evicted_kernel<<<blocks_for(m, kThreads), kThreads, 0, stream>>>(
        pos.data_ptr<int64_t>(), m, a.ev_key, a.ev_score, tids, a.out, e_keys.data_ptr<int64_t>(),
        e_tids.data_ptr<int64_t>(), e_idx.data_ptr<int64_t>(), e_scores.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {indices, results, e_keys, e_tids, e_idx, e_scores};
}

// ---- erase -----------------------------------------------------------------------------

struct EraseArgs {
  const int64_t* keys;
  const uint8_t* digest;
  int64_t cap;
  const int64_t* sk;
  uint8_t* sd;
  bool* erased;
};

__global__ void erase_kernel(EraseArgs a, Segments segs) {
  for_each_key_of_segment(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const int64_t slot = tile_find_slot(tile, a.sd, a.sk, a.cap, b, a.digest[i], a.keys[i]);
    if (tile.thread_rank() != 0) return;
    a.erased[i] = slot >= 0;
    if (slot >= 0) a.sd[slot] = kErased;
  });
}

// sizes[t] -= erased keys of table t.
__global__ void tally_erase_kernel(const bool* erased, const int64_t* tids, int64_t n,
                                   int64_t* sizes) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = i < n && erased[i];
  const unsigned long long group = active && tids ? static_cast<unsigned long long>(tids[i]) : 0;
  cuda::warp_aggregate(active, group, [&](unsigned long long t, int count) {
    cuda::atomic_add_i64(&sizes[t], -static_cast<int64_t>(count));
  });
}

Tensor erase_cuda(const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& table_buckets,
                  const Tensor& sizes, const Tensor& keys, const std::optional<Tensor>& table_ids,
                  int64_t bucket_capacity) {
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const Layout L = make_layout(table_buckets, bucket_capacity, slot_keys);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_tensor(sizes, at::kLong, "sizes", L.dev);
  TORCH_CHECK(sizes.numel() == L.num_tables, "dynamicemb: sizes must hold one entry per table");
  const int64_t n = check_keys(keys, table_ids, std::nullopt, L.dev);
  Tensor erased = new_tensor(n, at::kBool, L.dev);
  if (n == 0) return erased;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Placed P = place_keys(L, keys, table_ids, stream);
  const SortedKeys sorted = sort_by_bucket(P.bucket);
  erase_kernel<<<blocks_for(n, kTilesPerBlock), kThreads, 0, stream>>>(
      EraseArgs{keys.data_ptr<int64_t>(), P.digest.data_ptr<uint8_t>(), L.cap,
                slot_keys.data_ptr<int64_t>(), slot_digests.data_ptr<uint8_t>(),
                erased.data_ptr<bool>()},
      sorted.segments());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  tally_erase_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      erased.data_ptr<bool>(), opt_ptr(table_ids), n, sizes.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return erased;
}

// ---- export ----------------------------------------------------------------------------

// keep[i]: slot begin + i is live (and, with filter scores, scored >= threshold).
__global__ void export_mask_kernel(const uint8_t* sd, const int64_t* fs, int64_t begin, int64_t m,
                                   int64_t threshold, bool* keep) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m) return;
  keep[i] = is_live(sd[begin + i]) && (!fs || fs[begin + i] >= threshold);
}

__global__ void export_gather_kernel(const int64_t* pos, int64_t m, int64_t begin,
                                     const int64_t* sk, const int64_t* tb, int64_t num_tables,
                                     int64_t cap, int64_t* keys, int64_t* tids, int64_t* idx) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= m) return;
  const int64_t slot = begin + pos[o];
  keys[o] = sk[slot];
  tids[o] = table_of_bucket(tb, num_tables, slot / cap);
  idx[o] = slot;
}

std::tuple<Tensor, Tensor, Tensor> export_range_cuda(const Tensor& slot_keys,
                                                      const Tensor& slot_digests,
                                                      const std::optional<Tensor>& filter_scores,
                                                      const Tensor& table_buckets, int64_t begin,
                                                      int64_t end, int64_t bucket_capacity,
                                                      int64_t threshold) {
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Layout L = make_layout(table_buckets, bucket_capacity, slot_keys);
  // Export syncs anyway: check the layout exactly as the CPU does.
  L.num_buckets = download(L.tb + L.num_tables, 1, stream)[0];
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  if (filter_scores) check_slots(*filter_scores, at::kLong, "filter_scores", L);
  TORCH_CHECK(0 <= begin && begin <= end && end <= L.num_slots(), "dynamicemb: export range [",
              begin, ", ", end, ") is outside [0, ", L.num_slots(), ")");
  const int64_t range = end - begin;
  Tensor keep = new_tensor(range, at::kBool, L.dev);
  if (range > 0) {
    export_mask_kernel<<<blocks_for(range, kThreads), kThreads, 0, stream>>>(
        slot_digests.data_ptr<uint8_t>(), opt_ptr(filter_scores), begin, range, threshold,
        keep.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const Tensor pos = at::nonzero(keep).view({-1});  // slot order
  const int64_t m = pos.numel();
  Tensor keys = new_tensor(m, at::kLong, L.dev), tids = new_tensor(m, at::kLong, L.dev);
  Tensor idx = new_tensor(m, at::kLong, L.dev);
  if (m > 0) {
    export_gather_kernel<<<blocks_for(m, kThreads), kThreads, 0, stream>>>(
        pos.data_ptr<int64_t>(), m, begin, slot_keys.data_ptr<int64_t>(), L.tb, L.num_tables, L.cap,
        keys.data_ptr<int64_t>(), tids.data_ptr<int64_t>(), idx.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {keys, tids, idx};
}

// ---- rehash (grow) -----------------------------------------------------------------------

struct RehashArgs {
  const int64_t* otb;  // old / new table_buckets (device)
  const int64_t* ntb;
  int64_t num_tables;
  int64_t old_buckets;
  int64_t cap;
  const int64_t* sk;
  const uint8_t* sd;
  const int64_t* sc;
  const int64_t* st;  // null without timestamps
  int64_t* nk;
  uint8_t* nd;
  int64_t* ns;
  int64_t* nt;
  int32_t* fill;  // slots used so far in each new bucket
  int64_t* dest;  // new index of each old slot (-1: not live)
};

// One thread per old bucket, slots in order: its keys land only in the new
// buckets it scales to, which no other thread writes, so the placement is
// the CPU's (the lowest free slot, in old slot order) without atomics.
__global__ void rehash_kernel(RehashArgs a) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.old_buckets) return;
  const int64_t t = table_of_bucket(a.otb, a.num_tables, b);
  const int64_t nb = a.ntb[t + 1] - a.ntb[t];
  for (int64_t s = b * a.cap; s < (b + 1) * a.cap; ++s) {
    if (!is_live(a.sd[s])) continue;
    const int64_t g = a.ntb[t] + bucket_in_table(key_hash(a.sk[s]), nb);
    const int64_t d = g * a.cap + a.fill[g]++;
    a.nk[d] = a.sk[s];
    a.nd[d] = a.sd[s];
    a.ns[d] = a.sc[s];
    if (a.nt) a.nt[d] = a.st[s];
    a.dest[s] = d;
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rehash_cuda(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& old_table_buckets,
    const Tensor& new_table_buckets, int64_t bucket_capacity) {
  const c10::cuda::CUDAGuard guard(table_device(slot_keys));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Layout O = make_layout(old_table_buckets, bucket_capacity, slot_keys);
  // Rehash is rare: validate the layouts on the host exactly as the CPU does.
  check_tensor(new_table_buckets, at::kLong, "new_table_buckets", O.dev);
  TORCH_CHECK(new_table_buckets.dim() == 1 && new_table_buckets.numel() >= 2,
              "dynamicemb: table_buckets must be 1-D with num_tables + 1 entries");
  const std::vector<int64_t> otb = download(O.tb, O.num_tables + 1, stream);
  const std::vector<int64_t> ntb =
      download(new_table_buckets.data_ptr<int64_t>(), new_table_buckets.numel(), stream);
  const int64_t T = O.num_tables;
  TORCH_CHECK(static_cast<int64_t>(ntb.size()) - 1 == T,
              "dynamicemb: grow cannot change the number of tables");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t ob = otb[t + 1] - otb[t], nb = ntb[t + 1] - ntb[t];
    TORCH_CHECK(ob > 0 && nb >= ob && nb % ob == 0, "dynamicemb: table ", t,
                ": the new bucket count (", nb, ") must be a multiple of the old one (", ob, ")");
  }
  O.num_buckets = otb[T];
  check_slots(slot_keys, at::kLong, "slot_keys", O);
  check_slots(slot_digests, at::kByte, "slot_digests", O);
  check_slots(slot_scores, at::kLong, "slot_scores", O);
  const bool with_ts = slot_timestamps.numel() > 0;
  if (with_ts) check_slots(slot_timestamps, at::kLong, "slot_timestamps", O);

  const int64_t cap = O.cap, S = ntb[T] * cap;
  const auto opts = at::TensorOptions().device(O.dev);
  Tensor nk = at::zeros({S}, opts.dtype(at::kLong));
  Tensor nd = at::zeros({S}, opts.dtype(at::kByte));  // kEmpty marks unused slots
  Tensor ns = at::zeros({S}, opts.dtype(at::kLong));
  Tensor nt = at::zeros({with_ts ? S : 0}, opts.dtype(at::kLong));
  Tensor fill = at::zeros({ntb[T]}, opts.dtype(at::kInt));
  Tensor dest = at::full({O.num_slots()}, -1, opts.dtype(at::kLong));
  if (O.num_buckets > 0) {
    const RehashArgs a{O.tb,
                       new_table_buckets.data_ptr<int64_t>(),
                       T,
                       O.num_buckets,
                       cap,
                       slot_keys.data_ptr<int64_t>(),
                       slot_digests.data_ptr<uint8_t>(),
                       slot_scores.data_ptr<int64_t>(),
                       with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr,
                       nk.data_ptr<int64_t>(),
                       nd.data_ptr<uint8_t>(),
                       ns.data_ptr<int64_t>(),
                       with_ts ? nt.data_ptr<int64_t>() : nullptr,
                       fill.data_ptr<int32_t>(),
                       dest.data_ptr<int64_t>()};
    rehash_kernel<<<blocks_for(O.num_buckets, kThreads), kThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // The moves in old index order.
  const Tensor old_idx = at::nonzero(at::ge(dest, 0)).view({-1});
  const Tensor new_idx = at::index_select(dest, 0, old_idx);
  return {nk, nd, ns, nt, old_idx, new_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("table_lookup", &lookup_cuda);
  m.impl("table_lookup_gather", &lookup_gather_cuda);
  m.impl("table_lookup_refresh", &lookup_refresh_cuda);
  m.impl("table_refresh", &refresh_cuda);
  m.impl("table_insert", &insert_cuda);
  m.impl("table_erase", &erase_cuda);
  m.impl("table_export_range", &export_range_cuda);
  m.impl("table_rehash", &rehash_cuda);
}

}  // namespace table
}  // namespace dynamicemb
