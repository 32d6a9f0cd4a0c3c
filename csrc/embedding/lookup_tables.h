// The hash tables emb_lookup_forward reads, checked alike by its CPU
// (lookup_forward_cpu.cpp) and CUDA (embedding_cuda.cu) kernels: G hash
// tables given as lists (slot_keys, slot_digests, table_buckets,
// bucket_capacity), each as a TableRef for its find, and where each embedding
// table's keys live in them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

#include "common/checks.h"
#include "embedding/hot_rows.h"
#include "embedding/row_parts.h"
#include "table/table_ref.h"

namespace dynamicemb {
namespace embedding {

// Where table t's keys live: hash table `group`, logical table `local` in it,
// whose slots map one-to-one onto the rows of weights[t] (TableRef::row).
struct TablePlace {
  int64_t group, local;
};

struct LookupTables {
  std::vector<table::TableRef> refs;  // one per hash table (keys, digests, layout)
  std::vector<TablePlace> place;      // one per embedding table
};

// read_tb(g): a host copy of table_buckets[g] (std::vector<int64_t>): its own
// data on the CPU, a download on CUDA. The refs point at the tensors' data.
template <class ReadTb>
LookupTables check_lookup_tables(at::TensorList slot_keys, at::TensorList slot_digests, at::TensorList table_buckets,
                                 c10::IntArrayRef bucket_capacity, c10::IntArrayRef table_group,
                                 c10::IntArrayRef table_local, const std::vector<RowParts>& rows, const at::Device& dev,
                                 ReadTb read_tb) {
  const size_t G = slot_keys.size();
  TORCH_CHECK(G > 0 && slot_digests.size() == G && table_buckets.size() == G && bucket_capacity.size() == G,
              "dynamicemb: slot_keys, slot_digests, table_buckets and bucket_capacity need one entry per hash table");
  LookupTables out;
  std::vector<std::vector<int64_t>> tbs;
  for (size_t g = 0; g < G; ++g) {
    const int64_t cap = bucket_capacity[g];
    TORCH_CHECK(cap > 0 && cap % table::kGroupSize == 0, "dynamicemb: bucket_capacity must be a positive multiple of ",
                table::kGroupSize, ", got ", cap);
    check_1d(table_buckets[g], at::kLong, "table_buckets", dev);
    TORCH_CHECK(table_buckets[g].numel() >= 2, "dynamicemb: table_buckets must hold num_tables + 1 entries");
    check_1d(slot_keys[g], at::kLong, "slot_keys", dev);
    check_1d(slot_digests[g], at::kByte, "slot_digests", dev);
    tbs.push_back(read_tb(g));
    const std::vector<int64_t>& tb = tbs.back();
    const int64_t L = static_cast<int64_t>(tb.size()) - 1;
    TORCH_CHECK(slot_keys[g].numel() == tb[L] * cap && slot_digests[g].numel() == tb[L] * cap,
                "dynamicemb: hash table ", g, " must hold ", tb[L] * cap, " slots");
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(0 <= tb[l] && tb[l] < tb[l + 1], "dynamicemb: table_buckets of hash table ", g,
                  " must be increasing from 0");
    table::TableRef r;
    r.table_buckets = table_buckets[g].data_ptr<int64_t>();
    r.num_tables = L;
    r.num_buckets = tb[L];
    r.bucket_capacity = cap;
    r.keys = slot_keys[g].data_ptr<int64_t>();
    r.digests = slot_digests[g].data_ptr<uint8_t>();
    out.refs.push_back(r);
  }
  const int64_t T = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(table_group.size()) == T && static_cast<int64_t>(table_local.size()) == T,
              "dynamicemb: table_group and table_local need one entry per table (", T, ")");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= table_group[t] && table_group[t] < static_cast<int64_t>(G), "dynamicemb: table ", t,
                " maps to hash table ", table_group[t], ", outside [0, ", G, ")");
    const std::vector<int64_t>& tb = tbs[table_group[t]];
    const int64_t l = table_local[t];
    TORCH_CHECK(0 <= l && l + 1 < static_cast<int64_t>(tb.size()), "dynamicemb: table ", t, " maps to logical table ",
                l, " of a hash table with ", tb.size() - 1);
    const int64_t slots = (tb[l + 1] - tb[l]) * bucket_capacity[table_group[t]];
    TORCH_CHECK(rows[t].rows == slots, "dynamicemb: table ", t, " has ", rows[t].rows, " rows for ", slots,
                " slots");
    out.place.push_back(TablePlace{table_group[t], l});
  }
  return out;
}

// hot_weights / hot_pos (both or neither; one entry per table): table t's
// hot rows, [h, its row width] in the weights' dtype on `dev`, and
// hot_pos[t], int32 [its rows] on `dev`, each entry -1 or a hot row.
// A table with no hot rows may give empty tensors. The entries of hot_pos are
// read, not checked here (a device download per call): the module builds them.
inline std::vector<HotRows> check_hot_rows(const std::optional<at::TensorList>& hot_weights,
                                           const std::optional<at::TensorList>& hot_pos, const std::vector<RowParts>& rows,
                                           at::ScalarType dtype, const at::Device& dev) {
  const size_t T = rows.size();
  std::vector<HotRows> out(T);
  TORCH_CHECK(hot_weights.has_value() == hot_pos.has_value(),
              "dynamicemb: hot_weights and hot_pos are given together or not at all");
  if (!hot_weights) return out;
  TORCH_CHECK(hot_weights->size() == T && hot_pos->size() == T, "dynamicemb: hot_weights and hot_pos need one entry "
              "per table (", T, "), got ", hot_weights->size(), " and ", hot_pos->size());
  for (size_t t = 0; t < T; ++t) {
    const at::Tensor& hw = (*hot_weights)[t];
    const at::Tensor& hp = (*hot_pos)[t];
    if (hw.numel() == 0 && hp.numel() == 0) continue;
    TORCH_CHECK(hw.device() == dev && hw.dim() == 2 && hw.is_contiguous() && hw.scalar_type() == dtype &&
                    hw.size(1) == rows[t].stride,
                "dynamicemb: hot_weights of table ", t, " must be a contiguous [rows, ", rows[t].stride, "] ", dtype,
                " tensor on ", dev, ", got ", hw.scalar_type(), " ", hw.sizes(), " on ", hw.device());
    TORCH_CHECK(hp.device() == dev && hp.dim() == 1 && hp.is_contiguous() && hp.scalar_type() == at::kInt &&
                    hp.numel() == rows[t].rows,
                "dynamicemb: hot_pos of table ", t, " must be a contiguous int32 [", rows[t].rows, "] tensor on ",
                dev, " (one entry per row), got ", hp.scalar_type(), " ", hp.sizes(), " on ", hp.device());
    TORCH_CHECK(hw.size(0) <= INT32_MAX, "dynamicemb: hot_weights of table ", t, " has more than 2^31 - 1 rows");
    out[t] = HotRows{hw.data_ptr(), hw.size(1), hp.data_ptr<int32_t>()};
  }
  return out;
}

}  // namespace embedding
}  // namespace dynamicemb
