// CPU kernels of the embedding layer: unique keys per table, row
// initialisation, gather + pool forward, and the backward that reduces one
// gradient per unique key and applies the optimizer to its row in place.
//
// Rows: table t's values are weights[t], a 2-D [rows, dim_t + state_t] tensor
// in the storage dtype; kernels address them by table-local row (-1: the key
// has no row, its value is its initial value and it gets no update).
// Bags: TBE layout, offsets [F * B + 1], bag j = f * B + b; feature f reads
// table feature_table[f]; pooled output [B, sum_f dim_f], features side by side.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "common/parallel_cpu.h"
#include "embedding/embedding_cpu.h"
#include "embedding/optimizer_rules.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace embedding {
namespace {

// ---- unique ------------------------------------------------------------------------

// (table, key) pairs deduplicated: unique keys and table ids in order of first
// occurrence within each of 64 hash parts (a fixed count: the order does not
// depend on threads), inverse[i] = unique id of index i, counts per unique.
std::tuple<Tensor, Tensor, Tensor, Tensor> unique_cpu(const Tensor& indices, const Tensor& offsets,
                                                      IntArrayRef feature_table, int64_t num_tables) {
  check_1d(indices, at::kLong, "indices");
  const int64_t n = indices.numel();
  const Bags bags = check_bags(n, offsets, feature_table, num_tables);
  const int64_t* key = indices.data_ptr<int64_t>();
  std::vector<int64_t> tid(n);
  std::vector<uint64_t> hash(n);
  at::parallel_for(0, bags.num_bags(), 256, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j) {
      const int64_t t = bags.table[bags.feature(j)];
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        tid[i] = t;
        hash[i] = table::fmix64(static_cast<uint64_t>(key[i]) ^ table::fmix64(static_cast<uint64_t>(t) + 1));
      }
    }
  });
  constexpr int kPartBits = 6;
  const cpu::StablePartition sp(n, n >= 4096 ? (1 << kPartBits) : 1,
                                [&](int64_t i) { return static_cast<int64_t>(hash[i] >> (64 - kPartBits)); });
  Tensor inverse = at::empty({n}, indices.options());
  int64_t* inv = inverse.data_ptr<int64_t>();
  // Per part: first-occurrence positions and counts of its unique pairs. The
  // probe table holds the pair itself, so a probe touches one entry.
  struct Entry {
    int64_t key;
    int32_t tid;
    int32_t id;  // -1: empty
  };
  std::vector<std::vector<int64_t>> first(sp.parts()), count(sp.parts());
  sp.for_each_part([&](int64_t p) {
    const int64_t m = sp.end(p) - sp.begin(p);
    int64_t cap = 16;
    while (cap < 2 * m) cap <<= 1;
    std::vector<Entry> table(cap, Entry{0, 0, -1});
    auto& fp = first[p];
    auto& cp = count[p];
    fp.reserve(m);
    cp.reserve(m);
    for (int64_t j = sp.begin(p); j < sp.end(p); ++j) {
      const int64_t i = sp.pos(j);
      const int64_t k = key[i];
      const int32_t t = static_cast<int32_t>(tid[i]);
      for (uint64_t h = hash[i] & (cap - 1);; h = (h + 1) & (cap - 1)) {
        Entry& e = table[h];
        if (e.id < 0) {
          e = Entry{k, t, static_cast<int32_t>(fp.size())};
          inv[i] = e.id;
          fp.push_back(i);
          cp.push_back(1);
          break;
        }
        if (e.key == k && e.tid == t) {
          inv[i] = e.id;
          ++cp[e.id];
          break;
        }
      }
    }
  });
  std::vector<int64_t> base(sp.parts() + 1, 0);
  for (int64_t p = 0; p < sp.parts(); ++p) base[p + 1] = base[p] + static_cast<int64_t>(first[p].size());
  const int64_t U = base[sp.parts()];
  Tensor ukeys = at::empty({U}, indices.options()), utids = at::empty({U}, indices.options()),
         ucounts = at::empty({U}, indices.options());
  int64_t *uk = ukeys.data_ptr<int64_t>(), *ut = utids.data_ptr<int64_t>(), *uc = ucounts.data_ptr<int64_t>();
  sp.for_each_part([&](int64_t p) {
    for (size_t u = 0; u < first[p].size(); ++u) {
      uk[base[p] + u] = key[first[p][u]];
      ut[base[p] + u] = tid[first[p][u]];
      uc[base[p] + u] = count[p][u];
    }
    for (int64_t j = sp.begin(p); j < sp.end(p); ++j) inv[sp.pos(j)] += base[p];
  });
  return {ukeys, utids, inverse, ucounts};
}

