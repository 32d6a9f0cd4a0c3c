// CPU kernels of the embedding layer: unique keys per table, row
// initialisation, gather + pool forward, and the backward that reduces one
// gradient per unique key and applies the optimizer to its row in place.
//
// Rows: table t's rows (weights[t], or a head and a tail: row_parts.h), 2-D
// [rows, dim_t + state_t] in the storage dtype; kernels address them by
// table-local row through row_at (-1: the key
// has no row, its value is its initial value and it gets no update).
// Bags: TBE layout, offsets [F * B + 1], bag j = f * B + b; feature f reads
// table feature_table[f]; pooled output [B, sum_f dim_f], features side by side.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "common/parallel_cpu.h"
#include "embedding/embedding_cpu.h"
#include "embedding/optimizer_rules.h"
#include "embedding/unique_rules.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace embedding {
namespace {

// ---- unique ------------------------------------------------------------------------

// (table, key) pairs deduplicated: unique keys and table ids in order of first
// occurrence within each of 64 hash parts (a fixed count: the order does not
// depend on threads), inverse[i] = unique id of index i, counts per unique.
//
// The pairs are first scattered, stably, into per-part runs of (key, table,
// hash) records, so that each part's probe reads its records in sequence and
// its probe table (sized by the part) stays in cache.
std::tuple<Tensor, Tensor, Tensor, Tensor> unique_cpu(const Tensor& indices, const Tensor& offsets,
                                                      IntArrayRef feature_table, int64_t num_tables) {
  check_1d(indices, at::kLong, "indices");
  const int64_t n = indices.numel();
  const Bags bags = check_bags(n, offsets, feature_table, num_tables);
  TORCH_CHECK(n < (int64_t{1} << 31), "dynamicemb: emb_unique takes fewer than 2^31 indices, got ", n);
  const int64_t* key = indices.data_ptr<int64_t>();
  std::vector<uint64_t> salt(num_tables);  // per table, mixed into its keys' hashes
  for (int64_t t = 0; t < num_tables; ++t) salt[t] = unique::salt(t);
  auto hash_of = [&](int64_t k, int64_t t) { return unique::pair_hash(k, salt[t]); };
  const bool partitioned = n >= unique::kPartsFrom;
  const int64_t P = partitioned ? (1 << unique::kPartBits) : 1;
  auto part_of = [&](uint64_t h) { return unique::part(h, partitioned); };
  struct Rec {
    int64_t key;
    int32_t tid;
    uint32_t hash;  // the pair hash's low bits: the probe's start
  };
  // Stable scatter by part: chunks of bags count, then place, their records.
  const int64_t nb = bags.num_bags();
  const int64_t C = std::max<int64_t>(1, std::min<int64_t>(cpu::num_chunks(n, 16384), nb));
  std::vector<int64_t> at_(C * P, 0);  // [chunk][part]: count, then write cursor
  auto for_each_chunk = [&](auto fn) {
    cpu::parallel_claim(C, [&](int64_t c) {
      auto f = fn;  // a local copy: its captures stay in registers (see the counting pass)
      bags.walk(nb * c / C, nb * (c + 1) / C, [&](int64_t j, int64_t ft, int64_t) {
        const int64_t t = bags.table[ft];
        for (int64_t i = bags.off[j], ie = bags.off[j + 1]; i < ie; ++i) f(c, t, i);
      });
    });
  };
  // Each index's part, kept from the counting pass for the later passes.
  std::unique_ptr<uint8_t[]> part_at(new uint8_t[n]);
  static_assert((1 << unique::kPartBits) <= 256, "parts must fit a byte");
  // The pointers by value: a byte store may alias anything the loop reads
  // through a reference, which made it reload them all for every index.
  for_each_chunk([pa = part_at.get(), cnt = at_.data(), key, P, &hash_of, &part_of](int64_t c, int64_t t, int64_t i) {
    const int64_t p = part_of(hash_of(key[i], t));
    pa[i] = static_cast<uint8_t>(p);
    ++cnt[c * P + p];
  });
  const std::vector<int64_t> part_begin = cpu::counts_to_starts(at_, C, P);
  std::vector<int64_t> cursor(at_);  // each (chunk, part)'s first record: the inverse's pass replays from it
  std::unique_ptr<Rec[]> rec(new Rec[n]);
  // Each part's records (and, in the last pass, local ids) are taken in
  // sequence, but 64 parts are too many streams for the hardware to follow:
  // fetch a few lines ahead in each (records: 16 bytes, local ids: 4).
  constexpr int64_t kRecAhead = 8, kIdAhead = 16;
  for_each_chunk([&](int64_t c, int64_t t, int64_t i) {
    const int64_t j = at_[c * P + part_at[i]]++;
    __builtin_prefetch(rec.get() + std::min(j + kRecAhead, n - 1), 1, 1);
    rec[j] = Rec{key[i], static_cast<int32_t>(t), static_cast<uint32_t>(hash_of(key[i], t))};
  });
  // Per part: local unique id of every record, and per unique its key, table
  // and count, at the part's own offset (a part has at most as many uniques
  // as records). The probe table holds the pair itself: a probe touches one entry.
  struct Entry {
    int64_t key;
    int32_t tid;
    int32_t id;  // -1: empty
  };
  std::unique_ptr<int32_t[]> lid(new int32_t[n]);
  std::unique_ptr<Rec[]> first(new Rec[n]);  // per unique: its pair (hash unused)
  std::unique_ptr<int64_t[]> count(new int64_t[n]);
  std::vector<int64_t> uniques(P, 0);
  cpu::parallel_claim(P, [&](int64_t p) {
    thread_local std::vector<Entry> table;
    const int64_t m = part_begin[p + 1] - part_begin[p];
    int64_t cap = 16;
    while (cap < 2 * m) cap <<= 1;
    table.assign(cap, Entry{0, 0, -1});
    Rec* fp = first.get() + part_begin[p];
    int64_t* cp = count.get() + part_begin[p];
    int32_t u = 0;
    for (int64_t j = part_begin[p]; j < part_begin[p + 1]; ++j) {
      const Rec r = rec[j];
      for (uint64_t h = r.hash & (cap - 1);; h = (h + 1) & (cap - 1)) {
        Entry& e = table[h];
        if (e.id < 0) {
          e = Entry{r.key, r.tid, u};
          fp[u] = r;
          cp[u++] = 1;
        } else if (e.key != r.key || e.tid != r.tid) {
          continue;
        } else {
          ++cp[e.id];
        }
        lid[j] = e.id;
        break;
      }
    }
    uniques[p] = u;
  });
  std::vector<int64_t> base(P + 1, 0);
  for (int64_t p = 0; p < P; ++p) base[p + 1] = base[p] + uniques[p];
  const int64_t U = base[P];
  Tensor ukeys = at::empty({U}, indices.options()), utids = at::empty({U}, indices.options()),
         ucounts = at::empty({U}, indices.options()), inverse = at::empty({n}, indices.options());
  int64_t *uk = ukeys.data_ptr<int64_t>(), *ut = utids.data_ptr<int64_t>(), *uc = ucounts.data_ptr<int64_t>(),
          *inv = inverse.data_ptr<int64_t>();
  cpu::parallel_claim(P, [&](int64_t p) {
    for (int64_t u = 0; u < uniques[p]; ++u) {
      uk[base[p] + u] = first[part_begin[p] + u].key;
      ut[base[p] + u] = first[part_begin[p] + u].tid;
      uc[base[p] + u] = count[part_begin[p] + u];
    }
  });
  // inverse in input order: each chunk replays its placing pass to find
  // its records (sequential writes, where scattering by record would not be).
  for_each_chunk([&](int64_t c, int64_t, int64_t i) {
    const int64_t p = part_at[i];
    const int64_t j = cursor[c * P + p]++;
    __builtin_prefetch(lid.get() + std::min(j + kIdAhead, n - 1), 0, 1);
    inv[i] = base[p] + lid[j];
  });
  return {ukeys, utids, inverse, ucounts};
}

// emb_unique padded to the indices' length (unique_rules.h's padding). The
// CPU checks the offsets at once: its record says they passed.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> unique_padded_cpu(const Tensor& indices,
                                                                             const Tensor& offsets,
                                                                             IntArrayRef feature_table,
                                                                             int64_t num_tables) {
  const auto [keys, tids, inverse, counts] = unique_cpu(indices, offsets, feature_table, num_tables);
  const int64_t n = indices.numel(), G = keys.numel();
  auto padded = [&](const Tensor& t, int64_t pad) {
    Tensor out = at::empty({n}, t.options());
    out.narrow(0, 0, G).copy_(t);
    out.narrow(0, G, n - G).fill_(pad);
    return out;
  };
  Tensor record = at::zeros({kOffsetsRecordLen}, indices.options());
  int64_t* r = record.data_ptr<int64_t>();
  r[kRecBad] = kNoBadOffset;
  r[kRecLast] = r[kRecCount] = n;
  return {padded(keys, unique::kPadKey), padded(tids, unique::kPadTable), inverse, padded(counts, unique::kPadCount),
          at::full({1}, G, indices.options()), record};
}

