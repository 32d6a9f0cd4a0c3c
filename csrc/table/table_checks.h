// Host-side argument checks shared by the CPU (table_*_cpu.cpp) and CUDA
// (table_*_cuda.cu) kernels of the table ops, so that both raise the same
// messages for the same bad input, and the TableRef (table_ref.h) they
// build over the checked tensors. `dev` is the table's device.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/checks.h"
#include "table/table_ref.h"

namespace dynamicemb {
namespace table {

inline void check_strategy(int64_t strategy) {
  TORCH_CHECK(strategy >= kTimestamp && strategy <= kTimestampLfu, "dynamicemb: unknown score strategy code ",
              strategy);
}

inline void check_tensor(const at::Tensor& t, at::ScalarType dtype, const char* name,
                         const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, "dynamicemb: ", name, " must be on ", dev,
              " (the table's device), got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "dynamicemb: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "dynamicemb: ", name, " must be contiguous");
}

// Keys (and per-key table ids / scores) must be 1-D int64 of one length;
// returns the number of keys.
inline int64_t check_keys(const at::Tensor& keys, const std::optional<at::Tensor>& table_ids,
                          const std::optional<at::Tensor>& key_scores, const at::Device& dev) {
  check_tensor(keys, at::kLong, "keys", dev);
  TORCH_CHECK(keys.dim() == 1, "dynamicemb: keys must be 1-D, got shape ", keys.sizes());
  const int64_t n = keys.numel();
  if (table_ids) {
    check_tensor(*table_ids, at::kLong, "table_ids", dev);
    TORCH_CHECK(table_ids->dim() == 1 && table_ids->numel() == n,
                "dynamicemb: table_ids must be 1-D with one entry per key (", n, "), got shape ",
                table_ids->sizes());
  }
  if (key_scores) {
    check_tensor(*key_scores, at::kLong, "scores", dev);
    TORCH_CHECK(key_scores->dim() == 1 && key_scores->numel() == n,
                "dynamicemb: scores must be 1-D with one entry per key (", n, "), got shape ",
                key_scores->sizes());
  }
  return n;
}

// table_insert_outcome's inputs: an insert's results (int8) and one table
// id (int64) per key, 1-D, on `dev`; returns the number of keys.
inline int64_t check_outcome_args(const at::Tensor& results, const at::Tensor& table_ids, int64_t num_tables,
                                  const at::Device& dev) {
  check_1d(results, at::kChar, "results", dev);
  check_1d(table_ids, at::kLong, "table_ids", dev);
  TORCH_CHECK(table_ids.numel() == results.numel(), "dynamicemb: results and table_ids must be 1-D of one length, got ",
              results.numel(), " and ", table_ids.numel());
  TORCH_CHECK(num_tables > 0, "dynamicemb: num_tables must be positive, got ", num_tables);
  return results.numel();
}

// table_insert's key_count: int64 [1] on the keys' device (null: every key).
inline const int64_t* check_key_count(const std::optional<at::Tensor>& key_count, const at::Device& dev) {
  if (!key_count) return nullptr;
  check_tensor(*key_count, at::kLong, "key_count", dev);
  TORCH_CHECK(key_count->numel() == 1, "dynamicemb: key_count must hold one count, got shape ",
              key_count->sizes());
  return key_count->data_ptr<int64_t>();
}

// table_lookup_gather: values [num_slots, dim] and out [n, dim], one floating
// dtype, contiguous rows. Returns the bytes of one row.
inline int64_t check_gather(const at::Tensor& values, const at::Tensor& out, int64_t n,
                            int64_t num_slots, const at::Device& dev) {
  const at::ScalarType dt = values.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "dynamicemb: values must be float32, float16 or bfloat16, got ", dt);
  check_tensor(values, dt, "values", dev);
  TORCH_CHECK(values.dim() == 2 && values.size(0) == num_slots,
              "dynamicemb: values must be 2-D with one row per slot (", num_slots,
              "), got shape ", values.sizes());
  check_tensor(out, dt, "out", dev);  // the dtype of values
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == values.size(1),
              "dynamicemb: out must have shape [", n, ", ", values.size(1), "] (keys x dim), got ",
              out.sizes());
  at::assert_no_overlap(out, values);
  return values.size(1) * static_cast<int64_t>(values.element_size());
}

