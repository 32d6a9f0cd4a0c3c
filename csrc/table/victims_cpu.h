// Victim selection for the CPU insert: the victims of one run of a bucket's
// keys (victim_candidates, table_rules.h), with each group's victim found by
// AVX2 where the CPU has it (the scalar group_victim's chain of dependent
// selects made victim listing a quarter of an evicting insert's time), and
// for runs of up to 16 keys the same list by ranks below a threshold, or in
// one filtered pass when many scores are equal.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cpu_vectors.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace table {

#if defined(__x86_64__)
DE_AVX2 __m256i load4(const int64_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

DE_AVX2 __m256i min_epi64_avx2(__m256i a, __m256i b) {
  return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b));
}

// group_victim for 16 slots in vectors: closed slots (held, or in `skip`)
// read as INT64_MAX, the minimum is reduced across lanes, and the lowest open
// slot holding it is the victim: the same slot and score as group_victim.
DE_AVX2 int group_victim_avx2(const int64_t* scores, const Epoch* epochs, Epoch call_epoch, uint32_t skip,
                              int64_t* score) {
  const uint32_t closed = (group_match(epochs, call_epoch) | skip) & 0xFFFFu;
  if (closed == 0xFFFFu) return -1;
  const __m256i lane_bit = _mm256_set_epi64x(8, 4, 2, 1);
  const __m256i top = _mm256_set1_epi64x(INT64_MAX);
  __m256i s[4];
  for (int v = 0; v < 4; ++v) {
    const __m256i nib = _mm256_set1_epi64x((closed >> (4 * v)) & 15u);
    const __m256i shut = _mm256_cmpeq_epi64(_mm256_and_si256(nib, lane_bit), lane_bit);
    s[v] = _mm256_blendv_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scores + 4 * v)), top, shut);
  }
  __m256i m = min_epi64_avx2(min_epi64_avx2(s[0], s[1]), min_epi64_avx2(s[2], s[3]));
  m = min_epi64_avx2(m, _mm256_permute2x128_si256(m, m, 1));
  m = min_epi64_avx2(m, _mm256_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  uint32_t at_min = 0;
  for (int v = 0; v < 4; ++v)
    at_min |= static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(s[v], m)))) << (4 * v);
  *score = _mm256_extract_epi64(m, 0);
  return lowest_bit(at_min & ~closed);  // some open slot holds the minimum
}

// victim_candidates' list for few victims (r <= kFewVictims), in one pass
// over the bucket instead of a tournament: a slot enters the sorted list only
// if it is open and scores below the list's last entry once the list is full
// (4 scores per compare; slots come in increasing order, so an equal score
// loses to the listed one). The same list as victim_candidates. `*entered`
// counts the slots that entered the list: its cost.
constexpr int kFewVictims = 16;

DE_AVX2 int few_victims_avx2(const int64_t* scores, const Epoch* epochs, int cap, Epoch call_epoch, int r,
                             int* out, int* entered) {
  int64_t listed[kFewVictims];  // the scores of out[0, m)
  int m = 0, n = 0;
  uint32_t held = 0;  // of the group of 16 slots that s is in
  for (int s = 0; s < cap; s += 8) {
    if ((s & (kGroupSize - 1)) == 0) held = group_match(epochs + s, call_epoch);
    uint32_t open = ~(held >> (s & 8)) & 0xFFu;
    if (m == r) {
      const __m256i last = _mm256_set1_epi64x(listed[m - 1]);
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scores + s));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scores + s + 4));
      open &= static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(last, a)))) |
              static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(last, b)))) << 4;
    }
    for (; open; open &= open - 1) {
      const int i = s + lowest_bit(open);
      const int64_t sc = scores[i];
      if (m == r && sc >= listed[m - 1]) continue;  // the list filled up within these 8
      int p = m < r ? m++ : m - 1;                   // when full, the last entry drops out
      for (; p > 0 && listed[p - 1] > sc; --p) {
        listed[p] = listed[p - 1];
        out[p] = out[p - 1];
      }
      listed[p] = sc;
      out[p] = i;
      ++n;
    }
  }
  *entered = n;
  return m;
}

// The same list when scores lie in no slot order (after lookups refreshed
// them, say), where few_victims_avx2's list insertions are many and
// unpredictable (a quarter of an evicting insert's time), without a branch
// per slot:
//  1. 16 group minima, group (k, l) being lane l of score vectors v = k mod 4
//     (held slots read as INT64_MAX);
//  2. T, the r-th smallest of those minima: r groups have an open slot
//     scoring <= T, so the r lowest open slots all score <= T;
//  3. the open slots scoring <= T (about 1.4 r for random scores) are
//     compacted in slot order;
//  4. each one's place in the list is its rank among them (lower score, then
//     lower slot: better_victim's order).
// Returns -1, leaving the list to few_victims_avx2, for more than kRankedMax
// candidates (many equal scores) or a bucket of more than kRankedCap slots.
// Per bucket of 128 random scores: 200-300 ns against 500-650 ns for
// few_victims_avx2 (r ~ Poisson(8), hot cache).
constexpr int kRankedCap = 128, kRankedMax = 48;