void offsets_verdict_cpu(const Tensor& record) {
  TORCH_CHECK(record.device().is_cpu() && record.scalar_type() == at::kLong && record.is_contiguous() &&
                  record.numel() == kOffsetsRecordLen,
              "dynamicemb: offsets_record must be a contiguous int64 CPU tensor of ", kOffsetsRecordLen, " entries");
  check_offsets_record(record.data_ptr<int64_t>());
}

// ---- initial rows ----------------------------------------------------------------------

// Row `row`'s initial values and fresh optimizer state (init::state_value).
template <class W>
void init_row(W* row, int64_t dim, int64_t stride, const init::Args& a, uint64_t seed, int64_t key) {
  // 16 Philox blocks at a time on AVX-512 and AVX2 CPUs (philox_cpu.cpp)
  init::fill_row(a, seed, key, dim, [row](int64_t j, float v) { row[j] = static_cast<W>(v); });
  const W s = static_cast<W>(init::state_value(a));
  for (int64_t d = dim; d < stride; ++d) row[d] = s;
}

// The float32 form for rows UniformPairs does not take: the row is built in
// `buf` (UNIFORM: 64 values at a time in vector registers) and streamed out,
// so that its lines are not fetched before being overwritten; memory-bound,
// this halves the time of a batch's new rows.
void init_row(float* row, int64_t dim, int64_t stride, const init::Args& a, uint64_t seed, int64_t key,
              std::vector<float>& buf) {
  buf.assign(stride, init::state_value(a));
  if (a.mode == init::kUniform) {  // fill_row's values
    uint32_t bits[64];
    for (int64_t j = 0; j < dim; j += 64) {
      init::outputs64(seed, a.stream, key, static_cast<uint64_t>(j / 4), bits);
      uniform_floats(buf.data() + j, bits, std::min<int64_t>(64, dim - j), a.lower, a.upper - a.lower);
    }
  } else {
    init_row(buf.data(), dim, dim, a, seed, key);
  }
  stream_floats(row, buf.data(), stride);
}