// ---- the table -------------------------------------------------------------

// The members of a table, in the order the ops take them.
enum Member : int {
  kSlotKeys,
  kSlotDigests,
  kSlotScores,
  kSlotTimestamps,
  kSlotEpochs,
  kTableBuckets,
  kSizes,
  kCounters,
  kNumMembers,
};

inline const char* member_name(int m) {
  static const char* const names[kNumMembers] = {"slot_keys",   "slot_digests",  "slot_scores", "slot_timestamps",
                                                 "slot_epochs", "table_buckets", "sizes",       "counters"};
  return names[m];
}

// An op's `Tensor[] table` argument holds every member, in Member's order.
inline void check_members(at::ArrayRef<at::Tensor> table) {
  TORCH_CHECK(table.size() == kNumMembers, "dynamicemb: a table is ", kNumMembers,
              " tensors (slot_keys, slot_digests, slot_scores, slot_timestamps, slot_epochs, table_buckets, sizes, "
              "counters), got ",
              table.size());
}

// A set of members (the ones an op reads or writes), as bits.
constexpr unsigned member_bit(Member m) { return 1u << m; }
// The members each kind of op uses (plus the timestamps where the strategy
// keeps them: with_timestamps).
constexpr unsigned kFindMembers = member_bit(kSlotKeys) | member_bit(kSlotDigests);
constexpr unsigned kRefreshMembers = kFindMembers | member_bit(kSlotScores);
constexpr unsigned kEraseMembers = kFindMembers | member_bit(kSizes);
constexpr unsigned kInsertMembers =
    kRefreshMembers | member_bit(kSlotEpochs) | member_bit(kSizes) | member_bit(kCounters);

// The layout checks both backends make: table_buckets int64 [num_tables + 1]
// on dev, bucket_capacity a positive multiple of the group size. Returns
// the ref's layout; the backend sets num_buckets.
inline TableRef check_layout(const at::Tensor& table_buckets, int64_t bucket_capacity, const at::Device& dev) {
  check_tensor(table_buckets, at::kLong, "table_buckets", dev);
  TORCH_CHECK(table_buckets.dim() == 1 && table_buckets.numel() >= 2,
              "dynamicemb: table_buckets must be 1-D with num_tables + 1 entries");
  TORCH_CHECK(bucket_capacity > 0 && bucket_capacity % kGroupSize == 0,
              "dynamicemb: bucket_capacity must be a positive multiple of ", kGroupSize, ", got ", bucket_capacity);
  TableRef r;
  r.table_buckets = table_buckets.data_ptr<int64_t>();
  r.num_tables = table_buckets.numel() - 1;
  r.bucket_capacity = bucket_capacity;
  return r;
}

// A per-slot array other than the table's members (take's slot_values,
// export's filter scores).
inline void check_slots(const at::Tensor& t, at::ScalarType dtype, const char* name, const TableRef& r,
                        const at::Device& dev) {
  check_tensor(t, dtype, name, dev);
  const int64_t slots = r.num_buckets * r.bucket_capacity;
  TORCH_CHECK(t.dim() == 1 && t.numel() == slots, "dynamicemb: ", name, " must hold ", slots, " slots, got shape ",
              t.sizes());
}

// `layout` (check_layout's, num_buckets set) with the members in `used`
// checked and attached: the slot arrays 1-D of one entry per slot, sizes
// one entry per table, counters kTableCounters per table.
inline TableRef attach_members(TableRef layout, at::ArrayRef<at::Tensor> table, unsigned used,
                               const at::Device& dev) {
  static constexpr at::ScalarType dtypes[kNumMembers] = {at::kLong, at::kByte, at::kLong, at::kLong, at::kByte};
  for (int m = 0; m < kNumMembers; ++m) {
    if (!(used & (1u << m)) || m == kTableBuckets) continue;
    const at::Tensor& t = table[m];
    if (m == kSizes || m == kCounters) {
      check_tensor(t, at::kLong, member_name(m), dev);
      const int64_t per_table = m == kSizes ? 1 : kTableCounters;
      TORCH_CHECK(t.numel() == per_table * layout.num_tables, "dynamicemb: ", member_name(m), " must hold ",
                  per_table, " entr", per_table == 1 ? "y" : "ies", " per table");
    } else {
      check_slots(t, dtypes[m], member_name(m), layout, dev);
    }
  }
  auto ptr = [&](Member m) { return (used & member_bit(m)) ? table[m].data_ptr() : nullptr; };
  layout.keys = static_cast<int64_t*>(ptr(kSlotKeys));
  layout.digests = static_cast<uint8_t*>(ptr(kSlotDigests));
  layout.scores = static_cast<int64_t*>(ptr(kSlotScores));
  layout.timestamps = static_cast<int64_t*>(ptr(kSlotTimestamps));
  layout.epochs = static_cast<Epoch*>(ptr(kSlotEpochs));
  layout.sizes = static_cast<int64_t*>(ptr(kSizes));
  layout.counters = static_cast<int64_t*>(ptr(kCounters));
  return layout;
}

