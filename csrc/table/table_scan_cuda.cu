// CUDA kernels of the table ops that scan slots rather than find keys
// (table_cuda.cuh has the design): table_export_range and table_rehash. Both
// sync anyway, so they check the layout on the host exactly as the CPU does.
#include <ATen/ops/full.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "table/table_cuda.cuh"

namespace dynamicemb {
namespace table {
namespace cuda_impl {
namespace {

// ---- export ----------------------------------------------------------------------------

// keep[i]: slot begin + i is live (and, with filter scores, scored >= threshold).
__global__ void export_mask_kernel(const uint8_t* sd, const int64_t* fs, int64_t begin, int64_t m,
                                   int64_t threshold, bool* keep) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m) return;
  keep[i] = is_live(sd[begin + i]) && (!fs || fs[begin + i] >= threshold);
}

__global__ void export_gather_kernel(TableRef ref, const int64_t* pos, int64_t m, int64_t begin, int64_t* keys,
                                     int64_t* tids, int64_t* idx) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= m) return;
  const int64_t slot = begin + pos[o];
  keys[o] = ref.keys[slot];
  tids[o] = ref.table_of_slot(slot);
  idx[o] = slot;
}

std::tuple<Tensor, Tensor, Tensor> export_range(at::ArrayRef<Tensor> table, const std::optional<Tensor>& filter_scores,
                                                int64_t begin, int64_t end, int64_t bucket_capacity,
                                                int64_t threshold) {
  const at::Device dev = table_device(table);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TableRef ref = make_ref(table, bucket_capacity, kFindMembers);
  // The slot arrays must hold exactly the layout's buckets, as on the CPU.
  ref.num_buckets = download(ref.table_buckets + ref.num_tables, 1, stream)[0];
  ref = attach_members(ref, table, kFindMembers, dev);
  if (filter_scores) check_slots(*filter_scores, at::kLong, "filter_scores", ref, dev);
  check_export_range(begin, end, ref.num_buckets * ref.bucket_capacity);
  const int64_t range = end - begin;
  Tensor keep = new_tensor(range, at::kBool, dev);
  if (range > 0) {
    export_mask_kernel<<<blocks_for(range, kThreads), kThreads, 0, stream>>>(
        ref.digests, opt_ptr(filter_scores), begin, range, threshold, keep.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const Tensor pos = at::nonzero(keep).view({-1});  // slot order
  const int64_t m = pos.numel();
  Tensor keys = new_tensor(m, at::kLong, dev), tids = new_tensor(m, at::kLong, dev);
  Tensor idx = new_tensor(m, at::kLong, dev);
  if (m > 0) {
    export_gather_kernel<<<blocks_for(m, kThreads), kThreads, 0, stream>>>(
        ref, pos.data_ptr<int64_t>(), m, begin, keys.data_ptr<int64_t>(), tids.data_ptr<int64_t>(),
        idx.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {keys, tids, idx};
}

// ---- rehash (grow) -----------------------------------------------------------------------

// One thread per old bucket (TableRef::rehash_bucket): its keys land only in
// the new buckets it scales to, which no other thread writes, so the
// placement is the CPU's without atomics. fill: slots used so far per new bucket.
__global__ void rehash_kernel(TableRef from, TableRef to, int32_t* fill, int64_t* dest) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= from.num_buckets) return;
  from.rehash_bucket(b, to, from.spread(b, to), [fill](int64_t g) -> int32_t& { return fill[g]; }, dest);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rehash(at::ArrayRef<Tensor> table,
                                                                  const Tensor& new_table_buckets,
                                                                  int64_t bucket_capacity) {
  const at::Device dev = table_device(table);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TableRef from = make_ref(table, bucket_capacity, kFindMembers);
  // Rehash is rare: validate the layouts on the host exactly as the CPU does.
  TableRef to = check_layout(new_table_buckets, bucket_capacity, dev);
  const std::vector<int64_t> otb = download(from.table_buckets, from.num_tables + 1, stream);
  const std::vector<int64_t> ntb = download(to.table_buckets, to.num_tables + 1, stream);
  check_grow(otb.data(), from.num_tables, ntb.data(), to.num_tables);
  const bool with_ts = table[kSlotTimestamps].numel() > 0;
  from.num_buckets = otb.back();
  from = attach_members(from, table,
                        kRefreshMembers | (with_ts ? member_bit(kSlotTimestamps) : 0u), dev);

  const int64_t cap = bucket_capacity, S = ntb.back() * cap;
  const auto opts = at::TensorOptions().device(dev);
  Tensor nk = at::zeros({S}, opts.dtype(at::kLong));
  Tensor nd = at::zeros({S}, opts.dtype(at::kByte));  // kEmpty marks unused slots
  Tensor ns = at::zeros({S}, opts.dtype(at::kLong));
  Tensor nt = at::zeros({with_ts ? S : 0}, opts.dtype(at::kLong));
  Tensor fill = at::zeros({ntb.back()}, opts.dtype(at::kInt));
  Tensor dest = at::full({from.num_buckets * cap}, -1, opts.dtype(at::kLong));
  to.num_buckets = ntb.back();
  to.keys = nk.data_ptr<int64_t>();
  to.digests = nd.data_ptr<uint8_t>();
  to.scores = ns.data_ptr<int64_t>();
  to.timestamps = with_ts ? nt.data_ptr<int64_t>() : nullptr;
  if (from.num_buckets > 0) {
    rehash_kernel<<<blocks_for(from.num_buckets, kThreads), kThreads, 0, stream>>>(
        from, to, fill.data_ptr<int32_t>(), dest.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // The moves in old index order.
  const Tensor old_idx = at::nonzero(at::ge(dest, 0)).view({-1});
  const Tensor new_idx = at::index_select(dest, 0, old_idx);
  return {nk, nd, ns, nt, old_idx, new_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("table_export_range", &export_range);
  m.impl("table_rehash", &rehash);
}

}  // namespace cuda_impl
}  // namespace table
}  // namespace dynamicemb
