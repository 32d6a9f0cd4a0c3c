// Initial values of embedding rows: a pure function of (seed, table, key,
// element), shared by the CPU and CUDA backends.
//
// Randomness is counter-based (Philox4x32-10 keyed by the seed, counter =
// (key, table, block)), so a key's initial row does not depend on batch
// order, rank or world size. The math uses only IEEE-exact operations (+, -,
// *, /, sqrt, frexp/ldexp) in double precision, with our own log and cos, so
// that both backends produce bit-identical rows (compile without FMA
// contraction: -ffp-contract=off, nvcc -fmad=false).
#pragma once
#include <cmath>
#include <cstdint>

#include "common/hd.h"

namespace dynamicemb {
namespace init {

// Values match dynamicemb.DynamicEmbInitializerMode.
enum Mode : int64_t { kNormal = 0, kTruncatedNormal = 1, kUniform = 2, kConstant = 3, kDebug = 4, kModes = 5 };
constexpr const char* kModeNames[kModes] = {"NORMAL", "TRUNCATED_NORMAL", "UNIFORM", "CONSTANT", "DEBUG"};

// One table's initializer; mirrors DynamicEmbInitializerArgs. `stream` names
// the table's random stream: a stable id of the table (not its position in a
// module), so that grouping tables differently on another world size keeps
// every key's initial row. `state`: where every optimizer-state column of a
// new row starts (0, or initial_accumulator_value for an optimizer whose
// rule has kAccumulator, optimizer_rules.h).
struct Args {
  int64_t mode;
  double mean, std_dev, lower, upper, value;
  int64_t stream;
  double state;
};

// The packed form the kernels take: a float64 row per table whose columns are
// these (Python packs by kArgNames, dynamicemb.rules.INIT_ARGS).
enum ArgColumn : int {
  kArgMode,
  kArgMean,
  kArgStdDev,
  kArgLower,
  kArgUpper,
  kArgValue,
  kArgStream,
  kArgState,
  kArgsWidth
};
constexpr const char* kArgNames[kArgsWidth] = {"mode", "mean", "std_dev", "lower", "upper", "value", "stream", "state"};

DE_HD Args args_from(const double* row) {
  return Args{static_cast<int64_t>(row[kArgMode]), row[kArgMean], row[kArgStdDev], row[kArgLower], row[kArgUpper],
              row[kArgValue], static_cast<int64_t>(row[kArgStream]), row[kArgState]};
}

// Column d of a new row of `dim` weights beyond them: its optimizer state's start.
DE_HD float state_value(const Args& a) { return static_cast<float>(a.state); }

// ---- Philox4x32-10 -------------------------------------------------------------

// Its round multipliers and key increments (philox_cpu.cpp's vector forms use them too).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

DE_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Block `block` of the stream of (seed, table, key): its 32-bit outputs
// 4 * block .. 4 * block + 3.
DE_HD void philox4(uint64_t seed, int64_t table, int64_t key, uint64_t block, uint32_t out[4]) {
  uint32_t c[4] = {static_cast<uint32_t>(key), static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32),
                   static_cast<uint32_t>(table), static_cast<uint32_t>(block)};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxM0, c[0], &hi0, &lo0);
    mulhilo32(kPhiloxM1, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  for (int i = 0; i < 4; ++i) out[i] = c[i];
}

#if !defined(__CUDA_ARCH__)
// Host: blocks first .. first + 15 at once, out[16 i + l] = output i of block
// first + l, exactly philox4's; false (nothing written) where the CPU lacks
// AVX-512 and AVX2. Defined in philox_cpu.cpp.
bool philox4_x16(uint64_t seed, int64_t table, int64_t key, uint64_t first, uint32_t out[64]);

// Host: the 32-bit outputs 4 first .. 4 first + 63 of the stream of (seed,
// table, key), in order (philox_cpu.cpp: transposed in registers with AVX2).
void outputs64(uint64_t seed, int64_t table, int64_t key, uint64_t first, uint32_t out[64]);

// Host: whether stream_uniform_row writes this row: AVX2, dim % 64 == 0,
// stride % 8 == 0, the row 32-byte aligned, and span * 2^-32 exact.
bool uniform_streamable(const float* row, int64_t dim, int64_t stride, double span);

// Host: row[0, dim) = UNIFORM's values (uniform_value, bit for bit) of the
// stream of (seed, table, key) and row[dim, stride) = 0, by non-temporal
// stores straight from vector registers (philox_cpu.cpp); false (nothing
// written) unless uniform_streamable.
bool stream_uniform_row(float* row, int64_t dim, int64_t stride, uint64_t seed, int64_t table, int64_t key,
                        double lower, double span);

// Host: stream_uniform_row of two uniform_streamable rows of the same dim and
// stride, (table, key, lower, span) each their own. With AVX-512 their rounds
// run interleaved: one row's rounds wait on their multiplies' latency, two
// rows' fill it (about 30% less time per row).
struct UniformRow {
  float* row;
  int64_t table, key;
  double lower, span;
};
void stream_uniform_rows2(const UniformRow& a, const UniformRow& b, int64_t dim, int64_t stride, uint64_t seed);
#endif

// fn(b, o) for the Philox blocks b in [0, blocks) of the stream of (seed,
// table, key), o their 4 outputs: 16 at a time where the host can, else one by one.
template <class Fn>
DE_HD void for_each_block(uint64_t seed, int64_t table, int64_t key, int64_t blocks, Fn fn) {
  int64_t b = 0;
#if !defined(__CUDA_ARCH__)
  uint32_t w[64];
  for (; b + 16 <= blocks && philox4_x16(seed, table, key, static_cast<uint64_t>(b), w); b += 16) {
    for (int l = 0; l < 16; ++l) {
      const uint32_t o[4] = {w[l], w[16 + l], w[32 + l], w[48 + l]};
      fn(b + l, o);
    }
  }
#endif
  for (; b < blocks; ++b) {
    uint32_t o[4];
    philox4(seed, table, key, static_cast<uint64_t>(b), o);
    fn(b, o);
  }
}

// The 32-bit output `n` of the stream of (seed, table, key).
DE_HD uint32_t philox_u32(uint64_t seed, int64_t table, int64_t key, uint64_t n) {
  uint32_t out[4];
  philox4(seed, table, key, n >> 2, out);
  return out[n & 3];
}

// A 32-bit output as a uniform in the open interval (0, 1).
DE_HD double unit(uint32_t x) { return (static_cast<double>(x) + 0.5) * (1.0 / 4294967296.0); }

// UNIFORM's value from one 32-bit output: lower + (upper - lower) * unit(x).
DE_HD float uniform_value(double lower, double span, uint32_t x) {
  return static_cast<float>(lower + span * unit(x));
}

// Uniform in the open interval (0, 1): output `n` of the stream.
DE_HD double uniform01(uint64_t seed, int64_t table, int64_t key, uint64_t n) {
  return unit(philox_u32(seed, table, key, n));
}

// ---- exact-operation math --------------------------------------------------------

// ln(x) for x > 0: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), then
// ln(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172: the series
// s * sum_k s^2k / (2k + 1) by Horner, 11 terms (the rest < 1e-19), with the
// coefficients as literals (no division per term: these dominate NORMAL).
DE_HD double ln(double x) {
  constexpr double kC[11] = {1.0, 0.3333333333333333, 0.2, 0.14285714285714285, 0.1111111111111111, 0.09090909090909091, 0.07692307692307693, 0.06666666666666667, 0.058823529411764705, 0.05263157894736842, 0.047619047619047616};
  int e;
  double m = frexp(x, &e);  // m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    e -= 1;
  }
  const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
  double sum = kC[10];
  for (int k = 9; k >= 0; --k) sum = sum * s2 + kC[k];
  return 2.0 * (s * sum) + e * 0.69314718055994530942;
}

