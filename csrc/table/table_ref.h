// TableRef: a small non-owning view of one scored hash table, in the manner
// of cuCollections' static_map_ref. It holds the layout and the slot arrays
// and offers what every kernel does with them: find a key, commit an
// insert's outcome to a slot (and tally it), erase, place a bucket's keys in a
// grown layout, and map a slot to its table's row. The rules it composes
// (hash, digest, slot scan, scores, victim order) are table_rules.h's.
//
// The same type serves the CPU kernels (table_*_cpu.cpp, lookup_forward_cpu),
// the CUDA kernels (table_*_cuda.cu, embedding_cuda.cu's eval lookup) and the
// host code that builds it over an op's checked tensors (table_checks.h's
// check_layout and attach_members; make_ref in table_cpu.h / table_cuda.cuh;
// embedding/lookup_tables.h), so the placement of a key and the meaning of a
// slot are written once. Specialisations:
//  - scalar:  find / find_from / find_or_free (one thread, table_rules.h's
//             group scan, SSE2 on the CPU);
//  - CPU:     the AVX2 scan of a full bucket and the victim lists
//             (bucket_scan_cpu.h, victims_cpu.h), and the prefetching
//             pipeline over many keys (find_pipeline_cpu.h);
//  - CUDA:    the 16-lane tile forms below (one bucket per tile).
// Kernels copy the ref into a local (it is a handful of words): stores of
// digest and result bytes may alias anything read through a reference.
#pragma once
#include <cstdint>

#include "common/hd.h"
#include "table/table_registry.h"  // the counters' columns (TableCounter)
#include "table/table_rules.h"

namespace dynamicemb {
namespace table {

// A key's place in a table: the first slot of its bucket and its digest.
struct Probe {
  int64_t base;
  uint8_t digest;
};

// How a call scores its keys: the strategy, the call's score (its clock or
// step) and the per-key score argument of a key given none.
struct Scoring {
  int64_t strategy, call_score, dflt;
  static DE_HD Scoring of(int64_t strategy, int64_t call_score) {
    return Scoring{strategy, call_score, default_key_score(strategy, call_score)};
  }
  // Key i's score argument (per_key: the call's per-key scores, or null).
  DE_HD int64_t key_score(const int64_t* per_key, int64_t i) const { return per_key ? per_key[i] : dflt; }
};

// Where an old bucket's keys go in a grown layout (rehash): the logical
// table, and the `count` new buckets from global bucket `first` that the
// old bucket scales to (only its keys land there).
struct Spread {
  int64_t table, first, count;
};

struct TableRef {
  // Layout: logical table t owns buckets [table_buckets[t], table_buckets[t + 1])
  // of bucket_capacity slots each; the slot arrays hold num_buckets buckets.
  const int64_t* table_buckets = nullptr;  // on the kernels' device
  int64_t num_tables = 0;
  int64_t num_buckets = 0;
  int64_t bucket_capacity = 0;
  // Slot arrays, one entry per slot; null where the op was not given them
  // (timestamps: unless the strategy keeps them).
  int64_t* keys = nullptr;
  uint8_t* digests = nullptr;  // kEmpty, kErased, or a live key's digest
  int64_t* scores = nullptr;
  int64_t* timestamps = nullptr;
  Epoch* epochs = nullptr;  // the insert call that last wrote each slot
  // Per logical table: live keys, and counters [num_tables, kTableCounters].
  int64_t* sizes = nullptr;
  int64_t* counters = nullptr;

  // ---- layout ----------------------------------------------------------------

