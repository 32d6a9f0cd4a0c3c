// Victim selection for the CPU insert: the victims of one run of a bucket's
// keys (victim_candidates, table_rules.h), with each group's victim found by
// AVX2 where the CPU has it (the scalar group_victim's chain of dependent
// selects made victim listing a quarter of an evicting insert's time), and
// for runs of up to 16 keys the same list in one filtered pass.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cpu_vectors.h"
#include "table/table_rules.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dynamicemb {
namespace table {

#if defined(__x86_64__)
#define DE_AVX2 __attribute__((target("avx2"))) inline

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
// loses to the listed one). The same list as victim_candidates.
constexpr int kFewVictims = 16;

DE_AVX2 int few_victims_avx2(const int64_t* scores, const Epoch* epochs, int cap, Epoch call_epoch, int r,
                             int* out) {
  int64_t listed[kFewVictims];  // the scores of out[0, m)
  int m = 0;
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
    }
  }
  return m;
}
#undef DE_AVX2
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
  void build(const int64_t* scores, const Epoch* epochs, const int64_t* keys, int cap, Epoch epoch,
             int64_t keys_left) {
    cand_.resize(cap);
    const int groups = cap / kGroupSize;
    group_slot_.resize(groups);
    group_score_.resize(groups);
    taken_.resize(groups);
    const int r = static_cast<int>(std::min<int64_t>(cap, keys_left));
#if defined(__x86_64__)
    if (r >= 1 && r <= kFewVictims && cpu::has_avx2())
      m_ = few_victims_avx2(scores, epochs, cap, epoch, r, cand_.data());
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
  int m_ = -1;  // -1: not built
  int cursor_ = 0;
};

}  // namespace table
}  // namespace dynamicemb
