// CUDA kernels of the embedding layer. embedding_cpu.cpp defines the
// semantics; these reproduce them, bit for bit where the float order allows:
//
// - emb_unique: hash-based. Every (table, key) pair claims a slot of an
//   open-addressing set, which keeps its first occurrence (atomicMin) and
//   count. The groups are then ordered by (hash part, first occurrence) with
//   one radix sort of a key of only the bits those use: the CPU's order (64
//   hash parts when n >= 4096, else one). The offsets' check and the group
//   count come back in one synchronising copy.
// - emb_init_rows / emb_forward read initial values through init::value
//   (exact double math; nvcc -fmad=false keeps it exact).
// - emb_forward: one warp per bag (pooled) or per index (NONE), lanes over
//   the dims (coalesced), each element summed over the bag's indices in
//   input order as the CPU does; explicit __fadd_rn / __fmul_rn so the sums
//   never contract into FMAs.
// - emb_lookup_forward: one thread per index finds its row with
//   table_rules.h's scalar bucket scan, then emb_forward's kernels run with
//   each index as its own key (inverse = identity). It also reads uint8 rows
//   (bag_checks.h), dequantized per element by load_value.
// - emb_backward_update: backward_cuda.cu.
//
// Validation (embedding_cuda.cuh) matches the CPU's checks and messages;
// checks of device data (offsets, row ranges) cost one synchronizing copy of
// an error record, once per offsets tensor (checked_once.h).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <limits>
#include <tuple>
#include <vector>

#include "common/radix_sort_cuda.cuh"
#include "embedding/embedding_cuda.cuh"
#include "embedding/init_rules.h"
#include "embedding/unique_rules.h"
#include "table/table_rules.h"
#include "embedding/lookup_tables.h"  // emb_lookup_forward

namespace dynamicemb {
namespace embedding {
namespace {

// The initial value of one element: one out-of-line copy of init::value (a
// rare path; inlined into every kernel instantiation it would dominate the
// code size and compile time).
__device__ __noinline__ float initial_value(const init::Args* a, uint64_t seed, int64_t key, int64_t d, int64_t D) {
  return init::value(*a, seed, key, d, D);
}

// ---- unique ------------------------------------------------------------------------------------

// The table of every index (from its bag's feature). It runs before the
// offsets' check is read: a bag out of [0, nb) (offsets that fail it) is
// clamped, so that nothing is read out of bounds before the op raises.
__global__ void index_tables_kernel(const int64_t* off, int64_t nb, int64_t B, const int64_t* feature_table,
                                    int64_t n, int64_t* tid) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) {
    const int64_t bag = bag_of(off, nb, i);
    tid[i] = feature_table[(bag < 0 ? 0 : bag >= nb ? nb - 1 : bag) / B];
  }
}

// Groups by hashing: every (table, key) pair claims a slot of an open-
// addressing set at load factor <= 1/2. A slot holds the first occurrence of
// its pair (the claimant's position, lowered by atomicMin: it always names an
// index of the same pair) and its count. Which slot a pair takes depends on
// scheduling; the output does not: groups are ordered by (hash part, first
// occurrence), both pure functions of the input.
constexpr int64_t kEmptySlot = std::numeric_limits<int64_t>::max();
static_assert(kNoBadOffset == kNoError, "the offsets record's 'none' is an error slot's");

__global__ void group_insert_kernel(const int64_t* key, const int64_t* tid, int64_t n, uint64_t mask, int64_t* first,
                                    int64_t* count, int64_t* slot_of) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) {
    const int64_t k = key[i], t = tid[i];
    uint64_t s = unique::pair_hash(k, unique::salt(t)) & mask;
    while (true) {
      int64_t f = first[s];  // possibly stale: then larger, of the same pair, or empty
      if (f == kEmptySlot) {
        f = static_cast<int64_t>(atomicCAS(reinterpret_cast<unsigned long long*>(&first[s]),
                                           static_cast<unsigned long long>(kEmptySlot),
                                           static_cast<unsigned long long>(i)));
        if (f == kEmptySlot) break;  // claimed
      }
      if (key[f] == k && tid[f] == t) {
        if (i < f) atomicMin(reinterpret_cast<long long*>(&first[s]), static_cast<long long>(i));
        break;
      }
      s = (s + 1) & mask;
    }
    atomic_add_i64(&count[s], 1);
    slot_of[i] = static_cast<int64_t>(s);
  }
}

