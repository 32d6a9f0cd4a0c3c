// The rules of the scored hash table, shared by the CPU (table_*_cpu.cpp) and
// CUDA (table_*_cuda.cu) backends so that both place, find, score and evict
// keys identically. Everything here is a small host/device function over one
// bucket; TableRef (table_ref.h) composes them over a whole table, and the
// bulk kernels only decide which keys run where.
//
// Layout: one physical table of buckets, each `bucket_capacity` slots. Logical
// table t owns buckets [table_buckets[t], table_buckets[t+1]). A slot holds a
// key (int64), a digest (uint8) and a score (int64). The digest doubles as the
// slot state, so that every int64 is a legal key:
//   kEmpty  (0)  never used. Inserts fill the lowest free slot, so the used
//                slots of a bucket form a prefix: a scan stops at kEmpty.
//   kErased (1)  a tombstone left by erase; reused before any live slot.
//   2..255       live, the digest of the key's hash.
#pragma once
#include <cstdint>

#include "common/hd.h"

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#define DE_HAVE_SSE2 1
#endif

namespace dynamicemb {
namespace table {

constexpr uint8_t kEmpty = 0;
constexpr uint8_t kErased = 1;
constexpr uint8_t kFirstLiveDigest = 2;
// Digests are compared 16 at a time (one SSE2 register; one CUDA tile).
constexpr int kGroupSize = 16;

// The insert call that last wrote a slot: the running call holds the slots
// whose epoch is its own (it never evicts them). One byte, so that a victim
// search reads two lines of a 128-slot bucket's epochs, not eight; callers
// number calls 1..kMaxEpoch and clear every slot's epoch when they wrap.
using Epoch = uint8_t;
constexpr int64_t kMaxEpoch = 255;

// Values match dynamicemb.DynamicEmbScoreStrategy / ScoredHashTable in Python.
enum ScoreStrategy : int64_t {
  kTimestamp = 0,     // score = clock at the last access (LRU)
  kStep = 1,          // score = caller's step at the last access
  kCustomized = 2,    // score = value given with the key
  kLfu = 3,           // score = number of accesses (incremented by a frequency)
  kNoEviction = 4,    // never evicts; score = clock at the last access
  kTimestampLfu = 5,  // evicts by access count, keeps the last access time too
};

// Per-key outcome of an insert, matching dynamicemb.InsertResult.
enum InsertResult : int8_t {
  kInserted = 0,  // stored in a free slot
  kAssigned = 1,  // already present
  kEvicted = 2,   // stored by evicting the bucket's lowest-scored slot
  kFailed = 3,    // not stored: bucket full of held slots, or NO_EVICTION
};
// Whether an insert gave the key a new row: its slot's row holds nothing of
// the key yet, and is to be initialised (table_insert_outcome).
DE_HD bool got_row(int8_t result) { return result == kInserted || result == kEvicted; }
// A key of a hold_stored insert not stored when the call began: its
// placement waits until the call's stored keys are held (never an output).
constexpr int8_t kPendingResult = 4;
// A padding key of table_insert (at or past key_count): index -1 and this
// result, which no tally counts and no caller takes for a stored key.
constexpr int8_t kPaddingResult = kAssigned;
// The bucket of a padding key: past every real one (the CUDA kernels sort
// keys by bucket, so padding comes last and forms no run they process).
constexpr int32_t kPaddingBucket = 0x7fffffff;

// ---- hashing -------------------------------------------------------------

// MurmurHash3's 64-bit finalizer.
DE_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

DE_HD uint64_t key_hash(int64_t key) {
  return fmix64(static_cast<uint64_t>(key));
}

DE_HD uint64_t mul_hi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// The bucket comes from the high bits of the hash (multiply-shift), while
// routing over ranks uses hash % world (the low bits): the keys one rank owns
// still spread over all of its buckets. Scaling the bucket count by k sends
// an old bucket's keys to k new buckets only, so grow never overflows one.
DE_HD int64_t bucket_in_table(uint64_t hash, int64_t num_buckets) {
  return static_cast<int64_t>(mul_hi64(hash, static_cast<uint64_t>(num_buckets)));
}

// The global bucket of hash `hash` in logical table t, which owns buckets
// [tb[t], tb[t + 1]).
DE_HD int64_t global_bucket(const int64_t* tb, int64_t t, uint64_t hash) {
  return tb[t] + bucket_in_table(hash, tb[t + 1] - tb[t]);
}

// Bits 32..39: independent of both the bucket (top bits) and the rank (low).
DE_HD uint8_t digest_of(uint64_t hash) {
  uint8_t d = static_cast<uint8_t>(hash >> 32);
  return d < kFirstLiveDigest ? static_cast<uint8_t>(d + kFirstLiveDigest) : d;
}

DE_HD bool is_live(uint8_t digest) { return digest >= kFirstLiveDigest; }

// ---- scores ----------------------------------------------------------------

DE_HD bool counts_accesses(int64_t s) { return s == kLfu || s == kTimestampLfu; }
DE_HD bool keeps_timestamps(int64_t s) { return s == kTimestampLfu; }
DE_HD bool may_evict(int64_t s) { return s != kNoEviction; }

// The per-key score argument when the caller gives none: one access for the
// counting strategies, the call's score otherwise.
DE_HD int64_t default_key_score(int64_t s, int64_t call_score) {
  return counts_accesses(s) ? 1 : call_score;
}

// `call_score` is the call's clock (TIMESTAMP, NO_EVICTION, the pair's time)
// or step (STEP); `key_score` the key's own score (CUSTOMIZED) or frequency.
DE_HD int64_t score_on_insert(int64_t s, int64_t call_score, int64_t key_score) {
  return (counts_accesses(s) || s == kCustomized) ? key_score : call_score;
}

DE_HD int64_t score_on_access(int64_t s, int64_t old, int64_t call_score,
                              int64_t key_score) {
  if (counts_accesses(s)) {  // saturate at both limits (signed overflow is UB)
    if (key_score > 0 && old > INT64_MAX - key_score) return INT64_MAX;
    if (key_score < 0 && old < INT64_MIN - key_score) return INT64_MIN;
    return old + key_score;
  }
  return s == kCustomized ? key_score : call_score;
}

// Whether accesses of one slot leave the same score in any order (the score
// is the call's), so that a call's accesses may be committed in parallel.
DE_HD bool access_order_free(int64_t s) { return !counts_accesses(s) && s != kCustomized; }

// An access of the key at `slot`: its score, and its access time where the
// strategy keeps one (ts null otherwise).
DE_HD void refresh_slot(int64_t s, int64_t* sc, int64_t* ts, int64_t slot, int64_t call_score,
                        int64_t key_score) {
  sc[slot] = score_on_access(s, sc[slot], call_score, key_score);
  if (ts) ts[slot] = call_score;
}

// ---- slot scan ---------------------------------------------------------------

// Bit i set where group[i] == want, for the 16 digests of a group.
DE_HD uint32_t group_match(const uint8_t* group, uint8_t want) {
#if defined(DE_HAVE_SSE2)
  const __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
  return static_cast<uint32_t>(
      _mm_movemask_epi8(_mm_cmpeq_epi8(g, _mm_set1_epi8(static_cast<char>(want)))));
#else
  uint32_t m = 0;
  for (int i = 0; i < kGroupSize; ++i) m |= static_cast<uint32_t>(group[i] == want) << i;
  return m;
#endif
}

// Bit i set where group[i] is kEmpty or kErased (digest < 2).
DE_HD uint32_t group_free(const uint8_t* group) {
#if defined(DE_HAVE_SSE2)
  const __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
  // digest < 2  <=>  max(digest, 1) == 1
  const __m128i one = _mm_set1_epi8(1);
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(g, one), one)));
#else
  uint32_t m = 0;
  for (int i = 0; i < kGroupSize; ++i) m |= static_cast<uint32_t>(group[i] < kFirstLiveDigest) << i;
  return m;
