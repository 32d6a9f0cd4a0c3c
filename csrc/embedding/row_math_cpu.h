// The innermost row loops of the CPU embedding kernels. They are cloned for
// AVX-512, AVX2 and baseline x86-64 and picked at load time (GCC
// target_clones), so one portable build runs at the machine's vector width.
// FMA contraction stays off (-ffp-contract=off): results do not depend on
// the clone picked.
#pragma once
#include <cstdint>

#include "embedding/init_rules.h"

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

// The UNIFORM initial row of `key` into v[0, dim): init::fill_row's values
// (same Philox outputs, same double math), 16 blocks (64 elements) at a time.
[[maybe_unused]] DE_ROW_CLONES static void uniform_row(float* __restrict v, const init::Args& a, uint64_t seed,
                                                       int64_t key, int64_t dim) {
  constexpr int N = 16;
  for (int64_t b = 0; 4 * b < dim; b += N) {
    uint32_t o[4][N];
    init::philox4_blocks<N>(seed, a.stream, key, static_cast<uint64_t>(b), o);
    float x[4 * N];
    for (int l = 0; l < N; ++l)
      for (int i = 0; i < 4; ++i)
        x[4 * l + i] = static_cast<float>(a.lower + (a.upper - a.lower) * init::unit(o[i][l]));
    const int64_t m = dim - 4 * b < 4 * N ? dim - 4 * b : 4 * N;
    for (int64_t j = 0; j < m; ++j) v[4 * b + j] = x[j];
  }
}

}  // namespace embedding
}  // namespace dynamicemb
