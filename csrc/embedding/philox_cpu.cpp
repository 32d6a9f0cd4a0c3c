// 16 Philox4x32-10 blocks at once with AVX-512 (one lane per block), or as
// two interleaved sets of 8 lanes with AVX2, for the CPU's initial rows: the same outputs as
// init_rules.h philox4, several times faster per block than the scalar
// rounds. Chosen at run time (the CPU may lack either).
#include <cstdint>

#include "common/cpu_vectors.h"
#include "embedding/init_rules.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DE_PHILOX_AVX512 1
#endif

namespace dynamicemb {
namespace init {
#if defined(DE_PHILOX_AVX512)
namespace {

// The 16 blocks of a call differ only in c3 (the block number): round 0
// multiplies (key, table), the same in every lane, and round 1's first
// product too, so those three products are scalar (exactly philox4's rounds
// 0 and 1). Per lane, round 0 leaves c2 = block ^ c2_xor, whose product
// round 1 takes; the rest is shared, and rounds 2 on use keys k0, k1.
struct SharedStart {
  uint32_t c2_xor, c0_xor, c2, c3, k0, k1;
};

inline SharedStart shared_start(uint64_t seed, int64_t table, int64_t key) {
  const auto mul = [](uint32_t m, uint32_t c) { return static_cast<uint64_t>(m) * c; };
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const uint64_t a = mul(kPhiloxM0, static_cast<uint32_t>(key)), b = mul(kPhiloxM1, static_cast<uint32_t>(table));
  const uint32_t r0c0 = static_cast<uint32_t>(b >> 32) ^ static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32) ^ k0;
  const uint32_t r0c1 = static_cast<uint32_t>(b), r0c3 = static_cast<uint32_t>(a);
  const uint32_t r0hi0 = static_cast<uint32_t>(a >> 32) ^ k1;  // round 0's c2 = this ^ c3 (per lane)
  k0 += kPhiloxW0;
  k1 += kPhiloxW1;
  const uint64_t a1 = mul(kPhiloxM0, r0c0);  // round 1's c0 product
  return SharedStart{r0hi0, r0c1 ^ k0, static_cast<uint32_t>(a1 >> 32) ^ r0c3 ^ k1, static_cast<uint32_t>(a1),
                     k0 + kPhiloxW0, k1 + kPhiloxW1};
}

// The AVX2 form: (hi, lo) of c * m for 8 lanes.
__attribute__((target("avx2"))) inline void mulhilo8(__m256i c, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(c, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Blocks first .. first + 15 as two interleaved sets of 8 lanes (their
// rounds are independent, so one hides the other's multiply latency), left
// in registers: c[i][h] lane l = output i of block first + 8 h + l.
__attribute__((target("avx2"))) inline void philox16_rounds(uint64_t seed, int64_t table, int64_t key, uint64_t first,
                                                            __m256i c[4][2]) {
  const auto u = [](uint64_t v) { return static_cast<int>(static_cast<uint32_t>(v)); };
  const SharedStart st = shared_start(seed, table, key);
  uint32_t k0 = st.k0, k1 = st.k1;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_set1_epi32(u(kPhiloxM0)), m1 = _mm256_set1_epi32(u(kPhiloxM1));
  __m256i c0[2], c1[2], c2[2], c3[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i r0c2 = _mm256_xor_si256(_mm256_add_epi32(lanes, _mm256_set1_epi32(u(first + 8 * h))),
                                          _mm256_set1_epi32(u(st.c2_xor)));
    __m256i hi1, lo1;
    mulhilo8(r0c2, m1, &hi1, &lo1);
    c0[h] = _mm256_xor_si256(hi1, _mm256_set1_epi32(u(st.c0_xor)));
    c1[h] = lo1;
    c2[h] = _mm256_set1_epi32(u(st.c2));
    c3[h] = _mm256_set1_epi32(u(st.c3));
  }
  for (int r = 2; r < 10; ++r) {  // philox4's round, lane by lane
    const __m256i key0 = _mm256_set1_epi32(u(k0)), key1 = _mm256_set1_epi32(u(k1));
    for (int h = 0; h < 2; ++h) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c0[h], m0, &hi0, &lo0);
      mulhilo8(c2[h], m1, &hi1, &lo1);
      c0[h] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[h]), key0);
      c2[h] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[h]), key1);
      c1[h] = lo1;
      c3[h] = lo0;
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int h = 0; h < 2; ++h) {
    c[0][h] = c0[h];
    c[1][h] = c1[h];
    c[2][h] = c2[h];
    c[3][h] = c3[h];
  }
}

