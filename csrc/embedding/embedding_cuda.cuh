// Pieces shared by the CUDA embedding kernels (embedding_cuda.cu: unique,
// init, forward, the fused eval lookup; backward_cuda.cu: the backward and
// fused optimizer): the facts the kernels read per table and per feature,
// and the host-side checks, which refuse what the CPU's (embedding_cpu.h)
// refuse with the same messages.
//
// Internal to each .cu that includes it (an unnamed namespace, as when this
// lived in one file): the CPU kernels have their own Bags and Rows.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

#include "common/checked_once.h"
#include "common/checks.h"
#include "common/cuda_utils.cuh"
#include "embedding/bag_checks.h"
#include "embedding/hot_rows.h"
#include "embedding/init_rules.h"
#include "embedding/row_parts.h"

namespace dynamicemb {
namespace embedding {
namespace {

using at::Tensor;
using at::TensorList;
using c10::IntArrayRef;
using namespace dynamicemb::cuda;

// Elements per lane of a row chunk: a warp covers kChunk dims at a time.
constexpr int kPerLane = 8;
constexpr int64_t kChunk = kPerLane * kWarp;

// Per-table facts the kernels need (uploaded per call).
struct TableDev {
  RowParts rows;  // where each row is (row_parts.h), in the storage dtype
  int64_t dim;
  init::Args init;
  HotRows hot;  // emb_lookup_forward's hot rows (hot_rows.h); none for the training ops
};
// Per feature: its table and first column in the pooled output.
struct FeatureDev {
  int64_t table, col;
};

// ---- validation (the CPU's checks, on a CUDA device) ----------------------------------------

struct Bags {
  const int64_t* off;  // device
  int64_t F, B, n;
  std::vector<int64_t> table;  // per feature
  int64_t num_bags() const { return F * B; }
};

__global__ void check_offsets_kernel(const int64_t* off, int64_t nb, int64_t* err) {
  if (thread_begin() == 0) {
    err[1] = off[0];
    err[2] = off[nb];
  }
  for (int64_t j = thread_begin(); j < nb; j += thread_stride())
    if (off[j + 1] < off[j]) flag_min(&err[0], j);
}

// The bags' shape (host), without reading the offsets' values.
inline Bags bag_shape(int64_t n, const Tensor& offsets, IntArrayRef feature_table, int64_t num_tables,
                      at::Device dev) {
  check_1d(offsets, at::kLong, "offsets", dev);
  const auto [F, B] = check_bag_shape(offsets, feature_table, num_tables);
  return Bags{offsets.data_ptr<int64_t>(), F, B, n, std::vector<int64_t>(feature_table.begin(), feature_table.end())};
}

// Error slots 0..2 of the offsets' values check (first decreasing position,
// off[0], off[nb]); the caller reads them, with slots of its own if it has some.
inline void launch_offsets_check(const Bags& bags, int64_t* err, cudaStream_t stream) {
  const int64_t nb = bags.num_bags();
  check_offsets_kernel<<<blocks_for(nb, kThreads), kThreads, 0, stream>>>(bags.off, nb, err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Raises the CPU's error for offsets whose check read `e`; else records them
// as checked (checked_once.h: the step's later ops skip the check).
inline void raise_offsets_errors(const Bags& bags, const Tensor& offsets, const std::vector<int64_t>& e,
                                 cudaStream_t stream) {
  check_offset_values(e[1], e[2], bags.n, e[0] == kNoError ? -1 : e[0], [&](int64_t j) {
    const auto v = download(bags.off + j, 2, stream);
    return std::make_pair(v[0], v[1]);
  });
  CheckedOnce::record(offsets, Checked::kOffsets, bags.n);
}

// `clamps`: the caller's kernels clamp offsets (the training forward and
// backward), so offsets whose record is still to be read pass too.
inline Bags check_bags(int64_t n, const Tensor& offsets, IntArrayRef feature_table, int64_t num_tables, at::Device dev,
                cudaStream_t stream, bool clamps = false) {
  Bags bags = bag_shape(n, offsets, feature_table, num_tables, dev);
  if (CheckedOnce::holds(offsets, Checked::kOffsets, n) ||
      (clamps && CheckedOnce::holds(offsets, Checked::kOffsetsClamped, n)))
    return bags;
  ErrorSlots err(3, dev, stream);
  launch_offsets_check(bags, err.ptr(), stream);
  raise_offsets_errors(bags, offsets, err.read(), stream);
  return bags;
}

__global__ void check_inverse_kernel(const int64_t* inv, int64_t n, int64_t keys, int64_t* err) {
  for (int64_t i = thread_begin(); i < n; i += thread_stride())
    if (static_cast<uint64_t>(inv[i]) >= static_cast<uint64_t>(keys)) flag_min(err, i);
}

// The CPU's check_inverse: every inverse[i] names one of `keys` unique keys
// (the kernels index rows and keys by it). emb_unique's inverse, unchanged
// since, passed it (checked_once.h): no synchronising copy then.
inline void check_inverse(const Tensor& inverse, int64_t keys, cudaStream_t stream) {
  const int64_t n = inverse.numel();
  if (n == 0 || CheckedOnce::holds(inverse, Checked::kInverse, keys)) return;
  ErrorSlots err(1, inverse.device(), stream);
  check_inverse_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(inverse.data_ptr<int64_t>(), n, keys,
                                                                         err.ptr());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t bad = err.read()[0];
  if (bad != kNoError) raise_inverse_error(bad, download(inverse.data_ptr<int64_t>() + bad, 1, stream)[0], keys);
  CheckedOnce::record(inverse, Checked::kInverse, keys);
}

struct Rows {
  std::vector<RowParts> parts;
  std::vector<int64_t> dim, stride;
  at::ScalarType dtype;
  at::Device device;
  int64_t num_tables() const { return static_cast<int64_t>(parts.size()); }
};

// The op runs on the device of `rows`. A table's rows (row_parts.h: whole, or
// a head and a tail) are on that device or in pinned host memory (the host
// part of a hybrid table, storage.py): the kernels then read and update the
// rows in place through the mapped device pointer.
inline Rows check_rows(TensorList weights, IntArrayRef dims, const Tensor& rows) {
  TORCH_CHECK(!weights.empty(), "dynamicemb: no weight tensors");
  Rows r{{}, {}, {}, weights[0].scalar_type(), rows.device()};
  TORCH_CHECK(r.device.is_cuda(), "dynamicemb: rows must be on a CUDA device, got ", r.device);
  r.parts = table_parts(
      weights, dims,
      [&](int64_t t, const Tensor& w) {
        TORCH_CHECK((w.device() == r.device || (w.is_cpu() && w.is_pinned())) && w.dim() == 2 &&
                        w.is_contiguous() && w.scalar_type() == r.dtype,
                    "dynamicemb: weights of table ", t, " must be a contiguous 2-D tensor of ", r.dtype, " on ",
                    r.device, " or in pinned host memory, got ", w.device(), w.is_cpu() ? " (not pinned)" : "");
      },
      [](const Tensor& w) { return kernel_ptr(w); });
  r.dim.assign(dims.begin(), dims.end());
  for (const RowParts& p : r.parts) r.stride.push_back(p.stride);
  return r;
}

// init_params may live on the host (as the module keeps it) or on the device.
inline std::vector<init::Args> init_args(const Tensor& params, int64_t num_tables, cudaStream_t stream) {
  TORCH_CHECK(params.scalar_type() == at::kDouble && params.dim() == 2 && params.is_contiguous() &&
                  params.size(0) == num_tables && params.size(1) == init::kArgsWidth,
              "dynamicemb: init_params must be a contiguous float64 [num_tables, ", init::kArgsWidth, "] tensor");
  TORCH_CHECK(params.device().is_cpu() || params.device().is_cuda(),
              "dynamicemb: init_params must be on the CPU or a CUDA device");
  const std::vector<double> host =
      download(params.data_ptr<double>(), params.numel(), stream, params.device().is_cuda());
  std::vector<init::Args> a;
  for (int64_t t = 0; t < num_tables; ++t) a.push_back(init::args_from(host.data() + t * init::kArgsWidth));
  return a;
}

inline std::vector<TableDev> table_facts(const Rows& R, const std::vector<init::Args>& args) {
  std::vector<TableDev> tabs;
  for (int64_t t = 0; t < R.num_tables(); ++t)
    tabs.push_back(TableDev{R.parts[t], R.dim[t], args.empty() ? init::Args{} : args[t]});
  return tabs;
}

inline std::vector<FeatureDev> feature_facts(const Bags& bags, const std::vector<int64_t>& col) {
  std::vector<FeatureDev> feats;
  for (int64_t f = 0; f < bags.F; ++f) feats.push_back(FeatureDev{bags.table[f], col[f]});
  return feats;
}

inline const float* opt_weights(const std::optional<Tensor>& psw, int64_t n, at::Device dev) {
  if (!psw) return nullptr;
  check_1d(*psw, at::kFloat, "per_sample_weights", dev);
  TORCH_CHECK(psw->numel() == n, "dynamicemb: per_sample_weights has ", psw->numel(), " entries for ", n,
              " indices");
  return psw->data_ptr<float>();
}
// acc + scale * v, rounded after each operation (the CPU's -ffp-contract=off).
__device__ __forceinline__ float mul_add(float acc, float scale, float v) {
  return __fadd_rn(acc, __fmul_rn(scale, v));
}

}  // namespace
}  // namespace embedding
}  // namespace dynamicemb
