// CPU kernels of the scored hash table. The table rules (hash, digest, score
// update, slot scan, victim choice) live in table_rules.h; this file only
// spreads keys over threads.
//
// Ordering contract (API.md §6): a call's result equals processing its keys
// one at a time in input order. Mutating calls therefore run buckets in
// parallel and the keys of one bucket in input order (see BucketBatch);
// lookups without score refresh read only and run keys freely in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "common/huge_pages_cpu.h"
#include "common/parallel_cpu.h"
#include "table/bucket_batch_cpu.h"
#include "table/bucket_scan_cpu.h"
#include "table/table_checks.h"
#include "table/table_rules.h"
#include "table/victims_cpu.h"

namespace dynamicemb {
namespace table {
namespace {

using at::Tensor;

constexpr int64_t kSerialBelow = 4096;  // keys; smaller calls run on one thread

void prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }
void prefetch_write(const void* p) { __builtin_prefetch(p, 1, 1); }

// ---- validation --------------------------------------------------------------

const at::Device kCpu(at::kCPU);

void check_tensor(const Tensor& t, at::ScalarType dtype, const char* name) {
  table::check_tensor(t, dtype, name, kCpu);
}

// The table layout: table t owns buckets [tb[t], tb[t+1]).
struct Layout {
  const int64_t* tb;
  int64_t num_tables;
  int64_t cap;  // slots per bucket
  int64_t num_buckets() const { return tb[num_tables]; }
  int64_t num_slots() const { return num_buckets() * cap; }
};

Layout make_layout(const Tensor& table_buckets, int64_t bucket_capacity) {
  check_tensor(table_buckets, at::kLong, "table_buckets");
  TORCH_CHECK(table_buckets.dim() == 1 && table_buckets.numel() >= 2,
              "dynamicemb: table_buckets must be 1-D with num_tables + 1 entries");
  TORCH_CHECK(bucket_capacity > 0 && bucket_capacity % kGroupSize == 0,
              "dynamicemb: bucket_capacity must be a positive multiple of ", kGroupSize, ", got ",
              bucket_capacity);
  const int64_t* tb = table_buckets.data_ptr<int64_t>();
  const int64_t T = table_buckets.numel() - 1;
  // Table t owns buckets [tb[t], tb[t+1]): keys are placed without bounds
  // checks, so every table must own at least one bucket from 0 on.
  TORCH_CHECK(tb[0] == 0, "dynamicemb: table_buckets must start at 0, got ", tb[0]);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(tb[t + 1] > tb[t], "dynamicemb: table ", t, " owns no bucket (table_buckets must increase)");
  return Layout{tb, T, bucket_capacity};
}

void check_slots(const Tensor& t, at::ScalarType dtype, const char* name, const Layout& L) {
  check_tensor(t, dtype, name);
  TORCH_CHECK(t.dim() == 1 && t.numel() == L.num_slots(), "dynamicemb: ", name, " must hold ",
              L.num_slots(), " slots, got shape ", t.sizes());
}

const int64_t* opt_ptr(const std::optional<Tensor>& t) {
  return t ? t->data_ptr<int64_t>() : nullptr;
}

// ---- key placement -------------------------------------------------------------

// Global bucket of key i, or -1 for a bad table id.
struct BucketOf {  // held by value in the per-key loops (see BucketBatch::each_record)
  const int64_t* keys;
  const int64_t* tids;
  Layout L;
  int64_t table(int64_t i) const { return tids ? tids[i] : 0; }
  int64_t operator()(int64_t i) const {
    const int64_t t = table(i);
    return t < 0 || t >= L.num_tables ? -1 : global_bucket(L.tb, t, key_hash(keys[i]));
  }
};

// A mutating call's keys regrouped by bucket (bucket_batch_cpu.h), with the
// table ids checked before any slot is touched; fill(i, digest, rec) writes
// the rest of key i's record (its bucket is set).
template <class Rec, class Fill>
BucketBatch<Rec> batch_by_bucket(const BucketOf& where, int64_t n, Fill fill) {
  BucketBatch<Rec> bb(n, where.L.num_buckets(), kSerialBelow, where);
  const int64_t i = bb.bad_position();
  TORCH_CHECK(i < 0, "dynamicemb: table id ", where.tids ? where.tids[std::max<int64_t>(i, 0)] : 0,
              " (key position ", i, ") is out of range [0, ", where.L.num_tables, ")");
  bb.gather([where, fill](int64_t i, Rec& r) {
    const uint64_t h = key_hash(where.keys[i]);
    r.bucket = global_bucket(where.L.tb, where.table(i), h);
    fill(i, digest_of(h), r);
  });
  return bb;
}

// Fetches every cache line of a[0 .. n), for writing with kWrite.
template <bool kWrite = false, class T>
void prefetch_range(const T* a, int64_t n) {
  constexpr uintptr_t kLineBytes = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(a + n);
  for (uintptr_t l = reinterpret_cast<uintptr_t>(a) & ~(kLineBytes - 1); l < end; l += kLineBytes)
    __builtin_prefetch(reinterpret_cast<const void*>(l), kWrite, 1);
}

// Prefetches the digests of the bucket at slot `base` (both lines for 128 slots).
void prefetch_bucket(const uint8_t* digests, int64_t base, int64_t cap) {
  prefetch(digests + base);
  if (cap > 64) prefetch(digests + base + 64);
}

// The per-slot arrays a call writes at the slot a key is found in (nullptr:
// not written), fetched for writing with the key's line.
struct WrittenAtMatch {
  const int64_t* scores = nullptr;
  const Epoch* epochs = nullptr;
  const int64_t* timestamps = nullptr;
};

// Walks one part's runs in bucket order: fn(runs, r, base) for each run
// (base: the first slot of its bucket), so that fn may look at later runs.
// Prefetches per key, at two distances: its bucket's digests and, once they
// are in, the lines of the slot its digest first matches (the key's, and
// those of `written`); and each run's digests three runs ahead.
template <class Rec, class RunFn>
void walk_runs(const Runs<Rec>& runs, const uint8_t* sd, const int64_t* sk, int64_t cap, RunFn fn,
               const WrittenAtMatch& written = {}) {
  const Rec* recs = runs.recs;
  const int64_t m = runs.start[runs.count];
  constexpr int64_t kDigestAhead = 16, kKeyAhead = 6;
  auto ahead = [&](int64_t q) {
    if (q + kDigestAhead < m) prefetch_bucket(sd, recs[q + kDigestAhead].bucket * cap, cap);
    if (q + kKeyAhead < m) {
      const Rec& r = recs[q + kKeyAhead];
      const int c = first_digest_match(sd + r.bucket * cap, static_cast<int>(cap), r.digest);
      if (c >= 0) {
        const int64_t slot = r.bucket * cap + c;
        prefetch(sk + slot);
        if (written.scores) prefetch_write(written.scores + slot);
        if (written.epochs) prefetch_write(written.epochs + slot);
        if (written.timestamps) prefetch_write(written.timestamps + slot);
      }
    }
  };
  for (int64_t q = 0; q < std::min(m, kDigestAhead); ++q) prefetch_bucket(sd, recs[q].bucket * cap, cap);
  for (int64_t r = 0; r < runs.count; ++r) {
    // Digests also three runs ahead, for fn's look at the next two runs.
    if (r + 3 < runs.count) prefetch_bucket(sd, runs.bucket(r + 3) * cap, cap);
    for (int64_t q = runs.start[r]; q < runs.start[r + 1]; ++q) ahead(q);
    fn(runs, r, runs.bucket(r) * cap);
  }
}

// Walks a batch's records in bucket order and finds each key:
// fn(rec, base, slot in the bucket or -1).
template <class Rec, class Fn>
void find_each(BucketBatch<Rec>& bb, const uint8_t* sd, const int64_t* sk, int64_t cap, Fn fn,
               const WrittenAtMatch& written = {}) {
  bb.for_each_part([&](const Runs<Rec>& part) {
    walk_runs(
        part, sd, sk, cap,
        [&](const Runs<Rec>& runs, int64_t run, int64_t base) {
          Rec* rs = runs.begin(run);
          for (int64_t q = 0; q < runs.len(run); ++q)
            fn(rs[q], base, find_in_bucket<false>(sd + base, sk + base, cap, rs[q].digest, rs[q].key, nullptr));
        },
        written);
  });
}

// Per-table counts of the classes cls(i) in [0, K) (negative: not counted).
template <class Cls>
std::vector<int64_t> tally_by_table(int64_t n, const int64_t* tids, int64_t T, int K, Cls cls) {
  return cpu::tally(n, T, K, [&](int64_t i) { return tids ? tids[i] : 0; }, cls);
}

using cpu::compact;

Tensor new_tensor(int64_t n, at::ScalarType dtype) {
  return at::empty({n}, at::TensorOptions().dtype(dtype));
}

// True when the bucket at `digests` has no kEmpty or kErased slot.
bool bucket_full(const uint8_t* digests, int cap) {
  for (int g = 0; g < cap; g += kGroupSize)
    if (group_free(digests + g)) return false;
  return true;
}

}  // namespace
}  // namespace table
}  // namespace dynamicemb

