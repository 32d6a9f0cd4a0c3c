// CPU kernels of the table ops that find keys: table_lookup (with or without
// a gather of value rows), table_lookup_refresh, table_refresh (at known
// slots), table_erase and table_take. See table_cpu.h for the ordering
// contract: only lookup_refresh needs the keys of a bucket in input order.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <tuple>

#include "table/table_cpu.h"

namespace dynamicemb {
namespace table {
namespace cpu_impl {
namespace {

// ---- lookup (read-only), with or without a gather of value rows -----------------

constexpr int64_t kLookupBlock = 32;  // keys per pipeline stage (find_pipelined)

// What a lookup copies per found key: nothing, or its row of a values tensor
// (fetched when the key is found, copied a pipeline stage later).
struct NoRows {
  void fetch(int64_t) const {}
  void copy(int64_t, int64_t) const {}
  static constexpr bool kCopies = false;
};

struct CopyRows {
  const char* src;
  char* dst;
  int64_t bytes;
  static constexpr bool kCopies = true;
  void fetch(int64_t slot) const {
    for (int64_t l = 0; l < bytes; l += 64) prefetch(src + slot * bytes + l);
  }
  void copy(int64_t i, int64_t slot) const {
    if (slot >= 0) std::memcpy(dst + i * bytes, src + slot * bytes, bytes);
    else std::memset(dst + i * bytes, 0, bytes);
  }
};

// The checked inputs and new outputs of a read-only lookup: key i's slot
// (-1 where missing) and whether it was found.
struct LookupCall {
  TableRef ref;
  const int64_t* keys;
  const int64_t* tids;  // null: every key in table 0
  Tensor indices, found;
  int64_t n;
};

LookupCall prepare_lookup(at::ArrayRef<Tensor> table, int64_t bucket_capacity, const Tensor& keys,
                          const std::optional<Tensor>& table_ids, unsigned used = kFindMembers) {
  const TableRef r = make_ref(table, bucket_capacity, used);
  const int64_t n = check_keys(keys, table_ids, std::nullopt, cpu_device());
  return {r, keys.data_ptr<int64_t>(), opt_ptr(table_ids), new_tensor(n, at::kLong), new_tensor(n, at::kBool), n};
}

// find_pipelined's keys for one table: key i of table tids[i].
template <class Rows>
struct TableKeys {
  TableRef r;
  const int64_t* keys;
  const int64_t* tids;
  int64_t* out;
  bool* fnd;
  std::atomic<int64_t>* bad;  // a key position with a bad table id
  Rows rows;
  static constexpr bool kAfter = Rows::kCopies;
  int64_t table(int64_t i) const {
    const int64_t t = tids ? tids[i] : 0;
    if (r.has_table(t)) return t;
    cpu::keep_first(*bad, i);
    return -1;
  }
  const TableRef& ref(int64_t) const { return r; }
  int64_t key(int64_t i) const { return keys[i]; }
  void found(int64_t i, int64_t slot) const {
    out[i] = slot;
    fnd[i] = slot >= 0;
    if (slot >= 0) rows.fetch(slot);
  }
  void after(int64_t i) const { rows.copy(i, out[i]); }
};

// Every key's slot (and row, with CopyRows), keys in parallel; raises a bad
// table id.
template <class Rows = NoRows>
void lookup_all(const LookupCall& c, const Rows& rows = {}) {
  std::atomic<int64_t> bad{-1};
  const TableKeys<Rows> keys{c.ref, c.keys, c.tids, c.indices.data_ptr<int64_t>(), c.found.data_ptr<bool>(), &bad,
                             rows};
  cpu::parallel_ranges(c.n, 2048, [&](int64_t b, int64_t e) { find_pipelined<kLookupBlock>(b, e, keys); });
  check_table_ids(bad.load(), c.tids, c.ref);
}

std::tuple<Tensor, Tensor> lookup(at::ArrayRef<Tensor> table, const Tensor& keys,
                                  const std::optional<Tensor>& table_ids, int64_t bucket_capacity) {
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids);
  lookup_all(c);
  return {c.indices, c.found};
}

// lookup + copy of each key's row of `values` into `out` (zeros where missing).
std::tuple<Tensor, Tensor> lookup_gather(at::ArrayRef<Tensor> table, const Tensor& keys,
                                         const std::optional<Tensor>& table_ids, int64_t bucket_capacity,
                                         const Tensor& values, const Tensor& out) {
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids);
  const int64_t bytes = check_gather(values, out, c.n, c.ref.num_buckets * c.ref.bucket_capacity, cpu_device());
  lookup_all(c, CopyRows{static_cast<const char*>(values.const_data_ptr()), static_cast<char*>(out.data_ptr()), bytes});
  return {c.indices, c.found};
}

// ---- lookup that refreshes scores --------------------------------------------------

std::tuple<Tensor, Tensor> lookup_refresh(at::ArrayRef<Tensor> table, const Tensor& keys,
                                          const std::optional<Tensor>& table_ids,
                                          const std::optional<Tensor>& key_scores, int64_t strategy,
                                          int64_t bucket_capacity, int64_t call_score) {
  check_strategy(strategy);
  const TableRef ref =
      make_ref(table, bucket_capacity, with_timestamps(kRefreshMembers, strategy));
  const int64_t n = check_keys(keys, table_ids, key_scores, cpu_device());
  Tensor indices = new_tensor(n, at::kLong);
  Tensor found = new_tensor(n, at::kBool);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* ks = opt_ptr(key_scores);
  int64_t* out = indices.data_ptr<int64_t>();
  bool* fnd = found.data_ptr<bool>();
  const Scoring scoring = Scoring::of(strategy, call_score);
  struct Rec {
    int64_t key, score, bucket;  // the walk sets bucket to the slot, -1 if missing
    uint8_t digest;
  };
  const BucketOf where{k, opt_ptr(table_ids), ref};
  BucketBatch<Rec> bb = batch_by_bucket<Rec>(where, n, [k, ks, scoring](int64_t i, uint8_t d, Rec& r) {
    r.key = k[i];
    r.score = scoring.key_score(ks, i);
    r.digest = d;
  });
  bb.for_each_part([&](const Runs<Rec>& part) {
    walk_runs(
        part, ref,
        [&](const Runs<Rec>& runs, int64_t run, int64_t base, const TableRef& R) {
          Rec* rs = runs.begin(run);
          for (int64_t q = 0; q < runs.len(run); ++q) {
            const int64_t slot = R.find(Probe{base, rs[q].digest}, rs[q].key);
            rs[q].bucket = slot;
            if (slot >= 0) R.refresh(slot, scoring, rs[q].score);
          }
        },
        WrittenAtMatch{ref.scores, nullptr, ref.timestamps});
  });
  bb.scatter(where, [out, fnd](int64_t i, const Rec& r) {  // by value: see BucketBatch::each_record
    out[i] = r.bucket;
    fnd[i] = r.bucket >= 0;
  });
  return {indices, found};
}

// ---- refresh at known slots ----------------------------------------------------------

// An access of the keys at distinct slots `indices` (-1: none), found
// earlier: scores as lookup_refresh sets them, without finding the keys again.
void refresh(at::ArrayRef<Tensor> table, const Tensor& indices, const std::optional<Tensor>& key_scores,
             int64_t strategy, int64_t call_score) {
  const TableRef ref = refresh_ref(table, indices, key_scores, strategy);
  const int64_t n = indices.numel(), slots = table[kSlotScores].numel();
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* ks = opt_ptr(key_scores);
  const Scoring scoring = Scoring::of(strategy, call_score);
  std::atomic<int64_t> bad{-1};
  cpu::parallel_ranges(n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = idx[i];
      if (s < -1 || s >= slots) {
        cpu::keep_first(bad, i);
        continue;
      }
      if (s >= 0) ref.refresh(s, scoring, scoring.key_score(ks, i));
    }
  });
  const int64_t i = bad.load();
  TORCH_CHECK(i < 0, "dynamicemb: slot index ", i >= 0 ? idx[i] : 0, " (position ", i, ") is out of range [-1, ",
              slots, ")");
}