// ---- initial rows ----------------------------------------------------------------------

template <class W>
void init_row(W* row, int64_t dim, int64_t stride, const init::Args& a, uint64_t seed, int64_t key) {
  init::fill_row(a, seed, key, dim, [row](int64_t j, float v) { row[j] = static_cast<W>(v); });
  for (int64_t d = dim; d < stride; ++d) row[d] = static_cast<W>(0.0f);  // fresh optimizer state
}

void init_rows_cpu(TensorList weights, const Tensor& rows, const Tensor& table_ids, const Tensor& keys,
                   IntArrayRef dims, const Tensor& init_params, int64_t seed) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(table_ids, at::kLong, "table_ids");
  check_1d(keys, at::kLong, "keys");
  const int64_t n = rows.numel();
  TORCH_CHECK(table_ids.numel() == n && keys.numel() == n, "dynamicemb: rows, table_ids and keys differ in length");
  const auto args = init_args(init_params, static_cast<int64_t>(R.w.size()));
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* t = table_ids.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_init_rows", [&] {
    std::vector<scalar_t*> w;
    for (const auto& x : R.w) w.push_back(x.data_ptr<scalar_t>());
    at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (r[i] < 0) continue;
        TORCH_CHECK(0 <= t[i] && t[i] < (int64_t)w.size() && r[i] < R.w[t[i]].size(0), "dynamicemb: row ", r[i],
                    " of table ", t[i], " is out of range");
        init_row(w[t[i]] + r[i] * R.stride[t[i]], R.dim[t[i]], R.stride[t[i]], args[t[i]], seed, k[i]);
      }
    });
  });
}

// ---- forward ---------------------------------------------------------------------------

// Indices ahead of use whose rows are prefetched: enough misses in flight to
// cover memory latency without thrashing the line fill buffers.
constexpr int64_t kPrefetchAhead = 48;

template <class W>
void prefetch_row(const W* row, int64_t bytes) {
  if (row == nullptr) return;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, 3);
}

template <class W, class O>
void forward_impl(const Rows& R, const Bags& bags, const int64_t* rows, const int64_t* ukeys, const int64_t* inv,
                  const float* psw, int64_t pooling, const std::vector<init::Args>& args, uint64_t seed,
                  const std::vector<int64_t>& doff, O* out) {
  std::vector<const W*> w;
  for (const auto& x : R.w) w.push_back(x.data_ptr<W>());
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  for_each_span(bags, [&](int64_t jb, int64_t je) {
    // The row of every index of the span (nullptr: none, it reads its initial
    // value), resolved first so that the gather can prefetch ahead of use.
    thread_local std::vector<const W*> src;
    thread_local std::vector<float> acc;
    src.resize(bags.off[je] - bags.off[jb]);
    acc.resize(max_d);
    for (int64_t j = jb; j < je; ++j) {
      const int64_t t = bags.table[bags.feature(j)];
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        const int64_t r = rows[inv[i]];
        src[i - bags.off[jb]] = r >= 0 ? w[t] + r * R.stride[t] : nullptr;
      }
    }
    pool_span<W, O>(R, bags, jb, je, src.data(), [&](int64_t i) { return ukeys[inv[i]]; }, psw, pooling, args, seed,
                    doff, acc.data(), out);
  });
}

