// emb_lookup_forward on the CPU: the eval forward in one pass over the
// indices, without dedup (a key's row is read-only in eval): each index is
// hashed, found in its table's scored hash table and gathered into its bag.
// Missing keys read their eval initial value; nothing is inserted and no
// score changes (as table_lookup).
//
// Per span of bags, table_lookup's pipeline (find_pipeline_cpu.h) over
// blocks of 16 indices resolves rows (block k+2 hashed and its digest lines
// prefetched, block k+1's candidate key line prefetched, block k searched),
// then pool_span gathers. Each row found is prefetched at once (a span's
// rows, 2048 of them, fit the L2 cache), so its miss overlaps the find's
// misses of later keys rather than waiting for pool_span's own prefetch:
// 7-13% off the int8 program's call on bench_inference's tables, warm or
// after a cache flush (in-process A/B, 2 cores). The find is TableRef's,
// so the result is table_lookup's. A row with a hot copy (hot_rows.h) is
// read there.
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "embedding/embedding_cpu.h"
#include "embedding/lookup_tables.h"
#include "table/find_pipeline_cpu.h"

namespace dynamicemb {
namespace embedding {
namespace {

constexpr int64_t kFindBlock = 16;  // indices per pipeline stage

// find_pipelined's keys: index i0 + k of table tab[k] (embedding_cpu.h's
// table numbering), found in its hash table; found(k, slot) sets src[k] to
// its row of weights (nullptr: its key is missing) and prefetches the row.
template <class W>
struct ForwardKeys {
  const table::TableRef* refs;  // per hash table
  const TablePlace* place;      // per table
  const RowParts* rows;  // per table
  const HotRows* hot;  // per table
  const int64_t* keys;  // from i0
  const int64_t* tab;
  const int64_t* bytes;  // per table: a row's bytes
  const W** src;
  static constexpr bool kAfter = false;
  int64_t table(int64_t k) const { return place[tab[k]].local; }
  const table::TableRef& ref(int64_t k) const { return refs[place[tab[k]].group]; }
  int64_t key(int64_t k) const { return keys[k]; }
  void found(int64_t k, int64_t slot) const {
    const int64_t t = tab[k];
    src[k] = slot >= 0 ? resolve_row<W>(rows[t], hot[t], ref(k).row(slot, place[t].local)) : nullptr;
    prefetch_row(src[k], bytes[t]);
  }
  void after(int64_t) const {}
};

Tensor lookup_forward_cpu(TensorList slot_keys, TensorList slot_digests, TensorList table_buckets,
                          IntArrayRef bucket_capacity, IntArrayRef table_group, IntArrayRef table_local,
                          TensorList weights, const Tensor& indices, const Tensor& offsets, IntArrayRef feature_table,
                          IntArrayRef dims, const std::optional<Tensor>& per_sample_weights, int64_t pooling,
                          const Tensor& init_params, int64_t seed, at::ScalarType output_dtype,
                          const std::optional<TensorList>& hot_weights, const std::optional<TensorList>& hot_pos) {
  const Rows R = check_rows(weights, dims);
  const std::vector<HotRows> hot = check_hot_rows(hot_weights, hot_pos, R.parts, R.dtype, at::Device(at::kCPU));
  const LookupTables H = check_lookup_tables(
      slot_keys, slot_digests, table_buckets, bucket_capacity, table_group, table_local, R.parts,
      at::Device(at::kCPU), [&](size_t g) {
        const int64_t* tb = table_buckets[g].data_ptr<int64_t>();
        return std::vector<int64_t>(tb, tb + table_buckets[g].numel());
      });
  check_1d(indices, at::kLong, "indices");
  const int64_t n = indices.numel();
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables());
  const float* psw = opt_weights(per_sample_weights, n);
  const auto args = init_args(init_params, R.num_tables());
  const std::vector<int64_t> doff = feature_columns(R, bags);
  Tensor out = forward_output(R, bags, doff, psw, pooling, output_dtype);
  const int64_t* keys = indices.data_ptr<int64_t>();
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  std::vector<int64_t> bytes(R.num_tables());
  // Besides float rows, uint8 rows (bag_checks.h), which only this op reads.
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kByte, R.dtype, "dynamicemb_lookup_forward", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output_dtype, "dynamicemb_lookup_forward_out", [&] {
      using O = scalar_t;
      O* o = out.data_ptr<O>();
      for (int64_t t = 0; t < R.num_tables(); ++t) bytes[t] = row_bytes<W>(R.dim[t]);
      for_each_span(bags, [&](int64_t jb, int64_t je) {
        thread_local std::vector<const W*> src;
        thread_local std::vector<int64_t> tab;
        thread_local std::vector<float> acc;
        const int64_t i0 = bags.off[jb], i1 = bags.off[je];
        src.resize(i1 - i0);
        tab.resize(i1 - i0);
        acc.resize(max_d);
        bags.walk(jb, je, [&](int64_t j, int64_t f, int64_t) {
          std::fill(tab.begin() + (bags.off[j] - i0), tab.begin() + (bags.off[j + 1] - i0), bags.table[f]);
        });
        const ForwardKeys<W> span{H.refs.data(), H.place.data(), R.parts.data(), hot.data(), keys + i0, tab.data(),
                                  bytes.data(), src.data()};
        table::find_pipelined<kFindBlock>(0, i1 - i0, span);
        pool_span<W, O>(R, bags, jb, je, src.data(), [&](int64_t i) { return keys[i]; }, psw, pooling, args,
                        static_cast<uint64_t>(seed), doff, acc.data(), o);
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) { m.impl("emb_lookup_forward", &lookup_forward_cpu); }

}  // namespace embedding
}  // namespace dynamicemb
