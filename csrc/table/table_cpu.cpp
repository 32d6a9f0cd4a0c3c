// CPU kernels of the scored hash table. The table rules (hash, digest, score
// update, slot scan, victim choice) live in table_rules.h; this file only
// spreads keys over threads.
//
// Ordering contract (API.md §6): a call's result equals processing its keys
// one at a time in input order. Mutating calls therefore run buckets in
// parallel and the keys of one bucket in input order (see BucketOrder);
// lookups without score refresh read only and run keys freely in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "common/parallel_cpu.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace table {
namespace {

using at::Tensor;

constexpr int64_t kSerialBelow = 4096;  // keys; smaller calls run on one thread

void prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }

// ---- validation --------------------------------------------------------------

void check_tensor(const Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "dynamicemb: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "dynamicemb: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "dynamicemb: ", name, " must be contiguous");
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
  return Layout{table_buckets.data_ptr<int64_t>(), table_buckets.numel() - 1, bucket_capacity};
}

void check_slots(const Tensor& t, at::ScalarType dtype, const char* name, const Layout& L) {
  check_tensor(t, dtype, name);
  TORCH_CHECK(t.dim() == 1 && t.numel() == L.num_slots(), "dynamicemb: ", name, " must hold ",
              L.num_slots(), " slots, got shape ", t.sizes());
}

// Keys (and per-key table ids / scores) must be 1-D int64 of one length.
int64_t check_keys(const Tensor& keys, const std::optional<Tensor>& table_ids,
                   const std::optional<Tensor>& key_scores) {
  check_tensor(keys, at::kLong, "keys");
  TORCH_CHECK(keys.dim() == 1, "dynamicemb: keys must be 1-D, got shape ", keys.sizes());
  const int64_t n = keys.numel();
  if (table_ids) {
    check_tensor(*table_ids, at::kLong, "table_ids");
    TORCH_CHECK(table_ids->dim() == 1 && table_ids->numel() == n,
                "dynamicemb: table_ids must be 1-D with one entry per key (", n, "), got shape ",
                table_ids->sizes());
  }
  if (key_scores) {
    check_tensor(*key_scores, at::kLong, "scores");
    TORCH_CHECK(key_scores->dim() == 1 && key_scores->numel() == n,
                "dynamicemb: scores must be 1-D with one entry per key (", n, "), got shape ",
                key_scores->sizes());
  }
  return n;
}

const int64_t* opt_ptr(const std::optional<Tensor>& t) {
  return t ? t->data_ptr<int64_t>() : nullptr;
}

// ---- key placement -------------------------------------------------------------

// Global bucket and digest of every key. Table ids are checked here, before
// any slot is touched.
struct Placed {
  std::vector<int64_t> bucket;
  std::vector<uint8_t> digest;
};

Placed place_keys(const int64_t* keys, const int64_t* tids, int64_t n, const Layout& L) {
  Placed p{std::vector<int64_t>(n), std::vector<uint8_t>(n)};
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, n, 8192, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = tids ? tids[i] : 0;
      if (t < 0 || t >= L.num_tables) {
        bad.store(i, std::memory_order_relaxed);
        p.bucket[i] = 0;
        continue;
      }
      const uint64_t h = key_hash(keys[i]);
      p.bucket[i] = L.tb[t] + bucket_in_table(h, L.tb[t + 1] - L.tb[t]);
      p.digest[i] = digest_of(h);
    }
  });
  const int64_t i = bad.load();
  TORCH_CHECK(i < 0, "dynamicemb: table id ", tids ? tids[std::max<int64_t>(i, 0)] : 0,
              " (key position ", i, ") is out of range [0, ", L.num_tables, ")");
  return p;
}

// Runs fn(pos) for every key so that the keys of one bucket go in input
// order while different buckets go in parallel: key positions partitioned
// (stably) by part, a contiguous range of buckets, then one task per part.
class BucketOrder {
 public:
  BucketOrder(int64_t n, const int64_t* bucket, int64_t num_buckets)
      : sp_(n, parts(n, num_buckets), [&](int64_t i) { return bucket[i] * parts_ / num_buckets; }) {}

  // fn(pos) processes one key; ahead(pos) may prefetch for a key soon due.
  template <class Fn, class Ahead>
  void run(Fn fn, Ahead ahead) const {
    constexpr int64_t kAhead = 8;
    sp_.for_each_part([&](int64_t p) {
      const int64_t e = sp_.end(p);
      for (int64_t j = sp_.begin(p); j < e; ++j) {
        if (j + kAhead < e) ahead(sp_.pos(j + kAhead));
        fn(sp_.pos(j));
      }
    });
  }