__global__ void slot_used_kernel(const int64_t* first, int64_t cap, int64_t* used) {
  for (int64_t s = thread_begin(); s < cap; s += thread_stride()) used[s] = first[s] != kEmptySlot;
}

// Per used slot (group g = seg[s] - 1): its first occurrence, count, slot and
// the CPU's order key: part << first_bits | first, first < 2^first_bits.
__global__ void group_order_kernel(const int64_t* first, const int64_t* count, const int64_t* seg, int64_t cap,
                                   const int64_t* key, const int64_t* tid, bool partitioned, int first_bits,
                                   int64_t* g_first, int64_t* g_count, int64_t* g_slot, int64_t* order_key) {
  for (int64_t s = thread_begin(); s < cap; s += thread_stride()) {
    const int64_t f = first[s];
    if (f == kEmptySlot) continue;
    const int64_t g = seg[s] - 1;
    g_first[g] = f;
    g_count[g] = count[s];
    g_slot[g] = s;
    const int64_t part = unique::part(unique::pair_hash(key[f], unique::salt(tid[f])), partitioned);
    order_key[g] = (part << first_bits) | f;
  }
}

// Unique u = the u-th group in order: its key, table, count; rank of its slot
// = u. Of `len` entries, those from *groups on are padding (the padded form,
// which also gets the count in num_unique: a tensor of its own, so that the
// step does not keep the cumulative sum alive).
__global__ void emit_unique_kernel(const int64_t* order, int64_t len, const int64_t* groups, const int64_t* g_first,
                                   const int64_t* g_count, const int64_t* g_slot, const int64_t* key,
                                   const int64_t* tid, int64_t* ukeys, int64_t* utids, int64_t* ucounts,
                                   int64_t* slot_rank, int64_t* num_unique) {
  const int64_t G = *groups;
  if (num_unique != nullptr && thread_begin() == 0) *num_unique = G;
  for (int64_t u = thread_begin(); u < len; u += thread_stride()) {
    if (u >= G) {
      ukeys[u] = unique::kPadKey;
      utids[u] = unique::kPadTable;
      ucounts[u] = unique::kPadCount;
      continue;
    }
    const int64_t g = order[u], f = g_first[g];
    ukeys[u] = key[f];
    utids[u] = tid[f];
    ucounts[u] = g_count[g];
    slot_rank[g_slot[g]] = u;
  }
}

__global__ void emit_inverse_kernel(const int64_t* slot_of, const int64_t* slot_rank, int64_t n, int64_t* inverse) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) inverse[i] = slot_rank[slot_of[i]];
}

// The rest of the padded form's offsets record (bag_checks.h): the values at
// the first decreasing position, and the indices' count.
__global__ void offsets_record_kernel(const int64_t* off, int64_t n, int64_t* rec) {
  const int64_t bad = rec[kRecBad];
  const bool some = bad != kNoBadOffset;
  rec[kRecBadLo] = some ? off[bad] : 0;  // 0 without one, as the CPU's record
  rec[kRecBadHi] = some ? off[bad + 1] : 0;
  rec[kRecCount] = n;
}

struct Unique {
  Tensor keys, tids, inverse, counts, num_unique, offsets_record;
};

