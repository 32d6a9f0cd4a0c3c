// Whole-bucket digest scans for the CPU kernels, 32 digests per compare where
// the CPU has AVX2 (table_rules.h's scans compare a group of 16 at a time,
// branching per group): the same slot as the rule they stand in for.
#pragma once
#include <cstdint>

#include "common/cpu_vectors.h"
#include "table/table_ref.h"

namespace dynamicemb {
namespace table {

#if defined(__x86_64__)
// Bit i set where digests[g + i] == d, for the 32 digests from g (16 when
// only 16 are left before cap).
DE_AVX2 uint32_t match32_avx2(const uint8_t* digests, int g, int cap, uint8_t d) {
  if (g + 32 > cap) return group_match(digests + g, d);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(digests + g));
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(static_cast<char>(d)))));
}

// find_in_bucket<true> for a full bucket (no kEmpty or kErased slot, so no
// free slot and no early stop): the lowest slot whose digest is d and key is
// `key`, or -1.
DE_AVX2 int find_in_full_bucket_avx2(const uint8_t* digests, const int64_t* keys, int cap, uint8_t d,
                                     int64_t key) {
  for (int g = 0; g < cap; g += 32)
    for (uint32_t m = match32_avx2(digests, g, cap, d); m; m &= m - 1)
      if (keys[g + lowest_bit(m)] == key) return g + lowest_bit(m);
  return -1;
}
#endif

// find_in_bucket<true>'s result for a bucket known to be full.
inline int find_in_full_bucket(const uint8_t* digests, const int64_t* keys, int cap, uint8_t d, int64_t key,
                               bool avx2) {
#if defined(__x86_64__)
  if (avx2) return find_in_full_bucket_avx2(digests, keys, cap, d, key);
#endif
  return find_in_bucket<false>(digests, keys, cap, d, key, nullptr);  // no kEmpty: scans every group
}

// TableRef::find_or_free's slot for a bucket known to be full (no free slot).
inline int64_t find_in_full(const TableRef& r, Probe p, int64_t key, bool avx2) {
  const int s = find_in_full_bucket(r.digests + p.base, r.keys + p.base, r.cap(), p.digest, key, avx2);
  return s >= 0 ? p.base + s : -1;
}

}  // namespace table
}  // namespace dynamicemb