  DE_HD int cap() const { return static_cast<int>(bucket_capacity); }
  DE_HD bool has_table(int64_t t) const { return t >= 0 && t < num_tables; }
  // Whether table t's bucket range lies within the slot arrays (the CUDA
  // kernels check it, as they never read table_buckets on the host).
  DE_HD bool table_fits(int64_t t) const {
    const int64_t lo = table_buckets[t], hi = table_buckets[t + 1];
    return lo >= 0 && hi > lo && hi <= num_buckets;
  }
  // The global bucket of hash `hash` in table t.
  DE_HD int64_t bucket(int64_t t, uint64_t hash) const { return global_bucket(table_buckets, t, hash); }
  DE_HD Probe at_bucket(int64_t b, uint8_t digest) const { return Probe{b * bucket_capacity, digest}; }
  DE_HD Probe probe(int64_t t, int64_t key) const {
    const uint64_t h = key_hash(key);
    return at_bucket(bucket(t, h), digest_of(h));
  }
  DE_HD int64_t first_slot(int64_t t) const { return table_buckets[t] * bucket_capacity; }
  // The row of `slot` in its table t's own storage (slot minus the table's first slot).
  DE_HD int64_t row(int64_t slot, int64_t t) const { return slot - first_slot(t); }
  DE_HD int64_t table_of_slot(int64_t slot) const {
    return table_of_bucket(table_buckets, num_tables, slot / bucket_capacity);
  }

  // ---- find (scalar): global slots, -1 where missing ------------------------------

  DE_HD int64_t find(Probe p, int64_t key) const {
    return global(p, find_in_bucket<false>(digests + p.base, keys + p.base, cap(), p.digest, key, nullptr));
  }
  // The bucket's first slot with the key's digest (bucket-local, -1: none):
  // a pipeline prefetches its key, then calls find_from.
  DE_HD int candidate(Probe p) const { return first_digest_match(digests + p.base, cap(), p.digest); }
  DE_HD int64_t find_from(Probe p, int64_t key, int cand) const {
    return global(p, find_from_candidate(digests + p.base, keys + p.base, cap(), p.digest, key, cand));
  }
  // find, and the slot an insert of a new key takes (-1: the bucket is full).
  DE_HD int64_t find_or_free(Probe p, int64_t key, int64_t* free_slot) const {
    int f;
    const int s = find_in_bucket<true>(digests + p.base, keys + p.base, cap(), p.digest, key, &f);
    *free_slot = global(p, f);
    return global(p, s);
  }

  // ---- insert and access -------------------------------------------------------------

  // Writes an insert's outcome `result` for `key` (digest, score argument
  // key_score) at `slot`: a found key (kAssigned) is scored as accessed; a
  // stored one (kInserted, kEvicted) takes the slot. Either way the slot
  // becomes held by `epoch`, and stamped where timestamps are kept. The
  // caller reads an evicted key and score before.
  // Returns the slot's new score (so that a copy in registers need not read it back).
  DE_HD int64_t commit(int64_t slot, int8_t result, int64_t key, uint8_t digest, const Scoring& s,
                       int64_t key_score, Epoch epoch) const {
    int64_t score;
    if (result == kAssigned) {
      score = score_on_access(s.strategy, scores[slot], s.call_score, key_score);
    } else {
      keys[slot] = key;
      digests[slot] = digest;
      score = score_on_insert(s.strategy, s.call_score, key_score);
    }
    scores[slot] = score;
    if (timestamps) timestamps[slot] = s.call_score;
    epochs[slot] = epoch;
    return score;
  }
  // A lookup's access of the key at `slot` (lookup_refresh).
  DE_HD void refresh(int64_t slot, const Scoring& s, int64_t key_score) const {
    refresh_slot(s.strategy, scores, timestamps, slot, s.call_score, key_score);
  }
  // Adds `count` keys of table t with insert `result` to the sizes and
  // counters; add(int64_t* p, int64_t v) does *p += v (atomically on CUDA).
  template <class Add>
  DE_HD void tally_insert(int64_t t, int result, int64_t count, Add add) const {
    int64_t* c = counters + t * kTableCounters;
    switch (result) {
      case kInserted:
        add(&sizes[t], count);
        add(&c[kCountInserted], count);
        break;
      case kEvicted:
        add(&c[kCountInserted], count);
        add(&c[kCountEvicted], count);
        break;
      case kFailed:
        add(&c[kCountFailed], count);
        break;
      default:
        break;
    }
  }

  // ---- erase ---------------------------------------------------------------------------