// UNIFORM float32 rows that stream_uniform_row can write (the common layout:
// no buffer), taken two at a time (init::stream_uniform_rows2: one row's
// rounds fill the other's latency).
class UniformPairs {
 public:
  // Whether the row is taken (written now or with the next one taken).
  bool add(float* row, int64_t dim, int64_t stride, const init::Args& a, int64_t key, uint64_t seed) {
    const double span = a.upper - a.lower;
    if (a.mode != init::kUniform || init::state_value(a) != 0.0f || !init::uniform_streamable(row, dim, stride, span))
      return false;
    const init::UniformRow r{row, a.stream, key, a.lower, span};
    if (held_ && dim == dim_ && stride == stride_) {
      init::stream_uniform_rows2(first_, r, dim, stride, seed);
      held_ = false;
      return true;
    }
    flush(seed);
    first_ = r;
    dim_ = dim;
    stride_ = stride;
    held_ = true;
    return true;
  }
  // Writes a row still held.
  void flush(uint64_t seed) {
    if (held_) init::stream_uniform_row(first_.row, dim_, stride_, seed, first_.table, first_.key, first_.lower,
                                        first_.span);
    held_ = false;
  }

 private:
  init::UniformRow first_{};
  int64_t dim_ = 0, stride_ = 0;
  bool held_ = false;
};

