#include "common/huge_pages_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dynamicemb {
namespace cpu {

namespace {
constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
// Below this an array is cheap to reach through 4 KiB pages anyway.
constexpr size_t kAdviseFrom = size_t{4} << 20;

size_t nbytes(at::IntArrayRef sizes, at::ScalarType dtype) {
  return static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
}

// The next mapped array's offset in its mapping: a different 64-byte line
// in the first 128 KiB for each. Arrays of the same shape (the tables of a
// model) would otherwise all start 2 MiB-aligned, so that the rows of one
// key, often at the same row in every table, would share their L2 sets.
size_t next_color() {
  static std::atomic<uint64_t> count{0};
  constexpr uint64_t kLines = (uint64_t{128} << 10) / 64;
  return static_cast<size_t>((count.fetch_add(1, std::memory_order_relaxed) * 37) % kLines) * 64;
}

at::Tensor empty_huge_op(at::IntArrayRef sizes, at::ScalarType dtype, bool own_mapping) {
  return own_mapping ? empty_mapped(sizes, dtype) : empty_huge(sizes, dtype);
}
}  // namespace

at::Tensor empty_huge(at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = t.nbytes();
  if (bytes >= kAdviseFrom) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t b = (p + kHugePage - 1) & ~(kHugePage - 1), e = (p + bytes) & ~(kHugePage - 1);
    if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
  }
#endif
  return t;
}

at::Tensor empty_mapped(at::IntArrayRef sizes, at::ScalarType dtype) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = nbytes(sizes, dtype);
  if (bytes >= kAdviseFrom) {
    // 2 MiB-aligned, advised before its first touch; the array starts a few
    // lines in (next_color). Its last partial 2 MiB page is taken whole when
    // that adds at most an eighth to the array, else it stays on small pages.
    const size_t color = next_color(), used = color + bytes;
    const size_t whole = (used + kHugePage - 1) & ~(kHugePage - 1);
    const size_t advised = whole - used <= bytes / 8 ? whole : used & ~(kHugePage - 1);
    void* raw = mmap(nullptr, whole + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      const uintptr_t r = reinterpret_cast<uintptr_t>(raw), b = (r + kHugePage - 1) & ~(kHugePage - 1);
      if (b > r) munmap(raw, b - r);
      if (r + kHugePage > b) munmap(reinterpret_cast<void*>(b + whole), r + kHugePage - b);
      if (advised > 0) madvise(reinterpret_cast<void*>(b), advised, MADV_HUGEPAGE);
      return at::from_blob(
          reinterpret_cast<void*>(b + color), sizes, [b, whole](void*) { munmap(reinterpret_cast<void*>(b), whole); },
          at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return empty_huge(sizes, dtype);  // small, or no mapping
}

TORCH_LIBRARY_IMPL(dynamicemb, CompositeExplicitAutograd, m) { m.impl("empty_huge", &empty_huge_op); }

}  // namespace cpu
}  // namespace dynamicemb
