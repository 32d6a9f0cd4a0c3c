// Host-side checks of TBE-style bag inputs (offsets [F * B + 1] and the
// feature -> table map) and of row widths, shared by the CPU and CUDA
// embedding kernels so that both refuse the same inputs with the same
// messages. Where the offsets themselves are read differs (host loop /
// device kernel); the verdict on what was read is here.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/clamp.h>
#include <c10/util/ArrayRef.h>

#include <limits>
#include <utility>
#include <vector>

#include "embedding/optimizer_rules.h"

namespace dynamicemb {
namespace embedding {

// (F, B) of offsets that hold F * B + 1 entries, every feature's table in range.
inline std::pair<int64_t, int64_t> check_bag_shape(const at::Tensor& offsets, c10::IntArrayRef feature_table,
                                                   int64_t num_tables) {
  const int64_t F = static_cast<int64_t>(feature_table.size());
  TORCH_CHECK(F > 0, "dynamicemb: at least one feature is needed");
  TORCH_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % F == 0, "dynamicemb: offsets have ",
              offsets.numel(), " entries; expected num_features (", F, ") * batch_size + 1");
  for (int64_t f = 0; f < F; ++f)
    TORCH_CHECK(0 <= feature_table[f] && feature_table[f] < num_tables, "dynamicemb: feature ", f,
                " maps to table ", feature_table[f], ", outside [0, ", num_tables, ")");
  return {F, (offsets.numel() - 1) / F};
}

// An inverse entry (at position i, value v) that names none of `keys` unique keys.
[[noreturn]] inline void raise_inverse_error(int64_t i, int64_t v, int64_t keys) {
  TORCH_CHECK(false, "dynamicemb: inverse[", i, "] = ", v, " names no key (", keys, " keys)");
  __builtin_unreachable();
}

// The offsets' values: start at 0, end at n, non-decreasing. `bad` is a j
// with offsets[j + 1] < offsets[j] (< 0: none); pair_at(j) reads
// (offsets[j], offsets[j + 1]) for the message.
template <class PairAt>
void check_offset_values(int64_t first, int64_t last, int64_t n, int64_t bad, PairAt pair_at) {
  TORCH_CHECK(first == 0, "dynamicemb: offsets must start at 0, got ", first);
  TORCH_CHECK(last == n, "dynamicemb: offsets end at ", last, " but there are ", n, " indices");
  if (bad < 0) return;
  const std::pair<int64_t, int64_t> v = pair_at(bad);
  TORCH_CHECK(false, "dynamicemb: offsets must be non-decreasing (offsets[", bad + 1, "] = ", v.second,
              " < offsets[", bad, "])");
}

// The offsets' check as a record read later (emb_unique_padded): the first
// j with offsets[j + 1] < offsets[j] (kNoBadOffset: none) and those two
// values, offsets[0], offsets[F * B] and the indices' count n.
enum OffsetsRecord : int { kRecBad = 0, kRecFirst, kRecLast, kRecBadLo, kRecBadHi, kRecCount, kOffsetsRecordLen };
constexpr int64_t kNoBadOffset = std::numeric_limits<int64_t>::max();

// check_offset_values' verdict on a record (host memory).
inline void check_offsets_record(const int64_t* r) {
  check_offset_values(r[kRecFirst], r[kRecLast], r[kRecCount], r[kRecBad] == kNoBadOffset ? -1 : r[kRecBad],
                      [&](int64_t) { return std::make_pair(r[kRecBadLo], r[kRecBadHi]); });
}

// uint8 rows are FBGEMM's fused 8-bit rowwise layout: dim codes q, then a
// float32 scale and bias (native byte order) in this many bytes; element d
// is float(q[d]) * scale + bias. Only emb_lookup_forward reads them.
constexpr int64_t kInt8RowTail = 8;

// Table t's rows ([rows, width] of dtype) hold its dim elements. uint8 rows
// are exactly dim + kInt8RowTail wide: the kernels find the scale and bias
// right after the dim codes, FBGEMM in a row's last 8 bytes; both must agree.
inline void check_row_width(size_t t, at::ScalarType dtype, int64_t width, int64_t dim) {
  TORCH_CHECK(width >= dim, "dynamicemb: table ", t, " rows are narrower than its dim");
  TORCH_CHECK(dtype != at::kByte || width == dim + kInt8RowTail, "dynamicemb: table ", t,
              ": uint8 rows must be dim + ", kInt8RowTail, " = ", dim + kInt8RowTail,
              " bytes wide (codes, then float32 scale and bias), got ", width);
}

enum Pooling : int64_t { kSum = 0, kMean = 1, kNone = 2 };

// The fused update's codes: an optimizer and a weight decay mode the rules know.
inline void check_optimizer(int64_t optimizer, int64_t weight_decay_mode) {
  TORCH_CHECK(optim::known(optimizer), "dynamicemb: unknown optimizer ", optimizer);
  TORCH_CHECK(weight_decay_mode >= 0 && weight_decay_mode < optim::kDecayModes,
              "dynamicemb: unknown weight_decay_mode ", weight_decay_mode, " (0 NONE, 1 L2, 2 DECOUPLE)");
}

// Where each feature's gradient is in grad_output: col[f] its first column
// (pooled; col[F] = width), width the row width of grad_output; grad, the
// output gradient the backward reads (grad_output, clipped).
struct GradColumns {
  std::vector<int64_t> col;
  int64_t width;
  at::Tensor grad;
};

// emb_backward_update's checks once its tensors' own are done: the codes,
// max_gradient,
// each table's room for its optimizer state (rows [rows, stride]) and the
// shape of grad_output for n indices in bags of B per feature.
// FBGEMM's gradient_clipping (max_gradient > 0), as its TBE backward does
// it on both devices: each element of the output gradient (a bag's pooled
// gradient; an index's row without pooling) is clamped to [-max_gradient,
// max_gradient] before per-sample weights and MEAN's 1 / L scale it and the
// occurrences of a key are summed. A NaN stays a NaN (skip_nonfinite's).
inline GradColumns check_backward(const at::Tensor& grad_output, int64_t n, int64_t B,
                                  const std::vector<int64_t>& feature_table, const std::vector<int64_t>& dim,
                                  const std::vector<int64_t>& stride, int64_t pooling, int64_t optimizer,
                                  int64_t weight_decay_mode, double max_gradient) {
  check_optimizer(optimizer, weight_decay_mode);
  TORCH_CHECK(max_gradient >= 0.0 && max_gradient <= 3.0e38, "dynamicemb: max_gradient must be a finite number >= 0 "
              "(0: no gradient clipping), got ", max_gradient);
  for (size_t t = 0; t < dim.size(); ++t)
    TORCH_CHECK(stride[t] >= dim[t] + optim::state_width(optimizer, dim[t]), "dynamicemb: table ", t,
                " rows have no room for the optimizer state");
  const int64_t F = static_cast<int64_t>(feature_table.size());
  GradColumns g{std::vector<int64_t>(F + 1, 0), 0,
                max_gradient > 0.0 ? grad_output.clamp(-max_gradient, max_gradient) : grad_output};
  for (int64_t f = 0; f < F; ++f) g.col[f + 1] = g.col[f] + dim[feature_table[f]];
  g.width = pooling == kNone ? dim[feature_table[0]] : g.col[F];
  TORCH_CHECK(grad_output.size(1) == g.width && grad_output.size(0) == (pooling == kNone ? n : B),
              "dynamicemb: grad_output has shape ", grad_output.sizes(), ", the output had another");
  return g;
}

}  // namespace embedding
}  // namespace dynamicemb