// The initial values and fresh optimizer state of row r[i] of table t[i] for
// key k[i], for every i in [0, n) with r[i] >= 0 and (no mask or mask[i]); a
// pair out of range raises, or with skip_bad is skipped.
void init_rows_where(const Rows& R, const std::vector<init::Args>& args, uint64_t seed, const int64_t* r,
                     const int64_t* t, const int64_t* k, const bool* mask, int64_t n, bool skip_bad = false) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_init_rows", [&] {
    const int64_t T = R.num_tables();
    constexpr bool kStreamed = std::is_same_v<scalar_t, float>;
    auto wanted = [&](int64_t i) { return r[i] >= 0 && (mask == nullptr || mask[i]); };
    cpu::parallel_ranges(n, 256, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> buf;
      UniformPairs pairs;
      constexpr int64_t kAhead = 8;  // the rows are scattered: fetch them for writing ahead
      for (int64_t i = b; i < e; ++i) {
        const int64_t a = i + kAhead;
        if (!kStreamed && a < e && wanted(a) && 0 <= t[a] && t[a] < T && r[a] < R.parts[t[a]].rows) {
          const char* row = reinterpret_cast<const char*>(R.row<scalar_t>(t[a], r[a]));
          for (int64_t q = 0; q < R.stride[t[a]] * static_cast<int64_t>(sizeof(scalar_t)); q += 64)
            __builtin_prefetch(row + q, 1, 3);
        }
        if (!wanted(i)) continue;
        const bool ok = 0 <= t[i] && t[i] < T && r[i] < R.parts[t[i]].rows;
        if (!ok && skip_bad) continue;
        TORCH_CHECK(ok, "dynamicemb: row ", r[i], " of table ", t[i], " is out of range");
        if constexpr (kStreamed) {
          float* row = reinterpret_cast<float*>(R.row<scalar_t>(t[i], r[i]));
          const init::Args& a = args[t[i]];
          if (!pairs.add(row, R.dim[t[i]], R.stride[t[i]], a, k[i], seed))
            init_row(row, R.dim[t[i]], R.stride[t[i]], a, seed, k[i], buf);
        } else {
          init_row(R.row<scalar_t>(t[i], r[i]), R.dim[t[i]], R.stride[t[i]], args[t[i]], seed, k[i]);
        }
      }
      if (kStreamed) {
        pairs.flush(seed);
        stream_fence();
      }
    });
  });
}

void init_rows_cpu(TensorList weights, const Tensor& rows, const Tensor& table_ids, const Tensor& keys,
                   IntArrayRef dims, const Tensor& init_params, int64_t seed, bool skip_bad) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(table_ids, at::kLong, "table_ids");
  check_1d(keys, at::kLong, "keys");
  const int64_t n = rows.numel();
  TORCH_CHECK(table_ids.numel() == n && keys.numel() == n, "dynamicemb: rows, table_ids and keys differ in length");
  init_rows_where(R, init_args(init_params, R.num_tables()), static_cast<uint64_t>(seed),
                  rows.data_ptr<int64_t>(), table_ids.data_ptr<int64_t>(), keys.data_ptr<int64_t>(), nullptr, n,
                  skip_bad);
}

// The keys' rows from their slots (slot_row), the new keys' rows initialised
// (init_rows_where with skip_bad: the rows are the table's own slots).
Tensor slot_rows_init_cpu(TensorList weights, const Tensor& slots, const Tensor& slot_begin, const Tensor& table_ids,
                          const Tensor& keys, const Tensor& is_new, IntArrayRef dims, const Tensor& init_params,
                          int64_t seed) {
  const Rows R = check_rows(weights, dims);
  const int64_t T = R.num_tables();
  check_slot_rows_args(slots, slot_begin, table_ids, keys, is_new, T, at::Device(at::kCPU));
  const int64_t n = slots.numel();
  Tensor rows = at::empty({n}, slots.options());
  const int64_t *s = slots.data_ptr<int64_t>(), *sb = slot_begin.data_ptr<int64_t>(),
                *t = table_ids.data_ptr<int64_t>();
  int64_t* r = rows.data_ptr<int64_t>();
  cpu::parallel_ranges(n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) r[i] = slot_row(s[i], t[i], sb, T);
  });
  init_rows_where(R, init_args(init_params, T), static_cast<uint64_t>(seed), r, t, keys.data_ptr<int64_t>(),
                  is_new.data_ptr<bool>(), n, /*skip_bad=*/true);
  return rows;
}

