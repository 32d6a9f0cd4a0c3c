"""The rules the kernels follow, as the extension states them.

They are written once, in the C++ rule headers, and exported by one op
(``dynamicemb::rules``, csrc/rules.cpp) that this module reads at import. The
rest of the package names codes, widths and columns through this module
instead of restating them:

- optimizers (csrc/embedding/optimizer_rules.h): ``OPTIMIZERS``,
  ``optimizer(code)``: FBGEMM name and values, state width, hyper-parameters,
  whether its state starts at initial_accumulator_value;
  ``HYPER_PARAMETERS``, ``WeightDecayMode``;
- score strategies (csrc/table/table_rules.h, table_registry.h): their
  codes (``TIMESTAMP_LFU``: the (TIMESTAMP, LFU) pair) and traits by code,
  ``counts_accesses`` ... ``score_is_clock``;
- counter columns: ``TableCounter`` (ScoredHashTable.counters),
  ``TierCounter`` (CachedStorage.tier_counters);
- the packed initializer (csrc/embedding/init_rules.h): ``INIT_ARGS``, the
  names of its columns in order, and ``INIT_MODES``;
- ``INT8_ROW_TAIL``: the bytes after a uint8 row's codes (float32 scale and
  bias, FBGEMM's fused 8-bit rows; csrc/embedding/bag_checks.h);
- ``OFFSETS_RECORD_LEN``: the entries of emb_unique_padded's offsets record
  (csrc/embedding/bag_checks.h).
"""
import enum
from typing import Dict, NamedTuple, Tuple

from dynamicemb._ops import RULES as _RULES


# ---- optimizers -----------------------------------------------------------------------------


class OptimizerRule(NamedTuple):
    code: int  # the kernels' code (checkpoints record it)
    name: str  # FBGEMM's EmbOptimType member
    values: Tuple[str, ...]  # the EmbOptimType values it serves, the member's own first
    state_per_dim: int  # optimizer state columns: state_per_dim * dim + state_fixed
    state_fixed: int
    rowwise: bool  # a pass over the row's gradient before the update
    hyper_parameters: Tuple[str, ...]  # those it reads (FBGEMM's names)
    accumulator: bool  # its state starts at initial_accumulator_value (else 0)

    def state_width(self, dim: int) -> int:
        """Columns of optimizer state next to a row of ``dim`` weights."""
        return self.state_per_dim * dim + self.state_fixed


OPTIMIZERS: Tuple[OptimizerRule, ...] = tuple(
    OptimizerRule(o["code"], o["name"], tuple(o["values"].split()), o["state_per_dim"], o["state_fixed"],
                  o["rowwise"], tuple(o["hyper_parameters"]), o["accumulator"]) for o in _RULES["optimizers"])
_OPTIMIZER_BY_CODE: Dict[int, OptimizerRule] = {o.code: o for o in OPTIMIZERS}


def optimizer(code: int) -> OptimizerRule:
    """The rule of an optimizer code (dynamicemb.optimizer.optimizer_code)."""
    return _OPTIMIZER_BY_CODE[code]


# emb_backward_update's hyper-parameters, in its order.
HYPER_PARAMETERS: Tuple[str, ...] = tuple(_RULES["hyper_parameters"])
# FBGEMM's WeightDecayMode values the rules take.
WeightDecayMode = enum.IntEnum("WeightDecayMode", {n: i for i, n in enumerate(_RULES["weight_decay_modes"])})


# ---- score strategies ------------------------------------------------------------------------


class StrategyRule(NamedTuple):
    code: int
    name: str
    call_score: str  # a call's score: "clock" (the table's), "step" (the caller's) or "given" (CUSTOMIZED)
    counts_accesses: bool  # the score counts accesses
    keeps_timestamps: bool  # each slot also keeps its last access time (the call score)
    may_evict: bool  # an insert into a full bucket may evict
    score_is_clock: bool  # the score is a clock reading (a checkpoint stores it as an age)


STRATEGIES: Dict[int, StrategyRule] = {
    s["code"]: StrategyRule(s["code"], s["name"], s["call_score"], s["counts_accesses"], s["keeps_timestamps"],
                            s["may_evict"], s["score_is_clock"]) for s in _RULES["score_strategies"]}
# The internal code of the (TIMESTAMP, LFU) pair (types.strategy_code).
TIMESTAMP_LFU: int = next(s.code for s in STRATEGIES.values() if s.name == "TIMESTAMP_LFU")


def strategy(code: int) -> StrategyRule:
    """The rule of a score strategy code (types.strategy_code)."""
    try:
        return STRATEGIES[int(code)]
    except KeyError:
        raise ValueError(f"unknown score strategy code {code!r}; the codes are {sorted(STRATEGIES)}") from None


def counts_accesses(code: int) -> bool:
    return strategy(code).counts_accesses


def keeps_timestamps(code: int) -> bool:
    return strategy(code).keeps_timestamps


def may_evict(code: int) -> bool:
    return strategy(code).may_evict


def score_is_clock(code: int) -> bool:
    return strategy(code).score_is_clock


def scored_by_step(code: int) -> bool:
    """The score is the caller's training step (the module's step)."""
    return strategy(code).call_score == "step"


def scored_by_caller(code: int) -> bool:
    """The caller gives the scores (CUSTOMIZED: set_score, or per key)."""
    return strategy(code).call_score == "given"


def access_time_is_clock(code: int) -> bool:
    """A slot's access time is a clock reading: its score, or the access
    time it keeps next to a count. Incremental dumps filter by it."""
    s = strategy(code)
    return s.score_is_clock or (s.keeps_timestamps and s.call_score == "clock")


# ---- counters and row layouts ------------------------------------------------------------------

TABLE_COUNTERS: Tuple[str, ...] = tuple(_RULES["table_counters"])
TableCounter = enum.IntEnum("TableCounter", {n.upper(): i for i, n in enumerate(TABLE_COUNTERS)})
TIER_COUNTERS: Tuple[str, ...] = tuple(_RULES["tier_counters"])
TierCounter = enum.IntEnum("TierCounter", {n.upper(): i for i, n in enumerate(TIER_COUNTERS)})

INIT_ARGS: Tuple[str, ...] = tuple(_RULES["init_args"])
INIT_MODES: Tuple[str, ...] = tuple(_RULES["init_modes"])
INT8_ROW_TAIL: int = _RULES["int8_row_tail"]
OFFSETS_RECORD_LEN: int = _RULES["offsets_record_len"]
