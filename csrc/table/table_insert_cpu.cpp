// CPU kernel of table_insert: keys regrouped by bucket (table_cpu.h), the
// buckets walked in parallel and each bucket's keys in input order, each key
// found, stored in a free slot or evicting (victims_cpu.h), and its outcome
// committed and tallied by TableRef (table_ref.h). A call whose keys are all
// stored already (a trained table's usual step) skips the regrouping: its
// keys are found by the lookup's pipeline and committed as accessed.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <vector>

#include "common/cpu_vectors.h"
#include "table/bucket_scan_cpu.h"
#include "table/table_cpu.h"
#include "table/victims_cpu.h"

namespace dynamicemb {
namespace table {
namespace cpu_impl {
namespace {

// True when the bucket at `digests` has no kEmpty or kErased slot.
bool bucket_full(const uint8_t* digests, int cap) {
  for (int g = 0; g < cap; g += kGroupSize)
    if (group_free(digests + g)) return false;
  return true;
}

// find_pipelined's keys for find_all: each key's slot goes to out; a missing
// key (or a bad table id) raises `missing`.
struct AllKeys {
  TableRef r;
  const int64_t* keys;
  const int64_t* tids;
  int64_t* out;
  std::atomic<bool>* missing;
  static constexpr bool kAfter = false;
  int64_t table(int64_t i) const {
    const int64_t t = tids ? tids[i] : 0;
    return r.has_table(t) ? t : -1;
  }
  const TableRef& ref(int64_t) const { return r; }
  int64_t key(int64_t i) const { return keys[i]; }
  void found(int64_t i, int64_t slot) const {
    out[i] = slot;
    if (slot < 0) missing->store(true, std::memory_order_relaxed);
  }
  void after(int64_t) const {}
};

// Whether every key is stored (out: their slots). A missing key stops the
// pass within kStop keys per thread: a call with new keys pays little for it.
bool find_all(const TableRef& ref, const int64_t* k, const int64_t* tids, int64_t n, int64_t* out) {
  constexpr int64_t kBlock = 32, kStop = 1024;
  std::atomic<bool> missing{false};
  const AllKeys keys{ref, k, tids, out, &missing};
  cpu::parallel_ranges(n, 2048, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e && !missing.load(std::memory_order_relaxed); s += kStop)
      find_pipelined<kBlock>(s, std::min(e, s + kStop), keys);
  });
  return !missing.load();
}

// Commits every key at its slot as accessed (kAssigned, which tallies
// nothing): in parallel where the order of a slot's accesses cannot matter,
// else in input order, as the walk does for a key given twice.
void commit_found(const TableRef& ref, const Scoring& scoring, const int64_t* k, const int64_t* ks,
                  const int64_t* slot, int64_t n, Epoch ecall) {
  auto commit = [&](int64_t b, int64_t e) {
    constexpr int64_t kAhead = 16;  // slots are scattered: their lines fetched for writing ahead
    for (int64_t i = b; i < e; ++i) {
      if (i + kAhead < e) {
        const int64_t a = slot[i + kAhead];
        prefetch_write(ref.scores + a);
        prefetch_write(ref.epochs + a);
        if (ref.timestamps) prefetch_write(ref.timestamps + a);
      }
      ref.commit(slot[i], kAssigned, k[i], 0, scoring, scoring.key_score(ks, i), ecall);
    }
  };
  if (access_order_free(scoring.strategy))
    cpu::parallel_ranges(n, 2048, commit);
  else
    commit(0, n);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> insert(
    at::ArrayRef<Tensor> table, const Tensor& keys, const std::optional<Tensor>& table_ids,
    const std::optional<Tensor>& key_scores, int64_t strategy, int64_t bucket_capacity, int64_t call_score,
    int64_t epoch, const std::optional<Tensor>& evictable, bool list_evicted,
    const std::optional<Tensor>& key_count, bool hold_stored) {
  check_strategy(strategy);
  const TableRef ref = make_ref(table, bucket_capacity, with_timestamps(kInsertMembers, strategy));
  const bool* may_evict_table = check_evictable(evictable, ref, cpu_device());
  check_epoch(epoch);
  const int64_t all = check_keys(keys, table_ids, key_scores, cpu_device());
  const int64_t* count = check_key_count(key_count, cpu_device());
  // The keys past key_count are padding: only the first n are processed.
  const int64_t n = count ? std::clamp<int64_t>(*count, 0, all) : all;
  const bool avx2 = cpu::has_avx2();

  Tensor indices = new_tensor(all, at::kLong);
  Tensor results = new_tensor(all, at::kChar);
  indices.narrow(0, n, all - n).fill_(-1);
  results.narrow(0, n, all - n).fill_(static_cast<int64_t>(kPaddingResult));
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* tids = opt_ptr(table_ids);
  const int64_t* ks = opt_ptr(key_scores);
  int64_t* out = indices.data_ptr<int64_t>();
  int8_t* res = results.data_ptr<int8_t>();
  const Scoring scoring = Scoring::of(strategy, call_score);
  const Epoch ecall = static_cast<Epoch>(epoch);
  const bool evicts = may_evict(strategy);
  const int cap = ref.cap();

  if (n > 0 && find_all(ref, k, tids, n, out)) {
    commit_found(ref, scoring, k, ks, out, n, ecall);
    results.narrow(0, 0, n).fill_(static_cast<int64_t>(kAssigned));
    return {indices, results, new_tensor(0, at::kLong), new_tensor(0, at::kLong), new_tensor(0, at::kLong),
            new_tensor(0, at::kLong)};
  }

  struct Rec {
    // In: the key, its score argument, bucket and digest, and whether it may
    // evict. The walk turns bucket into the slot (-1: failed) and, for an
    // evicting key, key and score into the evicted key and score.
    int64_t key, score, bucket;
    uint8_t digest;
    bool may_evict;
    int8_t res;
  };
  const BucketOf where{k, tids, ref};
  BucketBatch<Rec> bb = batch_by_bucket<Rec>(
      where, n, [k, ks, scoring, evicts, may_evict_table, tids](int64_t i, uint8_t d, Rec& r) {
        r.key = k[i];
        r.score = scoring.key_score(ks, i);
        r.digest = d;
        r.may_evict = evicts && (!may_evict_table || may_evict_table[tids ? tids[i] : 0]);
      });
  auto evicted = [list_evicted](const Rec& r) { return list_evicted && r.res == kEvicted; };
  constexpr int64_t kFillAhead = 4;  // runs; within walk_runs' digest prefetch (kDigestAhead keys)
  const std::vector<int64_t> first_evicted = bb.for_each_part([&](const Runs<Rec>& part) {
    int path = kFewProbe;  // the victim lists' path (RunVictims): try the filtered pass first
    RunVictims victims[2] = {RunVictims(&path), RunVictims(&path)};  // of this run and the next
    // Whether the buckets of runs run, run + 1 and run + 2 are full (at
    // index run % 3, ...), each tested once, two runs ahead: a run writes only
    // its own bucket, and inserts only take slots, so a later one stays as tested.
    bool full_at[3] = {};
    walk_runs(part, ref, [&](const Runs<Rec>& runs, int64_t run, int64_t base, const TableRef& R) {
      int64_t* const sk = R.keys;
      int64_t* const sc = R.scores;
      Epoch* const ep = R.epochs;
      Rec* rs = runs.begin(run);
      const int64_t len = runs.len(run);
      const int64_t b1 = run + 1 < runs.count ? runs.bucket(run + 1) * cap : -1;  // next run's
      auto test_full = [&](int64_t r) { return r < runs.count && bucket_full(R.digests + runs.bucket(r) * cap, cap); };
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
          const int64_t b2 = runs.bucket(run + 2) * cap;
          prefetch_range(sc + b2, cap);
          prefetch_range(ep + b2, cap);
        }
        if (next_full) victims[(run + 1) & 1].build(sc + b1, ep + b1, sk + b1, cap, ecall, runs.len(run + 1));
      }
      // A bucket's new keys fill its free slots from the first free one
      // (kEmpty or a tombstone) on: the lines they write are fetched
      // kFillAhead runs ahead (a run is about one key in a sparse call), else
      // each new key waits on its write misses.
      if (run + kFillAhead < runs.count) {
        const int64_t bf = runs.bucket(run + kFillAhead) * cap;
        const int f = first_free_slot(R.digests + bf, cap);
        if (f >= 0) {
          // Every line the run's keys could fill (up to its length, within the bucket).
          const int64_t from = bf + f, fill = std::min<int64_t>(cap - f, runs.len(run + kFillAhead));
          prefetch_range<true>(sk + from, fill);
          prefetch_range<true>(sc + from, fill);
          if (R.timestamps) prefetch_range<true>(R.timestamps + from, fill);
          prefetch_range<true>(ep + from, fill);
        }
      }
      RunVictims& vic = victims[run & 1];
      // hold_stored: the run's keys stored when the call began are found and
      // held first; the others are then placed in input order (`pending`).
      if (hold_stored) {
        for (int64_t q = 0; q < len; ++q) {
          Rec& r = rs[q];
          const Probe p{base, r.digest};
          const int64_t slot = full ? find_in_full(R, p, r.key, avx2) : R.find(p, r.key);
          if (slot < 0) {
            r.res = kPendingResult;
            continue;
          }
          R.commit(slot, kAssigned, r.key, r.digest, scoring, r.score, ecall);
          r.res = kAssigned;
          r.bucket = slot;
        }
      }
      // Digests of the keys this loop stored: under hold_stored a pending key
      // whose digest is not among them is not stored (only a repeated new key
      // can be), so its second find is skipped.
      uint64_t placed[4] = {0, 0, 0, 0};
      for (int64_t q = 0; q < len; ++q) {
        Rec& r = rs[q];
        if (hold_stored && r.res != kPendingResult) continue;
        const Probe p{base, r.digest};
        const int64_t key = r.key, key_score = r.score;
        int64_t free_slot = -1;
        const bool again = !hold_stored || ((placed[r.digest >> 6] >> (r.digest & 63)) & 1);
        int64_t slot = -1;
        if (full) {
          if (again) slot = find_in_full(R, p, key, avx2);
        } else if (again) {
          slot = R.find_or_free(p, key, &free_slot);
        } else {
          const int f = first_free_slot(R.digests + base, cap);  // find_or_free's free slot
          free_slot = f >= 0 ? base + f : -1;
        }
        int8_t result = kAssigned;
        if (slot < 0) {
          slot = free_slot;
          result = kInserted;
          if (slot < 0 && r.may_evict) {
            const int v = vic.next(sc + base, ep + base, sk + base, cap, ecall, len - q);
            if (v >= 0) {
              slot = base + v;
              r.key = sk[slot];
              r.score = sc[slot];
              result = kEvicted;
            }
          }
          if (slot < 0) {
            r.res = kFailed;
            r.bucket = -1;
            continue;
          }
        }
        R.commit(slot, result, key, r.digest, scoring, key_score, ecall);
        if (hold_stored && result != kAssigned) placed[r.digest >> 6] |= uint64_t{1} << (r.digest & 63);
        r.res = result;
        r.bucket = slot;
      }
      vic.reset();
    }, WrittenAtMatch{ref.scores, ref.epochs, ref.timestamps});
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

  // The sizes and counters, per table and result.
  constexpr int kResults = kFailed + 1;
  const std::vector<int64_t> cnt =
      tally_by_table(n, tids, ref.num_tables, kResults, [&](int64_t i) { return int(res[i]); });
  for (int64_t t = 0; t < ref.num_tables; ++t)
    for (int r = 0; r < kResults; ++r) ref.tally_insert(t, r, cnt[t * kResults + r], PlainAdd{});
  return {indices, results, e_keys, e_tids, e_idx, e_scores};
}

// table_insert_outcome: each key's got_row, and the failures per table id
// (an id out of range raises, for a failed key: the ids that are counted).
std::tuple<Tensor, Tensor> insert_outcome(const Tensor& results, const Tensor& table_ids, int64_t num_tables) {
  const int64_t n = check_outcome_args(results, table_ids, num_tables, cpu_device());
  const int8_t* res = results.data_ptr<int8_t>();
  const int64_t* t = table_ids.data_ptr<int64_t>();
  Tensor got = new_tensor(n, at::kBool), failed = at::zeros({num_tables}, table_ids.options());
  bool* g = got.data_ptr<bool>();
  int64_t* f = failed.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    g[i] = got_row(res[i]);
    if (res[i] != kFailed) continue;
    TORCH_CHECK(0 <= t[i] && t[i] < num_tables, "dynamicemb: table_insert_outcome: table_ids[", i, "] = ", t[i],
                " is outside [0, ", num_tables, ")");
    ++f[t[i]];
  }
  return {got, failed};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("table_insert", &insert);
  m.impl("table_insert_outcome", &insert_outcome);
}

}  // namespace cpu_impl
}  // namespace table
}  // namespace dynamicemb