// ---- row order ----------------------------------------------------------------------

// Positions 0..n-1 of (table, row) pairs in the order of their rows'
// addresses, to within blocks: the tables' rows laid end to end and cut into
// about n / 2 blocks, input order kept within a block. Rows written at random
// over tables larger than the caches cost about half as much in this order
// (neighbours share pages and DRAM rows; measured on the torchrec benchmark's
// tables: new rows' init 34 -> 21 ms, the backward's updates 50 -> 30 ms).
// Blocks of a few rows rather than n / 16: the partition costs 0.1-0.2 ms
// more for 113K keys in 4M rows, while a step of one process takes 11% less
// with half its keys new (the init and the backward write rows in finer
// order) and 6-11% less with all stored; bench_torchrec's dynamic step with
// half the ids new went from 62 to 53 ms.
// Pairs that name no row (or a bad one) come first.
constexpr int64_t kRowOrderFrom = 4096;  // pairs; fewer: input order
constexpr int64_t kRowOrderPairsPerBlock = 2;  // blocks: about n / this

template <class RowOf>
cpu::StablePartition row_order(const Rows& R, RowOf row_of, const int64_t* t, int64_t n) {
  const int64_t T = R.num_tables();
  std::vector<int64_t> base(T + 1, 0);
  for (int64_t k = 0; k < T; ++k) base[k + 1] = base[k] + R.parts[k].rows;
  int shift = 0;
  while ((base[T] >> shift) > std::max<int64_t>(1, n / kRowOrderPairsPerBlock)) ++shift;
  return cpu::StablePartition(n, n < kRowOrderFrom ? 1 : (base[T] >> shift) + 2, [&](int64_t i) -> int64_t {
    const int64_t r = row_of(i);
    return (0 <= t[i] && t[i] < T && 0 <= r && r < base[t[i] + 1] - base[t[i]]) ? ((base[t[i]] + r) >> shift) + 1
                                                                                : 0;
  });
}

// A training step's unique keys put in row order (order, and rows, keys and
// table ids permuted by it; inverse renumbered to match), with the rows of the
// new keys (is_new) initialised in that order: one pass instead of an order,
// gathers, a renumbering and an init call, each over the batch. The keys come
// with their hash table slots: a key's row is its slot less its table's first
// slot (slot_begin), -1 stays -1.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> row_order_init_cpu(
    TensorList weights, const Tensor& slots, const Tensor& slot_begin, const Tensor& table_ids, const Tensor& keys,
    const Tensor& is_new, const Tensor& inverse, IntArrayRef dims, const Tensor& init_params, int64_t seed) {
  const Rows R = check_rows(weights, dims);
  const int64_t n = slots.numel(), m = inverse.numel(), T = R.num_tables();
  check_slot_rows_args(slots, slot_begin, table_ids, keys, is_new, T, at::Device(at::kCPU));
  check_1d(inverse, at::kLong, "inverse");
  check_inverse(inverse, n);
  const auto args = init_args(init_params, T);
  const int64_t *s = slots.data_ptr<int64_t>(), *sb = slot_begin.data_ptr<int64_t>(),
                *t = table_ids.data_ptr<int64_t>(), *k = keys.data_ptr<int64_t>(), *inv = inverse.data_ptr<int64_t>();
  // The row of position i (a bad table id keeps its slot: row_order puts it first, init rejects it).
  const auto row_of = [&](int64_t i) { return slot_row(s[i], t[i], sb, T); };
  const bool* nw = is_new.data_ptr<bool>();
  Tensor order_out = at::empty({n}, slots.options()), rows_out = at::empty({n}, slots.options()),
         keys_out = at::empty({n}, keys.options()), tids_out = at::empty({n}, table_ids.options()),
         inv_out = at::empty({m}, inverse.options());
  int64_t *oo = order_out.data_ptr<int64_t>(), *ro = rows_out.data_ptr<int64_t>(), *ko = keys_out.data_ptr<int64_t>(),
          *to = tids_out.data_ptr<int64_t>(), *io = inv_out.data_ptr<int64_t>();
  std::unique_ptr<int64_t[]> renumber(new int64_t[n]);
  std::unique_ptr<bool[]> new_out(new bool[n]);
  const cpu::StablePartition order = row_order(R, row_of, t, n);
  // Both passes read at random (the keys' arrays, then renumber):
  // fetched kAhead positions ahead.
  constexpr int64_t kAhead = 16;
  cpu::parallel_ranges(n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      if (j + kAhead < e) {
        const int64_t oa = order.pos(j + kAhead);
        __builtin_prefetch(s + oa);
        __builtin_prefetch(k + oa);
        __builtin_prefetch(t + oa);
        __builtin_prefetch(nw + oa);
        __builtin_prefetch(&renumber[oa], 1);
      }
      const int64_t o = order.pos(j);
      oo[j] = o;
      ro[j] = row_of(o);
      ko[j] = k[o];
      to[j] = t[o];
      new_out[j] = nw[o];
      renumber[o] = j;
    }
  });
  cpu::parallel_ranges(m, 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (i + kAhead < e) __builtin_prefetch(&renumber[inv[i + kAhead]]);
      io[i] = renumber[inv[i]];
    }
  });
  init_rows_where(R, args, static_cast<uint64_t>(seed), ro, to, ko, new_out.get(), n);
  return {order_out, rows_out, keys_out, tids_out, inv_out};
}