#endif
}

DE_HD int lowest_bit(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __ffs(m) - 1;
#else
  return __builtin_ctz(m);
#endif
}

// The lowest kEmpty/kErased slot of a bucket (the slot an insert of a new key
// takes), or -1 when it is full.
DE_HD int first_free_slot(const uint8_t* digests, int capacity) {
  for (int g = 0; g < capacity; g += kGroupSize) {
    const uint32_t f = group_free(digests + g);
    if (f) return g + lowest_bit(f);
  }
  return -1;
}

// Finds `key` (digest `d`) among the live slots of one bucket; returns its slot
// or -1. With `first_free`, also reports the lowest kEmpty/kErased slot (-1 when
// the bucket is full): the slot an insert takes.
template <bool kWantFree>
DE_HD int find_in_bucket(const uint8_t* digests, const int64_t* keys, int capacity,
                         uint8_t d, int64_t key, int* first_free) {
  if (kWantFree) *first_free = -1;
  for (int g = 0; g < capacity; g += kGroupSize) {
    uint32_t m = group_match(digests + g, d);
    while (m) {
      const int i = lowest_bit(m);
      if (keys[g + i] == key) return g + i;
      m &= m - 1;
    }
    const uint32_t empty = group_match(digests + g, kEmpty);
    if (kWantFree && *first_free < 0) {
      const uint32_t f = group_free(digests + g);
      if (f) *first_free = g + lowest_bit(f);
    }
    if (empty) return -1;  // the used slots are a prefix: nothing further
  }
  return -1;
}

