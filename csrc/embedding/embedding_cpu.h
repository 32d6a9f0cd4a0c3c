// Pieces shared by the CPU embedding kernels (embedding_cpu.cpp: unique,
// init, forward, backward; lookup_forward_cpu.cpp: the fused eval lookup):
// input validation, the bag structure and the pooled gather.
//
// Rows: table t's rows (row_parts.h: weights[t], or its head and tail), 2-D
// [rows, dim_t + state_t] in the storage dtype (uint8, for emb_lookup_forward only: [rows, dim_t + 8],
// bag_checks.h). Bags: TBE layout, offsets [F * B + 1], bag j = f * B + b;
// feature f reads table feature_table[f]; pooled output [B, sum_f dim_f].
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "common/parallel_cpu.h"
#include "embedding/bag_checks.h"
#include "embedding/init_rules.h"
#include "embedding/row_math_cpu.h"
#include "embedding/row_parts.h"

namespace dynamicemb {
namespace embedding {

using at::Tensor;
using at::TensorList;
using c10::IntArrayRef;

// Every inverse[i] names one of `keys` unique keys: the kernels index rows
// and keys by it. One branch-free pass; the first bad position is searched
// only when there is one.
inline void check_inverse(const Tensor& inverse, int64_t keys) {
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const int64_t n = inverse.numel();
  std::atomic<bool> any{false};
  cpu::parallel_ranges(n, 1 << 16, [&](int64_t b, int64_t e) {
    bool bad = false;
    for (int64_t i = b; i < e; ++i) bad |= static_cast<uint64_t>(inv[i]) >= static_cast<uint64_t>(keys);
    if (bad) any = true;
  });
  if (!any) return;
  int64_t i = 0;
  while (static_cast<uint64_t>(inv[i]) < static_cast<uint64_t>(keys)) ++i;
  raise_inverse_error(i, inv[i], keys);
}

// The bag structure of a batch: B bags per feature, F features.
struct Bags {
  const int64_t* off;
  int64_t F, B, n;
  std::vector<int64_t> table;  // per feature

  int64_t num_bags() const { return F * B; }
  int64_t feature(int64_t bag) const { return bag / B; }
  int64_t length(int64_t bag) const { return off[bag + 1] - off[bag]; }
  // fn(j, f, b) for bags j in [jb, je), bag j being sample b of feature f
  // (j = f * B + b): f and b advance with j, where a division per bag cost
  // short bags (5 ids) a fifth of a forward.
  template <class Fn>
  void walk(int64_t jb, int64_t je, Fn fn) const {
    if (jb >= je) return;
    int64_t f = feature(jb), b = jb - f * B;
    for (int64_t j = jb; j < je; ++j, ++b) {
      if (b == B) {
        b = 0;
        ++f;
      }
      fn(j, f, b);
    }
  }

  // The bag of every index.
  std::vector<int64_t> bag_of() const {
    std::vector<int64_t> bag(n);
    at::parallel_for(0, num_bags(), 256, [&](int64_t jb, int64_t je) {
      for (int64_t j = jb; j < je; ++j)
        for (int64_t i = off[j]; i < off[j + 1]; ++i) bag[i] = j;
    });
    return bag;
  }
};

inline Bags check_bags(int64_t n, const Tensor& offsets, IntArrayRef feature_table, int64_t num_tables) {
  check_1d(offsets, at::kLong, "offsets");
  const auto [F, B] = check_bag_shape(offsets, feature_table, num_tables);
  Bags bags{offsets.data_ptr<int64_t>(), F, B, n, std::vector<int64_t>(feature_table.begin(), feature_table.end())};
  const int64_t* off = bags.off;
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, bags.num_bags(), 16384, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j)
      if (off[j + 1] < off[j]) cpu::keep_first(bad, j);
  });
  check_offset_values(off[0], off[bags.num_bags()], n, bad.load(),
                      [&](int64_t j) { return std::make_pair(off[j], off[j + 1]); });
  return bags;
}