// ---- forward ---------------------------------------------------------------------------

template <class W, class O>
void forward_impl(const Rows& R, const Bags& bags, const int64_t* rows, const int64_t* ukeys, const int64_t* inv,
                  const float* psw, int64_t pooling, const std::vector<init::Args>& args, uint64_t seed,
                  const std::vector<int64_t>& doff, O* out) {
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  for_each_span(bags, [&](int64_t jb, int64_t je) {
    // The row of every index of the span (nullptr: none, it reads its initial
    // value), resolved first so that the gather can prefetch ahead of use.
    thread_local std::vector<const W*> src;
    thread_local std::vector<float> acc;
    src.resize(bags.off[je] - bags.off[jb]);
    acc.resize(max_d);
    constexpr int64_t kRowsAhead = 16;  // rows[] is read at random, beyond the caches for a large batch
    bags.walk(jb, je, [&](int64_t j, int64_t f, int64_t) {
      const int64_t t = bags.table[f];
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        if (i + kRowsAhead < bags.off[je]) __builtin_prefetch(rows + inv[i + kRowsAhead]);
        const int64_t r = rows[inv[i]];
        src[i - bags.off[jb]] = r >= 0 ? R.row<const W>(t, r) : nullptr;
      }
    });
    pool_span<W, O>(R, bags, jb, je, src.data(), [&](int64_t i) { return ukeys[inv[i]]; }, psw, pooling, args, seed,
                    doff, acc.data(), out);
  });
}

Tensor forward_cpu(TensorList weights, const Tensor& rows, const Tensor& unique_keys, const Tensor& inverse,
                   const Tensor& offsets, IntArrayRef feature_table, IntArrayRef dims,
                   const std::optional<Tensor>& per_sample_weights, int64_t pooling, const Tensor& init_params,
                   int64_t seed, at::ScalarType output_dtype) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(unique_keys, at::kLong, "unique_keys");
  check_1d(inverse, at::kLong, "inverse");
  TORCH_CHECK(unique_keys.numel() == rows.numel(), "dynamicemb: rows and unique_keys differ in length");
  check_inverse(inverse, rows.numel());
  const int64_t n = inverse.numel();
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables());
  const float* psw = opt_weights(per_sample_weights, n);
  const auto args = init_args(init_params, R.num_tables());
  const std::vector<int64_t> doff = feature_columns(R, bags);
  Tensor out = forward_output(R, bags, doff, psw, pooling, output_dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_forward", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output_dtype, "dynamicemb_forward_out", [&] {
      forward_impl<W, scalar_t>(R, bags, rows.data_ptr<int64_t>(), unique_keys.data_ptr<int64_t>(),
                                inverse.data_ptr<int64_t>(), psw, pooling, args, static_cast<uint64_t>(seed), doff,
                                out.data_ptr<scalar_t>());
    });
  });
  return out;
}

