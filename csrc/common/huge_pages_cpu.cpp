#include "common/huge_pages_cpu.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

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
}  // namespace

bool advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kAdviseFrom) return false;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  return e > b && madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

at::Tensor empty_huge(at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
  advise_huge_pages(t.data_ptr(), t.nbytes());
  return t;
}

namespace {
bool advise_huge_pages_op(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
              "dynamicemb: advise_huge_pages takes a contiguous CPU tensor");
  return advise_huge_pages(t.data_ptr(), t.nbytes());
}
}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) { m.impl("advise_huge_pages", &advise_huge_pages_op); }

}  // namespace cpu
}  // namespace dynamicemb