 private:
  // Small calls (or one thread) run in input order as one part.
  int64_t parts(int64_t n, int64_t num_buckets) {
    const int64_t threads = at::get_num_threads();
    parts_ = (n < kSerialBelow || threads == 1) ? 1 : std::max<int64_t>(1, std::min<int64_t>({num_buckets, 64 * threads, n / 64}));
    return parts_;
  }

  int64_t parts_ = 1;  // set before sp_ is built (declared first)
  cpu::StablePartition sp_;
};

// Per-table counts of the classes cls(i) in [0, K) (negative: not counted).
template <class Cls>
std::vector<int64_t> tally_by_table(int64_t n, const int64_t* tids, int64_t T, int K, Cls cls) {
  return cpu::tally(n, T, K, [&](int64_t i) { return tids ? tids[i] : 0; }, cls);
}

using cpu::compact;

Tensor new_tensor(int64_t n, at::ScalarType dtype) {
  return at::empty({n}, at::TensorOptions().dtype(dtype));
}

// Slot of a key found earlier in a bucket: global index = bucket * cap + slot.
void prefetch_bucket(const uint8_t* digests, int64_t base, int64_t cap) {
  prefetch(digests + base);
  if (cap > 64) prefetch(digests + base + 64);
}

}  // namespace
}  // namespace table
}  // namespace dynamicemb

