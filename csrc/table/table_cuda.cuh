// What the CUDA kernels of the table ops share (table_lookup_cuda.cu,
// table_insert_cuda.cu, table_scan_cuda.cu): the same ops, schemas and
// results as the CPU's, on TableRef (table_ref.h) and its 16-lane tile forms.
//
// Design. A 16-lane tile (cooperative_groups::tiled_partition<16>) works on
// one bucket at a time: lane l reads slot g + l of each group of 16, so a
// group's digests are one coalesced load and the scan is a ballot.
//  - table_lookup (read-only): one tile per key, no ordering needed; its
//    lanes read 16 digests each (4 lanes a key; 8 with a row to gather).
//  - table_lookup_refresh, table_insert, table_erase: API.md §6 wants the
//    result of processing the keys one at a time in input order. Each key's
//    global bucket is computed, key positions are stably sorted by bucket,
//    the starts of the runs of equal buckets are compacted, and a grid of
//    resident tiles takes the runs, each processing its bucket's keys in
//    input order. No two tiles touch one bucket, so slots need no atomics
//    and the result is deterministic. table_insert's tile holds its bucket
//    in registers (bucket_regs_cuda.cuh) where it fits.
//  - Sizes and counters are tallied afterwards from the per-key results,
//    summed per block first (cuda::tally).
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
// does not fit them; insert raises that (its layout checked once per
// table_buckets tensor, layout_fits), as do export and
// rehash, which check the layout on the host exactly as the CPU does. Lookup,
// refresh and erase without table ids skip the read-back (no sync): there such
// keys are simply not found.
//
// Everything here has internal linkage (an unnamed namespace): each of the
// three files gets its own copy of these few kernels and helpers.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/checked_once.h"
#include "common/cuda_utils.cuh"
#include "table/table_checks.h"
#include "table/table_ref.h"

