// emb_lookup_forward on the CPU: the eval forward in one pass over the
// indices, without dedup (a key's row is read-only in eval): each index is
// hashed, found in its table's scored hash table and gathered into its bag.
// Missing keys read their eval initial value; nothing is inserted and no
// score changes (as table_lookup).
//
// Per span of bags, a three-stage pipeline over blocks of 16 indices resolves
// rows (block k+2 hashed and its digest lines prefetched, block k+1's
// candidate key line prefetched, block k searched), then pool_span gathers
// with its own row prefetch. The rules (hash, bucket, digest, slot scan) are
// table_rules.h's, so the result is table_lookup's.
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "embedding/embedding_cpu.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace embedding {
namespace {

// One physical hash table (a group of logical tables).
struct HashView {
  const int64_t* keys;
  const uint8_t* digests;
  const int64_t* tb;  // logical table l owns buckets [tb[l], tb[l + 1])
  int64_t num_local, cap;
};

std::vector<HashView> check_views(TensorList slot_keys, TensorList slot_digests, TensorList table_buckets,
                                  IntArrayRef bucket_capacity) {
  const size_t G = slot_keys.size();
  TORCH_CHECK(G > 0 && slot_digests.size() == G && table_buckets.size() == G && bucket_capacity.size() == G,
              "dynamicemb: slot_keys, slot_digests, table_buckets and bucket_capacity need one entry per hash table");
  std::vector<HashView> v;
  for (size_t g = 0; g < G; ++g) {
    const int64_t cap = bucket_capacity[g];
    TORCH_CHECK(cap > 0 && cap % table::kGroupSize == 0, "dynamicemb: bucket_capacity must be a positive multiple of ",
                table::kGroupSize, ", got ", cap);
    check_1d(table_buckets[g], at::kLong, "table_buckets");
    TORCH_CHECK(table_buckets[g].numel() >= 2, "dynamicemb: table_buckets must hold num_tables + 1 entries");
    const int64_t* tb = table_buckets[g].data_ptr<int64_t>();
    const int64_t L = table_buckets[g].numel() - 1;
    check_1d(slot_keys[g], at::kLong, "slot_keys");
    check_1d(slot_digests[g], at::kByte, "slot_digests");
    TORCH_CHECK(slot_keys[g].numel() == tb[L] * cap && slot_digests[g].numel() == tb[L] * cap,
                "dynamicemb: hash table ", g, " must hold ", tb[L] * cap, " slots");
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(0 <= tb[l] && tb[l] < tb[l + 1], "dynamicemb: table_buckets of hash table ", g,
                  " must be increasing from 0");
    v.push_back(HashView{slot_keys[g].data_ptr<int64_t>(), slot_digests[g].data_ptr<uint8_t>(), tb, L, cap});
  }
  return v;
}

// Where table t's keys live: hash table group[t], logical table local[t] in it,
// whose slots must map one-to-one onto the rows of weights[t].
void check_placement(const std::vector<HashView>& V, IntArrayRef group, IntArrayRef local, const Rows& R) {
  const int64_t T = static_cast<int64_t>(R.w.size());
  TORCH_CHECK(static_cast<int64_t>(group.size()) == T && static_cast<int64_t>(local.size()) == T,
              "dynamicemb: table_group and table_local need one entry per table (", T, ")");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= group[t] && group[t] < static_cast<int64_t>(V.size()), "dynamicemb: table ", t,
                " maps to hash table ", group[t], ", outside [0, ", V.size(), ")");
    const HashView& h = V[group[t]];
    TORCH_CHECK(0 <= local[t] && local[t] < h.num_local, "dynamicemb: table ", t, " maps to logical table ",
                local[t], " of a hash table with ", h.num_local);
    const int64_t slots = (h.tb[local[t] + 1] - h.tb[local[t]]) * h.cap;
    TORCH_CHECK(R.w[t].size(0) == slots, "dynamicemb: table ", t, " has ", R.w[t].size(0), " rows for ", slots,
                " slots");
  }
}

void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 1); }