// ---- erase, take -----------------------------------------------------------------------

// A lookup (the parallel pipeline: no key's result depends on another's),
// then the found slots erased in input order: a key repeated in the input is
// erased (and reported) at its first occurrence only; on(i, slot) for each
// key erased, in input order. The bucket batches that inserts need (keys of a
// bucket in input order) cost about twice as much per key, and an erase
// writes only the slots the lookup found. `ahead`(slot): lines the caller
// reads at a slot, fetched with its digest.
template <class OnErased, class Ahead>
void erase_found(const LookupCall& c, OnErased on, Ahead ahead) {
  lookup_all(c);
  const TableRef ref = c.ref;
  const int64_t* slot = c.indices.data_ptr<int64_t>();
  const int64_t* tids = c.tids;
  constexpr int64_t kAhead = 16;  // a large call's digests left the caches since its lookup
  for (int64_t i = 0; i < c.n; ++i) {
    if (i + kAhead < c.n && slot[i + kAhead] >= 0) {
      prefetch_write(ref.digests + slot[i + kAhead]);
      ahead(slot[i + kAhead]);
    }
    const int64_t s = slot[i];
    if (s >= 0 && ref.erase(s)) {
      ref.tally_erase(tids ? tids[i] : 0, 1, PlainAdd{});
      on(i, s);
    }
  }
}

