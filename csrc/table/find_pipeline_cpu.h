// The CPU's pipeline for finding many keys at once, over TableRef's scalar
// find: table_lookup, table_lookup_gather, table_erase / take
// (table_lookup_cpu.cpp) and the fused eval forward (lookup_forward_cpu.cpp).
// Plus the prefetch helpers the CPU table kernels share.
#pragma once
#include <algorithm>
#include <cstdint>

#include "table/table_ref.h"

namespace dynamicemb {
namespace table {

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 1); }
inline void prefetch_write(const void* p) { __builtin_prefetch(p, 1, 1); }

// Prefetches the digests of the bucket at slot `base` (both lines for 128 slots).
inline void prefetch_bucket(const TableRef& r, int64_t base) {
  prefetch(r.digests + base);
  if (r.bucket_capacity > 64) prefetch(r.digests + base + 64);
}

// Fetches every cache line of a[0 .. n), for writing with kWrite.
template <bool kWrite = false, class T>
void prefetch_range(const T* a, int64_t n) {
  constexpr uintptr_t kLineBytes = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(a + n);
  for (uintptr_t l = reinterpret_cast<uintptr_t>(a) & ~(kLineBytes - 1); l < end; l += kLineBytes)
    __builtin_prefetch(reinterpret_cast<const void*>(l), kWrite, 1);
}

// Finds keys [b, e) in a software pipeline over blocks of B keys, so that the
// cache misses of one key overlap with other keys' work: at step s, stage k
// works on block s - k and touches only lines that stage k - 1 prefetched a
// step earlier.
//   0 place:  hash, bucket, digest; prefetch the bucket's digests
//   1 probe:  scan the digests; prefetch the first candidate's key
//   2 find:   compare the candidate's key (a full search only after a
//             digest's false match) -> slot
//   3 after:  (Keys::kAfter) e.g. copy each key's row, prefetched by found
// `keys` (copied: a local the compiler keeps in registers) says where key i
// lives and takes its result:
//   int64_t table(i)        its logical table, -1 when it has none (then
//                           found(i, -1))
//   const TableRef& ref(i)  its table's ref (where table(i) >= 0)
//   int64_t key(i)
//   void found(i, slot)     its global slot or -1, in order of i
//   void after(i)           with kAfter, one block after found
template <int64_t B, class Keys>
void find_pipelined(int64_t b, int64_t e, Keys keys) {
  constexpr int kStages = 3;
  int64_t base[kStages][B];  // the bucket's first slot, -1: no table
  uint8_t dg[kStages][B];
  int32_t cand[kStages][B];  // TableRef::candidate
  const int64_t blocks = (e - b + B - 1) / B;
  auto first = [&](int64_t blk) { return b + blk * B; };
  auto size = [&](int64_t blk) { return std::min(B, e - first(blk)); };
  auto place = [&](int64_t blk) {
    int64_t* bs = base[blk % kStages];
    uint8_t* ds = dg[blk % kStages];
    for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) {
      const int64_t t = keys.table(i);
      if (t < 0) {
        bs[j] = -1;
        continue;
      }
      const TableRef& r = keys.ref(i);
      const Probe p = r.probe(t, keys.key(i));
      bs[j] = p.base;
      ds[j] = p.digest;
      prefetch_bucket(r, p.base);
    }
  };
  auto probe = [&](int64_t blk) {
    const int64_t* bs = base[blk % kStages];
    const uint8_t* ds = dg[blk % kStages];
    int32_t* cs = cand[blk % kStages];
    for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) {
      if (bs[j] < 0) continue;
      const TableRef& r = keys.ref(i);
      const int c = r.candidate(Probe{bs[j], ds[j]});
      cs[j] = c;
      if (c >= 0) prefetch(r.keys + bs[j] + c);
    }
  };
  auto find = [&](int64_t blk) {
    const int64_t* bs = base[blk % kStages];
    const uint8_t* ds = dg[blk % kStages];
    const int32_t* cs = cand[blk % kStages];
    for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i)
      keys.found(i, bs[j] < 0 ? -1 : keys.ref(i).find_from(Probe{bs[j], ds[j]}, keys.key(i), cs[j]));
  };
  auto after = [&](int64_t blk) {
    for (int64_t j = 0, i = first(blk); j < size(blk); ++j, ++i) keys.after(i);
  };
  auto live = [&](int64_t blk) { return blk >= 0 && blk < blocks; };
  for (int64_t s = 0; s < blocks + kStages; ++s) {
    if (live(s)) place(s);
    if (live(s - 1)) probe(s - 1);
    if (live(s - 2)) find(s - 2);
    if constexpr (Keys::kAfter) {
      if (live(s - 3)) after(s - 3);
    }
  }
}

}  // namespace table
}  // namespace dynamicemb