namespace dynamicemb {
namespace table {
namespace {

// ---- lookup (read-only), with or without a gather of value rows -------------------

// What a read-only lookup reads and writes.
struct LookupView {
  Layout L;
  const int64_t* keys;
  const int64_t* tids;  // null: every key in table 0
  const int64_t* sk;
  const uint8_t* sd;
  int64_t* out;  // slot index per key, -1 where missing
  bool* found;
};

constexpr int64_t kLookupBlock = 32;  // keys per pipeline stage

// A software pipeline over blocks of kLookupBlock keys, so that the cache
// misses of one key overlap with other keys' work: at step t, stage s works
// on block t - s and touches only lines that stage s - 1 prefetched a step
// earlier.
//   0 place:  hash, bucket, digest; prefetch the bucket's digests
//   1 probe:  scan the digests; prefetch the first candidate's key
//   2 find:   compare the candidate's key (a full search only after a
//             digest's false match) -> slot index
//   3 rows:   (lookup_gather) copy each key's row, prefetched by stage 2
// Returns a key position with a bad table id, or -1.
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

template <class Rows = NoRows>
int64_t lookup_pipeline(const LookupView& view, int64_t n, const Rows& copier = {}) {
  constexpr int kStages = 3;
  constexpr int64_t B = kLookupBlock;
  std::atomic<int64_t> bad{-1};
  cpu::parallel_ranges(n, 2048, [&](int64_t b, int64_t e) {
    // Local copies: the digest bytes stored below may alias anything read
    // through a reference, which made every key reload the view's pointers.
    const LookupView v = view;
    const Rows rows = copier;
    int64_t base[kStages][B];  // bucket's first slot, -1 for a bad table id
    uint8_t dg[kStages][B];
    int32_t cand[kStages][B];  // first_digest_match
    const int64_t blocks = (e - b + B - 1) / B;
    auto first = [&](int64_t blk) { return b + blk * B; };
    auto size = [&](int64_t blk) { return std::min(B, e - first(blk)); };
    auto place = [&](int64_t blk) {
      int64_t* bs = base[blk % kStages];
      uint8_t* ds = dg[blk % kStages];
      for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) {
        const int64_t t = v.tids ? v.tids[i] : 0;
        if (t < 0 || t >= v.L.num_tables) {
          bad.store(i, std::memory_order_relaxed);
          bs[j] = -1;
          continue;
        }
        const uint64_t h = key_hash(v.keys[i]);
        bs[j] = global_bucket(v.L.tb, t, h) * v.L.cap;
        ds[j] = digest_of(h);
        prefetch_bucket(v.sd, bs[j], v.L.cap);
      }
    };
    auto probe = [&](int64_t blk) {
      const int64_t* bs = base[blk % kStages];
      const uint8_t* ds = dg[blk % kStages];
      int32_t* cs = cand[blk % kStages];
      for (int64_t j = 0; j < size(blk); ++j) {
        if (bs[j] < 0) continue;
        const int c = first_digest_match(v.sd + bs[j], v.L.cap, ds[j]);
        cs[j] = c;
        if (c >= 0) prefetch(v.sk + bs[j] + c);
      }
    };
    auto find = [&](int64_t blk) {
      const int64_t* bs = base[blk % kStages];
      const uint8_t* ds = dg[blk % kStages];
      const int32_t* cs = cand[blk % kStages];
      for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) {
        const int s = bs[j] < 0 ? -1
                                : find_from_candidate(v.sd + bs[j], v.sk + bs[j], v.L.cap, ds[j], v.keys[i],
                                                      cs[j]);
        v.out[i] = s >= 0 ? bs[j] + s : -1;
        v.found[i] = s >= 0;
        if (s >= 0) rows.fetch(bs[j] + s);
      }
    };
    auto copy = [&](int64_t blk) {
      for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) rows.copy(i, v.out[i]);
    };
    auto live = [&](int64_t blk) { return blk >= 0 && blk < blocks; };
    for (int64_t t = 0; t < blocks + kStages; ++t) {
      if (live(t)) place(t);
      if (live(t - 1)) probe(t - 1);
      if (live(t - 2)) find(t - 2);
      if (Rows::kCopies && live(t - 3)) copy(t - 3);
    }
  });
  return bad.load();
}