// Blocks 8 h .. 8 h + 7 of philox16_rounds' c in the stream's order: o[q]
// holds outputs 8 q .. 8 q + 7 of those 32 (4 per block), transposed in registers.
__attribute__((target("avx2"))) inline void ordered8(const __m256i c[4][2], int h, __m256i o[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(c[0][h], c[1][h]), t1 = _mm256_unpackhi_epi32(c[0][h], c[1][h]);
  const __m256i t2 = _mm256_unpacklo_epi32(c[2][h], c[3][h]), t3 = _mm256_unpackhi_epi32(c[2][h], c[3][h]);
  const __m256i b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
  o[0] = _mm256_permute2x128_si256(b04, b15, 0x20);
  o[1] = _mm256_permute2x128_si256(b26, b37, 0x20);
  o[2] = _mm256_permute2x128_si256(b04, b15, 0x31);
  o[3] = _mm256_permute2x128_si256(b26, b37, 0x31);
}

// Blocks first .. first + 15 as two interleaved sets of 8 lanes.
// kOrdered: out[4 l + i] = output i of block first + l (the stream's order);
// else philox4_x16's layout out[16 i + l].
template <bool kOrdered>
__attribute__((target("avx2"))) void philox16_avx2(uint64_t seed, int64_t table, int64_t key, uint64_t first,
                                                    uint32_t out[64]) {
  __m256i c[4][2];
  philox16_rounds(seed, table, key, first, c);
  for (int h = 0; h < 2; ++h) {
    __m256i* o = reinterpret_cast<__m256i*>(out + 32 * h);
    if constexpr (kOrdered) {
      __m256i v[4];
      ordered8(c, h, v);
      for (int q = 0; q < 4; ++q) _mm256_storeu_si256(o + q, v[q]);
    } else {
      for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i + 8 * h), c[i][h]);
    }
  }
}

// UNIFORM's row from registers: 64 outputs at a time (the stream's order),
// each mapped exactly as init::uniform_value (lower + span * ((x + 0.5) *
// 2^-32), in double, -> float) and stored non-temporally, 8 floats at once;
// the optimizer state zeroed likewise. x + 0.5 is exact from the signed
// conversion of x - 2^31, and span32 = span * 2^-32 exactly (checked), so
// span32 * (x + 0.5) is the same real product as span * ((x + 0.5) * 2^-32)
// and rounds to the same double: two operations fewer per 4 values.
__attribute__((target("avx2"))) inline __m128 uniform4(const uint32_t* bits, __m256d lo, __m256d sp32) {
  const __m128i x = _mm_xor_si128(_mm_load_si128(reinterpret_cast<const __m128i*>(bits)), _mm_set1_epi32(INT32_MIN));
  const __m256d v = _mm256_add_pd(_mm256_cvtepi32_pd(x), _mm256_set1_pd(2147483648.5));  // x + 0.5, exactly
  return _mm256_cvtpd_ps(_mm256_add_pd(lo, _mm256_mul_pd(sp32, v)));
}

__attribute__((target("avx2"))) void stream_uniform_avx2(float* row, int64_t dim, int64_t stride, uint64_t seed,
                                                          int64_t table, int64_t key, double lower, double span32) {
  const __m256d lo = _mm256_set1_pd(lower), sp = _mm256_set1_pd(span32);
  alignas(32) uint32_t bits[64];
  for (int64_t j = 0; j < dim; j += 64) {
    philox16_avx2<true>(seed, table, key, static_cast<uint64_t>(j / 4), bits);
    for (int q = 0; q < 64; q += 8)
      _mm256_stream_ps(row + j + q, _mm256_set_m128(uniform4(bits + q + 4, lo, sp), uniform4(bits + q, lo, sp)));
  }
  for (int64_t d = dim; d < stride; d += 8) _mm256_stream_ps(row + d, _mm256_setzero_ps());
}

