// Columns of a cached storage's per-table tier counters [num_tables,
// kTierCounters] (int64), which dynamicemb/tiers/cache.py tallies on the
// host: keys found in the cache, keys missed, rows written back to the
// backing store, keys the backing store evicted (lost), new keys stored, keys a step served
// outside the cache (bypassed: the cache could not hold them; they are
// read from and written back to the store around that step), keys a step
// could not place at all (failed: the cache could not hold them under ERROR,
// and the step raised).
// Defined here with the other counters so that Python reads the columns by
// name (dynamicemb.rules.TierCounter).
#pragma once
#include <cstdint>

namespace dynamicemb {
namespace tiers {

enum TierCounter : int64_t { kHits = 0, kMisses = 1, kWriteBacks = 2, kLost = 3, kNew = 4, kBypassed = 5,
                           kFailed = 6, kTierCounters = 7 };
constexpr const char* kTierCounterNames[kTierCounters] = {"hits",   "misses",   "write_backs", "lost",
                                                          "new",    "bypassed", "failed"};

}  // namespace tiers
}  // namespace dynamicemb