  // Erases the key at `slot` (found by a find) unless an earlier erase of the
  // same call did; returns whether this one did.
  DE_HD bool erase(int64_t slot) const {
    if (!is_live(digests[slot])) return false;
    digests[slot] = kErased;
    return true;
  }
  template <class Add>
  DE_HD void tally_erase(int64_t t, int64_t count, Add add) const {
    add(&sizes[t], -count);
  }

  // ---- rehash (grow) ----------------------------------------------------------------

  // Where old bucket b's keys go in `to`, whose per-table bucket counts are
  // integer multiples of this one's.
  DE_HD Spread spread(int64_t b, const TableRef& to) const {
    const int64_t t = table_of_bucket(table_buckets, num_tables, b);
    const int64_t k = (to.table_buckets[t + 1] - to.table_buckets[t]) / (table_buckets[t + 1] - table_buckets[t]);
    return Spread{t, to.table_buckets[t] + k * (b - table_buckets[t]), k};
  }
  // Moves old bucket b's live slots, in slot order, to the lowest unused
  // slots of their buckets in `to`; fill(g) is the count of slots used so far
  // in new bucket g (of sp's range), an int32_t& that this advances; dest[s]
  // gets the new slot of old slot s. Only this bucket's keys land in its
  // spread, so buckets move in parallel without atomics.
  template <class Fill>
  DE_HD void rehash_bucket(int64_t b, const TableRef& to, const Spread& sp, Fill fill, int64_t* dest) const {
    const int64_t nb = to.table_buckets[sp.table + 1] - to.table_buckets[sp.table];
    for (int64_t s = b * bucket_capacity; s < (b + 1) * bucket_capacity; ++s) {
      if (!is_live(digests[s])) continue;
      const int64_t g = to.table_buckets[sp.table] + bucket_in_table(key_hash(keys[s]), nb);
      const int64_t d = g * bucket_capacity + fill(g)++;
      to.keys[d] = keys[s];
      to.digests[d] = digests[s];
      to.scores[d] = scores[s];
      if (to.timestamps) to.timestamps[d] = timestamps[s];
      dest[s] = d;
    }
  }

#if defined(__CUDACC__)
  // ---- 16-lane tile forms (cooperative_groups::thread_block_tile<16>) -------------
  // Same results as the scalar forms; every lane returns them.

  template <class Tile>
  __device__ __forceinline__ int64_t find(const Tile& tile, Probe p, int64_t key) const {
    return global(p, tile_find_key(tile, digests + p.base, keys + p.base, cap(), p.digest, key));
  }
  // find for a tile of kLanes lanes with 16-byte digest loads (needs
  // wide_digests()).
  template <int kLanes, class Tile>
  __device__ __forceinline__ int64_t find16(const Tile& tile, Probe p, int64_t key) const {
    return global(p, tile_find_key16<kLanes>(tile, digests + p.base, keys + p.base, cap(), p.digest, key));
  }
  // Whether every bucket's digests start 16-byte aligned (find16).
  bool wide_digests() const { return reinterpret_cast<uintptr_t>(digests) % 16 == 0 && bucket_capacity % 16 == 0; }
  template <class Tile>
  __device__ __forceinline__ int64_t find_or_free(const Tile& tile, Probe p, int64_t key, int64_t* free_slot) const {
    int f;
    const int s = tile_find_in_bucket<true>(tile, digests + p.base, keys + p.base, cap(), p.digest, key, &f);
    *free_slot = global(p, f);
    return global(p, s);
  }
  // The victim of the bucket at p for a call holding the slots of `epoch`
  // (-1: every slot is held).
  template <class Tile>
  __device__ __forceinline__ int64_t victim(const Tile& tile, Probe p, Epoch epoch) const {
    return global(p, tile_pick_victim(tile, scores + p.base, epochs + p.base, cap(), epoch));
  }
#endif

 private:
  static DE_HD int64_t global(Probe p, int local) { return local >= 0 ? p.base + local : -1; }
};

}  // namespace table
}  // namespace dynamicemb
