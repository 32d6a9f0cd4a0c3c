// store_gather / store_scatter on the CPU: a backing store's rows at
// positions its key index gave (rows_checks.h). CPU tensors are addressed
// directly, so ATen's row copies do the work.
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

#include "tiers/rows_checks.h"

namespace dynamicemb {
namespace tiers {
namespace {

void gather_cpu(const at::Tensor& store, const at::Tensor& positions, at::Tensor& out) {
  check_store_rows(store, positions, out, "out");
  at::index_select_out(out, store, 0, positions);
}

void scatter_cpu(at::Tensor& store, const at::Tensor& positions, const at::Tensor& rows) {
  check_store_rows(store, positions, rows, "rows");
  store.index_copy_(0, positions, rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("store_gather", &gather_cpu);
  m.impl("store_scatter", &scatter_cpu);
}

}  // namespace tiers
}  // namespace dynamicemb
