// One bucket held in a 16-lane tile's registers while the tile inserts the
// run of keys that a call sends to it (table_insert_cuda.cu). Lane l holds
// slots 8l .. 8l + 7: their digests (one 8-byte load, the 128-slot bucket
// in one coalesced line) and, once a key finds the bucket full, their scores
// and epochs. Each key then costs shuffles and the loads of its digest
// matches' keys, where tile_find_in_bucket reloads the digests group by group
// for every key. Each lane reads and writes only its own slots, so the keys
// of a run need no memory barrier between them.
//
// The results are those of TableRef's tile forms (find_or_free, victim):
// the key's slot; else the lowest kEmpty / kErased slot (the used slots are
// a prefix, so no live key lies past it); else the lowest (score, slot) not
// held by the call. Buckets of up to 128 slots (kSlots per lane) whose
// arrays are aligned for the wide loads (fits()); others use the tile forms.
#pragma once
#include <cstdint>

#include "table/table_ref.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace table {
namespace cuda_impl {
namespace {

class BucketRegs {
 public:
  static constexpr int kSlots = 8;  // per lane
  static constexpr int kMaxCapacity = kSlots * kGroupSize;

  // Whether ref's buckets can be held (capacity and the loads' alignment).
  static bool fits(const TableRef& r) {
    auto aligned = [](const void* p, uintptr_t a) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % a == 0; };
    return r.bucket_capacity <= kMaxCapacity && r.bucket_capacity % kGroupSize == 0 && aligned(r.digests, 8) &&
           aligned(r.scores, 16) && aligned(r.epochs, 8);
  }

  // Loads the digests of the bucket whose first slot is `base`.
  template <class Tile>
  __device__ __forceinline__ BucketRegs(const Tile& tile, const TableRef& ref, int64_t base)
      : base_(base), first_(kSlots * static_cast<int>(tile.thread_rank())), has_(first_ < ref.bucket_capacity) {
    if (has_) digests_ = *reinterpret_cast<const uint64_t*>(ref.digests + base + first_);
  }

  // The bucket-local slot holding `key` (digest d), -1 where missing.
  template <class Tile>
  __device__ __forceinline__ int find(const Tile& tile, const TableRef& ref, int64_t key, uint8_t d) const {
    int found = -1;
    if (has_) {
      uint32_t m = slots_where([d](uint32_t w) { return __vcmpeq4(w, 0x01010101u * d); });
      while (m) {
        const int j = lowest_bit(m);
        if (ref.keys[base_ + first_ + j] == key) {
          found = first_ + j;
          break;
        }
        m &= m - 1;
      }
    }
    return lowest(tile, found);
  }

  // The lowest kEmpty / kErased slot, -1 when the bucket is full.
  template <class Tile>
  __device__ __forceinline__ int first_free(const Tile& tile) const {
    int f = -1;
    if (has_) {
      const uint32_t m = slots_where([](uint32_t w) { return __vcmpltu4(w, 0x01010101u * kFirstLiveDigest); });
      if (m) f = first_ + lowest_bit(m);
    }
    return lowest(tile, f);
  }

  // The victim of a full bucket for the call holding `epoch` (-1: every slot
  // is held); loads the scores and epochs on first use.
  template <class Tile>
  __device__ __forceinline__ int victim(const Tile& tile, const TableRef& ref, Epoch epoch) {
    if (!scored_) load_scores(ref);
    int best = -1;
    int64_t best_score = 0;
    if (has_) {
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        if (static_cast<Epoch>(epochs_ >> (8 * k)) == epoch) continue;
        if (better_victim(scores_[k], first_ + k, best_score, best)) {
          best = first_ + k;
          best_score = scores_[k];
        }
      }
    }
    return tile_best_victim(tile, best, best_score);
  }

  // The lane that holds bucket-local slot s.
  static __device__ __forceinline__ int owner(int s) { return s / kSlots; }

  // The owner's registers after TableRef::commit wrote slot s (digest d,
  // epoch, and the score it returned).
  __device__ __forceinline__ void committed(int s, uint8_t d, Epoch epoch, int64_t score) {
    const int k = s - first_;
    digests_ = (digests_ & ~(0xffull << (8 * k))) | static_cast<uint64_t>(d) << (8 * k);
    if (!scored_) return;
    epochs_ = (epochs_ & ~(0xffull << (8 * k))) | static_cast<uint64_t>(epoch) << (8 * k);
#pragma unroll
    for (int j = 0; j < kSlots; ++j)  // constant indices keep scores_ in registers
      if (j == k) scores_[j] = score;
  }

 private:
  // Bit j set where the lane's digest j passes cmp, a per-byte __vcmp*4
  // (0xff where it holds) of 4 digests at a time.
  template <class Cmp>
  __device__ __forceinline__ uint32_t slots_where(Cmp cmp) const {
    auto bits = [](uint32_t x) { return ((x >> 7) & 1u) | ((x >> 14) & 2u) | ((x >> 21) & 4u) | ((x >> 28) & 8u); };
    return bits(cmp(static_cast<uint32_t>(digests_))) | bits(cmp(static_cast<uint32_t>(digests_ >> 32))) << 4;
  }
  // The lowest lane's non-negative s (lanes hold ascending slots), -1: none.
  template <class Tile>
  static __device__ __forceinline__ int lowest(const Tile& tile, int s) {
    const uint32_t any = tile.ballot(s >= 0);
    return any ? tile.shfl(s, lowest_bit(any)) : -1;
  }
  __device__ __forceinline__ void load_scores(const TableRef& ref) {
    scored_ = true;
    if (!has_) return;
    const int64_t s = base_ + first_;
    epochs_ = *reinterpret_cast<const uint64_t*>(ref.epochs + s);
#pragma unroll
    for (int k = 0; k < kSlots; k += 2) {
      const longlong2 v = *reinterpret_cast<const longlong2*>(ref.scores + s + k);
      scores_[k] = v.x;
      scores_[k + 1] = v.y;
    }
  }

  int64_t base_;
  int first_;  // the lane's first bucket-local slot
  bool has_;   // whether the lane holds slots (capacity > first_)
  bool scored_ = false;
  uint64_t digests_ = 0, epochs_ = 0;
  int64_t scores_[kSlots] = {};
};

}  // namespace
}  // namespace cuda_impl
}  // namespace table
}  // namespace dynamicemb