// Each table's rows (row_parts.h: whole, or a head and a tail) and the
// layout facts the kernels need.
struct Rows {
  std::vector<RowParts> parts;
  std::vector<int64_t> dim, stride;
  at::ScalarType dtype;
  int64_t num_tables() const { return static_cast<int64_t>(parts.size()); }
  template <class W>
  W* row(int64_t t, int64_t r) const { return row_at<W>(parts[t], r); }
};

inline Rows check_rows(TensorList weights, IntArrayRef dims) {
  TORCH_CHECK(!weights.empty(), "dynamicemb: no weight tensors");
  Rows r{{}, {}, {}, weights[0].scalar_type()};
  r.parts = table_parts(
      weights, dims,
      [&](int64_t t, const Tensor& w) {
        TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == r.dtype,
                    "dynamicemb: weights of table ", t, " must be a contiguous 2-D CPU tensor of ", r.dtype);
      },
      [](const Tensor& w) { return w.data_ptr(); });
  r.dim.assign(dims.begin(), dims.end());
  for (const RowParts& p : r.parts) r.stride.push_back(p.stride);
  return r;
}

inline std::vector<init::Args> init_args(const Tensor& params, int64_t num_tables) {
  TORCH_CHECK(params.scalar_type() == at::kDouble && params.dim() == 2 && params.is_contiguous() &&
                  params.size(0) == num_tables && params.size(1) == init::kArgsWidth,
              "dynamicemb: init_params must be a contiguous float64 [num_tables, ", init::kArgsWidth, "] tensor");
  std::vector<init::Args> a;
  for (int64_t t = 0; t < num_tables; ++t) a.push_back(init::args_from(params.data_ptr<double>() + t * init::kArgsWidth));
  return a;
}

inline const float* opt_weights(const std::optional<Tensor>& psw, int64_t n) {
  if (!psw) return nullptr;
  check_1d(*psw, at::kFloat, "per_sample_weights");
  TORCH_CHECK(psw->numel() == n, "dynamicemb: per_sample_weights has ", psw->numel(), " entries for ", n,
              " indices");
  return psw->data_ptr<float>();
}

// Indices ahead of use whose rows are prefetched: enough misses in flight to
// cover memory latency without thrashing the line fill buffers.
constexpr int64_t kPrefetchAhead = 48;

// Per feature: its first column in the pooled output (doff[F]: the width).
inline std::vector<int64_t> feature_columns(const Rows& R, const Bags& bags) {
  std::vector<int64_t> doff(bags.F + 1, 0);
  for (int64_t f = 0; f < bags.F; ++f) doff[f + 1] = doff[f] + R.dim[bags.table[f]];
  return doff;
}

// The forward's output: [n, D] for pooling NONE (one dim for every feature,
// no per-sample weights), else [B, sum of the features' dims].
inline Tensor forward_output(const Rows& R, const Bags& bags, const std::vector<int64_t>& doff, const float* psw,
                             int64_t pooling, at::ScalarType output_dtype) {
  TORCH_CHECK(pooling == kSum || pooling == kMean || pooling == kNone, "dynamicemb: unknown pooling ", pooling);
  if (pooling != kNone) return at::empty({bags.B, doff[bags.F]}, at::TensorOptions().dtype(output_dtype));
  const int64_t D = R.dim[bags.table[0]];
  for (int64_t f = 0; f < bags.F; ++f)
    TORCH_CHECK(R.dim[bags.table[f]] == D, "dynamicemb: pooling NONE needs one dim for all features (feature ", f,
                " has ", R.dim[bags.table[f]], ", feature 0 has ", D, ")");
  TORCH_CHECK(!psw, "dynamicemb: per_sample_weights are not supported with pooling NONE");
  return at::empty({bags.n, D}, at::TensorOptions().dtype(output_dtype));
}

// Bags are gathered in spans of about this many indices: a span's row
// pointers stay in L1/L2 between being resolved and being pooled.
constexpr int64_t kSpanIndices = 2048;