void check_table_ids(int64_t bad, const int64_t* tids, const Layout& L) {
  TORCH_CHECK(bad < 0, "dynamicemb: table id ", bad >= 0 ? tids[bad] : 0, " (key position ", bad,
              ") is out of range [0, ", L.num_tables, ")");
}

// The checked inputs and new outputs of a read-only lookup.
struct LookupCall {
  LookupView view;
  Tensor indices, found;
};

LookupCall prepare_lookup(const Tensor& slot_keys, const Tensor& slot_digests,
                          const Tensor& table_buckets, const Tensor& keys,
                          const std::optional<Tensor>& table_ids, int64_t bucket_capacity) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  const int64_t n = check_keys(keys, table_ids, std::nullopt, kCpu);
  Tensor indices = new_tensor(n, at::kLong);
  Tensor found = new_tensor(n, at::kBool);
  const LookupView v{L,
                     keys.data_ptr<int64_t>(),
                     opt_ptr(table_ids),
                     slot_keys.data_ptr<int64_t>(),
                     slot_digests.data_ptr<uint8_t>(),
                     indices.data_ptr<int64_t>(),
                     found.data_ptr<bool>()};
  return {v, indices, found};
}

std::tuple<Tensor, Tensor> lookup_cpu(const Tensor& slot_keys, const Tensor& slot_digests,
                                      const Tensor& table_buckets, const Tensor& keys,
                                      const std::optional<Tensor>& table_ids,
                                      int64_t bucket_capacity) {
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  check_table_ids(lookup_pipeline(c.view, keys.numel()), c.view.tids, c.view.L);
  return {c.indices, c.found};
}

