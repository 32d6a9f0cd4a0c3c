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


def _check_clock_threshold(name: str, since_load: Optional[set], threshold: int, now: int) -> None:
    """A clock threshold is a reading of the table clock: one past the clock
    now is not (another host's: keys touched since the load would be left
    out), and after a load on another clock (checkpoint/clock.py) one from
    before it does not apply (the loaded rows count as touched at the load
    less their age at the dump)."""
    if threshold > now:
        raise ValueError(f"incremental_dump: table {name!r}: threshold {threshold} is later than the table's clock "
                         f"({now} ns now): it is not a reading of this process's table clock (a threshold from "
                         f"another process does not carry over, e.g. after a load); pass 0 to get every row, then "
                         f"the thresholds incremental_dump returns")
    if since_load is not None and threshold > 0 and threshold not in since_load:
        warnings.warn(f"incremental_dump: table {name!r} was loaded from a checkpoint, and threshold {threshold} "
                      f"was not returned by incremental_dump since: the checkpoint was saved on another clock (another "
                      f"host), so the load restored access times as the rows' ages at the dump counted back from "
                      f"the load, and a threshold from before it selects rows by that, not by the keys touched "
                      f"since; pass 0 once after such a load to get every row", RuntimeWarning,
                      stacklevel=3)


def incremental_dump(model: torch.nn.Module, score_threshold: Threshold, pg: Optional[dist.ProcessGroup] = None
                     ) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Dict[str, int]]:
    """({table: (keys, values)}, {table: next threshold}), on the table's
    device. With `pg`, every rank receives the keys and values of all ranks
    (concatenated in rank order) on the CPU."""
    out, nxt = {}, {}
    score_threshold = flat_per_table(score_threshold, "incremental_dump(score_threshold=...)",
                                     "{table: threshold} (or one int)")
    for name, ref in model_tables(model, what="incremental_dump").items():
        now = ref.storage.now(ref.index)  # before the export: a key touched during it is in the next dump too
        threshold = _per_table(score_threshold, name, ref.storage.strategy(ref.index))
        storage, t = ref.storage, ref.index
        if rules.access_time_is_clock(storage.strategy(t)):
            _check_clock_threshold(name, ref.module.thresholds_since_load.get(t), threshold, now)
        keys, values = [], []
        for k, rows, _ in storage.export(t, threshold=threshold):
            keys.append(k)
            values.append(rows[:, :ref.options.dim])
        dim, dev = ref.options.dim, ref.module.device
        out[name] = (torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=dev),
                     torch.cat(values).to(dev) if values
                     else torch.empty(0, dim, dtype=ref.module.embedding_dtype, device=dev))
        strategy = storage.strategy(t)
        if rules.access_time_is_clock(strategy):
            nxt[name] = now
            if t in ref.module.thresholds_since_load:
                ref.module.thresholds_since_load[t].add(now)
        elif rules.scored_by_step(strategy):
            nxt[name] = ref.module.step + 1  # the next training step's score
        else:
            nxt[name] = threshold
    if pg is not None and rank_world(pg)[1] > 1:
        gathered = [None] * dist.get_world_size(pg)
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
