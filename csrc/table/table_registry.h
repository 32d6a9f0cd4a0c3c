// The hash table's rules as named data, for the registry Python reads
// (csrc/rules.cpp -> dynamicemb/rules.py): every score strategy with its name
// and what its callers pass as a call's score, and the columns of the
// per-table counters. What a strategy does with scores is table_rules.h's;
// the traits exported with it are computed from those rules, not restated.
#pragma once
#include <cstdint>

#include "table/table_rules.h"

namespace dynamicemb {
namespace table {

// What a call's score (table_insert's call_score) is under a strategy: the
// table's clock (table_clock), the caller's training step, or a value the
// caller gives (CUSTOMIZED).
enum CallScore : int64_t { kCallClock = 0, kCallStep = 1, kCallGiven = 2 };
constexpr const char* kCallScoreNames[] = {"clock", "step", "given"};

struct StrategyInfo {
  int64_t code;  // ScoreStrategy
  const char* name;
  CallScore call_score;
};
// Every strategy, once (a new one: its code and score rules in table_rules.h,
// its entry here, its member in dynamicemb.DynamicEmbScoreStrategy).
constexpr StrategyInfo kStrategies[] = {
    {kTimestamp, "TIMESTAMP", kCallClock}, {kStep, "STEP", kCallStep},
    {kCustomized, "CUSTOMIZED", kCallGiven}, {kLfu, "LFU", kCallClock},
    {kNoEviction, "NO_EVICTION", kCallClock}, {kTimestampLfu, "TIMESTAMP_LFU", kCallClock},
};

// Whether a slot's score is a reading of the table's clock: the call's score
// as given, on insert and on access (not a count nor the key's own score),
// under a strategy whose call score is the clock. Found by asking the rules.
inline bool score_is_clock(const StrategyInfo& s) {
  const int64_t call = 11, key = 7, old = 5;
  return s.call_score == kCallClock && score_on_insert(s.code, call, key) == call &&
         score_on_access(s.code, old, call, key) == call;
}

// Columns of table_insert's counters [num_tables, kTableCounters] (int64):
// keys stored in a new slot (INSERTED or EVICTED), rows evicted, keys failed.
enum TableCounter : int64_t { kCountInserted = 0, kCountEvicted = 1, kCountFailed = 2, kTableCounters = 3 };
constexpr const char* kTableCounterNames[kTableCounters] = {"inserted", "evicted", "failed"};

}  // namespace table
}  // namespace dynamicemb
