// Where a table's row lives: the one addressing rule of every embedding
// kernel, CPU and CUDA.
//
// A table's rows are one tensor, or two parts (a hybrid table, storage.py):
// rows [0, split) in the head (accelerator memory), rows [split, rows) in the
// tail (pinned host memory on a CUDA device, read and written in place
// through its mapped pointer). An op's `weights` list gives T tensors (each
// table's rows whole) or 2T (the T heads, then the T tails; a table kept whole
// gives an empty tail). On the CPU both parts are ordinary memory, so the CPU
// tests run every kernel through the split.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "common/checks.h"
#include "common/hd.h"
#include "embedding/bag_checks.h"

namespace dynamicemb {
namespace embedding {

// One table's rows: row r at head + r * stride below split, else at
// tail + (r - split) * stride (the storage dtype; stride in elements).
struct RowParts {
  void* head = nullptr;
  void* tail = nullptr;
  int64_t split = 0, rows = 0, stride = 0;
};

template <class W>
DE_HD W* row_at(const RowParts& p, int64_t r) {
  return r < p.split ? static_cast<W*>(p.head) + r * p.stride : static_cast<W*>(p.tail) + (r - p.split) * p.stride;
}

// The row of a key at hash table slot `slot` of table t: the slot less the
// table's first slot, slot_begin[t] (-1, no slot, stays -1; a table id out of
// [0, T) keeps the slot, which the row's range check then rejects).
DE_HD int64_t slot_row(int64_t slot, int64_t t, const int64_t* slot_begin, int64_t T) {
  return slot >= 0 && 0 <= t && t < T ? slot - slot_begin[t] : slot;
}

// Host side, both backends: the keys' slots, their tables' first slots
// (slot_begin [T]), table ids, keys and new-row flags of a row computation
// (emb_slot_rows_init, emb_row_order_init), on `device`.
inline void check_slot_rows_args(const at::Tensor& slots, const at::Tensor& slot_begin, const at::Tensor& table_ids,
                                 const at::Tensor& keys, const at::Tensor& is_new, int64_t T, at::Device device) {
  check_1d(slots, at::kLong, "slots", device);
  check_1d(slot_begin, at::kLong, "slot_begin", device);
  check_1d(table_ids, at::kLong, "table_ids", device);
  check_1d(keys, at::kLong, "keys", device);
  check_1d(is_new, at::kBool, "is_new", device);
  const int64_t n = slots.numel();
  TORCH_CHECK(table_ids.numel() == n && keys.numel() == n && is_new.numel() == n,
              "dynamicemb: slots, table_ids, keys and is_new differ in length");
  TORCH_CHECK(slot_begin.numel() == T, "dynamicemb: slot_begin has ", slot_begin.numel(), " entries for ", T,
              " tables");
}

// Host side, both backends: each table's parts from an op's weights list (T
// or 2T tensors, T = dims.size()). check(t, part) checks one tensor (device,
// contiguity, dtype); the parts of a table must agree in width and dtype, and
// the width must hold the table's dim (check_row_width). ptr(part) is the
// pointer the kernels use (the mapped device pointer of a pinned tensor on CUDA).
template <class Check, class Ptr>
std::vector<RowParts> table_parts(at::TensorList weights, c10::IntArrayRef dims, Check check, Ptr ptr) {
  const int64_t n = static_cast<int64_t>(weights.size()), T = static_cast<int64_t>(dims.size());
  TORCH_CHECK(T > 0 && (n == T || n == 2 * T), "dynamicemb: ", n, " weight tensors for ", T,
              " tables (one per table, or a head and a tail per table)");
  std::vector<RowParts> parts(T);
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor& head = weights[t];
    check(t, head);
    RowParts& p = parts[t];
    p.head = ptr(head);
    p.split = p.rows = head.size(0);
    p.stride = head.size(1);
    check_row_width(t, head.scalar_type(), p.stride, dims[t]);
    if (n == T) continue;
    const at::Tensor& tail = weights[T + t];
    check(t, tail);
    TORCH_CHECK(tail.size(1) == head.size(1) && tail.scalar_type() == head.scalar_type(), "dynamicemb: table ", t,
                ": its tail rows (", tail.scalar_type(), " x ", tail.size(1), ") differ from its head rows (",
                head.scalar_type(), " x ", head.size(1), ")");
    p.tail = ptr(tail);
    p.rows += tail.size(0);
  }
  return parts;
}

}  // namespace embedding
}  // namespace dynamicemb
