// The keys of a mutating table call regrouped by bucket (CPU), so that the
// keys of one bucket go in input order while different buckets go in
// parallel (the ordering contract of table_cpu.h).
//
// Each key's record (its inputs; the walk overwrites them with its results)
// is moved into one of P parts, each a contiguous range of 2^shift buckets:
// one pass counts the keys per (chunk of input, part), one writes the
// records. Each part's records then sit together (a few hundred KiB, cache
// resident), are copied in bucket order (so that the walk reads them in
// sequence), walked, and copied back; a last pass in input order hands every
// key its record back. Every pass over the inputs and outputs is sequential;
// only the walk over the table's slots is not.
// A key position that the placement rejects (bad table id) is reported before
// any record is written, so the caller can throw before touching a slot.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "common/huge_pages_cpu.h"
#include "common/parallel_cpu.h"

namespace dynamicemb {
namespace table {

// Room for n T's (uninitialised), kept by the calling thread from call to
// call; Tag tells one use's room from another's. A call of a million keys
// needs tens of MiB of records, which glibc would map afresh each time
// (blocks from 32 MiB up always are) and the kernel fault in and clear page
// by page. The room of the largest call so far stays allocated, on 2 MiB
// pages where the kernel gives them.
template <class T, class Tag>
T* scratch_room(int64_t n) {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_destructible_v<T>);
  thread_local at::Tensor room;
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  if (!room.defined() || room.numel() < bytes) room = cpu::empty_huge({bytes}, at::kByte);
  return reinterpret_cast<T*>(room.data_ptr<uint8_t>());
}

// One part's records in bucket order (input order within a bucket), cut into
// runs of one bucket each: run r is recs[start[r], start[r + 1]).
template <class Rec>
struct Runs {
  Rec* recs;
  const uint32_t* start;  // count + 1 entries
  int64_t count;
  Rec* begin(int64_t r) const { return recs + start[r]; }
  int64_t len(int64_t r) const { return start[r + 1] - start[r]; }
  int64_t bucket(int64_t r) const { return recs[start[r]].bucket; }
};

template <class Rec>  // Rec: trivially constructible, with an int64_t `bucket`
class BucketBatch {
 public:
  // bucket_of(i): key i's global bucket, or -1 for a bad table id.
  template <class BucketOf>
  BucketBatch(int64_t n, int64_t num_buckets, int64_t serial_below, BucketOf bucket_of)
      : n_(n), num_buckets_(num_buckets) {
    const int64_t threads = at::get_num_threads();
    // About 64 parts per thread (load balance) of at least ~64 keys each.
    const int64_t want = n < serial_below ? 1 : std::max<int64_t>(1, std::min<int64_t>(64 * threads, n / 64));
    while ((num_buckets_ - 1) >> shift_ >= want) ++shift_;
    parts_ = ((num_buckets_ - 1) >> shift_) + 1;
    chunks_ = n < serial_below ? 1 : std::max<int64_t>(1, std::min<int64_t>(cpu::num_chunks(n, 8192), (int64_t{1} << 22) / parts_));
    len_ = std::max<int64_t>(1, (n + chunks_ - 1) / chunks_);
    start_.assign(chunks_ * parts_, 0);
    std::atomic<int64_t> bad{-1};
    cpu::parallel_claim(chunks_, [&](int64_t c) {
      for (int64_t i = c * len_, e = std::min(n, i + len_); i < e; ++i) {
        const int64_t b = bucket_of(i);
        if (b < 0) {
          cpu::keep_first(bad, i);
          continue;
        }
        ++start_[c * parts_ + (b >> shift_)];
      }
    });
    bad_ = bad.load();
    part_begin_ = cpu::counts_to_starts(start_, chunks_, parts_);
  }

  // A key position that bucket_of rejected, or -1.
  int64_t bad_position() const { return bad_; }

