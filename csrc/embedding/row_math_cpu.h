// The innermost row loops of the CPU embedding kernels. They are cloned for
// AVX-512, AVX2 and baseline x86-64 and picked at load time (GCC
// target_clones), so one portable build runs at the machine's vector width.
// FMA contraction stays off (-ffp-contract=off): results do not depend on
// the clone picked.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

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

// uint8 rows (bag_checks.h: n codes, then float32 scale and bias, unaligned):
// each element dequantized as q * scale + bias, then added as a float's.
DE_ROW_CLONES static void add_scaled(float* __restrict acc, const uint8_t* __restrict x, float s, int64_t n) {
  float scale, bias;
  std::memcpy(&scale, x + n, sizeof scale);
  std::memcpy(&bias, x + n + sizeof scale, sizeof bias);
  for (int64_t i = 0; i < n; ++i) acc[i] += s * (static_cast<float>(x[i]) * scale + bias);
}

// Half and bfloat16 rows: converted element by element.
template <class W>
static void add_scaled(float* __restrict acc, const W* __restrict x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += s * static_cast<float>(x[i]);
}

namespace rows_detail {
// 8 floats in a vector register (two on baseline x86-64); loads and stores
// are unaligned (memcpy), written inline: a function passing this type by
// value would change its ABI with the clone's target.
typedef float f32x8 __attribute__((vector_size(32)));
// Stores through this unaligned view: a memcpy of a vector compiled to a
// spill and a copy loop whose reads stalled on the spill.
typedef float f32x8u __attribute__((vector_size(32), aligned(4), may_alias));
}  // namespace rows_detail

// Prefetches the `bytes` of a row (nullptr: a missing row, nothing to fetch).
template <class W>
inline void prefetch_row(const W* row, int64_t bytes) {
  if (row == nullptr) return;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + b);
}

// out[0, D) = post * (sum over l of s_l * rows[l][0, D)), added in order
// l = 0, 1, ... from 0 (s_l = scales[l], or 1 when scales is null): the sums
// of add_scaled from a zeroed acc, bit for bit, times post (1: the sums
// themselves, x * 1 being x). The sums stay in registers across rows, 64
// columns at a time, and go to out once; rows[L, ahead) are rows due next,
// prefetched kAhead on.
DE_ROW_CLONES static void sum_rows(float* __restrict out, const float* const* rows, const float* scales, int64_t L,
                                   int64_t D, int64_t ahead, float post = 1.0f) {
  using rows_detail::f32x8;
  using rows_detail::f32x8u;
  // Rows ahead (4 lines each at dim 64). 8 measured best of 4..64 on an
  // earlier Xeon; on an AMD EPYC (Zen 4, AVX-512) 32 beat 8 by 15-40%, on
  // tables in and beyond the caches (emb_forward, 164K ids, 8 x 16K..512K rows).
  constexpr int64_t kAhead = 32;
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    // Zeroed and stored one vector at a time: zeroing the whole array at
    // once compiled to a `rep stos` that cost more than the sums of a bag.
    f32x8 a[8];
    for (int k = 0; k < 8; ++k) a[k] = f32x8{};
    for (int64_t l = 0; l < L; ++l) {
      if (d0 == 0 && l + kAhead < ahead) prefetch_row(rows[l + kAhead], D * 4);
      const float* x = rows[l] + d0;
      const float s = scales ? scales[l] : 1.0f;
      for (int k = 0; k < 8; ++k) {
        f32x8 v;
        std::memcpy(&v, x + 8 * k, sizeof v);
        a[k] += s * v;
      }
    }
    for (int k = 0; k < 8; ++k) *reinterpret_cast<f32x8u*>(out + d0 + 8 * k) = a[k] * post;
  }
  for (; d0 + 8 <= D; d0 += 8) {
    f32x8 a = {};
    for (int64_t l = 0; l < L; ++l) {
      if (d0 == 0 && l + kAhead < ahead) prefetch_row(rows[l + kAhead], D * 4);
      f32x8 v;
      std::memcpy(&v, rows[l] + d0, sizeof v);
      a += (scales ? scales[l] : 1.0f) * v;
    }
    *reinterpret_cast<f32x8u*>(out + d0) = a * post;
  }
  for (; d0 < D; ++d0) {
    float a = 0.0f;
    for (int64_t l = 0; l < L; ++l) a += (scales ? scales[l] : 1.0f) * rows[l][d0];
    out[d0] = a * post;
  }
}

// Whether every element of g[0, D) is optim::finite (g - g == 0), in
// vectors: the lanes' sums of g - g stay 0 only if every element is finite
// (backward_update_cpu; an element-by-element test cost the backward 40% more time).
DE_ROW_CLONES static bool all_finite(const float* g, int64_t D) {
  using rows_detail::f32x8;
  f32x8 z = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    f32x8 v;
    std::memcpy(&v, g + d, sizeof v);
    z += v - v;
  }
  float s = 0.0f;
  for (; d < D; ++d) s += g[d] - g[d];
  for (int k = 0; k < 8; ++k) s += z[k];
  return s == 0.0f;
}

