// What the CPU kernels of the table ops share (table_lookup_cpu.cpp,
// table_insert_cpu.cpp, table_scan_cpu.cpp): the checked TableRef over an
// op's tensors, the keys of a mutating call regrouped by bucket, and the walk
// over those buckets. The table rules are table_rules.h's, composed by
// TableRef (table_ref.h); these files only spread keys over threads.
//
// Ordering contract (API.md §6): a call's result equals processing its keys
// one at a time in input order. Mutating calls therefore run buckets in
// parallel and the keys of one bucket in input order (see BucketBatch);
// lookups without score refresh read only and run keys freely in parallel.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/parallel_cpu.h"
#include "table/bucket_batch_cpu.h"
#include "table/find_pipeline_cpu.h"
#include "table/table_checks.h"
#include "table/table_ref.h"

namespace dynamicemb {
namespace table {
namespace cpu_impl {

using at::Tensor;

constexpr int64_t kSerialBelow = 4096;  // keys; smaller calls run on one thread

inline at::Device cpu_device() { return at::Device(at::kCPU); }

inline void check_tensor(const Tensor& t, at::ScalarType dtype, const char* name) {
  table::check_tensor(t, dtype, name, cpu_device());
}

// A layout's ref (no members). Keys are placed without bounds checks, so
// every table must own at least one bucket from bucket 0 on; the slot arrays
// hold table_buckets[num_tables] buckets.
inline TableRef layout_ref(const Tensor& table_buckets, int64_t bucket_capacity) {
  TableRef r = check_layout(table_buckets, bucket_capacity, cpu_device());
  const int64_t* tb = r.table_buckets;
  TORCH_CHECK(tb[0] == 0, "dynamicemb: table_buckets must start at 0, got ", tb[0]);
  for (int64_t t = 0; t < r.num_tables; ++t)
    TORCH_CHECK(tb[t + 1] > tb[t], "dynamicemb: table ", t, " owns no bucket (table_buckets must increase)");
  r.num_buckets = tb[r.num_tables];
  return r;
}

// The table's ref with the members in `used` checked.
inline TableRef make_ref(at::ArrayRef<Tensor> table, int64_t bucket_capacity, unsigned used) {
  check_members(table);
  return attach_members(layout_ref(table[kTableBuckets], bucket_capacity), table, used, cpu_device());
}

inline void check_slots(const Tensor& t, at::ScalarType dtype, const char* name, const TableRef& r) {
  table::check_slots(t, dtype, name, r, cpu_device());
}

inline const int64_t* opt_ptr(const std::optional<Tensor>& t) { return t ? t->data_ptr<int64_t>() : nullptr; }

inline Tensor new_tensor(int64_t n, at::ScalarType dtype) {
  return at::empty({n}, at::TensorOptions().dtype(dtype));
}

inline void check_table_ids(int64_t bad, const int64_t* tids, const TableRef& r) {
  TORCH_CHECK(bad < 0, "dynamicemb: table id ", bad >= 0 ? tids[bad] : 0, " (key position ", bad,
              ") is out of range [0, ", r.num_tables, ")");
}

// ---- keys by bucket (mutating calls) ---------------------------------------------

// Global bucket of key i, or -1 for a bad table id.
struct BucketOf {  // held by value in the per-key loops (see BucketBatch::each_record)
  const int64_t* keys;
  const int64_t* tids;
  TableRef ref;
  int64_t table(int64_t i) const { return tids ? tids[i] : 0; }
  int64_t operator()(int64_t i) const {
    const int64_t t = table(i);
    return ref.has_table(t) ? ref.bucket(t, key_hash(keys[i])) : -1;
  }
};

// A mutating call's keys regrouped by bucket (bucket_batch_cpu.h), with the
// table ids checked before any slot is touched; fill(i, digest, rec) writes
// the rest of key i's record (its bucket is set).
template <class Rec, class Fill>
BucketBatch<Rec> batch_by_bucket(const BucketOf& where, int64_t n, Fill fill) {
  BucketBatch<Rec> bb(n, where.ref.num_buckets, kSerialBelow, where);
  const int64_t i = bb.bad_position();
  TORCH_CHECK(i < 0, "dynamicemb: table id ", where.tids ? where.tids[std::max<int64_t>(i, 0)] : 0,
              " (key position ", i, ") is out of range [0, ", where.ref.num_tables, ")");
  bb.gather([where, fill](int64_t i, Rec& r) {
    const uint64_t h = key_hash(where.keys[i]);
    r.bucket = where.ref.bucket(where.table(i), h);
    fill(i, digest_of(h), r);
  });
  return bb;
}

// The per-slot arrays a call writes at the slot a key is found in (nullptr:
// not written), fetched for writing with the key's line.
struct WrittenAtMatch {
  const int64_t* scores = nullptr;
  const Epoch* epochs = nullptr;
  const int64_t* timestamps = nullptr;
};

// Walks one part's runs in bucket order: fn(runs, r, base, ref) for each run
// (base: the first slot of its bucket), so that fn may look at later runs.
// Prefetches per key, at two distances: its bucket's digests and, once they
// are in, the lines of the slot its digest first matches (the key's, and
// those of `written`); and each run's digests three runs ahead. fn gets
// walk_runs' own copy of the ref: a local, which fn's stores (of digest
// bytes, say) cannot alias, so its fields stay in registers.
template <class Rec, class RunFn>
void walk_runs(const Runs<Rec>& runs, const TableRef ref, RunFn fn, const WrittenAtMatch& written = {}) {
  const Rec* recs = runs.recs;
  const int64_t m = runs.start[runs.count];
  const int64_t cap = ref.bucket_capacity;
  constexpr int64_t kDigestAhead = 16, kKeyAhead = 6;
  auto ahead = [&](int64_t q) {
    if (q + kDigestAhead < m) prefetch_bucket(ref, recs[q + kDigestAhead].bucket * cap);
    if (q + kKeyAhead < m) {
      const Rec& r = recs[q + kKeyAhead];
      const Probe p = ref.at_bucket(r.bucket, r.digest);
      const int c = ref.candidate(p);
      if (c >= 0) {
        const int64_t slot = p.base + c;
        prefetch(ref.keys + slot);
        if (written.scores) prefetch_write(written.scores + slot);
        if (written.epochs) prefetch_write(written.epochs + slot);
        if (written.timestamps) prefetch_write(written.timestamps + slot);
      }
    }
  };
  for (int64_t q = 0; q < std::min(m, kDigestAhead); ++q) prefetch_bucket(ref, recs[q].bucket * cap);
  for (int64_t r = 0; r < runs.count; ++r) {
    // Digests also three runs ahead, for fn's look at the next two runs.
    if (r + 3 < runs.count) prefetch_bucket(ref, runs.bucket(r + 3) * cap);
    for (int64_t q = runs.start[r]; q < runs.start[r + 1]; ++q) ahead(q);
    fn(runs, r, runs.bucket(r) * cap, static_cast<const TableRef&>(ref));
  }
}

// ---- counts ------------------------------------------------------------------------

// Per-table counts of the classes cls(i) in [0, K) (negative: not counted).
template <class Cls>
std::vector<int64_t> tally_by_table(int64_t n, const int64_t* tids, int64_t T, int K, Cls cls) {
  return cpu::tally(n, T, K, [&](int64_t i) { return tids ? tids[i] : 0; }, cls);
}

// TableRef's tallies on the CPU: one thread adds a call's totals.
struct PlainAdd {
  void operator()(int64_t* p, int64_t v) const { *p += v; }
};

}  // namespace cpu_impl
}  // namespace table
}  // namespace dynamicemb
