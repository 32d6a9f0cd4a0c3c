// The table clock on the CPU: CLOCK_MONOTONIC in ns (std::chrono::steady_clock
// on Linux), the clock of Python's time.monotonic_ns().
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <chrono>

namespace dynamicemb {
namespace table {
namespace {

at::Tensor clock_cpu(const at::Tensor& like) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count();
  return at::full({1}, static_cast<int64_t>(ns), like.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) { m.impl("table_clock", &clock_cpu); }

}  // namespace table
}  // namespace dynamicemb