// src[i - i0] = the row of index i in [i0, i1) (nullptr: its key is missing);
// tab[i - i0] = its table.
template <class W>
void find_rows(const std::vector<HashView>& V, IntArrayRef group, IntArrayRef local, const std::vector<const W*>& w,
               const Rows& R, const int64_t* keys, const int64_t* tab, int64_t i0, int64_t i1, const W** src) {
  constexpr int64_t B = 16;
  int64_t base[3][B];
  uint8_t dg[3][B];
  int32_t cand[3][B];  // first_digest_match
  const int64_t m = i1 - i0, blocks = (m + B - 1) / B;
  auto size_of = [&](int64_t blk) { return std::min(B, m - blk * B); };
  for (int64_t blk = 0; blk < blocks + 2; ++blk) {
    if (blk < blocks) {  // stage 1: hash, prefetch the bucket's digests
      for (int64_t q = 0; q < size_of(blk); ++q) {
        const int64_t k = blk * B + q, t = tab[k];
        const HashView& h = V[group[t]];
        const int64_t l = local[t];
        const uint64_t hash = table::key_hash(keys[i0 + k]);
        const int64_t b = table::global_bucket(h.tb, l, hash) * h.cap;
        base[blk % 3][q] = b;
        dg[blk % 3][q] = table::digest_of(hash);
        prefetch_line(h.digests + b);
        if (h.cap > 64) prefetch_line(h.digests + b + 64);
      }
    }
    if (blk >= 1 && blk - 1 < blocks) {  // stage 2: prefetch the candidate's key
      const int64_t blk1 = blk - 1;
      for (int64_t q = 0; q < size_of(blk1); ++q) {
        const HashView& h = V[group[tab[blk1 * B + q]]];
        const int64_t b = base[blk1 % 3][q];
        const int c = table::first_digest_match(h.digests + b, static_cast<int>(h.cap), dg[blk1 % 3][q]);
        cand[blk1 % 3][q] = c;
        if (c >= 0) prefetch_line(h.keys + b + c);
      }
    }
    if (blk >= 2) {  // stage 3: the candidate's key (a full search after a false match)
      const int64_t blk2 = blk - 2;
      for (int64_t q = 0; q < size_of(blk2); ++q) {
        const int64_t k = blk2 * B + q, t = tab[k];
        const HashView& h = V[group[t]];
        const int64_t b = base[blk2 % 3][q];
        const int s = table::find_from_candidate(h.digests + b, h.keys + b, static_cast<int>(h.cap),
                                                 dg[blk2 % 3][q], keys[i0 + k], cand[blk2 % 3][q]);
        src[k] = s >= 0 ? w[t] + (b + s - h.tb[local[t]] * h.cap) * R.stride[t] : nullptr;
      }
    }
  }
}

Tensor lookup_forward_cpu(TensorList slot_keys, TensorList slot_digests, TensorList table_buckets,
                          IntArrayRef bucket_capacity, IntArrayRef table_group, IntArrayRef table_local,
                          TensorList weights, const Tensor& indices, const Tensor& offsets, IntArrayRef feature_table,
                          IntArrayRef dims, const std::optional<Tensor>& per_sample_weights, int64_t pooling,
                          const Tensor& init_params, int64_t seed, at::ScalarType output_dtype) {
  const Rows R = check_rows(weights, dims);
  const std::vector<HashView> V = check_views(slot_keys, slot_digests, table_buckets, bucket_capacity);
  check_placement(V, table_group, table_local, R);
  check_1d(indices, at::kLong, "indices");
  const int64_t n = indices.numel();
  const Bags bags = check_bags(n, offsets, feature_table, static_cast<int64_t>(R.w.size()));
  const float* psw = opt_weights(per_sample_weights, n);
  const auto args = init_args(init_params, static_cast<int64_t>(R.w.size()));
  const std::vector<int64_t> doff = feature_columns(R, bags);
  Tensor out = forward_output(R, bags, doff, psw, pooling, output_dtype);
  const int64_t* keys = indices.data_ptr<int64_t>();
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  // Besides float rows, uint8 rows (bag_checks.h), which only this op reads.
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kByte, R.dtype, "dynamicemb_lookup_forward", [&] {
    using W = scalar_t;
    std::vector<const W*> w;
    for (const auto& x : R.w) w.push_back(x.data_ptr<W>());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output_dtype, "dynamicemb_lookup_forward_out", [&] {
      using O = scalar_t;
      O* o = out.data_ptr<O>();
      for_each_span(bags, [&](int64_t jb, int64_t je) {
        thread_local std::vector<const W*> src;
        thread_local std::vector<int64_t> tab;
        thread_local std::vector<float> acc;
        const int64_t i0 = bags.off[jb], i1 = bags.off[je];
        src.resize(i1 - i0);
        tab.resize(i1 - i0);
        acc.resize(max_d);
        for (int64_t j = jb; j < je; ++j)
          std::fill(tab.begin() + (bags.off[j] - i0), tab.begin() + (bags.off[j + 1] - i0),
                    bags.table[bags.feature(j)]);
        find_rows<W>(V, table_group, table_local, w, R, keys, tab.data(), i0, i1, src.data());
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
