// CPU kernels of the table ops that scan slots rather than find keys:
// table_export_range (live slots in slot order) and table_rehash (grow).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "common/huge_pages_cpu.h"
#include "table/table_cpu.h"

namespace dynamicemb {
namespace table {
namespace cpu_impl {
namespace {

using cpu::compact;

// ---- export ----------------------------------------------------------------------

// Live slots in [begin, end) (with filter_scores: only those >= threshold), in
// slot order: (keys, table ids, slot indices).
std::tuple<Tensor, Tensor, Tensor> export_range(at::ArrayRef<Tensor> table, const std::optional<Tensor>& filter_scores,
                                                int64_t begin, int64_t end, int64_t bucket_capacity,
                                                int64_t threshold) {
  const TableRef ref = make_ref(table, bucket_capacity, kFindMembers);
  if (filter_scores) check_slots(*filter_scores, at::kLong, "filter_scores", ref);
  check_export_range(begin, end, ref.num_buckets * ref.bucket_capacity);
  const int64_t* fs = opt_ptr(filter_scores);
  Tensor keys, tids, idx;
  int64_t *kp, *tp, *ip;
  compact(
      end - begin,
      [&](int64_t i) { return is_live(ref.digests[begin + i]) && (!fs || fs[begin + i] >= threshold); },
      [&](int64_t m) {
        kp = (keys = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        tp = (tids = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        ip = (idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
      },
      [&](int64_t i, int64_t o) {
        const int64_t slot = begin + i;
        kp[o] = ref.keys[slot];
        tp[o] = ref.table_of_slot(slot);
        ip[o] = slot;
      });
  return {keys, tids, idx};
}

// ---- rehash (grow) ---------------------------------------------------------------

// Moves every live slot into a layout whose per-table bucket counts are
// integer multiples of the old ones (TableRef::rehash_bucket): each old bucket
// by one task, in slot order (deterministic). Returns the new slot arrays and
// the moves (old index -> new index) in old index order.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rehash(at::ArrayRef<Tensor> table,
                                                                  const Tensor& new_table_buckets,
                                                                  int64_t bucket_capacity) {
  const TableRef old_layout = make_ref(table, bucket_capacity, 0);
  TableRef to = layout_ref(new_table_buckets, bucket_capacity);
  check_grow(old_layout.table_buckets, old_layout.num_tables, to.table_buckets, to.num_tables);
  const bool with_ts = table[kSlotTimestamps].numel() > 0;
  const TableRef from =
      make_ref(table, bucket_capacity, kRefreshMembers | (with_ts ? member_bit(kSlotTimestamps) : 0u));

  const int64_t S = to.num_buckets * to.bucket_capacity;
  Tensor nk = cpu::empty_huge({S}, at::kLong), nd = cpu::empty_huge({S}, at::kByte),
         ns = cpu::empty_huge({S}, at::kLong);
  Tensor nt = with_ts ? cpu::empty_huge({S}, at::kLong) : new_tensor(0, at::kLong);
  std::fill_n(nd.data_ptr<uint8_t>(), S, kEmpty);  // kEmpty marks unused slots
  std::fill_n(nk.data_ptr<int64_t>(), S, 0);
  std::fill_n(ns.data_ptr<int64_t>(), S, 0);
  if (with_ts) std::fill_n(nt.data_ptr<int64_t>(), S, 0);
  to.keys = nk.data_ptr<int64_t>();
  to.digests = nd.data_ptr<uint8_t>();
  to.scores = ns.data_ptr<int64_t>();
  to.timestamps = with_ts ? nt.data_ptr<int64_t>() : nullptr;
  // New index of every old slot (-1: not live), filled per old bucket.
  const int64_t old_slots = from.num_buckets * from.bucket_capacity;
  std::vector<int64_t> dest(old_slots, -1);
  at::parallel_for(0, from.num_buckets, 256, [&](int64_t bb, int64_t be) {
    std::vector<int32_t> fill;  // slots used in each new bucket of the spread
    for (int64_t b = bb; b < be; ++b) {
      const Spread sp = from.spread(b, to);
      fill.assign(sp.count, 0);
      from.rehash_bucket(b, to, sp, [&](int64_t g) -> int32_t& { return fill[g - sp.first]; }, dest.data());
    }
  });
  Tensor old_idx, new_idx;
  int64_t *op, *np;
  compact(
      old_slots, [&](int64_t s) { return dest[s] >= 0; },
      [&](int64_t m) {
        op = (old_idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        np = (new_idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
      },
      [&](int64_t s, int64_t o) {
        op[o] = s;
        np[o] = dest[s];
      });
  return {nk, nd, ns, nt, old_idx, new_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("table_export_range", &export_range);
  m.impl("table_rehash", &rehash);
}

}  // namespace cpu_impl
}  // namespace table
}  // namespace dynamicemb
