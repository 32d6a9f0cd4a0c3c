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

// (hi, lo) 32-bit halves of c * m for 16 lanes: vpmuludq on the even lanes
// and on the odd lanes shifted down, blended back.
__attribute__((target("avx512f"))) inline void mulhilo16(__m512i c, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(c, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

__attribute__((target("avx512f"))) void philox16_avx512(uint64_t seed, int64_t table, int64_t key, uint64_t first,
                                                         uint32_t out[64]) {
  const auto u = [](uint64_t v) { return static_cast<int>(static_cast<uint32_t>(v)); };
  __m512i c0 = _mm512_set1_epi32(u(static_cast<uint64_t>(key)));
  __m512i c1 = _mm512_set1_epi32(u(static_cast<uint64_t>(key) >> 32));
  __m512i c2 = _mm512_set1_epi32(u(static_cast<uint64_t>(table)));
  __m512i c3 = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                _mm512_set1_epi32(u(first)));
  const __m512i m0 = _mm512_set1_epi32(u(0xD2511F53u)), m1 = _mm512_set1_epi32(u(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {  // philox4's round, lane by lane
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, m0, &hi0, &lo0);
    mulhilo16(c2, m1, &hi1, &lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(u(k0)));
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(u(k1)));
    c1 = lo1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm512_storeu_si512(out, c0);
  _mm512_storeu_si512(out + 16, c1);
  _mm512_storeu_si512(out + 32, c2);
  _mm512_storeu_si512(out + 48, c3);
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
  const auto mul = [](uint32_t m, uint32_t c) { return static_cast<uint64_t>(m) * c; };
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  // The 16 blocks differ only in c3 (the block number): round 0 multiplies
  // (key, table), the same in every lane, and round 1's first product too,
  // so those three products are scalar (exactly philox4's rounds 0 and 1).
  const uint64_t a = mul(kM0, static_cast<uint32_t>(key)), b = mul(kM1, static_cast<uint32_t>(table));
  const uint32_t r0c0 = static_cast<uint32_t>(b >> 32) ^ static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32) ^ k0;
  const uint32_t r0c1 = static_cast<uint32_t>(b), r0c3 = static_cast<uint32_t>(a);
  const uint32_t r0hi0 = static_cast<uint32_t>(a >> 32) ^ k1;  // round 0's c2 = this ^ c3 (per lane)
  k0 += kW0;
  k1 += kW1;
  const uint64_t a1 = mul(kM0, r0c0);  // round 1's c0 product
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_set1_epi32(u(kM0)), m1 = _mm256_set1_epi32(u(kM1));
  __m256i c0[2], c1[2], c2[2], c3[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i r0c2 = _mm256_xor_si256(_mm256_add_epi32(lanes, _mm256_set1_epi32(u(first + 8 * h))),
                                          _mm256_set1_epi32(u(r0hi0)));
    __m256i hi1, lo1;
    mulhilo8(r0c2, m1, &hi1, &lo1);
    c0[h] = _mm256_xor_si256(hi1, _mm256_set1_epi32(u(r0c1 ^ k0)));
    c1[h] = lo1;
    c2[h] = _mm256_set1_epi32(u(static_cast<uint32_t>(a1 >> 32) ^ r0c3 ^ k1));
    c3[h] = _mm256_set1_epi32(u(static_cast<uint32_t>(a1)));
  }
  k0 += kW0;
  k1 += kW1;
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
    k0 += kW0;
    k1 += kW1;
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

// stream_uniform_avx2 with AVX-512's conversions (8 values at once, the same
// operations lane for lane), straight from the rounds' registers: no
// round trip through memory (about 12% less time per row on an AVX-512 CPU).
__attribute__((target("avx2,avx512f"))) inline __m256 uniform8(__m256i bits, __m512d lo, __m512d sp32) {
  const __m256i x = _mm256_xor_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m512d v = _mm512_add_pd(_mm512_cvtepi32_pd(x), _mm512_set1_pd(2147483648.5));  // x + 0.5, exactly
  return _mm512_cvtpd_ps(_mm512_add_pd(lo, _mm512_mul_pd(sp32, v)));
}

__attribute__((target("avx2,avx512f"))) void stream_uniform_avx512(float* row, int64_t dim, int64_t stride,
                                                                    uint64_t seed, int64_t table, int64_t key,
                                                                    double lower, double span32) {
  const __m512d lo = _mm512_set1_pd(lower), sp = _mm512_set1_pd(span32);
  for (int64_t j = 0; j < dim; j += 64) {
    __m256i c[4][2];
    philox16_rounds(seed, table, key, static_cast<uint64_t>(j / 4), c);
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      ordered8(c, h, v);
      for (int q = 0; q < 4; ++q) _mm256_stream_ps(row + j + 32 * h + 8 * q, uniform8(v[q], lo, sp));
    }
  }
  for (int64_t d = dim; d < stride; d += 8) _mm256_stream_ps(row + d, _mm256_setzero_ps());
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

bool stream_uniform_row(float* row, int64_t dim, int64_t stride, uint64_t seed, int64_t table, int64_t key,
                        double lower, double span) {
  const double span32 = span * (1.0 / 4294967296.0);
  if (!cpu::has_avx2() || dim % 64 != 0 || stride % 8 != 0 || reinterpret_cast<uintptr_t>(row) % 32 != 0 ||
      span32 * 4294967296.0 != span)
    return false;  // (span32 is span * 2^-32 exactly unless it lost bits as a subnormal)
  if (simd() == Simd::kAvx512)
    stream_uniform_avx512(row, dim, stride, seed, table, key, lower, span32);
  else
    stream_uniform_avx2(row, dim, stride, seed, table, key, lower, span32);
  return true;
}
#else
bool philox4_x16(uint64_t, int64_t, int64_t, uint64_t, uint32_t*) { return false; }  // no x86: one by one
bool stream_uniform_row(float*, int64_t, int64_t, uint64_t, int64_t, int64_t, double, double) { return false; }
#endif

void outputs64(uint64_t seed, int64_t table, int64_t key, uint64_t first, uint32_t out[64]) {
#if defined(DE_PHILOX_AVX512)
  if (cpu::has_avx2()) {  // AVX-512 CPUs have it too
    philox16_avx2<true>(seed, table, key, first, out);
    return;
  }
#endif
  for (int l = 0; l < 16; ++l) philox4(seed, table, key, first + l, out + 4 * l);
}

}  // namespace init
}  // namespace dynamicemb