// lookup + copy of each key's row of `values` into `out` (zeros where missing).
std::tuple<Tensor, Tensor> lookup_gather_cpu(const Tensor& slot_keys, const Tensor& slot_digests,
                                             const Tensor& table_buckets, const Tensor& keys,
                                             const std::optional<Tensor>& table_ids,
                                             int64_t bucket_capacity, const Tensor& values,
                                             const Tensor& out) {
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  const int64_t bytes = check_gather(values, out, keys.numel(), c.view.L.num_slots(), kCpu);
  const CopyRows rows{static_cast<const char*>(values.const_data_ptr()), static_cast<char*>(out.data_ptr()), bytes};
  check_table_ids(lookup_pipeline(c.view, keys.numel(), rows), c.view.tids, c.view.L);
  return {c.indices, c.found};
}

// ---- lookup that refreshes scores ------------------------------------------------

std::tuple<Tensor, Tensor> lookup_refresh_cpu(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& table_buckets, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score) {
  check_strategy(strategy);
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  if (keeps_timestamps(strategy)) check_slots(slot_timestamps, at::kLong, "slot_timestamps", L);
  const int64_t n = check_keys(keys, table_ids, key_scores, kCpu);
  Tensor indices = new_tensor(n, at::kLong);
  Tensor found = new_tensor(n, at::kBool);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* ks = opt_ptr(key_scores);
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* sc = slot_scores.data_ptr<int64_t>();
  int64_t* ts = keeps_timestamps(strategy) ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  int64_t* out = indices.data_ptr<int64_t>();
  bool* fnd = found.data_ptr<bool>();
  const int64_t dflt = default_key_score(strategy, call_score);
  struct Rec {
    int64_t key, score, bucket;  // the walk sets bucket to the slot, -1 if missing
    uint8_t digest;
  };
  const BucketOf where{k, opt_ptr(table_ids), L};
  BucketBatch<Rec> bb = batch_by_bucket<Rec>(where, n, [k, ks, dflt](int64_t i, uint8_t d, Rec& r) {
    r.key = k[i];
    r.score = ks ? ks[i] : dflt;
    r.digest = d;
  });
  find_each(
      bb, sd, sk, L.cap,
      [&](Rec& r, int64_t base, int s) {
        r.bucket = s >= 0 ? base + s : -1;
        if (s >= 0) refresh_slot(strategy, sc, ts, base + s, call_score, r.score);
      },
      WrittenAtMatch{sc, nullptr, ts});
  bb.scatter(where, [out, fnd](int64_t i, const Rec& r) {  // by value: see BucketBatch::each_record
    out[i] = r.bucket;
    fnd[i] = r.bucket >= 0;
  });
  return {indices, found};
}

// ---- refresh at known slots ------------------------------------------------------

// An access of the keys at distinct slots `indices` (-1: none), found
// earlier: scores as lookup_refresh sets them, without finding the keys again.
void refresh_cpu(const Tensor& slot_scores, const Tensor& slot_timestamps, const Tensor& indices,
                 const std::optional<Tensor>& key_scores, int64_t strategy, int64_t call_score) {
  check_strategy(strategy);
  const bool with_ts = keeps_timestamps(strategy);
  const int64_t n = check_refresh(slot_scores, slot_timestamps, indices, key_scores, with_ts);
  const int64_t slots = slot_scores.numel();
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* ks = opt_ptr(key_scores);
  int64_t* sc = slot_scores.data_ptr<int64_t>();
  int64_t* ts = with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  const int64_t dflt = default_key_score(strategy, call_score);
  std::atomic<int64_t> bad{-1};
  cpu::parallel_ranges(n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = idx[i];
      if (s < -1 || s >= slots) {
        bad.store(i, std::memory_order_relaxed);
        continue;
      }
      if (s >= 0) refresh_slot(strategy, sc, ts, s, call_score, ks ? ks[i] : dflt);
    }
  });
  const int64_t i = bad.load();
  TORCH_CHECK(i < 0, "dynamicemb: slot index ", i >= 0 ? idx[i] : 0, " (position ", i, ") is out of range [-1, ",
              slots, ")");
}