namespace dynamicemb {
namespace table {
namespace {

// ---- lookup (read-only) ----------------------------------------------------------

std::tuple<Tensor, Tensor> lookup_cpu(const Tensor& slot_keys, const Tensor& slot_digests,
                                      const Tensor& table_buckets, const Tensor& keys,
                                      const std::optional<Tensor>& table_ids,
                                      int64_t bucket_capacity) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  const int64_t n = check_keys(keys, table_ids, std::nullopt);
  Tensor indices = new_tensor(n, at::kLong);
  Tensor found = new_tensor(n, at::kBool);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* tids = opt_ptr(table_ids);
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* out = indices.data_ptr<int64_t>();
  bool* fnd = found.data_ptr<bool>();
  std::atomic<int64_t> bad{-1};
  // A three-stage pipeline over blocks of 16 keys, so that the misses of a
  // lookup overlap with other keys' work: block k+2 is hashed and its digest
  // lines prefetched, block k+1's digests are scanned and the candidate key
  // line prefetched, block k is searched (both lines now cached).
  at::parallel_for(0, n, 2048, [&](int64_t b, int64_t e) {
    constexpr int64_t B = 16;
    int64_t base[3][B];
    uint8_t dg[3][B];
    const int64_t blocks = (e - b + B - 1) / B;
    auto size_of = [&](int64_t blk) { return std::min(B, e - (b + blk * B)); };
    for (int64_t blk = 0; blk < blocks + 2; ++blk) {
      if (blk < blocks) {  // stage 1: hash, prefetch the bucket's digests
        int64_t* bs = base[blk % 3];
        uint8_t* ds = dg[blk % 3];
        const int64_t i0 = b + blk * B;
        for (int64_t j = 0; j < size_of(blk); ++j) {
          const int64_t t = tids ? tids[i0 + j] : 0;
          if (t < 0 || t >= L.num_tables) {
            bad.store(i0 + j, std::memory_order_relaxed);
            bs[j] = -1;
            continue;
          }
          const uint64_t h = key_hash(k[i0 + j]);
          bs[j] = (L.tb[t] + bucket_in_table(h, L.tb[t + 1] - L.tb[t])) * L.cap;
          ds[j] = digest_of(h);
          prefetch_bucket(sd, bs[j], L.cap);
        }
      }
      if (blk >= 1 && blk - 1 < blocks) {  // stage 2: prefetch the candidate's key
        const int64_t* bs = base[(blk - 1) % 3];
        const uint8_t* ds = dg[(blk - 1) % 3];
        for (int64_t j = 0; j < size_of(blk - 1); ++j) {
          if (bs[j] < 0) continue;
          const int c = first_digest_match(sd + bs[j], L.cap, ds[j]);
          if (c >= 0) prefetch(sk + bs[j] + c);
        }
      }
      if (blk >= 2) {  // stage 3: search
        const int64_t* bs = base[(blk - 2) % 3];
        const uint8_t* ds = dg[(blk - 2) % 3];
        const int64_t i0 = b + (blk - 2) * B;
        for (int64_t j = 0; j < size_of(blk - 2); ++j) {
          const int s = bs[j] < 0 ? -1 : find_in_bucket<false>(sd + bs[j], sk + bs[j], L.cap, ds[j], k[i0 + j], nullptr);
          out[i0 + j] = s >= 0 ? bs[j] + s : -1;
          fnd[i0 + j] = s >= 0;
        }
      }
    }
  });
  const int64_t i = bad.load();
  TORCH_CHECK(i < 0, "dynamicemb: table id ", i >= 0 ? tids[i] : 0, " (key position ", i,
              ") is out of range [0, ", L.num_tables, ")");
  return {indices, found};
}

// ---- lookup that refreshes scores ------------------------------------------------

std::tuple<Tensor, Tensor> lookup_refresh_cpu(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& table_buckets, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  if (keeps_timestamps(strategy)) check_slots(slot_timestamps, at::kLong, "slot_timestamps", L);
  const int64_t n = check_keys(keys, table_ids, key_scores);
  Tensor indices = new_tensor(n, at::kLong);
  Tensor found = new_tensor(n, at::kBool);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* ks = opt_ptr(key_scores);
  const Placed P = place_keys(k, opt_ptr(table_ids), n, L);
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* sc = slot_scores.data_ptr<int64_t>();
  int64_t* ts = keeps_timestamps(strategy) ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  int64_t* out = indices.data_ptr<int64_t>();
  bool* fnd = found.data_ptr<bool>();
  const int64_t dflt = default_key_score(strategy, call_score);
  BucketOrder(n, P.bucket.data(), L.num_buckets())
      .run(
          [&](int64_t i) {
            const int64_t base = P.bucket[i] * L.cap;
            const int s = find_in_bucket<false>(sd + base, sk + base, L.cap, P.digest[i], k[i], nullptr);
            out[i] = s >= 0 ? base + s : -1;
            fnd[i] = s >= 0;
            if (s < 0) return;
            sc[base + s] = score_on_access(strategy, sc[base + s], call_score, ks ? ks[i] : dflt);
            if (ts) ts[base + s] = call_score;
          },
          [&](int64_t i) { prefetch_bucket(sd, P.bucket[i] * L.cap, L.cap); });
  return {indices, found};
}

// ---- insert ----------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> insert_cpu(
    const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& slot_scores,
    const Tensor& slot_timestamps, const Tensor& slot_epochs, const Tensor& table_buckets,
    const Tensor& sizes, const Tensor& counters, const Tensor& keys,
    const std::optional<Tensor>& table_ids, const std::optional<Tensor>& key_scores,
    int64_t strategy, int64_t bucket_capacity, int64_t call_score, int64_t epoch,
    const std::optional<Tensor>& evictable) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_slots(slot_scores, at::kLong, "slot_scores", L);
  check_slots(slot_epochs, at::kInt, "slot_epochs", L);
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
  TORCH_CHECK(epoch > 0 && epoch <= INT32_MAX, "dynamicemb: epoch must be in [1, 2^31)");
  const int64_t n = check_keys(keys, table_ids, key_scores);

  Tensor indices = new_tensor(n, at::kLong);
  Tensor results = new_tensor(n, at::kChar);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* tids = opt_ptr(table_ids);
  const int64_t* ks = opt_ptr(key_scores);
  const Placed P = place_keys(k, tids, n, L);
  int64_t* sk = slot_keys.data_ptr<int64_t>();
  uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  int64_t* sc = slot_scores.data_ptr<int64_t>();
  int32_t* ep = slot_epochs.data_ptr<int32_t>();
  int64_t* ts = keeps_timestamps(strategy) ? slot_timestamps.data_ptr<int64_t>() : nullptr;
  int64_t* out = indices.data_ptr<int64_t>();
  int8_t* res = results.data_ptr<int8_t>();
  // The displaced key and score of an evicting insert, by key position.
  std::vector<int64_t> ev_key(n), ev_score(n);
  const int64_t dflt = default_key_score(strategy, call_score);
  const int32_t e32 = static_cast<int32_t>(epoch);