// sum_rows over uint8 rows (add_scaled's dequantization: q * scale + bias,
// then scaled by s_l and added): the sums of add_scaled from a zeroed acc,
// bit for bit, kept in registers 64 (then 16) columns at a time, times post.
DE_ROW_CLONES static void sum_rows_int8(float* __restrict out, const uint8_t* const* rows, const float* scales,
                                        int64_t L, int64_t D, int64_t ahead, float post = 1.0f) {
  using rows_detail::f32x8;
  using rows_detail::f32x8u;
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  typedef uint8_t u8x32 __attribute__((vector_size(32)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  constexpr int64_t kAhead = 48;  // rows (2 lines each at dim 64), as pool_span's add
  // Codes [h, h + 8) of q, zero-extended to int32 by a shuffle in registers
  // (a zero extension by conversion, and a direct uint8 -> float one,
  // compiled to one scalar move per element; a vector built from 8 loaded
  // bytes went through the stack and stalled on store forwarding).
#define DE_WIDEN(h)                                                                                                \
  __builtin_shufflevector(q, z, h, 16, 16, 16, h + 1, 16, 16, 16, h + 2, 16, 16, 16, h + 3, 16, 16, 16, h + 4, 16, \
                          16, 16, h + 5, 16, 16, 16, h + 6, 16, 16, 16, h + 7, 16, 16, 16)
  auto to_f32 = [](u8x32 w) {
    i32x8 i;
    std::memcpy(&i, &w, sizeof i);
    return __builtin_convertvector(i, f32x8);
  };
  auto params = [&](int64_t l, float* scale, float* bias) {
    std::memcpy(scale, rows[l] + D, sizeof *scale);
    std::memcpy(bias, rows[l] + D + sizeof *scale, sizeof *bias);
  };
  const u8x16 z = {};
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    f32x8 a[8];
    for (int k = 0; k < 8; ++k) a[k] = f32x8{};
    for (int64_t l = 0; l < L; ++l) {
      if (d0 == 0 && l + kAhead < ahead) prefetch_row(rows[l + kAhead], D + 8);
      const uint8_t* x = rows[l] + d0;
      float scale, bias;
      params(l, &scale, &bias);
      const float s = scales ? scales[l] : 1.0f;
      for (int m = 0; m < 4; ++m) {
        u8x16 q;
        std::memcpy(&q, x + 16 * m, sizeof q);
        a[2 * m] += s * (to_f32(DE_WIDEN(0)) * scale + bias);
        a[2 * m + 1] += s * (to_f32(DE_WIDEN(8)) * scale + bias);
      }
    }
    for (int k = 0; k < 8; ++k) *reinterpret_cast<f32x8u*>(out + d0 + 8 * k) = a[k] * post;
  }
  for (; d0 + 16 <= D; d0 += 16) {
    f32x8 a0 = {}, a1 = {};
    for (int64_t l = 0; l < L; ++l) {
      if (d0 == 0 && l + kAhead < ahead) prefetch_row(rows[l + kAhead], D + 8);
      float scale, bias;
      params(l, &scale, &bias);
      const float s = scales ? scales[l] : 1.0f;
      u8x16 q;
      std::memcpy(&q, rows[l] + d0, sizeof q);
      a0 += s * (to_f32(DE_WIDEN(0)) * scale + bias);
      a1 += s * (to_f32(DE_WIDEN(8)) * scale + bias);
    }
    *reinterpret_cast<f32x8u*>(out + d0) = a0 * post;
    *reinterpret_cast<f32x8u*>(out + d0 + 8) = a1 * post;
  }
#undef DE_WIDEN
  for (; d0 < D; ++d0) {
    float a = 0.0f;
    for (int64_t l = 0; l < L; ++l) {
      float scale, bias;
      params(l, &scale, &bias);
      a += (scales ? scales[l] : 1.0f) * (static_cast<float>(rows[l][d0]) * scale + bias);
    }
    out[d0] = a * post;
  }
}

// out[i] = init::uniform_value(lower, span, bits[i]) for i in [0, n), in
// vector registers (exact operations: the same floats as the scalar rule).
[[maybe_unused]] DE_ROW_CLONES static void uniform_floats(float* __restrict out, const uint32_t* __restrict bits,
                                                          int64_t n, double lower, double span) {
  for (int64_t i = 0; i < n; ++i) out[i] = init::uniform_value(lower, span, bits[i]);
}

// dst[0, n) = src[0, n), by non-temporal stores for the 64-byte lines wholly
// inside dst: for a row whose old contents are never read (an ordinary store
// first fetches each line). The lines it shares with its neighbours (a row
// of dim + 1 floats) take ordinary stores: a non-temporal store to part of a
// line leaves with the rest of the line unknown, which costs a read-modify-
// write at memory (streaming whole 260-byte rows measured 3-6x slower than
// this). Callers fence (stream_fence) before others read dst.
inline void stream_floats(float* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  constexpr int64_t kLine = 64 / sizeof(float);
  const int64_t head = static_cast<int64_t>((64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64) / sizeof(float);
  if (head + kLine <= n) {
    for (; i < head; ++i) dst[i] = src[i];
    for (; i + kLine <= n; i += kLine)
      for (int64_t q = 0; q < kLine; q += 4) _mm_stream_ps(dst + i + q, _mm_loadu_ps(src + i + q));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace embedding
}  // namespace dynamicemb
