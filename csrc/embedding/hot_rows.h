// Hot rows: an optional second source of a table's rows (a copy of some of
// them, e.g. in device memory while the table's rows stay in a mapped file),
// read by emb_lookup_forward's CPU (lookup_forward_cpu.cpp) and CUDA
// (embedding_cuda.cu) kernels through the one rule below. A cached row is the
// same bytes as the table's row, so where a row is read from never changes
// the result.
#pragma once
#include <cstdint>

#include "common/hd.h"
#include "embedding/row_parts.h"

namespace dynamicemb {
namespace embedding {

// One table's hot rows: row h at w + h * stride (the table's dtype and row
// width); pos[r] is table row r's hot row, or -1. pos == nullptr: none.
struct HotRows {
  const void* w = nullptr;
  int64_t stride = 0;
  const int32_t* pos = nullptr;
};

// Where table row r is read: its hot copy when it has one, else its row (row_at).
template <class W>
DE_HD const W* resolve_row(const RowParts& rows, const HotRows& hot, int64_t r) {
  if (hot.pos != nullptr) {
    const int32_t h = hot.pos[r];
    if (h >= 0) return static_cast<const W*>(hot.w) + static_cast<int64_t>(h) * hot.stride;
  }
  return row_at<const W>(rows, r);
}

}  // namespace embedding
}  // namespace dynamicemb