#if defined(__CUDACC__)
// find_in_bucket for a 16-lane tile (cooperative_groups::thread_block_tile<16>):
// lane l holds slot g + l of each group, so the 16 digests are one coalesced
// load and group_match / group_free become ballots. Same result as the scalar
// twin: the lowest matching slot of the first group with a match, the lowest
// free slot up to the group that holds kEmpty. Every lane returns the result.
template <bool kWantFree, class Tile>
__device__ __forceinline__ int tile_find_in_bucket(const Tile& tile, const uint8_t* digests,
                                                   const int64_t* keys, int capacity, uint8_t d,
                                                   int64_t key, int* first_free) {
  const int lane = static_cast<int>(tile.thread_rank());
  if constexpr (kWantFree) *first_free = -1;
  for (int g = 0; g < capacity; g += kGroupSize) {
    const uint8_t mine = digests[g + lane];
    const uint32_t hit = tile.ballot(mine == d && keys[g + lane] == key);
    if (hit) return g + lowest_bit(hit);
    if constexpr (kWantFree) {
      if (*first_free < 0) {
        const uint32_t f = tile.ballot(mine < kFirstLiveDigest);
        if (f) *first_free = g + lowest_bit(f);
      }
    }
    if (tile.ballot(mine == kEmpty)) return -1;  // the used slots are a prefix
  }
  return -1;
}

// The find-only twin of tile_find_in_bucket<false> (no free slot wanted), for
// the 16-lane tiles of lookup_refresh and erase (table_lookup: tile_find_key16):
// lane l reads 4 digests (one 4-byte load) of each span of 64 slots, so a
// default bucket costs at most 2 dependent loads instead of 8. Same result:
// the lowest slot holding the key (a match is never past a kEmpty slot, the
// used slots being a prefix). Every lane returns it. Measured on an H200
// (1M keys into 64M slots): hits at LF 0.5 3.96 -> 4.31, misses 3.52 -> 4.24,
// hits at LF 1.0 3.01 -> 3.52 x2^30 keys/s; 8 digests a lane (128-slot
// spans) was slower for hits in half-full buckets.
template <class Tile>
__device__ __forceinline__ int tile_find_key(const Tile& tile, const uint8_t* digests, const int64_t* keys,
                                             int capacity, uint8_t d, int64_t key) {
  const int lane = static_cast<int>(tile.thread_rank());
  constexpr int kSpan = 4 * kGroupSize;
  for (int g = 0; g < capacity; g += kSpan) {
    const int s0 = g + 4 * lane;
    int found = -1;
    bool empty = false;
    if (s0 < capacity) {  // capacity is a multiple of 16: 4-byte aligned spans
      const uint32_t w = *reinterpret_cast<const uint32_t*>(digests + s0);
      for (int b = 0; b < 4 && found < 0; ++b) {
        const uint8_t x = static_cast<uint8_t>(w >> (8 * b));
        empty |= x == kEmpty;
        if (x == d && keys[s0 + b] == key) found = s0 + b;
      }
    }
    const uint32_t hit = tile.ballot(found >= 0);
    if (hit) return tile.shfl(found, lowest_bit(hit));
    if (tile.ballot(empty)) return -1;
  }
  return -1;
}

