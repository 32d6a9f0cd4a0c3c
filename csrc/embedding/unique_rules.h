// The order of emb_unique's output, shared by the CPU and CUDA kernels so
// that both return the same unique ids: (key, table) pairs are hashed with a
// per-table salt; from kPartsFrom indices on, the hash's top kPartBits bits
// split the pairs into 64 parts (the CPU deduplicates the parts in
// parallel). Uniques come part by part, in order of first occurrence within
// a part.
#pragma once
#include <cstdint>

#include "common/hd.h"
#include "table/table_rules.h"

namespace dynamicemb {
namespace unique {

constexpr int kPartBits = 6;
constexpr int64_t kPartsFrom = 4096;  // indices; fewer: one part

DE_HD uint64_t salt(int64_t table) { return table::fmix64(static_cast<uint64_t>(table) + 1); }
DE_HD uint64_t pair_hash(int64_t key, uint64_t table_salt) {
  return table::fmix64(static_cast<uint64_t>(key) ^ table_salt);
}
DE_HD int64_t part(uint64_t hash, bool partitioned) {
  return partitioned ? static_cast<int64_t>(hash >> (64 - kPartBits)) : 0;
}

// emb_unique_padded's entries past the unique count: key 0 of table 0 (in
// range, so its table ids pass the table ops' checks) seen 0 times.
constexpr int64_t kPadKey = 0, kPadTable = 0, kPadCount = 0;

}  // namespace unique
}  // namespace dynamicemb