// ---- insert ----------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> insert_cpu(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& slot_epochs, const Tensor& table_buckets,
    const Tensor& sizes, const Tensor& counters, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score, int64_t epoch,
    const std::optional<Tensor>& evictable) {
  check_strategy(strategy);
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  check_slots(slot_epochs, at::kByte, "slot_epochs", L);
  const bool* may_evict_table = nullptr;
  if (evictable) {
    check_tensor(*evictable, at::kBool, "evictable");
    TORCH_CHECK(evictable->numel() == L.num_tables, "dynamicemb: evictable must hold one flag per table");
    may_evict_table = evictable->data_ptr<bool>();
  }
  if (keeps_timestamps(strategy)) check_slots(slot_timestamps, at::kLong, "slot_timestamps", L);
  check_tensor(sizes, at::kLong, "sizes");
  check_tensor(counters, at::kLong, "counters");
  TORCH_CHECK(sizes.numel() == L.num_tables && counters.numel() == 3 * L.num_tables,
              "dynamicemb: sizes / counters must hold 1 / 3 entries per table");
  TORCH_CHECK(epoch > 0 && epoch <= kMaxEpoch, "dynamicemb: epoch must be in [1, ", kMaxEpoch, "], got ", epoch);
  const int64_t n = check_keys(keys, table_ids, key_scores, kCpu);
  const bool avx2 = cpu::has_avx2();

  Tensor indices = new_tensor(n, at::kLong);
  Tensor results = new_tensor(n, at::kChar);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* tids = opt_ptr(table_ids);
  const int64_t* ks = opt_ptr(key_scores);
  int64_t* sk = slot_keys.data_ptr<int64_t>();
  uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* sc = slot_scores.data_ptr<int64_t>();
  Epoch* ep = slot_epochs.data_ptr<Epoch>();
  int64_t* ts = keeps_timestamps(strategy) ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  int64_t* out = indices.data_ptr<int64_t>();
  int8_t* res = results.data_ptr<int8_t>();
  const int64_t dflt = default_key_score(strategy, call_score);
  const Epoch ecall = static_cast<Epoch>(epoch);
  const bool evicts = may_evict(strategy);
  const int cap = static_cast<int>(L.cap);

  struct Rec {
    // In: the key, its score argument, bucket and digest, and whether it may
    // evict. The walk turns bucket into the slot (-1: failed) and, for an
    // evicting key, key and score into the evicted key and score.
    int64_t key, score, bucket;
    uint8_t digest;
    bool may_evict;
    int8_t res;
  };
  const BucketOf where{k, tids, L};
  BucketBatch<Rec> bb = batch_by_bucket<Rec>(where, n, [k, ks, dflt, evicts, may_evict_table, tids](int64_t i, uint8_t d,
                                                                                                   Rec& r) {
    r.key = k[i];
    r.score = ks ? ks[i] : dflt;
    r.digest = d;
    r.may_evict = evicts && (!may_evict_table || may_evict_table[tids ? tids[i] : 0]);
  });
  auto evicted = [](const Rec& r) { return r.res == kEvicted; };
  constexpr int64_t kFillAhead = 4;  // runs; within walk_runs' digest prefetch (kDigestAhead keys)
  const std::vector<int64_t> first_evicted = bb.for_each_part([&](const Runs<Rec>& part) {
    int path = kFewProbe;  // the victim lists' path (RunVictims): try the filtered pass first
    RunVictims victims[2] = {RunVictims(&path), RunVictims(&path)};  // of this run and the next
    // Whether the buckets of runs run, run + 1 and run + 2 are full (at
    // index run % 3, ...), each tested once, two runs ahead: a run writes only
    // its own bucket, and inserts only take slots, so a later one stays as tested.
    bool full_at[3] = {};
    walk_runs(part, sd, sk, L.cap, [&](const Runs<Rec>& runs, int64_t run, int64_t base) {
      Rec* rs = runs.begin(run);
      const int64_t len = runs.len(run);
      const int64_t b1 = run + 1 < runs.count ? runs.bucket(run + 1) * L.cap : -1;  // next run's
      auto test_full = [&](int64_t r) { return r < runs.count && bucket_full(sd + runs.bucket(r) * L.cap, cap); };
      if (run == 0) {
        full_at[0] = test_full(0);
        full_at[1] = test_full(1);
      }
      full_at[(run + 2) % 3] = test_full(run + 2);
      const bool full = full_at[run % 3], next_full = full_at[(run + 1) % 3];
      if (evicts) {
        // Full buckets evict: their scores and epochs are fetched two runs
        // ahead and their victims listed one run ahead. (Listing only for
        // runs with a surely new key measured slower for runs of found keys:
        // the fetched lines are those their score and epoch writes need.)
        if (full_at[(run + 2) % 3]) {
          const int64_t b2 = runs.bucket(run + 2) * L.cap;
          prefetch_range(sc + b2, cap);
          prefetch_range(ep + b2, cap);
        }
        if (next_full)
          victims[(run + 1) & 1].build(sc + b1, ep + b1, sk + b1, cap, ecall, runs.len(run + 1));
      }
      // A bucket's new keys fill its free slots from the first free one
      // (kEmpty or a tombstone) on: the lines they write are fetched
      // kFillAhead runs ahead (a run is about one key in a sparse call), else
      // each new key waits on its write misses.
      if (run + kFillAhead < runs.count) {
        const int64_t bf = runs.bucket(run + kFillAhead) * L.cap;
        const int f = first_free_slot(sd + bf, cap);
        if (f >= 0) {
          // Every line the run's keys could fill (up to its length, within the bucket).
          const int64_t from = bf + f, fill = std::min<int64_t>(cap - f, runs.len(run + kFillAhead));
          prefetch_range<true>(sk + from, fill);
          prefetch_range<true>(sc + from, fill);
          if (ts) prefetch_range<true>(ts + from, fill);
          prefetch_range<true>(ep + from, fill);
        }
      }
      RunVictims& vic = victims[run & 1];
      for (int64_t q = 0; q < len; ++q) {
        Rec& r = rs[q];
        int free_slot = -1;
        int s = full ? find_in_full_bucket(sd + base, sk + base, cap, r.digest, r.key, avx2)
                     : find_in_bucket<true>(sd + base, sk + base, cap, r.digest, r.key, &free_slot);
        if (s >= 0) {
          sc[base + s] = score_on_access(strategy, sc[base + s], call_score, r.score);
          r.res = kAssigned;
        } else {
          s = free_slot;
          r.res = kInserted;
          const int64_t key = r.key, score = score_on_insert(strategy, call_score, r.score);
          if (s < 0 && r.may_evict) {
            s = vic.next(sc + base, ep + base, sk + base, cap, ecall, len - q);
            if (s >= 0) {
              r.key = sk[base + s];
              r.score = sc[base + s];
              r.res = kEvicted;
            }
          }
          if (s < 0) {
            r.res = kFailed;
            r.bucket = -1;
            continue;
          }
          sk[base + s] = key;
          sd[base + s] = r.digest;
          sc[base + s] = score;
        }
        if (ts) ts[base + s] = call_score;
        ep[base + s] = ecall;
        r.bucket = base + s;
      }
      vic.reset();
    }, WrittenAtMatch{sc, ep, ts});
  }, evicted);
  // Each key's slot and result, and the evicted (key, table, slot, score)
  // in input order, written in one pass.
  const int64_t m = first_evicted.back();
  Tensor e_keys = new_tensor(m, at::kLong), e_tids = new_tensor(m, at::kLong), e_idx = new_tensor(m, at::kLong),
         e_scores = new_tensor(m, at::kLong);
  int64_t *ekp = e_keys.data_ptr<int64_t>(), *etp = e_tids.data_ptr<int64_t>(), *eip = e_idx.data_ptr<int64_t>(),
          *esp = e_scores.data_ptr<int64_t>();
  bb.scatter(
      where,
      [out, res](int64_t i, const Rec& r) {  // by value: see BucketBatch::each_record
        out[i] = r.bucket;
        res[i] = r.res;
      },
      evicted, first_evicted,
      [ekp, etp, eip, esp, tids](int64_t o, int64_t i, const Rec& r) {
        ekp[o] = r.key;
        etp[o] = tids ? tids[i] : 0;
        eip[o] = r.bucket;
        esp[o] = r.score;
      });

  // Counters: inserted (new keys stored, by a free slot or by evicting),
  // evicted, failed; the size grows by the keys that took a free slot.
  const std::vector<int64_t> cnt = tally_by_table(n, tids, L.num_tables, 4, [&](int64_t i) { return int(res[i]); });
  int64_t* sz = sizes.data_ptr<int64_t>();
  int64_t* ctr = counters.data_ptr<int64_t>();
  for (int64_t t = 0; t < L.num_tables; ++t) {
    const int64_t* c = &cnt[t * 4];
    sz[t] += c[kInserted];
    ctr[t * 3 + 0] += c[kInserted] + c[kEvicted];
    ctr[t * 3 + 1] += c[kEvicted];
    ctr[t * 3 + 2] += c[kFailed];
  }
  return {indices, results, e_keys, e_tids, e_idx, e_scores};
}