// ---- backward + fused optimizer ------------------------------------------------------------

// A row's reduced gradient g[0, D), visited in element order (optim::update_row's walk).
struct RowWalk {
  const float* g;
  int64_t D;
  template <class Fn>
  void for_each(Fn fn) const {
    for (int64_t d = 0; d < D; ++d) fn(d, g[d]);
  }
  template <class Term>
  float sum(Term term) const {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s += term(d, g[d]);
    return s;
  }
  template <class Fn>
  void once(Fn fn) const {
    fn();
  }
};

Tensor backward_update_cpu(const Tensor& grad_output, TensorList weights, const Tensor& rows,
                           const Tensor& unique_table_ids, const Tensor& inverse, const Tensor& offsets,
                           IntArrayRef feature_table, IntArrayRef dims,
                           const std::optional<Tensor>& per_sample_weights, int64_t pooling, int64_t optimizer,
                           double lr, double eps, double beta1, double beta2, double weight_decay, int64_t step,
                           int64_t weight_decay_mode, double max_gradient, bool skip_nonfinite) {
  const Rows R = check_rows(weights, dims);
  check_1d(rows, at::kLong, "rows");
  check_1d(unique_table_ids, at::kLong, "unique_table_ids");
  check_1d(inverse, at::kLong, "inverse");
  const int64_t U = rows.numel(), n = inverse.numel();
  TORCH_CHECK(unique_table_ids.numel() == U, "dynamicemb: rows and unique_table_ids differ in length");
  check_inverse(inverse, U);
  const Bags bags = check_bags(n, offsets, feature_table, R.num_tables());
  const float* psw = opt_weights(per_sample_weights, n);
  TORCH_CHECK(grad_output.scalar_type() == at::kFloat && grad_output.is_contiguous() && grad_output.dim() == 2,
              "dynamicemb: grad_output must be a contiguous float32 2-D tensor");
  const GradColumns cols = check_backward(grad_output, n, bags.B, bags.table, R.dim, R.stride, pooling, optimizer,
                                          weight_decay_mode, max_gradient);
  const std::vector<int64_t>& doff = cols.col;
  const int64_t total_d = cols.width;
  const optim::Params p = optim::make_params(optimizer, lr, eps, beta1, beta2, weight_decay, step, weight_decay_mode);
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* ut = unique_table_ids.data_ptr<int64_t>();
  const float* grad = cols.grad.data_ptr<float>();
  // Each unique key's occurrences as (gradient slice, scale), in input order
  // (deterministic sums): a counting sort by unique id. Each thread owns a
  // range of unique ids and scans every index, so there are no per-thread
  // counters and the result does not depend on the thread count.
  std::vector<int64_t> begin(U + 1, 0);
  std::unique_ptr<const float*[]> occ_g(new const float*[n]);
  std::unique_ptr<float[]> occ_s(new float[n]);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 16384));
  auto for_each_part = [&](auto fn) {
    cpu::parallel_claim(parts, [&](int64_t q) { fn(U * q / parts, U * (q + 1) / parts); });
  };
  // The counters and cursors are hit at random (U of them, beyond the
  // caches for a large batch): fetched kCountAhead indices ahead.
  constexpr int64_t kCountAhead = 16;
  for_each_part([&](int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + kCountAhead < n) __builtin_prefetch(&begin[inv[i + kCountAhead] + 1], 1, 3);
      if (inv[i] >= lo && inv[i] < hi) ++begin[inv[i] + 1];
    }
  });
  for (int64_t u = 0; u < U; ++u) begin[u + 1] += begin[u];
  std::vector<int64_t> cursor(begin.begin(), begin.end() - 1);
  for_each_part([&](int64_t lo, int64_t hi) {
    bags.walk(0, bags.num_bags(), [&](int64_t j, int64_t f, int64_t b) {
      const int64_t L = bags.length(j);
      const float* go = grad + b * total_d + doff[f];
      for (int64_t i = bags.off[j]; i < bags.off[j + 1]; ++i) {
        if (i + kCountAhead < n) __builtin_prefetch(&cursor[inv[i + kCountAhead]], 1, 3);
        if (i + kCountAhead / 2 < n) {  // where that index's entry will go (its cursor is fetched by now)
          const int64_t ua = inv[i + kCountAhead / 2];
          if (ua >= lo && ua < hi) {  // (other parts' cursors belong to other threads)
            __builtin_prefetch(&occ_g[cursor[ua]], 1, 3);
            __builtin_prefetch(&occ_s[cursor[ua]], 1, 3);
          }
        }
        const int64_t u = inv[i];
        if (u < lo || u >= hi) continue;
        float scale = psw ? psw[i] : 1.0f;
        if (pooling == kMean) scale /= static_cast<float>(L);
        occ_g[cursor[u]] = pooling == kNone ? grad + i * R.dim[bags.table[f]] : go;
        occ_s[cursor[u]++] = scale;
      }
    });
  });
  const int64_t max_d = *std::max_element(R.dim.begin(), R.dim.end());
  const int64_t T = R.num_tables();
  // Tasks of about equal occurrence counts (not equal key counts: a few hot
  // keys hold much of a skewed batch); each key is reduced by one task, which
  // counts its rows left out as not finite (summed per table in task order).
  const int64_t tasks = U < 256 ? 1 : 8 * at::get_num_threads();
  std::vector<int64_t> skipped(tasks * T, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, R.dtype, "dynamicemb_backward", [&] {
    std::vector<int64_t> task_u(tasks + 1, U);
    for (int64_t q = 0; q < tasks; ++q)
      task_u[q] = std::lower_bound(begin.begin(), begin.end() - 1, n * q / tasks) - begin.begin();
    cpu::parallel_claim(tasks, [&](int64_t q) {
      const int64_t ub = task_u[q], ue = task_u[q + 1];
      thread_local std::vector<float> g;
      g.resize(max_d);
      // Rows being updated and gradient slices are scattered: fetch ahead.
      constexpr int64_t kRowAhead = 16, kGradAhead = 4, kGradPrefetches = 4;
      for (int64_t u = ub; u < ue; ++u) {
        if (u + kRowAhead < ue && r[u + kRowAhead] >= 0) {  // for writing: fetched exclusive
          const int64_t ta = ut[u + kRowAhead];
          const char* row = reinterpret_cast<const char*>(R.row<scalar_t>(ta, r[u + kRowAhead]));
          for (int64_t b = 0; b < R.stride[ta] * static_cast<int64_t>(sizeof(scalar_t)); b += 64)
            __builtin_prefetch(row + b, 1, 3);
        }
        if (u + kGradAhead < ue) {
          const int64_t ua = u + kGradAhead, bytes = R.dim[ut[ua]] * static_cast<int64_t>(sizeof(float));
          for (int64_t k = begin[ua]; k < std::min(begin[ua + 1], begin[ua] + kGradPrefetches); ++k)
            prefetch_row(occ_g[k], bytes);
        }
        if (r[u] < 0) continue;
        const int64_t t = ut[u], D = R.dim[t];
        sum_rows(g.data(), occ_g.get() + begin[u], occ_s.get() + begin[u], begin[u + 1] - begin[u], D, 0);
        if (skip_nonfinite && !all_finite(g.data(), D)) {
          ++skipped[q * T + t];
          continue;
        }
        RowWalk walk{g.data(), D};
        optim::dispatch(optimizer, [&](auto rule) {
          optim::update_row<decltype(rule)>(R.row<scalar_t>(t, r[u]), D, walk, p);
        });
      }
    });
  });
  Tensor counts = at::zeros({T}, rows.options());
  int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t q = 0; q < tasks; ++q)
    for (int64_t t = 0; t < T; ++t) c[t] += skipped[q * T + t];
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CPU, m) {
  m.impl("emb_unique", &unique_cpu);
  m.impl("emb_unique_padded", &unique_padded_cpu);
  m.impl("emb_offsets_verdict", &offsets_verdict_cpu);
  m.impl("emb_init_rows", &init_rows_cpu);
  m.impl("emb_slot_rows_init", &slot_rows_init_cpu);
  m.impl("emb_row_order_init", &row_order_init_cpu);
  m.impl("emb_forward", &forward_cpu);
  m.impl("emb_backward_update", &backward_update_cpu);
}

}  // namespace embedding
}  // namespace dynamicemb
