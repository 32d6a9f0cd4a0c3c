// CUDA kernel of table_insert (table_cuda.cuh has the design): the tile at
// the head of each bucket's run of keys finds each key, or takes the free
// slot or the victim, and commits the outcome (TableRef::commit); sizes and
// counters are tallied afterwards (TableRef::tally_insert), the evicted
// entries gathered in input order.
#include <ATen/ops/eq.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "table/bucket_regs_cuda.cuh"
#include "table/table_cuda.cuh"

namespace dynamicemb {
namespace table {
namespace cuda_impl {
namespace {

struct InsertArgs {
  TableRef ref;
  const int64_t* keys;
  const uint8_t* digest;
  const int64_t* key_scores;  // null: Scoring::dflt for every key
  Scoring scoring;
  Epoch epoch;
  const bool* evictable;  // per table, null: every table may evict
  const int64_t* tids;    // null: every key in table 0
  int64_t* out;
  int8_t* res;
  int64_t* ev_key;  // the displaced key and score, by key position
  int64_t* ev_score;
  bool hold_stored;  // a run's keys stored when the call began are held first (kPendingResult: the others)
};

__global__ void insert_kernel(InsertArgs a, Segments segs) {
  const TableRef ref = a.ref;
  if (a.hold_stored) {
    // The run's stored keys found and held (committed as accessed) first.
    for_each_key_of_run(segs, [&](const auto& tile, int64_t i, int32_t b) {
      if (b < 0) return;  // failed below
      const Probe p = ref.at_bucket(b, a.digest[i]);
      const int64_t slot = ref.find(tile, p, a.keys[i]);
      if (tile.thread_rank() != 0) return;
      if (slot < 0) {
        a.res[i] = kPendingResult;
        return;
      }
      ref.commit(slot, kAssigned, a.keys[i], p.digest, a.scoring, a.scoring.key_score(a.key_scores, i), a.epoch);
      a.out[i] = slot;
      a.res[i] = kAssigned;
    });
  }
  for_each_key_of_run(segs, [&](const auto& tile, int64_t i, int32_t b) {
    const bool lead = tile.thread_rank() == 0;
    if (b < 0) {  // no bucket (a flagged layout error)
      if (lead) {
        a.out[i] = -1;
        a.res[i] = kFailed;
      }
      return;
    }
    // (The same lane wrote it in the first pass: lead reads it for the tile.)
    if (a.hold_stored && tile.shfl(static_cast<int>(lead ? a.res[i] : 0), 0) != kPendingResult) return;
    const Probe p = ref.at_bucket(b, a.digest[i]);
    int64_t free_slot;
    int64_t slot = ref.find_or_free(tile, p, a.keys[i], &free_slot);
    int8_t r = kAssigned;
    if (slot < 0) {
      slot = free_slot;
      r = kInserted;
      // Uniform over the tile (it depends on the key only): the collective
      // victim search is entered by all lanes or none.
      if (slot < 0 && may_evict(a.scoring.strategy) && (!a.evictable || a.evictable[a.tids ? a.tids[i] : 0])) {
        slot = ref.victim(tile, p, a.epoch);
        r = kEvicted;
      }
    }
    if (!lead) return;  // one lane writes; the tile syncs before the next key
    if (slot < 0) {
      a.out[i] = -1;
      a.res[i] = kFailed;
      return;
    }
    if (r == kEvicted) {
      a.ev_key[i] = ref.keys[slot];
      a.ev_score[i] = ref.scores[slot];
    }
    ref.commit(slot, r, a.keys[i], p.digest, a.scoring, a.scoring.key_score(a.key_scores, i), a.epoch);
    a.out[i] = slot;
    a.res[i] = r;
  });
}

// insert_kernel with the bucket in registers (BucketRegs): the tile at the
// head of a bucket's run loads the run's keys 16 at a time (one per lane),
// then takes them in input order; the lane that holds a key's slot commits
// it. Same outcomes as insert_kernel.
template <class Tile>
__device__ __forceinline__ void insert_run(const Tile& tile, const InsertArgs& a, const Segments& segs, int64_t j,
                                           int32_t b) {
  const TableRef& ref = a.ref;
  const int lane = static_cast<int>(tile.thread_rank());
  if (b < 0) {  // no bucket (a flagged layout error)
    for (int64_t q = j + lane; q < segs.n && segs.bucket[q] == b; q += kGroupSize) {
      a.out[segs.order[q]] = -1;
      a.res[segs.order[q]] = kFailed;
    }
    return;
  }
  const int64_t base = ref.at_bucket(b, 0).base;
  BucketRegs bucket(tile, ref, base);
  const bool evicts = may_evict(a.scoring.strategy);
  // hold_stored: pass 0 finds and holds the run's stored keys (the others
  // are marked pending), pass 1 places the pending ones; else pass 1 alone.
  for (int pass = a.hold_stored ? 0 : 1; pass < 2; ++pass) {
    for (int64_t q0 = j;; q0 += kGroupSize) {
      // Lane l loads key q0 + l of the run: the run's keys are a prefix of lanes.
      const int64_t q = q0 + lane;
      const bool mine = q < segs.n && segs.bucket[q] == b;
      const int64_t my_i = mine ? segs.order[q] : 0;
      const int64_t my_key = mine ? a.keys[my_i] : 0;
      const uint8_t my_d = mine ? a.digest[my_i] : 0;
      const bool my_pending = pass == 1 && a.hold_stored && mine && a.res[my_i] == kPendingResult;
      const int count = __popc(tile.ballot(mine));
      for (int c = 0; c < count; ++c) {
        if (pass == 1 && a.hold_stored && !tile.shfl(my_pending, c)) continue;  // held in pass 0
        const int64_t i = tile.shfl(my_i, c), key = tile.shfl(my_key, c);
        const uint8_t d = static_cast<uint8_t>(tile.shfl(static_cast<uint32_t>(my_d), c));
        int s = bucket.find(tile, ref, key, d);
        int8_t r = kAssigned;
        if (s < 0) {
          if (pass == 0) {
            if (lane == 0) a.res[i] = kPendingResult;
            continue;
          }
          s = bucket.first_free(tile);
          r = kInserted;
          // Uniform over the tile: the collective victim search is entered by all lanes or none.
          if (s < 0 && evicts && (!a.evictable || a.evictable[a.tids ? a.tids[i] : 0])) {
            s = bucket.victim(tile, ref, a.epoch);
            r = kEvicted;
          }
        }
        if (s < 0) {
          if (lane == 0) {
            a.out[i] = -1;
            a.res[i] = kFailed;
          }
          continue;
        }
        if (lane != BucketRegs::owner(s)) continue;
        const int64_t slot = base + s;
        if (r == kEvicted) {
          a.ev_key[i] = ref.keys[slot];
          a.ev_score[i] = ref.scores[slot];
        }
        const int64_t score = ref.commit(slot, r, key, d, a.scoring, a.scoring.key_score(a.key_scores, i), a.epoch);
        bucket.committed(s, d, a.epoch, score);
        a.out[i] = slot;
        a.res[i] = r;
      }
      if (count < kGroupSize) break;
    }
    tile.sync();  // pass 0's marks, written by any lane, read by each key's lane in pass 1
  }
}

// A tile inserts each run (as insert_kernel). Measured on an H200 (bench_table,
// 1M keys into 16M slots, 2^30 keys/s): against insert_kernel, found keys 0.50
// -> 0.99, new ones and evicting ones within the spread (1.05 -> 1.09, 0.58 ->
// 0.64) while a tile per sorted position left most tiles idle; on the grid of
// resident tiles over the runs (for_each_run; one process, alternating),
// new keys 1.1 -> 1.7, found ones 1.1 -> 1.9, evicting ones 0.65 -> 1.05
// (docs/gpu/h200-2026-11-27). Keeping a full bucket's keys in shared memory
// as well (no load for a digest match or the evicted key) measured within
// the spread and was left out.
__global__ void __launch_bounds__(kThreads, 4) insert_regs_kernel(InsertArgs a, Segments segs) {
  for_each_run(segs, [&](const auto& tile, int64_t j, int32_t b) { insert_run(tile, a, segs, j, b); });
}

// The sizes and counters, per table and result (TableRef::tally_insert).
__global__ void tally_insert_kernel(TableRef ref, const int8_t* res, const int64_t* tids, int64_t n) {
  cuda::tally(
      n, ref.num_tables * 4,
      [&](int64_t i) { return res[i] == kAssigned ? int64_t{-1} : (tids ? tids[i] : 0) * 4 + res[i]; },
      [&](int64_t g, int64_t count) { ref.tally_insert(g / 4, static_cast<int>(g % 4), count, AtomicAdd{}); });
}

// The evicted entries, compacted in input order (pos: evicting key positions).
__global__ void gather_evicted_kernel(const int64_t* pos, int64_t m, const int64_t* ev_key, const int64_t* ev_score,
                                      const int64_t* tids, const int64_t* out, int64_t* e_keys, int64_t* e_tids,
                                      int64_t* e_idx, int64_t* e_scores) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= m) return;
  const int64_t i = pos[o];
  e_keys[o] = ev_key[i];
  e_tids[o] = tids ? tids[i] : 0;
  e_idx[o] = out[i];
  e_scores[o] = ev_score[i];
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> insert(
    at::ArrayRef<Tensor> table, const Tensor& keys, const std::optional<Tensor>& table_ids,
    const std::optional<Tensor>& key_scores, int64_t strategy, int64_t bucket_capacity, int64_t call_score,
    int64_t epoch, const std::optional<Tensor>& evictable, bool list_evicted,
    const std::optional<Tensor>& key_count, bool hold_stored) {
  check_strategy(strategy);
  const c10::cuda::CUDAGuard guard(table_device(table));
  const TableRef ref = make_ref(table, bucket_capacity, with_timestamps(kInsertMembers, strategy));
  const at::Device dev = table[kSlotKeys].device();
  const bool* may_evict_table = check_evictable(evictable, ref, dev);
  check_epoch(epoch);
  const int64_t n = check_keys(keys, table_ids, key_scores, dev);
  const int64_t* count = check_key_count(key_count, dev);  // read on the device only

  Tensor indices = new_tensor(n, at::kLong, dev);
  Tensor results = new_tensor(n, at::kChar, dev);
  if (n == 0) {
    auto none = [&] { return new_tensor(0, at::kLong, dev); };
    return {indices, results, none(), none(), none(), none()};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* tids = opt_ptr(table_ids);
  const Placed P = place_keys(ref, keys, table_ids, table[kTableBuckets], stream,
                              Padding{count, indices.data_ptr<int64_t>(), results.data_ptr<int8_t>()});
  const SortedKeys sorted = sort_by_bucket(P.bucket, stream);
  Tensor ev_key = new_tensor(n, at::kLong, dev), ev_score = new_tensor(n, at::kLong, dev);
  const InsertArgs a{ref,
                     keys.data_ptr<int64_t>(),
                     P.digest.data_ptr<uint8_t>(),
                     opt_ptr(key_scores),
                     Scoring::of(strategy, call_score),
                     static_cast<Epoch>(epoch),
                     may_evict_table,
                     tids,
                     indices.data_ptr<int64_t>(),
                     results.data_ptr<int8_t>(),
                     ev_key.data_ptr<int64_t>(),
                     ev_score.data_ptr<int64_t>(),
                     hold_stored};
  const Segments segs = sorted.segments();
  if (BucketRegs::fits(ref)) {
    const unsigned int grid = runs_grid<insert_regs_kernel>(segs);
    insert_regs_kernel<<<grid, kThreads, 0, stream>>>(a, segs);
  } else {
    const unsigned int grid = runs_grid<insert_kernel>(segs);
    insert_kernel<<<grid, kThreads, 0, stream>>>(a, segs);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Without table ids every key is in table 0, so a layout error leaves every
  // key without a bucket and the slots untouched: raise it before the tally.
  // A layout that fits (checked once per table_buckets) flags no key: no read.
  if (!table_ids && !layout_fits(ref, table[kTableBuckets], stream)) raise_flags(P.flags, table_ids, ref, stream);
  tally_insert_kernel<<<cuda::tally_grid(n), kThreads, 0, stream>>>(ref, a.res, tids, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  if (!list_evicted) {
    auto none = [&] { return new_tensor(0, at::kLong, dev); };
    return {indices, results, none(), none(), none(), none()};
  }
  const Tensor pos = at::nonzero(at::eq(results, static_cast<int64_t>(kEvicted))).view({-1});  // syncs
  const int64_t m = pos.numel();
  Tensor e_keys = new_tensor(m, at::kLong, dev), e_tids = new_tensor(m, at::kLong, dev);
  Tensor e_idx = new_tensor(m, at::kLong, dev), e_scores = new_tensor(m, at::kLong, dev);
  if (m > 0) {
    gather_evicted_kernel<<<blocks_for(m, kThreads), kThreads, 0, stream>>>(
        pos.data_ptr<int64_t>(), m, a.ev_key, a.ev_score, tids, a.out, e_keys.data_ptr<int64_t>(),
        e_tids.data_ptr<int64_t>(), e_idx.data_ptr<int64_t>(), e_scores.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {indices, results, e_keys, e_tids, e_idx, e_scores};
}

// table_insert_outcome: each key's got_row, and the failures per table id
// tallied per block (a failed key's id out of range is a device-side
// assert, as for torch's index ops: reading it back would cost a host sync).
__global__ void insert_outcome_kernel(const int8_t* res, const int64_t* tids, int64_t n, int64_t num_tables,
                                      bool* got, int64_t* failed) {
  for (int64_t i = cuda::thread_begin(); i < n; i += cuda::thread_stride()) got[i] = got_row(res[i]);
  cuda::tally(
      n, num_tables,
      [&](int64_t i) {
        if (res[i] != kFailed) return int64_t{-1};
        CUDA_KERNEL_ASSERT(tids[i] >= 0 && tids[i] < num_tables);
        return tids[i];
      },
      [&](int64_t t, int64_t count) { cuda::atomic_add_i64(failed + t, count); });
}

std::tuple<Tensor, Tensor> insert_outcome(const Tensor& results, const Tensor& table_ids, int64_t num_tables) {
  const at::Device dev = results.device();
  TORCH_CHECK(dev.is_cuda(), "dynamicemb: results must be on a CUDA device, got ", dev);
  const int64_t n = check_outcome_args(results, table_ids, num_tables, dev);
  const c10::cuda::CUDAGuard guard(dev);
  Tensor got = new_tensor(n, at::kBool, dev), failed = at::zeros({num_tables}, table_ids.options());
  if (n == 0) return {got, failed};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  insert_outcome_kernel<<<cuda::tally_grid(n), kThreads, 0, stream>>>(
      results.data_ptr<int8_t>(), table_ids.data_ptr<int64_t>(), n, num_tables, got.data_ptr<bool>(),
      failed.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {got, failed};
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CUDA, m) {
  m.impl("table_insert", &insert);
  m.impl("table_insert_outcome", &insert_outcome);
}

}  // namespace cuda_impl
}  // namespace table
}  // namespace dynamicemb