// cos(2 pi t) for t in [0, 1]: reduced to a in [0, pi/2], then the Taylor
// series sum_k (-1)^k a^2k / (2k)! by Horner, 12 terms (the rest < 1e-19).
DE_HD double cos_turns(double t) {
  constexpr double kC[12] = {1.0, -0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05, -2.755731922398589e-07, 2.08767569878681e-09, -1.1470745597729725e-11, 4.779477332387385e-14, -1.5619206968586225e-16, 4.110317623312165e-19, -8.896791392450574e-22};
  double y = t - static_cast<double>(static_cast<int64_t>(t + 0.5));  // [-0.5, 0.5]
  if (y < 0) y = -y;
  double sign = 1.0;
  if (y > 0.25) {  // cos(2 pi y) = -cos(2 pi (0.5 - y))
    y = 0.5 - y;
    sign = -1.0;
  }
  const double a = 6.28318530717958647693 * y, a2 = a * a;  // [0, pi/2]
  double sum = kC[11];
  for (int k = 10; k >= 0; --k) sum = sum * a2 + kC[k];
  return sign * sum;
}

// Box-Muller: a standard normal number from two uniforms.
DE_HD double box_muller(double u1, double u2) { return sqrt(-2.0 * ln(u1)) * cos_turns(u2); }