// ---- erase, take -------------------------------------------------------------------

// A lookup (the parallel pipeline: no key's result depends on another's),
// then the found slots marked erased in input order: a key repeated in the
// input is erased (and reported) at its first occurrence only; on(i, slot)
// for each key erased, in input order. The bucket batches that inserts need
// (keys of a bucket in input order) cost about twice as much per key, and an
// erase writes only the slots the lookup found. `ahead`(slot): lines the
// caller reads at a slot, fetched with its digest.
template <class OnErased, class Ahead>
void erase_found(const LookupCall& c, const Tensor& slot_digests, const Tensor& sizes, int64_t n, OnErased on,
                 Ahead ahead) {
  check_tensor(sizes, at::kLong, "sizes");
  TORCH_CHECK(sizes.numel() == c.view.L.num_tables, "dynamicemb: sizes must hold one entry per table");
  check_table_ids(lookup_pipeline(c.view, n), c.view.tids, c.view.L);
  uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* sz = sizes.data_ptr<int64_t>();
  const int64_t* slot = c.view.out;
  const int64_t* tids = c.view.tids;
  constexpr int64_t kAhead = 16;  // a large call's digests left the caches since its lookup
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && slot[i + kAhead] >= 0) {
      prefetch_write(sd + slot[i + kAhead]);
      ahead(slot[i + kAhead]);
    }
    const int64_t s = slot[i];
    if (s >= 0 && sd[s] != kErased) {
      sd[s] = kErased;
      --sz[tids ? tids[i] : 0];
      on(i, s);
    }
  }
}