DE_AVX2 uint32_t mask4(__m256i m) { return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(m))); }

DE_AVX2 __m256i max_epi64_avx2(__m256i a, __m256i b) {
  return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(b, a));
}

DE_AVX2_POPCNT int ranked_victims_avx2(const int64_t* scores, const Epoch* epochs, int cap, Epoch call_epoch,
                                       int r, int* out) {
  if (cap > kRankedCap) return -1;
  const int nv = cap / 4;  // vectors of 4 scores
  const __m256i top = _mm256_set1_epi64x(INT64_MAX), bottom = _mm256_set1_epi64x(INT64_MIN);
  const __m256i lanes = _mm256_set_epi64x(3, 2, 1, 0);
  uint32_t held[kRankedCap / kGroupSize];  // 4 bits per vector
  uint32_t any_held = 0;
  for (int g = 0; g < cap / kGroupSize; ++g) any_held |= held[g] = group_match(epochs + g * kGroupSize, call_epoch);
  auto held4 = [&held](int v) { return (held[v / 4] >> (4 * (v % 4))) & 15u; };
  // 1. (An open slot may score INT64_MAX too: openness is tracked apart.)
  __m256i mins[4] = {top, top, top, top};
  for (int v = 0; v < nv; v += 4)
    for (int k = 0; k < 4; ++k) {
      __m256i x = load4(scores + 4 * (v + k));
      if (any_held) {
        const __m256i bit = _mm256_sllv_epi64(_mm256_set1_epi64x(1), lanes);
        const __m256i shut = _mm256_and_si256(_mm256_set1_epi64x(held4(v + k)), bit);
        x = _mm256_blendv_epi8(x, top, _mm256_cmpeq_epi64(shut, bit));
      }
      mins[k] = min_epi64_avx2(mins[k], x);
    }
  // 2. Each minimum's count of smaller ones, all 16 at once (every vector
  // against every rotation of every vector); T is the largest minimum with
  // fewer than r smaller ones.
  __m256i less[4] = {};
  for (int l = 0; l < 4; ++l) {
    __m256i b = mins[l];
    for (int rot = 0; rot < 4; ++rot, b = _mm256_permute4x64_epi64(b, _MM_SHUFFLE(0, 3, 2, 1)))
      for (int k = 0; k < 4; ++k) less[k] = _mm256_sub_epi64(less[k], _mm256_cmpgt_epi64(mins[k], b));
  }
  __m256i t = bottom;
  for (int k = 0; k < 4; ++k)
    t = max_epi64_avx2(t, _mm256_blendv_epi8(bottom, mins[k], _mm256_cmpgt_epi64(_mm256_set1_epi64x(r), less[k])));
  t = max_epi64_avx2(t, _mm256_permute4x64_epi64(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = max_epi64_avx2(t, _mm256_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  // 3. Those scoring T exactly follow the others in the list, in slot order;
  // they are kept apart, so that only the ones scoring below T need ranks.
  uint64_t below[kRankedCap / 64 + 1] = {}, at[kRankedCap / 64 + 1] = {};  // bit per slot
  for (int v = 0; v < nv; ++v) {
    const __m256i x = load4(scores + 4 * v);
    const uint64_t open = ~held4(v) & 15u;
    const uint64_t eq = mask4(_mm256_cmpeq_epi64(x, t));
    below[v / 16] |= (open & ~(mask4(_mm256_cmpgt_epi64(x, t)) | eq)) << (4 * (v % 16));
    at[v / 16] |= (open & eq) << (4 * (v % 16));
  }
  alignas(32) int64_t cs[kRankedMax + 4];  // candidates below T: scores
  int ci[kRankedMax];                      // and slots
  int c = 0;
  for (int w = 0; w * 64 < cap; ++w) {
    if (c + __builtin_popcountll(below[w]) > kRankedMax) return -1;
    for (uint64_t bits = below[w]; bits; bits &= bits - 1) {
      const int i = 64 * w + __builtin_ctzll(bits);
      cs[c] = scores[i];
      ci[c++] = i;
    }
  }
  // 4. Four candidates at a time against each candidate j: j goes first if it
  // scores lower, or equal from an earlier (lower) slot.
  const int m = std::min(c, r);
  for (int i = 0; i < c; i += 4) {
    const __m256i x = load4(cs + i);
    const __m256i xi = _mm256_add_epi64(_mm256_set1_epi64x(i), lanes);
    __m256i rank = _mm256_setzero_si256();
    for (int j = 0; j < c; ++j) {
      const __m256i y = _mm256_set1_epi64x(cs[j]);
      const __m256i earlier = _mm256_cmpgt_epi64(xi, _mm256_set1_epi64x(j));
      const __m256i tie_first = _mm256_and_si256(_mm256_cmpeq_epi64(x, y), earlier);
      rank = _mm256_sub_epi64(rank, _mm256_or_si256(_mm256_cmpgt_epi64(x, y), tie_first));
    }
    alignas(32) int64_t rk[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(rk), rank);
    // Ranks from m on land in out[m], a spare entry.
    for (int l = 0; l < 4 && i + l < c; ++l) out[rk[l] < m ? rk[l] : m] = static_cast<int>(ci[i + l]);
  }
  // Then the slots scoring T, in slot order.
  int k = m;
  for (int w = 0; w * 64 < cap && k < r; ++w)
    for (uint64_t bits = at[w]; bits && k < r; bits &= bits - 1) out[k++] = 64 * w + __builtin_ctzll(bits);
  return k;
}

// The list for r <= kFewVictims by the path that suits the walk's buckets:
// few_victims_avx2 while few slots enter its list (scores rising with the
// slot, as in buckets filled by inserts and not refreshed since, or mostly
// equal), else ranked_victims_avx2, trying few_victims_avx2 again every
// kFewProbe buckets. `*path` carries the choice from bucket to bucket: 0 for
// few_victims_avx2, else the buckets since the last try, plus one.
constexpr int kFewProbe = 32;

DE_AVX2 int list_few_victims_avx2(const int64_t* scores, const Epoch* epochs, int cap, Epoch call_epoch, int r,
                                  int* out, int* path) {
  if (*path == 0 || *path == kFewProbe) {
    int entered;
    const int m = few_victims_avx2(scores, epochs, cap, call_epoch, r, out, &entered);
    *path = entered <= 2 * r + 4 ? 0 : 1;
    return m;
  }
  ++*path;
  const int m = ranked_victims_avx2(scores, epochs, cap, call_epoch, r, out);
  if (m >= 0) return m;
  *path = kFewProbe;  // many equal scores: try few_victims_avx2 next
  int entered;
  return few_victims_avx2(scores, epochs, cap, call_epoch, r, out, &entered);
}
#endif

// group_victim, in vectors where the CPU has AVX2.
struct CpuGroupVictim {
  int operator()(const int64_t* scores, const Epoch* epochs, Epoch call_epoch, uint32_t skip,
                 int64_t* score) const {
#if defined(__x86_64__)
    if (cpu::has_avx2()) return group_victim_avx2(scores, epochs, call_epoch, skip, score);
#endif
    return group_victim(scores, epochs, call_epoch, skip, score);
  }
};

// The victims of one run of a bucket's keys: the bucket's scores are scanned
// once, for as many victims as keys are left in the run: ahead of the run
// when its bucket is full, else at its first eviction. The keys of the listed
// slots are then prefetched: each eviction reads and overwrites one.
class RunVictims {
 public:
  // path: list_few_victims_avx2's choice, shared by the runs of a walk.
  explicit RunVictims(int* path) : path_(path) {}

  void build(const int64_t* scores, const Epoch* epochs, const int64_t* keys, int cap, Epoch epoch,
             int64_t keys_left) {
    cand_.resize(cap + 1);  // ranked_victims_avx2's spare entry
    const int groups = cap / kGroupSize;
    group_slot_.resize(groups);
    group_score_.resize(groups);
    taken_.resize(groups);
    const int r = static_cast<int>(std::min<int64_t>(cap, keys_left));
#if defined(__x86_64__)
    if (r >= 1 && r <= kFewVictims && cpu::has_avx2())
      m_ = list_few_victims_avx2(scores, epochs, cap, epoch, r, cand_.data(), path_);
    else
#endif
      m_ = victim_candidates(scores, epochs, cap, epoch, r, cand_.data(), group_slot_.data(), group_score_.data(),
                             taken_.data(), victim_of_group_);
    cursor_ = 0;
    for (int c = 0; c < m_; ++c) __builtin_prefetch(keys + cand_[c], 1, 1);
  }

  // The victim for a key with `keys_left` keys of the run left, itself included.
  int next(const int64_t* scores, const Epoch* epochs, const int64_t* keys, int cap, Epoch epoch,
           int64_t keys_left) {
    if (m_ < 0) build(scores, epochs, keys, cap, epoch, keys_left);
    return next_victim(cand_.data(), m_, &cursor_, epochs, epoch);
  }

  void reset() { m_ = -1; }

 private:
  CpuGroupVictim victim_of_group_;
  std::vector<int> cand_, group_slot_;  // group_*, taken_: victim_candidates' scratch
  std::vector<int64_t> group_score_;
  std::vector<uint32_t> taken_;
  int* path_;
  int m_ = -1;  // -1: not built
  int cursor_ = 0;
};

}  // namespace table
}  // namespace dynamicemb