  // fill(i, rec) writes key i's record, rec.bucket included (the bucket
  // bucket_of gave). Call once, after checking bad_position().
  template <class Fill>
  void gather(Fill fill) {
    static_assert(std::is_trivially_default_constructible_v<Rec> && std::is_trivially_destructible_v<Rec>);
    recs_ = scratch_room<Rec, RecordsTag>(n_);
    each_record(
        [fill](int64_t i) {
          Rec r;
          fill(i, r);
          return r;
        },
        [recs = recs_](int64_t, int64_t, const Rec& r, int64_t j) { recs[j] = r; });
  }

  // fn(runs) for each part, in parallel: its records in bucket order, cut
  // into runs of one bucket (Runs). What fn writes to them is copied back.
  template <class PartFn>
  void for_each_part(PartFn fn) {
    for_each_part(fn, CountsNone{});
  }

  // for_each_part that also counts, right after fn walked a part (its
  // records still in cache), the records that keep(rec) holds per chunk of
  // input: returns each chunk's first position among the kept records in
  // input order (chunks + 1 entries, the last their count), for scatter's
  // numbering.
  template <class PartFn, class Keep>
  std::vector<int64_t> for_each_part(PartFn fn, Keep keep) {
    constexpr bool kCounts = !std::is_same_v<Keep, CountsNone>;
    std::vector<int64_t> kept(kCounts ? chunks_ * parts_ : 0, 0);  // [chunk][part]
    cpu::parallel_claim(parts_, [&](int64_t p) {
      thread_local std::vector<uint32_t> start;
      const int64_t m = part_begin_[p + 1] - part_begin_[p];
      if (m == 0) return;
      Rec* recs = recs_ + part_begin_[p];
      Rec* sorted = scratch_room<Rec, SortedTag>(m);
      uint32_t* rank = scratch_room<uint32_t, RankTag>(m);  // where recs[j] went in sorted
      sort_part(p, recs, m, sorted, rank, start);
      fn(Runs<Rec>{sorted, start.data(), static_cast<int64_t>(start.size()) - 1});
      for (int64_t j = 0; j < m; ++j) recs[j] = sorted[rank[j]];
      if constexpr (!kCounts) return;
      for (int64_t c = 0; c < chunks_; ++c) {
        const int64_t e = c + 1 < chunks_ ? start_[(c + 1) * parts_ + p] : part_begin_[p + 1];
        int64_t k = 0;
        for (int64_t j = start_[c * parts_ + p]; j < e; ++j) k += keep(static_cast<const Rec&>(recs_[j]));
        kept[c * parts_ + p] = k;
      }
    });
    if constexpr (!kCounts) return {};
    std::vector<int64_t> first(chunks_ + 1, 0);
    for (int64_t c = 0; c < chunks_; ++c)
      first[c + 1] = first[c] + std::accumulate(kept.begin() + c * parts_, kept.begin() + (c + 1) * parts_, int64_t{0});
    return first;
  }

  // back(i, rec) for every key, chunks of input in parallel.
  template <class BucketOf, class Back>
  void scatter(BucketOf bucket_of, Back back) const {
    each_record(bucket_of, [recs = recs_, back](int64_t, int64_t i, int64_t, int64_t j) {
      back(i, static_cast<const Rec&>(recs[j]));
    });
  }

  // scatter, and emit(o, i, rec) for the records that keep(rec) holds, o
  // numbering them in input order from first (for_each_part's count).
  template <class BucketOf, class Back, class Keep, class Emit>
  void scatter(BucketOf bucket_of, Back back, Keep keep, const std::vector<int64_t>& first, Emit emit) const {
    constexpr int64_t kLine = 8;  // per chunk its next kept position, a cache line apart (no false sharing)
    std::vector<int64_t> next(chunks_ * kLine);
    for (int64_t c = 0; c < chunks_; ++c) next[c * kLine] = first[c];
    each_record(bucket_of, [recs = recs_, next = next.data(), back, keep, emit](int64_t c, int64_t i, int64_t, int64_t j) {
      const Rec& r = recs[j];
      back(i, r);
      if (keep(r)) emit(next[c * kLine]++, i, r);
    });
  }