Tensor forward_cpu(TensorList weights, const Tensor& rows, const Tensor& unique_keys, const Tensor& inverse,
                   const Tensor& offsets, IntArrayRef feature_table, IntArrayRef dims,
                   const std::optional<Tensor>& per_sample_weights, int64_t pooling, const Tensor& init_params,
                   int64_t seed, at::ScalarType output_dtype) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(unique_keys, at::kLong, "unique_keys");
  check_1d(inverse, at::kLong, "inverse");
  TORCH_CHECK(unique_keys.numel() == rows.numel(), "dynamicemb: rows and unique_keys differ in length");
  const int64_t n = inverse.numel();
  const Bags bags = check_bags(n, offsets, feature_table, static_cast<int64_t>(R.w.size()));
  const float* psw = opt_weights(per_sample_weights, n);
  const auto args = init_args(init_params, static_cast<int64_t>(R.w.size()));
  const std::vector<int64_t> doff = feature_columns(R, bags);
  Tensor out = forward_output(R, bags, doff, psw, pooling, output_dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_forward", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output_dtype, "dynamicemb_forward_out", [&] {
      forward_impl<W, scalar_t>(R, bags, rows.data_ptr<int64_t>(), unique_keys.data_ptr<int64_t>(),
                                inverse.data_ptr<int64_t>(), psw, pooling, args, static_cast<uint64_t>(seed), doff,
                                out.data_ptr<scalar_t>());
    });
  });
  return out;
}

// ---- backward + fused optimizer ------------------------------------------------------------

template <class W>
void update_row(W* row, int64_t D, float* g, int64_t kind, const optim::Params& p, const optim::AdamBias& bias) {
  switch (kind) {
    case optim::kSgd:
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<W>(optim::sgd(static_cast<float>(row[d]), g[d], p));
      break;
    case optim::kAdagrad:
      for (int64_t d = 0; d < D; ++d) {
        float w = row[d], m = row[D + d];
        optim::adagrad(&w, &m, g[d], p);
        row[d] = static_cast<W>(w);
        row[D + d] = static_cast<W>(m);
      }
      break;
    case optim::kRowwiseAdagrad: {
      float sum_sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        g[d] = g[d] + p.weight_decay * static_cast<float>(row[d]);
        sum_sq += g[d] * g[d];
      }
      const float m = optim::rowwise_adagrad_state(static_cast<float>(row[D]), sum_sq, D);
      row[D] = static_cast<W>(m);
      const float mult = optim::rowwise_adagrad_multiplier(m, p);
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<W>(static_cast<float>(row[d]) - mult * g[d]);
      break;
    }
    case optim::kAdam:
      for (int64_t d = 0; d < D; ++d) {
        float w = row[d], m1 = row[D + d], m2 = row[2 * D + d];
        optim::adam(&w, &m1, &m2, g[d], p, bias);
        row[d] = static_cast<W>(w);
        row[D + d] = static_cast<W>(m1);
        row[2 * D + d] = static_cast<W>(m2);
      }
      break;
  }
}

