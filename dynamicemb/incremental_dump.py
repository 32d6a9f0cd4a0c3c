"""Incremental dumps and score control (API.md §4).

incremental_dump(model, score_threshold) returns, per table, the keys and
values whose score is at or above the threshold: for TIMESTAMP (and
NO_EVICTION, and the (TIMESTAMP, LFU) pair's access time) the threshold is a
reading of the table's clock (ScoredHashTable.now(): time.monotonic_ns() on
the CPU, the GPU's global timer on CUDA), so the result is the keys touched
since then (the returned next threshold is such a reading);
for STEP it is a step. It also returns the threshold to pass next time.
"""
import warnings
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from dynamicemb import rules
from dynamicemb.aliases import flat_per_table
from dynamicemb.checkpoint.rank_errors import raise_any, status
from dynamicemb.checkpoint.tables import model_tables, rank_world
from dynamicemb.types import int64_score, strategy_label

__all__ = ["get_score", "incremental_dump", "set_score"]

Threshold = Union[int, Dict[str, int]]


def _per_table(value: Threshold, name: str, strategy: int) -> int:
    if isinstance(value, dict):
        if name not in value:
            hint = ""
            if not (rules.scored_by_step(strategy) or rules.scored_by_caller(strategy)):
                # The NVIDIA porting idiom incremental_dump(m, get_score(m)) lands here.
                hint = (f": table {name!r} scores by {strategy_label(strategy)}, which get_score(model) does not "
                        f"return (STEP and CUSTOMIZED tables only); pass the thresholds the previous "
                        f"incremental_dump returned (its second result), or 0 the first time (every row), or "
                        f"one int for every table")
            raise ValueError(f"no score threshold given for table {name!r}{hint}")
        return int64_score(value[name], f"table {name!r}")
    return int64_score(value, f"table {name!r}")


def clock_threshold_error(name: str, threshold: int, now: int) -> Optional[str]:
    """Why a clock threshold is refused, or None: one past the table's clock
    is not a reading of it (another host's: keys touched since a load
    would be left out)."""
    if threshold > now:
        return (f"incremental_dump: table {name!r}: threshold {threshold} is later than the table's clock ({now} ns "
                f"now): it is not a reading of this process's table clock (a threshold from another host does not "
                f"carry over a load); pass 0 to get every row, then the thresholds incremental_dump returns")
    return None


def _warn_threshold_before_load(name: str, load: Optional[dict], threshold: int) -> None:
    """After a load (BatchedDynamicEmbeddingTables.clock_loads), a threshold
    from before it warns where its result would mislead: one later than the
    checkpoint (the load rolled back what changed after the dump, which a
    replica updated past it keeps), or, on another clock
    (checkpoint/clock.py), any (the loaded rows count as touched at the load
    less their age at the dump)."""
    if load is None or not 0 < threshold < load["loaded_at"]:
        return  # none, or a reading taken since the load
    saved_at = load["saved_at"]
    if saved_at is None:
        why = ("the checkpoint was saved on another clock (another host), so the load restored access times as the "
               "rows' ages at the dump counted back from the load, and a threshold from before it selects rows by "
               "that, not by the keys touched since")
    elif threshold > saved_at:
        why = (f"it is later than the checkpoint (whose clock read {saved_at}): the load rolled back what changed "
               f"after the dump, which a replica updated past it still holds (incremental dumps carry no removals)")
    else:
        return  # the clock scores came back as saved: the threshold selects the keys touched since it
    warnings.warn(f"incremental_dump: table {name!r}: threshold {threshold} is from before the table's load from a "
                  f"checkpoint: {why}; pass 0 once after such a load to get every row", RuntimeWarning, stacklevel=3)