// Runs fn(jb, je) over consecutive spans of bags covering [0, num_bags), the
// spans in parallel; a span ends at the first bag boundary past kSpanIndices.
template <class Fn>
void for_each_span(const Bags& bags, Fn fn) {
  cpu::parallel_ranges(bags.num_bags(), 64, [&](int64_t b, int64_t e) {
    for (int64_t jb = b; jb < e;) {
      int64_t je = jb + 1;
      while (je < e && bags.off[je] - bags.off[jb] < kSpanIndices) ++je;
      fn(jb, je);
      jb = je;
    }
  });
}

// The bytes of a row that a gather reads: its dim elements (uint8: then
// their scale and bias).
template <class W>
constexpr int64_t row_bytes(int64_t dim) {
  return std::is_same_v<W, uint8_t> ? dim + kInt8RowTail : dim * static_cast<int64_t>(sizeof(W));
}

// Pools bags [jb, je): src[i - off[jb]] is index i's row (nullptr: it has
// none and reads its initial value, from key_of(i)). acc: max dim floats.
template <class W, class O, class KeyOf>
void pool_span(const Rows& R, const Bags& bags, int64_t jb, int64_t je, const W* const* src, KeyOf key_of,
               const float* psw, int64_t pooling, const std::vector<init::Args>& args, uint64_t seed,
               const std::vector<int64_t>& doff, float* acc, O* out) {
  const int64_t base = bags.off[jb], end = bags.off[je], total_d = doff[bags.F];
  // acc += scale * (row of index i); prefetches the row kPrefetchAhead on.
  auto add = [&](int64_t t, int64_t i, float scale) {
    const int64_t D = R.dim[t];
    if (i + kPrefetchAhead < end) prefetch_row(src[i + kPrefetchAhead - base], row_bytes<W>(D));
    if (const W* row = src[i - base]) {
      add_scaled(acc, row, scale, D);
    } else {
      init::fill_row(args[t], seed, key_of(i), D, [&](int64_t d, float v) { acc[d] += scale * v; });
    }
  };
  bags.walk(jb, je, [&](int64_t j, int64_t f, int64_t b) {
    const int64_t t = bags.table[f], D = R.dim[t];
    if (pooling == kNone) {  // one output row per index
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        std::fill_n(acc, D, 0.0f);
        add(t, i, 1.0f);
        for (int64_t d = 0; d < D; ++d) out[i * D + d] = static_cast<O>(acc[d]);
      }
      return;
    }
    const int64_t L = bags.length(j);
    const W* const* rows = src + (bags.off[j] - base);
    const float scale = (pooling == kMean && L > 0) ? 1.0f / static_cast<float>(L) : 1.0f;
    O* o = out + b * total_d + doff[f];
    constexpr bool kRegisterSums = std::is_same_v<W, float> || std::is_same_v<W, uint8_t>;
    if (kRegisterSums && std::none_of(rows, rows + L, [](const W* r) { return r == nullptr; })) {
      // Every row is stored: summed in registers (the same sums as add's),
      // stored straight to a float output with the scale, else to acc.
      if constexpr (kRegisterSums) {
        constexpr bool kDirect = std::is_same_v<O, float>;
        float* dst;
        if constexpr (kDirect) dst = o;
        else dst = acc;
        const float post = kDirect ? scale : 1.0f;
        const float* s = psw ? psw + bags.off[j] : nullptr;
        if constexpr (std::is_same_v<W, float>) sum_rows(dst, rows, s, L, D, end - bags.off[j], post);
        else sum_rows_int8(dst, rows, s, L, D, end - bags.off[j], post);
        if constexpr (kDirect) return;
      }
    } else {
      std::fill_n(acc, D, 0.0f);
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) add(t, i, psw ? psw[i] : 1.0f);
    }
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<O>(acc[d] * scale);
  });
}

}  // namespace embedding
}  // namespace dynamicemb