// tile_find_key for a tile of kLanes lanes that each read 16 digests (one
// 16-byte load) of each span of 16 * kLanes slots: with 8 lanes a 128-slot
// bucket is one coalesced 128-byte load, and a warp looks up 4 keys at a time
// (2 with 16 lanes), so more keys are in flight. digests + 16-byte multiples
// must be 16-byte aligned. Same result; every lane returns it.
template <int kLanes, class Tile>
__device__ __forceinline__ int tile_find_key16(const Tile& tile, const uint8_t* digests, const int64_t* keys,
                                               int capacity, uint8_t d, int64_t key) {
  const int lane = static_cast<int>(tile.thread_rank());
  const uint32_t want = 0x01010101u * d, none = 0x01010101u * kEmpty;
  for (int g = 0; g < capacity; g += 16 * kLanes) {
    const int s0 = g + 16 * lane;
    int found = -1;
    bool empty = false;
    if (s0 < capacity) {  // capacity is a multiple of 16: whole 16-byte spans
      const uint4 v = *reinterpret_cast<const uint4*>(digests + s0);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        empty |= __vcmpeq4(w[k], none) != 0;
        uint32_t m = __vcmpeq4(w[k], want) & 0x01010101u;  // bit 8j: byte j matches
        while (m && found < 0) {
          const int s = s0 + 4 * k + lowest_bit(m) / 8;
          if (keys[s] == key) found = s;
          m &= m - 1;
        }
      }
    }
    const uint32_t hit = tile.ballot(found >= 0);
    if (hit) return tile.shfl(found, lowest_bit(hit));
    if (tile.ballot(empty)) return -1;
  }
  return -1;
}
#endif

// The first live slot whose digest is `d` (the slot find_in_bucket checks
// first), or -1: lets a caller look at that slot's key (prefetch it, or
// compare it: find_from_candidate) ahead of the search.
DE_HD int first_digest_match(const uint8_t* digests, int capacity, uint8_t d) {
  for (int g = 0; g < capacity; g += kGroupSize) {
    const uint32_t m = group_match(digests + g, d);
    if (m) return g + lowest_bit(m);
    if (group_match(digests + g, kEmpty)) return -1;
  }
  return -1;
}

// find_in_bucket<false>, given first = first_digest_match(digests, capacity,
// d) found earlier: most keys end at that first candidate.
DE_HD int find_from_candidate(const uint8_t* digests, const int64_t* keys, int capacity, uint8_t d,
                              int64_t key, int first) {
  if (first < 0) return -1;
  if (keys[first] == key) return first;
  return find_in_bucket<false>(digests, keys, capacity, d, key, nullptr);
}

// The victim order: lower score first, then lower slot index.
DE_HD bool better_victim(int64_t score, int slot, int64_t best_score, int best_slot) {
  return best_slot < 0 || score < best_score || (score == best_score && slot < best_slot);
}

// The victim, the slot a new key evicts from a full bucket: the first in
// better_victim's order among the slots this call does not hold (epoch !=
// call epoch); none when every slot is held. Found per key by the CUDA tile
// (tile_pick_victim) and for a run of keys on the CPU (victim_candidates).

// The victim among one group of 16 slots, leaving out also the slots whose
// bit is set in `skip`: the group's best slot (index in the group, -1 when
// none is left) and its score. Selections by masks, not branches (compilers
// turn a conditional move into a jump at will): each comparison's outcome is
// data, not a pattern.
DE_HD int group_victim(const int64_t* scores, const Epoch* epochs, Epoch call_epoch, uint32_t skip,
                       int64_t* score) {
  int best = -1;
  int64_t best_score = 0;
  for (int i = 0; i < kGroupSize; ++i) {
    const bool open = (epochs[i] != call_epoch) & !((skip >> i) & 1u);
    const int64_t take = -static_cast<int64_t>(open & ((best < 0) | (scores[i] < best_score)));
    best_score = (scores[i] & take) | (best_score & ~take);
    best = (i & static_cast<int>(take)) | (best & ~static_cast<int>(take));
  }
  *score = best_score;
  return best;
}

