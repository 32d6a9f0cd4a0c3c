// Which hand-written vector paths (the victim search, the Philox and UNIFORM
// init) the CPU kernels may take: those the CPU has (checked at run time: one
// build runs on any x86-64), unless DYNAMICEMB_CPU_VECTORS=0, which runs the
// scalar rules instead, as a CPU without them (or not x86) does; the tests
// use it to check those. Read once per process. (row_math_cpu.h's compiler
// clones pick their width by the CPU alone.)
#pragma once
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// Hand-written vector functions, compiled for AVX2 in a portable build and
// called only where has_avx2() holds.
#define DE_AVX2 __attribute__((target("avx2"))) inline
#define DE_AVX2_POPCNT __attribute__((target("avx2,popcnt"))) inline
#endif

namespace dynamicemb {
namespace cpu {

inline bool vectors_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("DYNAMICEMB_CPU_VECTORS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed;
}

#if defined(__x86_64__) && defined(__GNUC__)
inline bool has_avx2() {
  static const bool on = vectors_allowed() && __builtin_cpu_supports("avx2");
  return on;
}

inline bool has_avx512f() {
  static const bool on = vectors_allowed() && __builtin_cpu_supports("avx512f");
  return on;
}
#else
inline bool has_avx2() { return false; }
inline bool has_avx512f() { return false; }
#endif

}  // namespace cpu
}  // namespace dynamicemb