Tensor erase(at::ArrayRef<Tensor> table, const Tensor& keys, const std::optional<Tensor>& table_ids,
             int64_t bucket_capacity) {
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids, kEraseMembers);
  Tensor erased = new_tensor(c.n, at::kBool);
  bool* er = erased.data_ptr<bool>();
  std::memset(er, 0, c.n);
  erase_found(c, [er](int64_t i, int64_t) { er[i] = true; }, [](int64_t) {});
  return erased;
}

// erase, returning what the erased keys held: their positions in keys
// (ascending), and their slots' entries of slot_values and the scores (a
// backing store's key index taking keys out: one lookup instead of a lookup
// for the entries and another for the erase).
std::tuple<Tensor, Tensor, Tensor> take(at::ArrayRef<Tensor> table, const Tensor& keys,
                                        const std::optional<Tensor>& table_ids, int64_t bucket_capacity,
                                        const Tensor& slot_values) {
  const LookupCall c = prepare_lookup(table, bucket_capacity, keys, table_ids, kEraseMembers | member_bit(kSlotScores));
  check_slots(slot_values, at::kLong, "slot_values", c.ref);
  Tensor at_ = new_tensor(c.n, at::kLong), values = new_tensor(c.n, at::kLong), scores = new_tensor(c.n, at::kLong);
  int64_t *ap = at_.data_ptr<int64_t>(), *vp = values.data_ptr<int64_t>(), *sp = scores.data_ptr<int64_t>();
  const int64_t *sv = slot_values.data_ptr<int64_t>(), *ss = c.ref.scores;
  int64_t m = 0;
  erase_found(
      c,
      [&](int64_t i, int64_t s) {
        ap[m] = i;
        vp[m] = sv[s];
        sp[m++] = ss[s];
      },
      [sv, ss](int64_t s) {
        prefetch(sv + s);
        prefetch(ss + s);
      });
  return {at_.narrow(0, 0, m), values.narrow(0, 0, m), scores.narrow(0, 0, m)};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("table_lookup", &lookup);
  m.impl("table_lookup_gather", &lookup_gather);
  m.impl("table_lookup_refresh", &lookup_refresh);
  m.impl("table_refresh", &refresh);
  m.impl("table_erase", &erase);
  m.impl("table_take", &take);
}

}  // namespace cpu_impl
}  // namespace table
}  // namespace dynamicemb