// emb_unique, exact (its outputs sized by the group count, which one
// synchronising copy brings back with the offsets' check) or padded (sized
// n, the count and the check's record left on the device: no wait).
Unique unique_cuda_impl(const Tensor& indices, const Tensor& offsets, IntArrayRef feature_table, int64_t num_tables,
                        bool padded) {
  TORCH_CHECK(indices.device().is_cuda(), "dynamicemb: indices must be on a CUDA device, got ", indices.device());
  const at::Device dev = indices.device();
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index());
  check_1d(indices, at::kLong, "indices", dev);
  const int64_t n = indices.numel();
  const Bags bags = bag_shape(n, offsets, feature_table, num_tables, dev);
  // Order key: 6 part bits + 56 bits of first occurrence + the padding bit.
  TORCH_CHECK(n < (int64_t{1} << 56), "dynamicemb: too many indices (", n, ")");
  const auto L = indices.options();
  // Exact: slots 0-2 the offsets' check (unless these offsets passed it
  // already), slot 3 the number of groups; one copy brings both back.
  // Padded: the offsets' record (always made, bags or none: it is never read
  // here). Until it is, the offsets count as checked only for the kernels
  // that clamp them (Checked::kOffsetsClamped).
  const bool check = padded || !CheckedOnce::holds(offsets, Checked::kOffsets, n);
  ErrorSlots err(padded ? kOffsetsRecordLen : 4, dev, stream);
  if (check) launch_offsets_check(bags, err.ptr(), stream);
  if (padded) {
    offsets_record_kernel<<<1, 1, 0, stream>>>(bags.off, n, err.ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    CheckedOnce::record(offsets, Checked::kOffsetsClamped, n);
  }
  Tensor inverse = at::empty({n}, L);
  if (n == 0 || bags.num_bags() == 0) {  // no index to group: the check raises for offsets that end past 0
    if (check && !padded) raise_offsets_errors(bags, offsets, err.read(), stream);
    if (!padded) return {at::zeros({0}, L), at::zeros({0}, L), inverse, at::zeros({0}, L), Tensor(), Tensor()};
    // Indices without bags (bad offsets, raised once the record is read):
    // all padding, which the inverse names in range meanwhile.
    inverse = at::zeros({n}, L);
    CheckedOnce::record(inverse, Checked::kInverse, n);
    return {at::zeros({n}, L), at::zeros({n}, L), inverse, at::zeros({n}, L), at::zeros({1}, L), err.tensor()};
  }

  const Tensor ftab = upload(bags.table, dev, stream);
  Tensor tid = at::empty({n}, L);
  index_tables_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      bags.off, bags.num_bags(), bags.B, device_ptr<int64_t>(ftab), n, tid.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  int64_t cap = 2;  // a power of two >= 2n: load factor <= 1/2, always a free slot
  while (cap < 2 * n) cap *= 2;
  const Tensor first = at::full({cap}, kEmptySlot, L), count = at::zeros({cap}, L);
  Tensor slot_of = at::empty({n}, L);
  group_insert_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      indices.data_ptr<int64_t>(), tid.data_ptr<int64_t>(), n, static_cast<uint64_t>(cap - 1),
      first.data_ptr<int64_t>(), count.data_ptr<int64_t>(), slot_of.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor used = at::empty({cap}, L);
  slot_used_kernel<<<blocks_for(cap, kThreads), kThreads, 0, stream>>>(first.data_ptr<int64_t>(), cap,
                                                                        used.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Tensor seg = at::cumsum(used, 0);  // group id + 1 of every used slot
  const int64_t* groups = seg.data_ptr<int64_t>() + cap - 1;  // G, on the device
  int64_t len = n;  // the outputs' length: G, or n padded
  if (!padded) {
    C10_CUDA_CHECK(cudaMemcpyAsync(err.ptr() + 3, groups, sizeof(int64_t),
                                   cudaMemcpyDeviceToDevice, stream));
    const std::vector<int64_t> e = err.read();
    if (check) raise_offsets_errors(bags, offsets, e, stream);
    len = e[3];
  }

  Tensor g_first = at::empty({len}, L), g_count = at::empty({len}, L), g_slot = at::empty({len}, L);
  const bool partitioned = n >= unique::kPartsFrom;
  const int first_bits = bits_for(n - 1), key_bits = first_bits + (partitioned ? unique::kPartBits : 0);
  // Padded: the entries past G keep a key above every group's, so sort last.
  Tensor order_key = padded ? at::full({len}, int64_t{1} << key_bits, L) : at::empty({len}, L);
  group_order_kernel<<<blocks_for(cap, kThreads), kThreads, 0, stream>>>(
      first.data_ptr<int64_t>(), count.data_ptr<int64_t>(), seg.data_ptr<int64_t>(), cap,
      indices.data_ptr<int64_t>(), tid.data_ptr<int64_t>(), partitioned, first_bits, g_first.data_ptr<int64_t>(),
      g_count.data_ptr<int64_t>(), g_slot.data_ptr<int64_t>(), order_key.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Distinct keys below 2^key_bits (padding: 2^key_bits).
  const Tensor order = std::get<1>(stable_sort_low_bits(order_key, key_bits + (padded ? 1 : 0), stream));

  Tensor ukeys = at::empty({len}, L), utids = at::empty({len}, L), ucounts = at::empty({len}, L),
         slot_rank = at::empty({cap}, L), num_unique = at::empty({padded ? 1 : 0}, L);
  emit_unique_kernel<<<blocks_for(len, kThreads), kThreads, 0, stream>>>(
      order.data_ptr<int64_t>(), len, groups, g_first.data_ptr<int64_t>(), g_count.data_ptr<int64_t>(),
      g_slot.data_ptr<int64_t>(), indices.data_ptr<int64_t>(), tid.data_ptr<int64_t>(), ukeys.data_ptr<int64_t>(),
      utids.data_ptr<int64_t>(), ucounts.data_ptr<int64_t>(), slot_rank.data_ptr<int64_t>(),
      padded ? num_unique.data_ptr<int64_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  emit_inverse_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
      slot_of.data_ptr<int64_t>(), slot_rank.data_ptr<int64_t>(), n, inverse.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The table ids come from feature_table, checked against num_tables (the
  // padding's too), and the inverse names the first G <= len entries: the
  // later ops skip their checks (checked_once.h).
  CheckedOnce::record(utids, Checked::kTableIds, num_tables);
  CheckedOnce::record(inverse, Checked::kInverse, len);
  return {ukeys, utids, inverse, ucounts, num_unique, padded ? err.tensor() : Tensor()};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> unique_cuda(const Tensor& indices, const Tensor& offsets,
                                                       IntArrayRef feature_table, int64_t num_tables) {
  const Unique u = unique_cuda_impl(indices, offsets, feature_table, num_tables, false);
  return {u.keys, u.tids, u.inverse, u.counts};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> unique_padded_cuda(const Tensor& indices,
                                                                              const Tensor& offsets,
                                                                              IntArrayRef feature_table,
                                                                              int64_t num_tables) {
  const Unique u = unique_cuda_impl(indices, offsets, feature_table, num_tables, true);
  return {u.keys, u.tids, u.inverse, u.counts, u.num_unique, u.offsets_record};
}

// ---- initial rows ----------------------------------------------------------------------------

// Where init_rows_kernel finds the rows: given (rows), or computed from the
// keys' slots (slot_row), written to rows_out, and initialised where is_new.
struct RowsOf {
  const int64_t* rows;
  const int64_t* slots = nullptr;
  const int64_t* slot_begin = nullptr;
  const bool* is_new = nullptr;
  int64_t* rows_out = nullptr;
};

// One warp per row, lanes over its elements: the initial weights, then the
// fresh optimizer state (init::state_value). Bad (table, row) pairs are skipped and recorded.
template <class W>
__global__ void init_rows_kernel(const TableDev* tabs, int64_t T, RowsOf of, const int64_t* tids,
                                 const int64_t* keys, int64_t n, uint64_t seed, int64_t* err) {
  const int lane = lane_id();
  for (int64_t i = warp_begin(); i < n; i += warp_stride()) {
    const int64_t t = tids[i];
    int64_t r;
    if (of.slots != nullptr) {
      r = slot_row(of.slots[i], t, of.slot_begin, T);
      if (lane == 0) of.rows_out[i] = r;
      if (!of.is_new[i]) continue;
    } else {
      r = of.rows[i];
    }
    if (r < 0) continue;
    if (t < 0 || t >= T || r >= tabs[t].rows.rows) {
      if (lane == 0 && err != nullptr) flag_min(err, i);
      continue;
    }
    const TableDev& tab = tabs[t];  // a reference: the init args stay in global memory
    W* row = row_at<W>(tab.rows, r);
    const int64_t key = keys[i];
    for (int64_t d = lane; d < tab.rows.stride; d += kWarp)
      row[d] = d < tab.dim ? static_cast<W>(initial_value(&tab.init, seed, key, d, tab.dim))
                           : static_cast<W>(init::state_value(tab.init));
  }
}

void init_rows_cuda(TensorList weights, const Tensor& rows, const Tensor& table_ids, const Tensor& keys,
                    IntArrayRef dims, const Tensor& init_params, int64_t seed, bool skip_bad) {
  const Rows R = check_rows(weights, dims, rows);
  const c10::cuda::CUDAGuard guard(R.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(R.device.index());
  check_1d(rows, at::kLong, "rows", R.device);
  check_1d(table_ids, at::kLong, "table_ids", R.device);
  check_1d(keys, at::kLong, "keys", R.device);
  const int64_t n = rows.numel();
  TORCH_CHECK(table_ids.numel() == n && keys.numel() == n, "dynamicemb: rows, table_ids and keys differ in length");
  const int64_t T = R.num_tables();
  const auto args = init_args(init_params, T, stream);
  if (n == 0) return;
  const Tensor tabs = upload(table_facts(R, args), R.device, stream);
  std::optional<ErrorSlots> err;  // none with skip_bad: the kernel skips bad pairs, nothing is read back
  if (!skip_bad) err.emplace(1, R.device, stream);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_init_rows_cuda", [&] {
    init_rows_kernel<scalar_t><<<blocks_for(n, kWarpsPerBlock), kThreads, 0, stream>>>(
        device_ptr<TableDev>(tabs), T, RowsOf{rows.data_ptr<int64_t>()}, table_ids.data_ptr<int64_t>(),
        keys.data_ptr<int64_t>(), n, static_cast<uint64_t>(seed), err ? err->ptr() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!err) return;
  const int64_t bad = err->read()[0];
  if (bad != kNoError) {
    const int64_t r = download(rows.data_ptr<int64_t>() + bad, 1, stream)[0];
    const int64_t t = download(table_ids.data_ptr<int64_t>() + bad, 1, stream)[0];
    TORCH_CHECK(false, "dynamicemb: row ", r, " of table ", t, " is out of range");
  }
}

// emb_slot_rows_init: the rows from the slots and the new rows initialised,
// in one launch (bad pairs skipped, as emb_init_rows with skip_bad: nothing
// is read back).
Tensor slot_rows_init_cuda(TensorList weights, const Tensor& slots, const Tensor& slot_begin, const Tensor& table_ids,
                           const Tensor& keys, const Tensor& is_new, IntArrayRef dims, const Tensor& init_params,
                           int64_t seed) {
  const Rows R = check_rows(weights, dims, slots);
  const c10::cuda::CUDAGuard guard(R.device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(R.device.index());
  const int64_t T = R.num_tables(), n = slots.numel();
  check_slot_rows_args(slots, slot_begin, table_ids, keys, is_new, T, R.device);
  const auto args = init_args(init_params, T, stream);
  Tensor rows = at::empty({n}, slots.options());
  if (n == 0) return rows;
  const Tensor tabs = upload(table_facts(R, args), R.device, stream);
  const RowsOf of{nullptr, slots.data_ptr<int64_t>(), slot_begin.data_ptr<int64_t>(), is_new.data_ptr<bool>(),
                  rows.data_ptr<int64_t>()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_slot_rows_init_cuda", [&] {
    init_rows_kernel<scalar_t><<<blocks_for(n, kWarpsPerBlock), kThreads, 0, stream>>>(
        device_ptr<TableDev>(tabs), T, of, table_ids.data_ptr<int64_t>(), keys.data_ptr<int64_t>(), n,
        static_cast<uint64_t>(seed), nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return rows;
}

// ---- forward ---------------------------------------------------------------------------------------
// Element d of a row of D elements, as a float.
template <class W>
__device__ __forceinline__ float load_value(const W* row, int64_t d, int64_t /*D*/) {
  return static_cast<float>(row[d]);
}

// uint8 rows (bag_checks.h): code d dequantized by the scale and bias after
// the D codes (unaligned: memcpy), multiply then add as the CPU's.
__device__ __forceinline__ float load_value(const uint8_t* row, int64_t d, int64_t D) {
  float scale, bias;
  memcpy(&scale, row + D, sizeof scale);
  memcpy(&bias, row + D + sizeof scale, sizeof bias);
  return __fadd_rn(__fmul_rn(static_cast<float>(row[d]), scale), bias);
}

// The forward kernels' register budget: the rare initial-value call would
// otherwise set it (~110) for the whole kernel and halve the resident warps.
constexpr int kForwardBlocksPerSM = 4;

// Pooled (SUM / MEAN): one warp per bag, lanes over a kChunk-wide slice of the
// dims. The lanes fetch up to 32 of the bag's indices at once (row, key,
// weight), then every element adds them one by one in input order.
template <class W, class O>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSM)
    forward_pooled_kernel(const TableDev* tabs, const FeatureDev* feats, const int64_t* off, int64_t nb, int64_t B,
                          int64_t n, const int64_t* rows, const int64_t* ukeys, const int64_t* inv, const float* psw,
                          bool mean, uint64_t seed, int64_t total_d, O* out) {
  const int lane = lane_id();
  for (int64_t j = warp_begin(); j < nb; j += warp_stride()) {
    const FeatureDev feat = feats[j / B];
    const TableDev& tab = tabs[feat.table];
    // Clamped to [0, n]: offsets whose check is read later (emb_unique_padded) read nothing out of bounds.
    int64_t beg, end;
    bag_range(off, j, n, &beg, &end);
    const int64_t D = tab.dim, L = end - beg;
    const float scale = (mean && L > 0) ? __fdiv_rn(1.0f, static_cast<float>(L)) : 1.0f;
    O* o = out + (j % B) * total_d + feat.col;
    for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
      float acc[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) acc[k] = 0.0f;
      for (int64_t i0 = beg; i0 < end; i0 += kWarp) {
        // Each lane resolves its index's row address (hot_rows.h; 0: no row).
        unsigned long long p = 0, key = 0;
        float s = 0.0f;
        if (i0 + lane < end) {
          const int64_t i = i0 + lane, u = inv[i], r = rows[u];
          if (r >= 0)
            p = reinterpret_cast<unsigned long long>(resolve_row<W>(tab.rows, tab.hot, r));
          else
            key = static_cast<unsigned long long>(ukeys[u]);
          s = psw ? psw[i] : 1.0f;
        }
        const int cnt = end - i0 < kWarp ? static_cast<int>(end - i0) : kWarp;
        for (int q = 0; q < cnt; ++q) {
          const W* row = reinterpret_cast<const W*>(__shfl_sync(kFullMask, p, q));
          const float sq = __shfl_sync(kFullMask, s, q);
          if (row != nullptr) {  // warp-uniform
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
              const int64_t d = d0 + k * kWarp + lane;
              if (d < D) acc[k] = mul_add(acc[k], sq, load_value(row, d, D));
            }
          } else {  // no row: the key's initial value
            const int64_t kq = static_cast<int64_t>(__shfl_sync(kFullMask, key, q));
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
              const int64_t d = d0 + k * kWarp + lane;
              if (d < D) acc[k] = mul_add(acc[k], sq, initial_value(&tab.init, seed, kq, d, D));
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t d = d0 + k * kWarp + lane;
        if (d < D) o[d] = static_cast<O>(__fmul_rn(acc[k], scale));
      }
    }
  }
}

// Pooling NONE: one warp per index, lanes over its row (0 + 1 * v, as the
// CPU's accumulation, which turns -0 into +0).
template <class W, class O>
__global__ void __launch_bounds__(kThreads, kForwardBlocksPerSM)
    forward_none_kernel(const TableDev* tabs, const FeatureDev* feats, const int64_t* off, int64_t nb, int64_t B,
                        const int64_t* rows, const int64_t* ukeys, const int64_t* inv, int64_t n, uint64_t seed,
                        O* out) {
  const int lane = lane_id();
  for (int64_t i = warp_begin(); i < n; i += warp_stride()) {
    const TableDev& tab = tabs[feats[bag_of(off, nb, i) / B].table];
    const int64_t u = inv[i], r = rows[u], D = tab.dim;
    O* o = out + i * D;
    if (r >= 0) {
      const W* row = resolve_row<W>(tab.rows, tab.hot, r);
      for (int64_t d = lane; d < D; d += kWarp)
        o[d] = static_cast<O>(mul_add(0.0f, 1.0f, load_value(row, d, D)));
    } else {
      const int64_t key = ukeys[u];
      for (int64_t d = lane; d < D; d += kWarp)
        o[d] = static_cast<O>(mul_add(0.0f, 1.0f, initial_value(&tab.init, seed, key, d, D)));
    }
  }
}

// The forward. `lookup` marks emb_lookup_forward's call: uint8 rows only
// there (the training ops refuse them at their dtype dispatch, as the CPU's),
// and its inverse is the identity, which needs no check.
Tensor forward_rows(TensorList weights, const Tensor& rows, const Tensor& unique_keys, const Tensor& inverse,
                    const Tensor& offsets, IntArrayRef feature_table, IntArrayRef dims,
                    const std::optional<Tensor>& per_sample_weights, int64_t pooling, const Tensor& init_params,
                    int64_t seed, at::ScalarType output_dtype, bool lookup,
                    const std::vector<HotRows>& hot = {}) {
  const Rows R = check_rows(weights, dims, rows);
  const at::Device dev = R.device;
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index());
  check_1d(rows, at::kLong, "rows", dev);
  check_1d(unique_keys, at::kLong, "unique_keys", dev);
  check_1d(inverse, at::kLong, "inverse", dev);
  TORCH_CHECK(unique_keys.numel() == rows.numel(), "dynamicemb: rows and unique_keys differ in length");
  if (!lookup) check_inverse(inverse, rows.numel(), stream);
  const int64_t n = inverse.numel();
  // The training forward clamps its offsets; the eval lookup's must pass now.
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables(), dev, stream, /*clamps=*/!lookup);
  const float* psw = opt_weights(per_sample_weights, n, dev);
  TORCH_CHECK(pooling == kSum || pooling == kMean || pooling == kNone, "dynamicemb: unknown pooling ", pooling);
  const auto args = init_args(init_params, R.num_tables(), stream);
  std::vector<int64_t> doff(bags.F + 1, 0);
  for (int64_t f = 0; f < bags.F; ++f) doff[f + 1] = doff[f] + R.dim[bags.table[f]];
  const auto opts = at::TensorOptions().dtype(output_dtype).device(dev);
  Tensor out;
  if (pooling == kNone) {
    const int64_t D = R.dim[bags.table[0]];
    for (int64_t f = 0; f < bags.F; ++f)
      TORCH_CHECK(R.dim[bags.table[f]] == D, "dynamicemb: pooling NONE needs one dim for all features (feature ", f,
                  " has ", R.dim[bags.table[f]], ", feature 0 has ", D, ")");
    TORCH_CHECK(!psw, "dynamicemb: per_sample_weights are not supported with pooling NONE");
    out = at::empty({n, D}, opts);
  } else {
    out = at::empty({bags.B, doff[bags.F]}, opts);
  }
  const int64_t items = pooling == kNone ? n : bags.num_bags();
  if (items == 0 || out.numel() == 0) return out;
  std::vector<TableDev> facts = table_facts(R, args);
  for (size_t t = 0; t < hot.size(); ++t) facts[t].hot = hot[t];
  const Tensor tabs = upload(facts, dev, stream);
  const Tensor feats = upload(feature_facts(bags, doff), dev, stream);
  auto launch = [&](auto row_type) {
    using W = decltype(row_type);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output_dtype, "dynamicemb_forward_cuda_out", [&] {
      const unsigned grid = blocks_for(items, kWarpsPerBlock);
      if (pooling == kNone) {
        forward_none_kernel<W, scalar_t><<<grid, kThreads, 0, stream>>>(
            device_ptr<TableDev>(tabs), device_ptr<FeatureDev>(feats), bags.off, bags.num_bags(), bags.B,
            rows.data_ptr<int64_t>(), unique_keys.data_ptr<int64_t>(), inverse.data_ptr<int64_t>(), n,
            static_cast<uint64_t>(seed), out.data_ptr<scalar_t>());
      } else {
        forward_pooled_kernel<W, scalar_t><<<grid, kThreads, 0, stream>>>(
            device_ptr<TableDev>(tabs), device_ptr<FeatureDev>(feats), bags.off, bags.num_bags(), bags.B, n,
            rows.data_ptr<int64_t>(), unique_keys.data_ptr<int64_t>(), inverse.data_ptr<int64_t>(), psw,
            pooling == kMean, static_cast<uint64_t>(seed), doff[bags.F], out.data_ptr<scalar_t>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  };
  if (lookup && R.dtype == at::kByte) {
    launch(uint8_t{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_forward_cuda",
                                    [&] { launch(scalar_t{}); });
  }
  return out;
}

Tensor forward_cuda(TensorList weights, const Tensor& rows, const Tensor& unique_keys, const Tensor& inverse,
                    const Tensor& offsets, IntArrayRef feature_table, IntArrayRef dims,
                    const std::optional<Tensor>& per_sample_weights, int64_t pooling, const Tensor& init_params,
                    int64_t seed, at::ScalarType output_dtype) {
  return forward_rows(weights, rows, unique_keys, inverse, offsets, feature_table, dims, per_sample_weights, pooling,
                      init_params, seed, output_dtype, false);
}

// ---- eval forward fused with the lookup ----------------------------------------------------------

// The table-local row of every index (-1: its key is missing), by
// TableRef's scalar find (table_lookup's result).
__global__ void lookup_rows_kernel(const table::TableRef* refs, const TablePlace* place, const int64_t* feature_table,
                                   const int64_t* off, int64_t nb, int64_t B, const int64_t* keys, int64_t n,
                                   int64_t* rows) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride()) {
    const TablePlace p = place[feature_table[bag_of(off, nb, i) / B]];
    const table::TableRef& ref = refs[p.group];
    const int64_t slot = ref.find(ref.probe(p.local, keys[i]), keys[i]);
    rows[i] = slot >= 0 ? ref.row(slot, p.local) : -1;
  }
}

// emb_lookup_forward: rows resolved per index, then the forward kernels with
// every index its own "unique" key (inverse = identity); a row with a hot
// copy (hot_rows.h) is read there by the forward kernels.
Tensor lookup_forward_cuda(TensorList slot_keys, TensorList slot_digests, TensorList table_buckets,
                           IntArrayRef bucket_capacity, IntArrayRef table_group, IntArrayRef table_local,
                           TensorList weights, const Tensor& indices, const Tensor& offsets,
                           IntArrayRef feature_table, IntArrayRef dims,
                           const std::optional<Tensor>& per_sample_weights, int64_t pooling,
                           const Tensor& init_params, int64_t seed, at::ScalarType output_dtype,
                           const std::optional<TensorList>& hot_weights, const std::optional<TensorList>& hot_pos) {
  const Rows R = check_rows(weights, dims, indices);
  const at::Device dev = R.device;
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index());
  check_1d(indices, at::kLong, "indices", dev);
  const int64_t n = indices.numel();
  const LookupTables H = check_lookup_tables(
      slot_keys, slot_digests, table_buckets, bucket_capacity, table_group, table_local, R.parts, dev,
      [&](size_t g) { return download(table_buckets[g].data_ptr<int64_t>(), table_buckets[g].numel(), stream); });
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables(), dev, stream);
  const std::vector<HotRows> hot = check_hot_rows(hot_weights, hot_pos, R.parts, R.dtype, dev);
  const auto L = indices.options();
  Tensor rows = at::empty({n}, L);
  if (n > 0) {
    const Tensor d_refs = upload(H.refs, dev, stream), d_place = upload(H.place, dev, stream),
                 d_ftab = upload(bags.table, dev, stream);
    lookup_rows_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
        device_ptr<table::TableRef>(d_refs), device_ptr<TablePlace>(d_place), device_ptr<int64_t>(d_ftab), bags.off,
        bags.num_bags(), bags.B, indices.data_ptr<int64_t>(), n, rows.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return forward_rows(weights, rows, indices, at::arange(n, L), offsets, feature_table, dims, per_sample_weights,
                      pooling, init_params, seed, output_dtype, true, hot);
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("emb_unique", &unique_cuda);
  m.impl("emb_unique_padded", &unique_padded_cuda);
  m.impl("emb_init_rows", &init_rows_cuda);
  m.impl("emb_slot_rows_init", &slot_rows_init_cuda);
  m.impl("emb_forward", &forward_cuda);
  m.impl("emb_lookup_forward", &lookup_forward_cuda);
}

}  // namespace embedding
}  // namespace dynamicemb