namespace dynamicemb {
namespace table {
namespace cuda_impl {
namespace {

namespace cg = cooperative_groups;
using at::Tensor;
using cuda::blocks_for;
using cuda::download;
using cuda::ErrorSlots;
using cuda::kNoError;
using cuda::kThreads;  // threads per block

constexpr int kTilesPerBlock = kThreads / kGroupSize;

// ---- the table ---------------------------------------------------------------------

// The table's device (that of slot_keys): every other tensor must be on it.
at::Device table_device(at::ArrayRef<Tensor> table) {
  check_members(table);
  const Tensor& slot_keys = table[kSlotKeys];
  TORCH_CHECK(slot_keys.device().is_cuda(), "dynamicemb: slot_keys must be on a CUDA device, got ",
              slot_keys.device());
  return slot_keys.device();
}

// The table's ref with the members in `used` checked. table_buckets stays on
// the device: the bucket count comes from the slot arrays (reading tb[T]
// would cost a sync), and the kernels check each table's range (table_fits).
TableRef make_ref(at::ArrayRef<Tensor> table, int64_t bucket_capacity, unsigned used) {
  const at::Device dev = table_device(table);
  TableRef r = check_layout(table[kTableBuckets], bucket_capacity, dev);
  const int64_t S = table[kSlotKeys].numel();
  TORCH_CHECK(S % bucket_capacity == 0, "dynamicemb: slot_keys must hold whole buckets of ", bucket_capacity,
              " slots, got ", S);
  // Buckets are sorted as int32 (half the radix passes); 2^31 buckets would
  // be terabytes of slots.
  TORCH_CHECK(S / bucket_capacity <= INT32_MAX, "dynamicemb: too many buckets for the CUDA table");
  r.num_buckets = S / bucket_capacity;
  return attach_members(r, table, used | member_bit(kSlotKeys), dev);
}

const int64_t* opt_ptr(const std::optional<Tensor>& t) { return t ? t->data_ptr<int64_t>() : nullptr; }

Tensor new_tensor(int64_t n, at::ScalarType dtype, const at::Device& dev) {
  return at::empty({n}, at::TensorOptions().dtype(dtype).device(dev));
}

// TableRef's tallies on the device.
struct AtomicAdd {
  __device__ __forceinline__ void operator()(int64_t* p, int64_t v) const { cuda::atomic_add_i64(p, v); }
};

// ---- key placement -----------------------------------------------------------------

// table_insert's padding (key_count): the keys at or past *count get
// bucket kPaddingBucket and their outcome (index -1, kPaddingResult) here.
struct Padding {
  const int64_t* count = nullptr;  // null: no padding
  int64_t* out = nullptr;
  int8_t* res = nullptr;
};

// flags[0]: lowest key position with a table id out of range; flags[1]: lowest
// position whose table's bucket range does not fit the slot arrays.
struct PlaceArgs {
  TableRef ref;
  const int64_t* keys;
  const int64_t* tids;  // null: every key in table 0
  int64_t* flags;
  Padding pad;
};

// Global bucket of key i (-1 when it has none; then `report` flags why).
__device__ __forceinline__ int32_t place_key(const PlaceArgs& a, int64_t i, uint8_t* digest, bool report) {
  const int64_t t = a.tids ? a.tids[i] : 0;
  if (!a.ref.has_table(t)) {
    if (report) cuda::flag_min(&a.flags[0], i);
    return -1;
  }
  if (!a.ref.table_fits(t)) {  // never reads or writes out of bounds
    if (report) cuda::flag_min(&a.flags[1], i);
    return -1;
  }
  const uint64_t h = key_hash(a.keys[i]);
  *digest = digest_of(h);
  return static_cast<int32_t>(a.ref.bucket(t, h));
}

__global__ void place_kernel(PlaceArgs a, int64_t n, int32_t* bucket, uint8_t* digest) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (a.pad.count && i >= *a.pad.count) {
    bucket[i] = kPaddingBucket;
    digest[i] = 0;
    a.pad.out[i] = -1;
    a.pad.res[i] = kPaddingResult;
    return;
  }
  uint8_t d = 0;
  bucket[i] = place_key(a, i, &d, true);
  digest[i] = d;
}

// Raises the CPU's error for a flagged table id, or a layout mismatch.
void raise_flags(const ErrorSlots& flags, const std::optional<Tensor>& table_ids, const TableRef& r,
                 cudaStream_t stream) {
  const std::vector<int64_t> f = flags.read();
  if (f[0] != kNoError) {
    const int64_t t = download(table_ids->data_ptr<int64_t>() + f[0], 1, stream)[0];
    TORCH_CHECK(false, "dynamicemb: table id ", t, " (key position ", f[0], ") is out of range [0, ", r.num_tables,
                ")");
  }
  TORCH_CHECK(f[1] == kNoError, "dynamicemb: table_buckets does not fit the slot arrays (", r.num_buckets,
              " buckets; key position ", f[1], ")");
}

__global__ void layout_fits_kernel(TableRef r, int64_t* flag) {
  for (int64_t t = cuda::thread_begin(); t < r.num_tables; t += cuda::thread_stride())
    if (!r.table_fits(t)) cuda::flag_min(flag, t);
}

// Whether every table's bucket range lies within the slot arrays: one
// synchronising copy per table_buckets tensor (checked_once.h), not per call.
bool layout_fits(const TableRef& r, const Tensor& table_buckets, cudaStream_t stream) {
  if (CheckedOnce::holds(table_buckets, Checked::kLayout, r.num_buckets)) return true;
  const ErrorSlots flag(1, table_buckets.device(), stream);
  layout_fits_kernel<<<cuda::blocks_for(r.num_tables, kThreads), kThreads, 0, stream>>>(r, flag.ptr());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (flag.read()[0] != kNoError) return false;
  CheckedOnce::record(table_buckets, Checked::kLayout, r.num_buckets);
  return true;
}

// The placement flags of a call with table ids, raised if set. Table ids that
// emb_unique made or that passed before, in a layout that fits, cannot be
// flagged: their read (a host sync) is skipped. `whole`: every id was placed
// (padding is not), so that passing checked the whole tensor.
void check_flags(const ErrorSlots& flags, const std::optional<Tensor>& table_ids, const TableRef& r,
                 const Tensor& table_buckets, cudaStream_t stream, bool whole = true) {
  if (CheckedOnce::holds(*table_ids, Checked::kTableIds, r.num_tables) && layout_fits(r, table_buckets, stream))
    return;
  raise_flags(flags, table_ids, r, stream);
  if (whole) CheckedOnce::record(*table_ids, Checked::kTableIds, r.num_tables);
}

// Every key's bucket and digest; checks table ids before any slot changes.
struct Placed {
  Tensor bucket;     // int32 [n], -1: no bucket (only with a flagged error)
  Tensor digest;     // uint8 [n]
  ErrorSlots flags;  // the two flags of PlaceArgs
};

Placed place_keys(const TableRef& r, const Tensor& keys, const std::optional<Tensor>& table_ids,
                  const Tensor& table_buckets, cudaStream_t stream, Padding pad = {}) {
  const int64_t n = keys.numel();
  const at::Device dev = keys.device();
  Placed p{new_tensor(n, at::kInt, dev), new_tensor(n, at::kByte, dev), ErrorSlots(2, dev, stream)};
  place_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      PlaceArgs{r, keys.data_ptr<int64_t>(), opt_ptr(table_ids), p.flags.ptr(), pad}, n, p.bucket.data_ptr<int32_t>(),
      p.digest.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Only table ids can be out of range before the slots change; without them
  // the (layout) flags are read where the op syncs anyway, if it does.
  if (table_ids) check_flags(p.flags, table_ids, r, table_buckets, stream, /*whole=*/pad.count == nullptr);
  return p;
}

// ---- bucket segments ---------------------------------------------------------------

// Key positions stably sorted by bucket: each run of equal buckets is one
// bucket's keys in input order. The runs' first sorted positions are
// compacted on the device (in no particular order: runs touch distinct
// buckets, so any order gives the same result), so that a grid of resident
// tiles loops over them with every tile on a run. One tile per sorted
// position (the form before) left 7 tiles of 8 idle at 8 keys a bucket and
// ran an eighth of the runs the GPU holds: on an H200, 1M keys into 16M
// slots, insert 1.1 -> 1.7 x2^30 keys/s, evicting insert 0.65 -> 1.05.
struct Segments {
  const int32_t* bucket;  // sorted
  const int64_t* order;   // key positions
  int64_t n;
  const int64_t* start;  // the runs' first sorted positions, *runs of them
  const int64_t* runs;
};

struct SortedKeys {
  Tensor bucket, order, start, runs;
  Segments segments() const {
    return Segments{bucket.data_ptr<int32_t>(), order.data_ptr<int64_t>(), bucket.numel(), start.data_ptr<int64_t>(),
                    runs.data_ptr<int64_t>()};
  }
};

// start[] gets every j that begins a run; one atomic per block reserves its
// entries (a count per warp, summed in shared memory).
__global__ void run_starts_kernel(const int32_t* bucket, int64_t n, int64_t* start, int64_t* runs) {
  __shared__ unsigned warp_base[cuda::kWarpsPerBlock];
  __shared__ unsigned long long block_base;
  const int64_t j = cuda::thread_begin();
  // Padding (kPaddingBucket, sorted last) forms no run: no tile takes it.
  const bool head = j < n && bucket[j] != kPaddingBucket && (j == 0 || bucket[j - 1] != bucket[j]);
  const unsigned lanes = __ballot_sync(cuda::kFullMask, head);
  const int warp = static_cast<int>(threadIdx.x) / cuda::kWarp, lane = cuda::lane_id();
  if (lane == 0) warp_base[warp] = __popc(lanes);
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned total = 0;
    for (int w = 0; w < cuda::kWarpsPerBlock; ++w) {
      const unsigned c = warp_base[w];
      warp_base[w] = total;
      total += c;
    }
    block_base = total ? atomicAdd(reinterpret_cast<unsigned long long*>(runs), total) : 0;
  }
  __syncthreads();
  if (head) start[block_base + warp_base[warp] + __popc(lanes & ((1u << lane) - 1))] = j;
}

SortedKeys sort_by_bucket(const Tensor& bucket, cudaStream_t stream) {
  auto [sorted, order] = cuda::stable_sort(bucket);
  const int64_t n = sorted.numel();
  SortedKeys k{sorted, order, new_tensor(n, at::kLong, bucket.device()), at::zeros({1}, order.options())};
  run_starts_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      sorted.data_ptr<int32_t>(), n, k.start.data_ptr<int64_t>(), k.runs.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return k;
}

// The grid of a kernel over a call's runs: as many blocks of kTilesPerBlock
// tiles as the device holds at once, and no more than the keys need.
template <auto Kernel>
unsigned int runs_grid(const Segments& s) {
  static int per_sm = 0;  // the kernel's resident blocks per SM (the same on every device of a process)
  if (per_sm == 0) C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
  const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(cuda::device_sms()) * per_sm);
  return static_cast<unsigned int>(std::min<int64_t>(blocks_for(s.n, kTilesPerBlock), resident));
}

// Tile r of the grid takes runs r, r + tiles, ...: op(tile, first sorted
// position, bucket) for each.
template <class Op>
__device__ __forceinline__ void for_each_run(const Segments& s, Op op) {
  const auto tile = cg::tiled_partition<kGroupSize>(cg::this_thread_block());
  const int64_t tiles = static_cast<int64_t>(gridDim.x) * kTilesPerBlock, runs = *s.runs;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kTilesPerBlock + tile.meta_group_rank(); r < runs;
       r += tiles) {
    const int64_t j = s.start[r];
    op(tile, j, s.bucket[j]);
  }
}

// op(tile, key position, bucket) for each key of each run, in input order
// within a run. The tile syncs between keys so that every lane sees the
// previous key's writes.
template <class Op>
__device__ __forceinline__ void for_each_key_of_run(const Segments& s, Op op) {
  for_each_run(s, [&](const auto& tile, int64_t j, int32_t b) {
    for (int64_t q = j; q < s.n && s.bucket[q] == b; ++q) {
      op(tile, s.order[q], b);
      tile.sync();
    }
  });
}

}  // namespace
}  // namespace cuda_impl
}  // namespace table
}  // namespace dynamicemb