Tensor erase_cpu(const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& table_buckets,
                 const Tensor& sizes, const Tensor& keys, const std::optional<Tensor>& table_ids,
                 int64_t bucket_capacity) {
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  const int64_t n = keys.numel();
  Tensor erased = new_tensor(n, at::kBool);
  bool* er = erased.data_ptr<bool>();
  std::memset(er, 0, n);
  erase_found(c, slot_digests, sizes, n, [er](int64_t i, int64_t) { er[i] = true; }, [](int64_t) {});
  return erased;
}

// erase, returning what the erased keys held: their positions in keys
// (ascending), and their slots' entries of slot_values and slot_scores (a
// backing store's key index taking keys out: one lookup instead of a lookup
// for the entries and another for the erase).
std::tuple<Tensor, Tensor, Tensor> take_cpu(const Tensor& slot_keys, const Tensor& slot_digests,
                                            const Tensor& table_buckets, const Tensor& sizes, const Tensor& keys,
                                            const std::optional<Tensor>& table_ids, int64_t bucket_capacity,
                                            const Tensor& slot_values, const Tensor& slot_scores) {
  const LookupCall c = prepare_lookup(slot_keys, slot_digests, table_buckets, keys, table_ids, bucket_capacity);
  check_slots(slot_values, at::kLong, "slot_values", c.view.L);
  check_slots(slot_scores, at::kLong, "slot_scores", c.view.L);
  const int64_t n = keys.numel();
  Tensor at_ = new_tensor(n, at::kLong), values = new_tensor(n, at::kLong), scores = new_tensor(n, at::kLong);
  int64_t *ap = at_.data_ptr<int64_t>(), *vp = values.data_ptr<int64_t>(), *sp = scores.data_ptr<int64_t>();
  const int64_t *sv = slot_values.data_ptr<int64_t>(), *ss = slot_scores.data_ptr<int64_t>();
  int64_t m = 0;
  erase_found(
      c, slot_digests, sizes, n,
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

// ---- export ----------------------------------------------------------------------

// Live slots in [begin, end) (with filter_scores: only those >= threshold), in
// slot order: (keys, table ids, slot indices).
std::tuple<Tensor, Tensor, Tensor> export_range_cpu(const Tensor& slot_keys,
                                                     const Tensor& slot_digests,
                                                     const std::optional<Tensor>& filter_scores,
                                                     const Tensor& table_buckets, int64_t begin,
                                                     int64_t end, int64_t bucket_capacity,
                                                     int64_t threshold) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  if (filter_scores) check_slots(*filter_scores, at::kLong, "filter_scores", L);
  TORCH_CHECK(0 <= begin && begin <= end && end <= L.num_slots(),
              "dynamicemb: export range [", begin, ", ", end, ") is outside [0, ", L.num_slots(), ")");
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  const int64_t* fs = opt_ptr(filter_scores);
  Tensor keys, tids, idx;
  int64_t *kp, *tp, *ip;
  compact(
      end - begin,
      [&](int64_t i) { return is_live(sd[begin + i]) && (!fs || fs[begin + i] >= threshold); },
      [&](int64_t m) {
        kp = (keys = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        tp = (tids = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        ip = (idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
      },
      [&](int64_t i, int64_t o) {
        const int64_t slot = begin + i;
        kp[o] = sk[slot];
        tp[o] = std::upper_bound(L.tb, L.tb + L.num_tables + 1, slot / L.cap) - L.tb - 1;
        ip[o] = slot;
      });
  return {keys, tids, idx};
}

// ---- rehash (grow) ---------------------------------------------------------------

// Moves every live slot into a layout whose per-table bucket counts are
// integer multiples of the old ones. An old bucket's keys land only in the k
// buckets it scales to, so no bucket overflows, and each old bucket is
// re-inserted by one task in slot order (deterministic). Returns the new slot
// arrays and the moves (old index -> new index) in old index order.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rehash_cpu(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& old_table_buckets,
    const Tensor& new_table_buckets, int64_t bucket_capacity) {
  const Layout O = make_layout(old_table_buckets, bucket_capacity);
  const Layout N = make_layout(new_table_buckets, bucket_capacity);
  TORCH_CHECK(O.num_tables == N.num_tables, "dynamicemb: grow cannot change the number of tables");
  for (int64_t t = 0; t < O.num_tables; ++t) {
    const int64_t ob = O.tb[t + 1] - O.tb[t], nb = N.tb[t + 1] - N.tb[t];
    TORCH_CHECK(ob > 0 && nb >= ob && nb % ob == 0, "dynamicemb: table ", t,
                ": the new bucket count (", nb, ") must be a multiple of the old one (", ob, ")");
  }
  check_slots(slot_keys, at::kLong, "slot_keys", O);
  check_slots(slot_digests, at::kByte, "slot_digests", O);
  check_slots(slot_scores, at::kLong, "slot_scores", O);
  const bool with_ts = slot_timestamps.numel() > 0;
  if (with_ts) check_slots(slot_timestamps, at::kLong, "slot_timestamps", O);

  const int64_t S = N.num_slots(), cap = O.cap;
  Tensor nk = cpu::empty_huge({S}, at::kLong), nd = cpu::empty_huge({S}, at::kByte),
         ns = cpu::empty_huge({S}, at::kLong);
  Tensor nt = with_ts ? cpu::empty_huge({S}, at::kLong) : new_tensor(0, at::kLong);
  std::fill_n(nd.data_ptr<uint8_t>(), S, kEmpty);  // kEmpty marks unused slots
  std::fill_n(nk.data_ptr<int64_t>(), S, 0);
  std::fill_n(ns.data_ptr<int64_t>(), S, 0);
  if (with_ts) std::fill_n(nt.data_ptr<int64_t>(), S, 0);

  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  const int64_t* sc = slot_scores.data_ptr<int64_t>();
  const int64_t* st = with_ts ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  int64_t* nkp = nk.data_ptr<int64_t>();
  uint8_t* ndp = nd.data_ptr<uint8_t>();
  int64_t* nsp = ns.data_ptr<int64_t>();
  int64_t* ntp = with_ts ? nt.data_ptr<int64_t>() : nullptr;
  // New index of every old slot (-1: not live), filled per old bucket.
  std::vector<int64_t> dest(O.num_slots(), -1);
  at::parallel_for(0, O.num_buckets(), 256, [&](int64_t bb, int64_t be) {
    std::vector<int64_t> fill;
    for (int64_t b = bb; b < be; ++b) {
      const int64_t t = std::upper_bound(O.tb, O.tb + O.num_tables + 1, b) - O.tb - 1;
      const int64_t nb = N.tb[t + 1] - N.tb[t];
      const int64_t k = nb / (O.tb[t + 1] - O.tb[t]);
      const int64_t first = k * (b - O.tb[t]);  // the first new bucket (table-local)
      fill.assign(k, 0);
      for (int64_t s = b * cap; s < (b + 1) * cap; ++s) {
        if (!is_live(sd[s])) continue;
        const int64_t local = bucket_in_table(key_hash(sk[s]), nb);
        const int64_t d = (N.tb[t] + local) * cap + fill[local - first]++;
        nkp[d] = sk[s];
        ndp[d] = sd[s];
        nsp[d] = sc[s];
        if (ntp) ntp[d] = st[s];
        dest[s] = d;
      }
    }
  });
  Tensor old_idx, new_idx;
  int64_t *op, *np;
  compact(
      O.num_slots(), [&](int64_t s) { return dest[s] >= 0; },
      [&](int64_t m) {
        op = (old_idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        np = (new_idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
      },
      [&](int64_t s, int64_t o) {
        op[o] = s;
        np[o] = dest[s];
      });
  return {nk, nd, ns, nt, old_idx, new_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("table_lookup", &lookup_cpu);
  m.impl("table_lookup_gather", &lookup_gather_cpu);
  m.impl("table_lookup_refresh", &lookup_refresh_cpu);
  m.impl("table_refresh", &refresh_cpu);
  m.impl("table_insert", &insert_cpu);
  m.impl("table_erase", &erase_cpu);
  m.impl("table_take", &take_cpu);
  m.impl("table_export_range", &export_range_cpu);
  m.impl("table_rehash", &rehash_cpu);
}

}  // namespace table
}  // namespace dynamicemb
