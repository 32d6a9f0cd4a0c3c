// Host-side argument checks shared by the CPU (table_cpu.cpp) and CUDA
// (table_cuda.cu) kernels of the table ops, so that both raise the same
// messages for the same bad input. `dev` is the table's device.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "table/table_rules.h"

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

// table_refresh: slot_scores (and the timestamps where the strategy keeps
// them) of one length, distinct slot indices in [-1, that length), per-index
// scores. Returns the number of indices.
inline int64_t check_refresh(const at::Tensor& slot_scores, const at::Tensor& slot_timestamps,
                             const at::Tensor& indices, const std::optional<at::Tensor>& key_scores,
                             bool with_ts) {
  const at::Device dev = slot_scores.device();
  check_tensor(slot_scores, at::kLong, "slot_scores", dev);
  TORCH_CHECK(slot_scores.dim() == 1, "dynamicemb: slot_scores must be 1-D");
  if (with_ts) {
    check_tensor(slot_timestamps, at::kLong, "slot_timestamps", dev);
    TORCH_CHECK(slot_timestamps.numel() == slot_scores.numel(),
                "dynamicemb: slot_timestamps must hold one entry per slot");
  }
  return check_keys(indices, std::nullopt, key_scores, dev);
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

}  // namespace table
}  // namespace dynamicemb
