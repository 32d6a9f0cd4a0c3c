// The innermost row loops of the CPU embedding kernels. They are cloned for
// AVX-512, AVX2 and baseline x86-64 and picked at load time (GCC
// target_clones), so one portable build runs at the machine's vector width.
// FMA contraction stays off (-ffp-contract=off): results do not depend on
// the clone picked.
#pragma once
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DE_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DE_ROW_CLONES
#endif

namespace dynamicemb {
namespace embedding {

// acc[0, n) += s * x[0, n)
DE_ROW_CLONES static void add_scaled(float* __restrict acc, const float* __restrict x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += s * x[i];
}

// Half and bfloat16 rows: converted element by element.
template <class W>
static void add_scaled(float* __restrict acc, const W* __restrict x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += s * static_cast<float>(x[i]);
}

}  // namespace embedding
}  // namespace dynamicemb