 private:
  struct CountsNone {  // for_each_part without a count
    bool operator()(const Rec&) const { return false; }
  };

  // fn(c, i, x, j) for every i in input order (chunks c in parallel), with
  // x = place(i) (x's bucket: x itself or x.bucket) and j the slot of i's
  // record: parts in order, input order within a part.
  //
  // The loop works on local copies of the members and closures: callers
  // store bytes (results, digests), which may alias anything read through a
  // pointer or reference, so the compiler would reload those for every key.
  template <class Place, class Fn>
  void each_record(Place place, Fn fn) const {
    cpu::parallel_claim(chunks_, [&](int64_t c) {
      thread_local std::vector<int64_t> cursors;
      cursors.assign(start_.begin() + c * parts_, start_.begin() + (c + 1) * parts_);
      int64_t* const next = cursors.data();
      const Rec* const recs = recs_;
      const int shift = shift_;
      const int64_t last = n_ - 1;
      auto pl = place;
      auto f = fn;
      for (int64_t i = c * len_, e = std::min(n_, i + len_); i < e; ++i) {
        const auto x = pl(i);
        const int64_t j = next[bucket(x) >> shift]++;
        // Each part's slots are taken in sequence, but too many parts are
        // in flight for the hardware to follow: fetch a few records ahead.
        __builtin_prefetch(recs + std::min(j + kStreamAhead, last), 1, 1);
        f(c, i, x, j);
      }
    });
  }

  static int64_t bucket(int64_t b) { return b; }
  static int64_t bucket(const Rec& r) { return r.bucket; }

  // Part p's records copied to `sorted` in bucket order, stably (rank[j]:
  // where recs[j] went), by a counting sort over the part's bucket range when
  // the keys are dense enough in it, else by a sort; `start` gets the runs'
  // first positions, and m.
  void sort_part(int64_t p, const Rec* recs, int64_t m, Rec* sorted, uint32_t* rank,
                 std::vector<uint32_t>& start) const {
    start.clear();
    const int64_t lo = p << shift_, width = std::min(num_buckets_, (p + 1) << shift_) - lo;
    if (width > 4 * m + 64) {
      thread_local std::vector<uint32_t> order;
      order.resize(m);
      for (int64_t j = 0; j < m; ++j) order[j] = static_cast<uint32_t>(j);
      std::stable_sort(order.begin(), order.end(),
                       [&](uint32_t x, uint32_t y) { return recs[x].bucket < recs[y].bucket; });
      for (int64_t k = 0; k < m; ++k) {
        sorted[k] = recs[order[k]];
        rank[order[k]] = static_cast<uint32_t>(k);
        if (k == 0 || sorted[k].bucket != sorted[k - 1].bucket) start.push_back(static_cast<uint32_t>(k));
      }
    } else {
      thread_local std::vector<uint32_t> at;  // per bucket: its first position, then the next free one
      at.assign(width + 1, 0);
      for (int64_t j = 0; j < m; ++j) ++at[recs[j].bucket - lo + 1];
      for (int64_t c = 1; c <= width; ++c) {
        if (at[c] != 0) start.push_back(at[c - 1]);
        at[c] += at[c - 1];
      }
      for (int64_t j = 0; j < m; ++j) {
        const uint32_t k = at[recs[j].bucket - lo]++;
        sorted[k] = recs[j];
        rank[j] = k;
      }
    }
    start.push_back(static_cast<uint32_t>(m));
  }

  struct RecordsTag {};
  struct SortedTag {};
  struct RankTag {};

  static constexpr int64_t kStreamAhead = 256 / sizeof(Rec) + 1;  // records, about 4 lines

  int64_t n_, num_buckets_;
  int shift_ = 0;
  int64_t parts_ = 1, chunks_ = 1, len_ = 1, bad_ = -1;
  std::vector<int64_t> start_;       // first record slot of (chunk, part)
  std::vector<int64_t> part_begin_;  // first record slot of each part
  Rec* recs_ = nullptr;
};

}  // namespace table
}  // namespace dynamicemb