  BucketOrder(n, P.bucket.data(), L.num_buckets())
      .run(
          [&](int64_t i) {
            const int64_t base = P.bucket[i] * L.cap;
            const int64_t key_score = ks ? ks[i] : dflt;
            int free_slot;
            int s = find_in_bucket<true>(sd + base, sk + base, L.cap, P.digest[i], k[i], &free_slot);
            if (s >= 0) {
              sc[base + s] = score_on_access(strategy, sc[base + s], call_score, key_score);
              res[i] = kAssigned;
            } else {
              s = free_slot;
              res[i] = kInserted;
              if (s < 0 && may_evict(strategy) && (!may_evict_table || may_evict_table[tids ? tids[i] : 0])) {
                s = pick_victim(sc + base, ep + base, L.cap, e32);
                if (s >= 0) {
                  ev_key[i] = sk[base + s];
                  ev_score[i] = sc[base + s];
                  res[i] = kEvicted;
                }
              }
              if (s < 0) {
                res[i] = kFailed;
                out[i] = -1;
                return;
              }
              sk[base + s] = k[i];
              sd[base + s] = P.digest[i];
              sc[base + s] = score_on_insert(strategy, call_score, key_score);
            }
            if (ts) ts[base + s] = call_score;
            ep[base + s] = e32;
            out[i] = base + s;
          },
          [&](int64_t i) { prefetch_bucket(sd, P.bucket[i] * L.cap, L.cap); });

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

  Tensor e_keys, e_tids, e_idx, e_scores;
  int64_t *ekp, *etp, *eip, *esp;
  compact(
      n, [&](int64_t i) { return res[i] == kEvicted; },
      [&](int64_t m) {
        ekp = (e_keys = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        etp = (e_tids = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        eip = (e_idx = new_tensor(m, at::kLong)).data_ptr<int64_t>();
        esp = (e_scores = new_tensor(m, at::kLong)).data_ptr<int64_t>();
      },
      [&](int64_t i, int64_t o) {
        ekp[o] = ev_key[i];
        etp[o] = tids ? tids[i] : 0;
        eip[o] = out[i];
        esp[o] = ev_score[i];
      });
  return {indices, results, e_keys, e_tids, e_idx, e_scores};
}

// ---- erase -----------------------------------------------------------------------

Tensor erase_cpu(const Tensor& slot_keys, const Tensor& slot_digests, const Tensor& table_buckets,
                 const Tensor& sizes, const Tensor& keys, const std::optional<Tensor>& table_ids,
                 int64_t bucket_capacity) {
  const Layout L = make_layout(table_buckets, bucket_capacity);
  check_slots(slot_keys, at::kLong, "slot_keys", L);
  check_slots(slot_digests, at::kByte, "slot_digests", L);
  check_tensor(sizes, at::kLong, "sizes");
  TORCH_CHECK(sizes.numel() == L.num_tables, "dynamicemb: sizes must hold one entry per table");
  const int64_t n = check_keys(keys, table_ids, std::nullopt);
  Tensor erased = new_tensor(n, at::kBool);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* tids = opt_ptr(table_ids);
  const Placed P = place_keys(k, tids, n, L);
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  uint8_t* sd = slot_digests.data_ptr<uint8_t>();
  bool* er = erased.data_ptr<bool>();
  BucketOrder(n, P.bucket.data(), L.num_buckets())
      .run(
          [&](int64_t i) {
            const int64_t base = P.bucket[i] * L.cap;
            const int s = find_in_bucket<false>(sd + base, sk + base, L.cap, P.digest[i], k[i], nullptr);
            er[i] = s >= 0;
            if (s >= 0) sd[base + s] = kErased;
          },
          [&](int64_t i) { prefetch_bucket(sd, P.bucket[i] * L.cap, L.cap); });
  const std::vector<int64_t> cnt = tally_by_table(n, tids, L.num_tables, 1, [&](int64_t i) { return er[i] ? 0 : -1; });
  int64_t* sz = sizes.data_ptr<int64_t>();
  for (int64_t t = 0; t < L.num_tables; ++t) sz[t] -= cnt[t];
  return erased;
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
  Tensor nk = new_tensor(S, at::kLong), nd = new_tensor(S, at::kByte), ns = new_tensor(S, at::kLong);
  Tensor nt = with_ts ? new_tensor(S, at::kLong) : new_tensor(0, at::kLong);
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
  m.impl("table_lookup_refresh", &lookup_refresh_cpu);
  m.impl("table_insert", &insert_cpu);
  m.impl("table_erase", &erase_cpu);
  m.impl("table_export_range", &export_range_cpu);
  m.impl("table_rehash", &rehash_cpu);
}

}  // namespace table
}  // namespace dynamicemb