// Standard normal number `m` of the stream (Box-Muller on uniforms 2m, 2m+1).
DE_HD double std_normal(uint64_t seed, int64_t table, int64_t key, uint64_t m) {
  return box_muller(uniform01(seed, table, key, 2 * m), uniform01(seed, table, key, 2 * m + 1));
}

DE_HD int64_t floor_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}

// ---- the initial value ----------------------------------------------------------------

// Element j (of `dim`) of the initial row of `key` in the table of `a`.
DE_HD float value(const Args& a, uint64_t seed, int64_t key, int64_t j, int64_t dim) {
  const int64_t table = a.stream;
  switch (a.mode) {
    case kUniform:
      return uniform_value(a.lower, a.upper - a.lower, philox_u32(seed, table, key, j));
    case kNormal:
      return static_cast<float>(a.mean + a.std_dev * std_normal(seed, table, key, j));
    case kTruncatedNormal: {
      // Rejection: try j, j + dim, j + 2 dim, ... until within [lower, upper].
      for (int r = 0; r < 64; ++r) {
        const double x = a.mean + a.std_dev * std_normal(seed, table, key, j + r * dim);
        if (x >= a.lower && x <= a.upper) return static_cast<float>(x);
      }
      return static_cast<float>(a.mean < a.lower ? a.lower : (a.mean > a.upper ? a.upper : a.mean));
    }
    case kDebug:  // readable in tests: key mod 100000 / 100, plus j / 10000
      return static_cast<float>(floor_mod(key, 100000) * 0.01 + j * 0.0001);
    case kConstant:
    default:
      return static_cast<float>(a.value);
  }
}

// The whole initial row, store(j, value) for j in [0, dim): exactly value()
// element by element, but one Philox block serves 4 uniforms (UNIFORM) or 2
// normals (NORMAL: element j uses outputs 2j, 2j+1), so a row costs a quarter
// (half) of the blocks.
template <class Store>
DE_HD void fill_row(const Args& a, uint64_t seed, int64_t key, int64_t dim, Store store) {
  switch (a.mode) {
    case kUniform:
      for_each_block(seed, a.stream, key, (dim + 3) / 4, [&](int64_t b, const uint32_t* o) {
        for (int l = 0; l < 4 && 4 * b + l < dim; ++l)
          store(4 * b + l, uniform_value(a.lower, a.upper - a.lower, o[l]));
      });
      return;
    case kNormal:
      for_each_block(seed, a.stream, key, (dim + 1) / 2, [&](int64_t b, const uint32_t* o) {
        store(2 * b, static_cast<float>(a.mean + a.std_dev * box_muller(unit(o[0]), unit(o[1]))));
        if (2 * b + 1 < dim)
          store(2 * b + 1, static_cast<float>(a.mean + a.std_dev * box_muller(unit(o[2]), unit(o[3]))));
      });
      return;
    case kConstant:
      for (int64_t j = 0; j < dim; ++j) store(j, static_cast<float>(a.value));
      return;
    default:
      for (int64_t j = 0; j < dim; ++j) store(j, value(a, seed, key, j, dim));
  }
}

}  // namespace init
}  // namespace dynamicemb