// (hi, lo) 32-bit halves of c * m for 16 lanes: vpmuludq on the even lanes
// and on the odd lanes shifted down; each half picked by a masked swap of
// neighbouring 32-bit values.
__attribute__((target("avx512f"))) inline void mulhilo16(__m512i c, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(c, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  *hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
  *lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
}

// philox16_rounds with 16 lanes of 512 bits: c[i] lane l = output i of
// block first + l. A lane's (hi, lo) halves come from the even and odd
// products by one masked in-lane shuffle each, and each round's two
// three-way xors are one ternary-logic operation: about a third of the AVX2
// form's operations per block.
__attribute__((target("avx512f"))) inline void philox16_rounds512(uint64_t seed, int64_t table, int64_t key,
                                                                  uint64_t first, __m512i c[4]) {
  const auto u = [](uint64_t v) { return static_cast<int>(static_cast<uint32_t>(v)); };
  constexpr int kXor3 = 0x96;  // a ^ b ^ c
  const SharedStart st = shared_start(seed, table, key);
  uint32_t k0 = st.k0, k1 = st.k1;
  const __m512i m0 = _mm512_set1_epi32(u(kPhiloxM0)), m1 = _mm512_set1_epi32(u(kPhiloxM1));
  const __m512i r0c2 = _mm512_xor_si512(
      _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(u(first))),
      _mm512_set1_epi32(u(st.c2_xor)));
  __m512i hi0, lo0, hi1, lo1;
  mulhilo16(r0c2, m1, &hi1, &lo1);
  __m512i c0 = _mm512_xor_si512(hi1, _mm512_set1_epi32(u(st.c0_xor))), c1 = lo1;
  __m512i c2 = _mm512_set1_epi32(u(st.c2)), c3 = _mm512_set1_epi32(u(st.c3));
  for (int r = 2; r < 10; ++r) {  // philox4's round, lane by lane
    mulhilo16(c0, m0, &hi0, &lo0);
    mulhilo16(c2, m1, &hi1, &lo1);
    c0 = _mm512_ternarylogic_epi32(hi1, c1, _mm512_set1_epi32(u(k0)), kXor3);
    c2 = _mm512_ternarylogic_epi32(hi0, c3, _mm512_set1_epi32(u(k1)), kXor3);
    c1 = lo1;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  c[0] = c0;
  c[1] = c1;
  c[2] = c2;
  c[3] = c3;
}

// philox16_rounds512's outputs in the stream's order: o[q] holds outputs
// 16 q .. 16 q + 15 (blocks 4 q .. 4 q + 3), by a 4 x 4 transpose of 32-bit
// values within 128-bit lanes and then one of the 128-bit lanes.
__attribute__((target("avx512f"))) inline void ordered16(const __m512i c[4], __m512i o[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(c[0], c[1]), t1 = _mm512_unpackhi_epi32(c[0], c[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(c[2], c[3]), t3 = _mm512_unpackhi_epi32(c[2], c[3]);
  // b[m] 128-bit lane k: block 4 k + m's 4 outputs.
  const __m512i b0 = _mm512_unpacklo_epi64(t0, t2), b1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i b2 = _mm512_unpacklo_epi64(t1, t3), b3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i s0 = _mm512_shuffle_i32x4(b0, b1, 0x44), s1 = _mm512_shuffle_i32x4(b2, b3, 0x44);
  const __m512i s2 = _mm512_shuffle_i32x4(b0, b1, 0xEE), s3 = _mm512_shuffle_i32x4(b2, b3, 0xEE);
  o[0] = _mm512_shuffle_i32x4(s0, s1, 0x88);
  o[1] = _mm512_shuffle_i32x4(s0, s1, 0xDD);
  o[2] = _mm512_shuffle_i32x4(s2, s3, 0x88);
  o[3] = _mm512_shuffle_i32x4(s2, s3, 0xDD);
}

// uniform4's mapping for 8 outputs: x + 0.5 exactly from the unsigned conversion.
__attribute__((target("avx512f"))) inline __m256 uniform8(__m256i bits, __m512d lo, __m512d sp32) {
  const __m512d v = _mm512_add_pd(_mm512_cvtepu32_pd(bits), _mm512_set1_pd(0.5));
  return _mm512_cvtpd_ps(_mm512_add_pd(lo, _mm512_mul_pd(sp32, v)));
}

// Blocks first .. first + 15 in philox4_x16's layout (out[16 i + l]).
__attribute__((target("avx512f"))) void philox16_avx512(uint64_t seed, int64_t table, int64_t key, uint64_t first,
                                                         uint32_t out[64]) {
  __m512i c[4];
  philox16_rounds512(seed, table, key, first, c);
  for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + 16 * i, c[i]);
}

// The same blocks in the stream's order (out[4 l + i]).
__attribute__((target("avx512f"))) void ordered_avx512(uint64_t seed, int64_t table, int64_t key, uint64_t first,
                                                        uint32_t out[64]) {
  __m512i c[4], v[4];
  philox16_rounds512(seed, table, key, first, c);
  ordered16(c, v);
  for (int q = 0; q < 4; ++q) _mm512_storeu_si512(out + 16 * q, v[q]);
}

// stream_uniform_avx2 with 512-bit rounds and conversions, straight from
// registers, for N rows at once (their rounds interleaved).
template <int N>
__attribute__((target("avx2,avx512f"))) void stream_uniform_avx512(const UniformRow* r, int64_t dim, int64_t stride,
                                                                    uint64_t seed) {
  __m512d lo[N], sp[N];
  for (int n = 0; n < N; ++n) {
    lo[n] = _mm512_set1_pd(r[n].lower);
    sp[n] = _mm512_set1_pd(r[n].span * (1.0 / 4294967296.0));  // exact: uniform_streamable
  }
  for (int64_t j = 0; j < dim; j += 64) {
    __m512i c[N][4], v[N][4];
    for (int n = 0; n < N; ++n) philox16_rounds512(seed, r[n].table, r[n].key, static_cast<uint64_t>(j / 4), c[n]);
    for (int n = 0; n < N; ++n) {
      ordered16(c[n], v[n]);
      float* row = r[n].row + j;
      for (int q = 0; q < 4; ++q) {
        _mm256_stream_ps(row + 16 * q, uniform8(_mm512_castsi512_si256(v[n][q]), lo[n], sp[n]));
        _mm256_stream_ps(row + 16 * q + 8, uniform8(_mm512_extracti64x4_epi64(v[n][q], 1), lo[n], sp[n]));
      }
    }
  }
  for (int n = 0; n < N; ++n)
    for (int64_t d = dim; d < stride; d += 8) _mm256_stream_ps(r[n].row + d, _mm256_setzero_ps());
}

enum class Simd { kNone, kAvx2, kAvx512 };

Simd simd() {
  static const Simd s = cpu::has_avx512f() ? Simd::kAvx512 : cpu::has_avx2() ? Simd::kAvx2 : Simd::kNone;
  return s;
}

}  // namespace

bool philox4_x16(uint64_t seed, int64_t table, int64_t key, uint64_t first, uint32_t out[64]) {
  switch (simd()) {
    case Simd::kAvx512:
      philox16_avx512(seed, table, key, first, out);
      return true;
    case Simd::kAvx2:
      philox16_avx2<false>(seed, table, key, first, out);
      return true;
    default:
      return false;
  }
}

bool uniform_streamable(const float* row, int64_t dim, int64_t stride, double span) {
  const double span32 = span * (1.0 / 4294967296.0);  // span * 2^-32 exactly unless it lost bits as a subnormal
  return cpu::has_avx2() && dim % 64 == 0 && stride % 8 == 0 && reinterpret_cast<uintptr_t>(row) % 32 == 0 &&
         span32 * 4294967296.0 == span;
}

bool stream_uniform_row(float* row, int64_t dim, int64_t stride, uint64_t seed, int64_t table, int64_t key,
                        double lower, double span) {
  if (!uniform_streamable(row, dim, stride, span)) return false;
  if (simd() == Simd::kAvx512) {
    const UniformRow r{row, table, key, lower, span};
    stream_uniform_avx512<1>(&r, dim, stride, seed);
  } else {
    stream_uniform_avx2(row, dim, stride, seed, table, key, lower, span * (1.0 / 4294967296.0));
  }
  return true;
}

void stream_uniform_rows2(const UniformRow& a, const UniformRow& b, int64_t dim, int64_t stride, uint64_t seed) {
  if (simd() == Simd::kAvx512) {
    const UniformRow r[2] = {a, b};
    stream_uniform_avx512<2>(r, dim, stride, seed);
  } else {
    stream_uniform_row(a.row, dim, stride, seed, a.table, a.key, a.lower, a.span);
    stream_uniform_row(b.row, dim, stride, seed, b.table, b.key, b.lower, b.span);
  }
}
#else
bool philox4_x16(uint64_t, int64_t, int64_t, uint64_t, uint32_t*) { return false; }  // no x86: one by one
bool uniform_streamable(const float*, int64_t, int64_t, double) { return false; }
bool stream_uniform_row(float*, int64_t, int64_t, uint64_t, int64_t, int64_t, double, double) { return false; }
void stream_uniform_rows2(const UniformRow&, const UniformRow&, int64_t, int64_t, uint64_t) {}
#endif

void outputs64(uint64_t seed, int64_t table, int64_t key, uint64_t first, uint32_t out[64]) {
#if defined(DE_PHILOX_AVX512)
  switch (simd()) {
    case Simd::kAvx512:
      ordered_avx512(seed, table, key, first, out);
      return;
    case Simd::kAvx2:
      philox16_avx2<true>(seed, table, key, first, out);
      return;
    default:
      break;
  }
#endif
  for (int l = 0; l < 16; ++l) philox4(seed, table, key, first + l, out + 4 * l);
}

}  // namespace init
}  // namespace dynamicemb