void backward_update_cpu(const Tensor& grad_output, TensorList weights, const Tensor& rows,
                         const Tensor& unique_table_ids, const Tensor& inverse, const Tensor& offsets,
                         IntArrayRef feature_table, IntArrayRef dims, const std::optional<Tensor>& per_sample_weights,
                         int64_t pooling, int64_t optimizer, double lr, double eps, double beta1, double beta2,
                         double weight_decay, int64_t step) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(unique_table_ids, at::kLong, "unique_table_ids");
  check_1d(inverse, at::kLong, "inverse");
  const int64_t U = rows.numel(), n = inverse.numel();
  TORCH_CHECK(unique_table_ids.numel() == U, "dynamicemb: rows and unique_table_ids differ in length");
  const Bags bags = check_bags(n, offsets, feature_table, static_cast<int64_t>(R.w.size()));
  const float* psw = opt_weights(per_sample_weights, n);
  TORCH_CHECK(grad_output.scalar_type() == at::kFloat && grad_output.is_contiguous() && grad_output.dim() == 2,
              "dynamicemb: grad_output must be a contiguous float32 2-D tensor");
  TORCH_CHECK(optimizer >= optim::kSgd && optimizer <= optim::kRowwiseAdagrad, "dynamicemb: unknown optimizer ",
              optimizer);
  for (int64_t t = 0; t < (int64_t)R.w.size(); ++t)
    TORCH_CHECK(R.stride[t] >= R.dim[t] + optim::state_width(optimizer, R.dim[t]), "dynamicemb: table ", t,
                " rows have no room for the optimizer state");
  std::vector<int64_t> doff(bags.F + 1, 0);
  for (int64_t f = 0; f < bags.F; ++f) doff[f + 1] = doff[f] + R.dim[bags.table[f]];
  const int64_t total_d = pooling == kNone ? R.dim[bags.table[0]] : doff[bags.F];
  TORCH_CHECK(grad_output.size(1) == total_d && grad_output.size(0) == (pooling == kNone ? n : bags.B),
              "dynamicemb: grad_output has shape ", grad_output.sizes(), ", the output had another");
  const optim::Params p{static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(beta1),
                        static_cast<float>(beta2), static_cast<float>(weight_decay), step};
  const optim::AdamBias bias = optimizer == optim::kAdam ? optim::adam_bias(p) : optim::AdamBias{1.0f, 1.0f};
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* ut = unique_table_ids.data_ptr<int64_t>();
  const float* grad = grad_output.data_ptr<float>();
  // The occurrences of each unique key, in input order (deterministic sums).
  const cpu::StablePartition occ(n, U, [&](int64_t i) { return inv[i]; });
  // The gradient slice and scale of every index, resolved per bag.
  std::vector<const float*> gsrc(n);
  std::vector<float> gscale(n);
  at::parallel_for(0, bags.num_bags(), 256, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j) {
      const int64_t f = bags.feature(j), L = bags.length(j);
      const float* go = grad + (j % bags.B) * total_d + doff[f];
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        gsrc[i] = pooling == kNone ? grad + i * R.dim[bags.table[f]] : go;
        float scale = psw ? psw[i] : 1.0f;
        if (pooling == kMean) scale /= static_cast<float>(L);
        gscale[i] = scale;
      }
    }
  });
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_backward", [&] {
    std::vector<scalar_t*> w;
    for (const auto& x : R.w) w.push_back(x.data_ptr<scalar_t>());
    at::parallel_for(0, U, 64, [&](int64_t ub, int64_t ue) {
      std::vector<float> g(max_d);
      constexpr int64_t kAhead = 4;  // rows being updated are scattered: fetch ahead
      for (int64_t u = ub; u < ue; ++u) {
        if (u + kAhead < ue && r[u + kAhead] >= 0) {
          const int64_t ta = ut[u + kAhead];
          prefetch_row(w[ta] + r[u + kAhead] * R.stride[ta], R.stride[ta] * static_cast<int64_t>(sizeof(scalar_t)));
        }
        if (r[u] < 0) continue;
        const int64_t t = ut[u], D = R.dim[t];
        std::fill_n(g.data(), D, 0.0f);
        for (int64_t j = (U == 1 ? 0 : occ.begin(u)); j < (U == 1 ? n : occ.end(u)); ++j) {
          const int64_t i = occ.pos(j);
          add_scaled(g.data(), gsrc[i], gscale[i], D);
        }
        update_row(w[t] + r[u] * R.stride[t], D, g.data(), optimizer, p, bias);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("emb_unique", &unique_cpu);
  m.impl("emb_init_rows", &init_rows_cpu);
  m.impl("emb_forward", &forward_cpu);
  m.impl("emb_backward_update", &backward_update_cpu);
}

}  // namespace embedding
}  // namespace dynamicemb