// The members an op that scores keys by `strategy` uses besides `used`:
// the timestamps where the strategy keeps them.
inline unsigned with_timestamps(unsigned used, int64_t strategy) {
  return keeps_timestamps(strategy) ? used | member_bit(kSlotTimestamps) : used;
}

// table_refresh: the table's slot_scores (and its timestamps where the
// strategy keeps them) of one length, slot indices and per-index scores on
// their device. Returns the ref over those arrays (the op finds no key):
// refresh them at distinct slot indices in [-1, slot_scores.numel()).
inline TableRef refresh_ref(at::ArrayRef<at::Tensor> table, const at::Tensor& indices,
                            const std::optional<at::Tensor>& key_scores, int64_t strategy) {
  check_strategy(strategy);
  check_members(table);
  const at::Tensor& scores = table[kSlotScores];
  const at::Device dev = scores.device();
  check_tensor(scores, at::kLong, "slot_scores", dev);
  TORCH_CHECK(scores.dim() == 1, "dynamicemb: slot_scores must be 1-D");
  TableRef r;
  r.scores = scores.data_ptr<int64_t>();
  if (keeps_timestamps(strategy)) {
    const at::Tensor& ts = table[kSlotTimestamps];
    check_tensor(ts, at::kLong, "slot_timestamps", dev);
    TORCH_CHECK(ts.numel() == scores.numel(), "dynamicemb: slot_timestamps must hold one entry per slot");
    r.timestamps = ts.data_ptr<int64_t>();
  }
  check_keys(indices, std::nullopt, key_scores, dev);
  return r;
}

// table_insert's `evictable`: one flag per table (null: every table may evict).
inline const bool* check_evictable(const std::optional<at::Tensor>& evictable, const TableRef& r,
                                   const at::Device& dev) {
  if (!evictable) return nullptr;
  check_tensor(*evictable, at::kBool, "evictable", dev);
  TORCH_CHECK(evictable->numel() == r.num_tables, "dynamicemb: evictable must hold one flag per table");
  return evictable->data_ptr<bool>();
}

inline void check_epoch(int64_t epoch) {
  TORCH_CHECK(epoch > 0 && epoch <= kMaxEpoch, "dynamicemb: epoch must be in [1, ", kMaxEpoch, "], got ", epoch);
}

// table_rehash: the new layout keeps the number of tables and scales each
// table's bucket count by an integer (host copies of both layouts).
inline void check_grow(const int64_t* otb, int64_t old_tables, const int64_t* ntb, int64_t new_tables) {
  TORCH_CHECK(old_tables == new_tables, "dynamicemb: grow cannot change the number of tables");
  for (int64_t t = 0; t < old_tables; ++t) {
    const int64_t ob = otb[t + 1] - otb[t], nb = ntb[t + 1] - ntb[t];
    TORCH_CHECK(ob > 0 && nb >= ob && nb % ob == 0, "dynamicemb: table ", t, ": the new bucket count (", nb,
                ") must be a multiple of the old one (", ob, ")");
  }
}

// table_export_range: [begin, end) within the slots.
inline void check_export_range(int64_t begin, int64_t end, int64_t slots) {
  TORCH_CHECK(0 <= begin && begin <= end && end <= slots, "dynamicemb: export range [", begin, ", ", end,
              ") is outside [0, ", slots, ")");
}

}  // namespace table
}  // namespace dynamicemb