def incremental_dump(model: torch.nn.Module, score_threshold: Threshold, pg: Optional[dist.ProcessGroup] = None
                     ) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Dict[str, int]]:
    """({table: (keys, values)}, {table: next threshold}), on the table's
    device. With `pg`, every rank receives the keys and values of all ranks
    (concatenated in rank order) on the CPU."""
    out, nxt = {}, {}
    score_threshold = flat_per_table(score_threshold, "incremental_dump(score_threshold=...)",
                                     "{table: threshold} (or one int)")
    tables = model_tables(model, what="incremental_dump")
    nows = {name: ref.storage.now(ref.index) for name, ref in tables.items()}  # before the export: a key touched
    # during it is in the next dump too. Thresholds checked on every rank first (with pg: all raise, none waits).
    error, thresholds = None, {}
    try:
        for name, ref in tables.items():
            thresholds[name] = threshold = _per_table(score_threshold, name, ref.storage.strategy(ref.index))
            if rules.access_time_is_clock(ref.storage.strategy(ref.index)):
                refused = clock_threshold_error(name, threshold, nows[name])
                if refused:
                    raise ValueError(refused)
    except (ValueError, TypeError) as e:
        error = e
    world = rank_world(pg)[1] if pg is not None else 1
    statuses = [None] * world
    if world > 1:
        dist.all_gather_object(statuses, status(error), group=pg)
    raise_any(statuses, error, lambda r, m: ValueError(f"incremental_dump: rank {r} refused its thresholds: {m}"))
    for name, ref in tables.items():
        now, threshold, storage, t = nows[name], thresholds[name], ref.storage, ref.index
        if rules.access_time_is_clock(storage.strategy(t)):
            _warn_threshold_before_load(name, ref.module.clock_loads.get(t), threshold)
        keys, values = [], []
        # A clock threshold of 0 is every row: a load on another clock restores a row older than this
        # clock's origin (time.monotonic_ns(): the host's uptime) at a negative reading.
        every = threshold <= 0 and rules.access_time_is_clock(storage.strategy(t))
        for k, rows, _ in storage.export(t, threshold=None if every else threshold):
            keys.append(k)
            values.append(rows[:, :ref.options.dim])
        dim, dev = ref.options.dim, ref.module.device
        out[name] = (torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=dev),
                     torch.cat(values).to(dev) if values
                     else torch.empty(0, dim, dtype=ref.module.embedding_dtype, device=dev))
        strategy = storage.strategy(t)
        # A training forward whose backward has not run scored its keys
        # already; their rows change at the backward: the next threshold
        # must not pass it, or the update would be in no delta.
        open_step = ref.module.oldest_open_step()
        if rules.access_time_is_clock(strategy):
            nxt[name] = now if open_step is None else threshold  # (no clock reading of that forward is kept)
        elif rules.scored_by_step(strategy):
            nxt[name] = ref.module.step + 1 if open_step is None else open_step  # the next step's score
        else:
            nxt[name] = threshold
    if world > 1:
        gathered = [None] * world
        # Pickled tensors would unpickle on the sender's device: send CPU copies.
        dist.all_gather_object(gathered, {n: (k.cpu(), v.cpu()) for n, (k, v) in out.items()}, group=pg)
        out = {n: (torch.cat([g[n][0] for g in gathered]), torch.cat([g[n][1] for g in gathered])) for n in out}
    return out, nxt


def get_score(model: torch.nn.Module) -> Dict[str, int]:
    """Per STEP table its module's step; per CUSTOMIZED table its score."""
    scores = {}
    for name, ref in model_tables(model, what="get_score").items():
        strategy = ref.storage.strategy(ref.index)
        if rules.scored_by_step(strategy):
            scores[name] = ref.module.step
        elif rules.scored_by_caller(strategy):
            scores[name] = ref.storage.custom_scores[ref.index]
    return scores


def set_score(model: torch.nn.Module, score: Threshold) -> None:
    """Sets the CUSTOMIZED score (given to keys accessed from now on) or the
    STEP counter, for every such table or per table name. Tables sharing a
    module share its step."""
    tables = model_tables(model, what="set_score")
    score = flat_per_table(score, "set_score(score=...)", "{table: score} (or one int)")
    if isinstance(score, dict) and set(score) - set(tables):
        raise ValueError(f"set_score: the model has no dynamic tables named {sorted(set(score) - set(tables))}; "
                         f"it has {sorted(tables)}")
    if not isinstance(score, dict) and not any(
            rules.scored_by_caller(r.storage.strategy(r.index)) or rules.scored_by_step(r.storage.strategy(r.index))
            for r in tables.values()):
        warnings.warn(f"set_score: the model's dynamic tables {sorted(tables)} score by neither STEP nor CUSTOMIZED: "
                      f"nothing was set", RuntimeWarning, stacklevel=2)
    for name, ref in tables.items():
        if isinstance(score, dict) and name not in score:
            continue
        strategy = ref.storage.strategy(ref.index)
        value = _per_table(score, name, strategy)
        if rules.scored_by_caller(strategy):
            ref.storage.custom_scores[ref.index] = value
        elif rules.scored_by_step(strategy):
            ref.module.step = value
        elif isinstance(score, dict):
            raise ValueError(f"table {name!r} scores by strategy {strategy_label(strategy)}; "
                             f"only STEP and CUSTOMIZED scores can be set")
