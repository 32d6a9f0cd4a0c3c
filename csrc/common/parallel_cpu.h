// Parallel building blocks of the CPU kernels: a stable partition of
// positions into parts, order-preserving compaction, per-group tallies.
// Results never depend on the thread count.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace dynamicemb {
namespace cpu {

// Chunks of about `grain` items, at most `per_thread` per thread.
inline int64_t num_chunks(int64_t n, int64_t grain, int64_t per_thread = 4) {
  return std::max<int64_t>(1, std::min<int64_t>(per_thread * at::get_num_threads(), n / grain));
}

// Lowers `at` (-1: none yet) to position i: the smallest offending position
// whatever the threads' order, as the CUDA kernels' flag_min keeps it, so
// that both backends name the same one in their error.
inline void keep_first(std::atomic<int64_t>& at, int64_t i) {
  int64_t cur = at.load(std::memory_order_relaxed);
  while ((cur < 0 || i < cur) && !at.compare_exchange_weak(cur, i, std::memory_order_relaxed)) {
  }
}

// fn(i) for i in [0, n), items claimed one at a time by the threads: a
// thread that a busy machine slows down takes fewer items instead of holding
// the others at the region's end. For items whose results do not depend on
// which thread runs them (disjoint outputs).
template <class Fn>
void parallel_claim(int64_t n, Fn fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  });
}

// fn(b, e) over [0, n) cut into ranges of about `grain` items (up to 8 per
// thread), claimed as in parallel_claim.
template <class Fn>
void parallel_ranges(int64_t n, int64_t grain, Fn fn) {
  const int64_t chunks = num_chunks(n, grain, 8);
  const int64_t len = (n + chunks - 1) / chunks;
  parallel_claim(chunks, [&](int64_t c) { fn(c * len, std::min(n, (c + 1) * len)); });
}

// Turns counts per (chunk, part) (row-major, chunks x parts) into each
// (chunk, part)'s first output position, parts in order and chunks in order
// within a part, in place; returns each part's first position (parts + 1).
inline std::vector<int64_t> counts_to_starts(std::vector<int64_t>& cnt, int64_t chunks, int64_t parts) {
  std::vector<int64_t> begin(parts + 1, 0);
  int64_t run = 0;
  for (int64_t p = 0; p < parts; ++p) {
    begin[p] = run;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = cnt[c * parts + p];
      cnt[c * parts + p] = run;
      run += k;
    }
  }
  begin[parts] = run;
  return begin;
}

// Positions 0..n-1 grouped by part(i) in [0, parts), input order kept within a
// part (a parallel stable counting sort). With one part the order is the
// identity and nothing is stored.
class StablePartition {
 public:
  template <class PartFn>
  StablePartition(int64_t n, int64_t parts, PartFn part) : n_(n), parts_(std::max<int64_t>(1, parts)) {
    if (parts_ == 1) return;
    const int64_t P = parts_;
    // Each chunk keeps a counter per part: bound chunks x parts so that many
    // parts (e.g. one per unique key) cost no more than ~32 MiB of counters.
    // One chunk per thread alone (more only balance the load: with one
    // thread they cost counters and a longer prefix sum).
    const int64_t per_thread = at::get_num_threads() > 1 ? 4 : 1;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(num_chunks(n, 8192, per_thread), (int64_t{1} << 22) / P));
    const int64_t len = (n + chunks - 1) / chunks;
    std::vector<int64_t> off(chunks * P, 0);
    // Each position's part, kept from the counting pass when it fits 32
    // bits: the placing pass reads it in sequence instead of asking again.
    const bool keep = P <= (int64_t{1} << 32);
    std::unique_ptr<uint32_t[]> part_at(keep ? new uint32_t[n] : nullptr);
    parallel_claim(chunks, [&](int64_t c) {
      for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i) {
        const int64_t p = part(i);
        if (keep) part_at[i] = static_cast<uint32_t>(p);
        ++off[c * P + p];
      }
    });
    begin_ = counts_to_starts(off, chunks, P);
    order_.resize(n);
    parallel_claim(chunks, [&](int64_t c) {
      for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i)
        order_[off[c * P + (keep ? int64_t{part_at[i]} : part(i))]++] = i;
    });
  }

  int64_t parts() const { return parts_; }
  int64_t begin(int64_t p) const { return parts_ == 1 ? 0 : begin_[p]; }
  int64_t end(int64_t p) const { return parts_ == 1 ? n_ : begin_[p + 1]; }
  int64_t pos(int64_t j) const { return parts_ == 1 ? j : order_[j]; }

  // fn(part) for every part, parts in parallel.
  template <class Fn>
  void for_each_part(Fn fn) const {
    if (parts_ == 1) return fn(int64_t{0});
    parallel_claim(parts_, fn);
  }

 private:
  int64_t n_, parts_;
  std::vector<int64_t> begin_, order_;
};

// Order-preserving stream compaction: counts keep(i) per chunk, calls
// alloc(total), then emit(i, out_pos) for each kept i in input order.
template <class Keep, class Alloc, class Emit>
int64_t compact(int64_t n, Keep keep, Alloc alloc, Emit emit) {
  const int64_t chunks = num_chunks(n, 16384);
  const int64_t len = std::max<int64_t>(1, (n + chunks - 1) / chunks);
  std::vector<int64_t> start(chunks + 1, 0);
  parallel_claim(chunks, [&](int64_t c) {
    int64_t k = 0;
    for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i) k += keep(i);
    start[c + 1] = k;
  });
  for (int64_t c = 0; c < chunks; ++c) start[c + 1] += start[c];
  alloc(start[chunks]);
  parallel_claim(chunks, [&](int64_t c) {
    int64_t o = start[c];
    for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i)
      if (keep(i)) emit(i, o++);
  });
  return start[chunks];
}

// Counts per (group(i), cls(i)) with group in [0, G) and cls in [0, K)
// (a negative cls is not counted): a G x K row-major vector.
template <class Group, class Cls>
std::vector<int64_t> tally(int64_t n, int64_t G, int K, Group group, Cls cls) {
  const int64_t chunks = num_chunks(n, 16384);
  const int64_t len = std::max<int64_t>(1, (n + chunks - 1) / chunks);
  std::vector<int64_t> acc(chunks * G * K, 0);
  parallel_claim(chunks, [&](int64_t c) {
    // Four sets of counters, taken in turn: a run of one class does not wait
    // on its previous increment (one counter made a chain through memory).
    thread_local std::vector<int64_t> part;
    part.assign(4 * G * K, 0);
    for (int64_t i = c * len, e = std::min(n, i + len); i < e; ++i) {
      const int k = cls(i);
      if (k >= 0) ++part[((i & 3) * G + group(i)) * K + k];
    }
    for (int64_t j = 0; j < G * K; ++j)
      acc[c * G * K + j] = part[j] + part[G * K + j] + part[2 * G * K + j] + part[3 * G * K + j];
  });
  std::vector<int64_t> out(G * K, 0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < G * K; ++j) out[j] += acc[c * G * K + j];
  return out;
}

}  // namespace cpu
}  // namespace dynamicemb
