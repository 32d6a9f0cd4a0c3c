// Columns of a cached storage's per-table tier counters [num_tables,
// kTierCounters] (int64), which dynamicemb/tiers/cache.py tallies on the
// host: keys found in the cache, keys missed, rows written back to the
// backing store, keys the backing store evicted (lost), new keys stored.
// Defined here with the other counters so that Python reads the columns by
// name (dynamicemb.rules.TierCounter).
#pragma once
#include <cstdint>

namespace dynamicemb {
namespace tiers {

enum TierCounter : int64_t { kHits = 0, kMisses = 1, kWriteBacks = 2, kLost = 3, kNew = 4, kTierCounters = 5 };
constexpr const char* kTierCounterNames[kTierCounters] = {"hits", "misses", "write_backs", "lost", "new"};

}  // namespace tiers
}  // namespace dynamicemb
