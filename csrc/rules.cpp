// dynamicemb::rules() -> str: the rules the kernels follow, as JSON, for
// dynamicemb/rules.py (read once at import). Everything here is read from
// the rule headers, so a rule is written once, in C++:
//   optimizers         embedding/optimizer_rules.h (codes, state widths, hyper-parameters,
//                      which state starts at initial_accumulator_value)
//   weight_decay_modes embedding/optimizer_rules.h
//   score_strategies   table/table_rules.h (traits), table/table_registry.h (names, call scores)
//   table_counters     table/table_registry.h
//   tier_counters      tiers/tier_counters.h
//   init_args, init_modes  embedding/init_rules.h
//   int8_row_tail      embedding/bag_checks.h (FBGEMM's fused 8-bit rows)
//   offsets_record_len embedding/bag_checks.h (emb_unique_padded's offsets record)
#include <torch/library.h>

#include <sstream>
#include <string>
#include <type_traits>

#include "embedding/bag_checks.h"
#include "embedding/init_rules.h"
#include "embedding/optimizer_rules.h"
#include "table/table_registry.h"
#include "tiers/tier_counters.h"

namespace dynamicemb {
namespace {

// A minimal JSON writer: the names here are identifiers, never escaped.
class Json {
 public:
  Json& begin(char c) {
    sep();
    os_ << c;
    first_ = true;
    return *this;
  }
  Json& end(char c) {
    os_ << c;
    first_ = false;
    return *this;
  }
  Json& key(const char* k) {
    sep();
    os_ << '"' << k << "\":";
    first_ = true;  // the value follows without a comma
    return *this;
  }
  Json& str(const char* v) {
    sep();
    os_ << '"' << v << '"';
    return *this;
  }
  Json& num(int64_t v) {
    sep();
    os_ << v;
    return *this;
  }
  Json& boolean(bool v) {
    sep();
    os_ << (v ? "true" : "false");
    return *this;
  }
  template <class T>
  Json& field(const char* k, T v) {
    key(k);
    if constexpr (std::is_same_v<T, bool>) {
      return boolean(v);
    } else if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) {
      return num(static_cast<int64_t>(v));
    } else {
      return str(v);
    }
  }
  // "k": [names...]
  template <size_t N>
  Json& names(const char* k, const char* const (&v)[N]) {
    key(k).begin('[');
    for (const char* s : v) str(s);
    return end(']');
  }
  std::string text() const { return os_.str(); }

 private:
  void sep() {
    if (!first_) os_ << ',';
    first_ = false;
  }
  std::ostringstream os_;
  bool first_ = true;
};

void optimizers(Json& j) {
  j.key("optimizers").begin('[');
  optim::for_each_rule([&](auto r) {
    using R = decltype(r);
    j.begin('{').field("code", R::kCode).field("name", R::kName).field("values", R::kValues);
    j.field("state_per_dim", R::kStatePerDim).field("state_fixed", R::kStateFixed).field("rowwise", R::kRowwise);
    j.field("accumulator", R::kAccumulator);
    j.key("hyper_parameters").begin('[');
    for (int h = 0; h < optim::kNumHyper; ++h)
      if (R::kHyper & (1u << h)) j.str(optim::kHyperNames[h]);
    j.end(']').end('}');
  });
  j.end(']');
  j.names("hyper_parameters", optim::kHyperNames);
  j.names("weight_decay_modes", optim::kDecayModeNames);
}

void strategies(Json& j) {
  j.key("score_strategies").begin('[');
  for (const auto& s : table::kStrategies) {
    j.begin('{').field("code", s.code).field("name", s.name);
    j.field("call_score", table::kCallScoreNames[s.call_score]);
    j.field("counts_accesses", table::counts_accesses(s.code));
    j.field("keeps_timestamps", table::keeps_timestamps(s.code));
    j.field("may_evict", table::may_evict(s.code)).field("score_is_clock", table::score_is_clock(s));
    j.end('}');
  }
  j.end(']');
}

std::string rules() {
  Json j;
  j.begin('{');
  optimizers(j);
  strategies(j);
  j.names("table_counters", table::kTableCounterNames);
  j.names("tier_counters", tiers::kTierCounterNames);
  j.names("init_args", init::kArgNames);
  j.names("init_modes", init::kModeNames);
  j.field("int8_row_tail", embedding::kInt8RowTail);
  j.field("offsets_record_len", embedding::kOffsetsRecordLen);
  j.end('}');
  return j.text();
}

}  // namespace

TORCH_LIBRARY_IMPL(dynamicemb, CompositeExplicitAutograd, m) {
  m.impl("rules", &rules);
}

}  // namespace dynamicemb