// The victims of several keys of one bucket in a row. Slots the call does not
// hold never change during the call (every slot a key writes becomes held), so
// the victim order over them is fixed: `out` gets the r lowest non-held slots
// in victim order (fewer when fewer are free to take), and it returns how
// many. If r keys remain in the bucket's run when this is built, at most r - 1
// of the listed slots become held before the last of them evicts, so the
// first listed slot not held at that time (next_victim) is the victim. The list is drawn as from a tournament: each group's best slot,
// then r times the best of those, its group's next best taking its place.
// `group_slot`, `group_score` and `taken` are scratch of capacity / 16 each.
// `victim_of_group` has group_victim's signature and result (a backend may
// pass a vector form of it).
template <class GroupVictim>
DE_HD int victim_candidates(const int64_t* scores, const Epoch* epochs, int capacity,
                            Epoch call_epoch, int r, int* out, int* group_slot, int64_t* group_score,
                            uint32_t* taken, GroupVictim victim_of_group) {
  const int groups = capacity / kGroupSize;
  for (int g = 0; g < groups; ++g) {
    taken[g] = 0;
    group_slot[g] = victim_of_group(scores + g * kGroupSize, epochs + g * kGroupSize, call_epoch, 0, &group_score[g]);
  }
  int m = 0;
  while (m < r) {
    int bg = -1;
    for (int g = 0; g < groups; ++g) {
      if (group_slot[g] >= 0 &&
          (bg < 0 || better_victim(group_score[g], g * kGroupSize + group_slot[g], group_score[bg],
                                   bg * kGroupSize + group_slot[bg])))
        bg = g;
    }
    if (bg < 0) break;
    out[m++] = bg * kGroupSize + group_slot[bg];
    taken[bg] |= 1u << group_slot[bg];
    group_slot[bg] = victim_of_group(scores + bg * kGroupSize, epochs + bg * kGroupSize, call_epoch, taken[bg],
                                     &group_score[bg]);
  }
  return m;
}

// The next victim from victim_candidates' list: the first listed slot not held
// now; `*cursor` skips the ones taken (held slots stay held). -1 when every
// listed slot is held, which with a list shorter than r means every slot is.
DE_HD int next_victim(const int* cand, int m, int* cursor, const Epoch* epochs,
                      Epoch call_epoch) {
  while (*cursor < m && epochs[cand[*cursor]] == call_epoch) ++*cursor;
  return *cursor < m ? cand[*cursor] : -1;
}

#if defined(__CUDACC__)
// The victim order's minimum over a 16-lane tile, each lane holding its own
// candidate (best = -1: none): a butterfly reduction under better_victim.
// (score, slot) is a total order, so every lane returns the one victim.
template <class Tile>
__device__ __forceinline__ int tile_best_victim(const Tile& tile, int best, int64_t best_score) {
  for (int off = kGroupSize / 2; off > 0; off /= 2) {
    const int other = tile.shfl_xor(best, off);
    const int64_t other_score = tile.shfl_xor(best_score, off);
    if (other >= 0 && better_victim(other_score, other, best_score, best)) {
      best = other;
      best_score = other_score;
    }
  }
  return best;
}

// The victim for a 16-lane tile: each lane takes slots lane, lane + 16, ...,
// then a butterfly reduction under better_victim. (score, slot) is a total
// order, so the minimum is the victim. Every lane returns it.
template <class Tile>
__device__ __forceinline__ int tile_pick_victim(const Tile& tile, const int64_t* scores,
                                                const Epoch* epochs, int capacity,
                                                Epoch call_epoch) {
  int best = -1;
  int64_t best_score = 0;
  for (int i = static_cast<int>(tile.thread_rank()); i < capacity; i += kGroupSize) {
    if (epochs[i] == call_epoch) continue;
    if (better_victim(scores[i], i, best_score, best)) {
      best = i;
      best_score = scores[i];
    }
  }
  return tile_best_victim(tile, best, best_score);
}
#endif

// ---- layout ------------------------------------------------------------------

// The logical table owning global bucket b: the last t with tb[t] <= b, i.e.
// std::upper_bound(tb, tb + num_tables + 1, b) - tb - 1.
DE_HD int64_t table_of_bucket(const int64_t* tb, int64_t num_tables, int64_t b) {
  int64_t lo = 0, hi = num_tables + 1;  // the first index with tb[i] > b lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (tb[mid] <= b) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

}  // namespace table
}  // namespace dynamicemb
