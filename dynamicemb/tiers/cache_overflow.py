"""The overflow of a cache: a training step's keys that find no slot in
their table's cache (it cannot hold the step's keys and the pinned ones at
once) get rows of their own for that step, after the cache's rows in the
table's weights (spare rows, grown as needed; the cache's own rows never
move). Those keys are in that block, and only there, from their forward
until its backward ran (batch_done): then their rows, updated by the fused
optimizer, and their scores go back to the backing store. So a cache too
small for a step degrades to reading and writing the store directly for its
overflow, and training stays what an all-in-memory table gives."""
from typing import Dict, List, Optional, Tuple

import torch

from dynamicemb import rules
from dynamicemb.types import DynamicEmbCheckMode


class OverflowBlock:
    """One forward's overflow rows: per table, its keys (sorted), their rows
    in the table's weights and their scores (as an in-memory table would
    score them this step)."""

    def __init__(self):
        self._parts: Dict[int, List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._times: Dict[int, List[torch.Tensor]] = {}
        self.tables: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.timestamps: Dict[int, torch.Tensor] = {}  # of tables that keep access times

    def add(self, t: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
            timestamps: Optional[torch.Tensor] = None) -> None:
        self._parts.setdefault(t, []).append((keys, rows, scores))
        if timestamps is not None:
            self._times.setdefault(t, []).append(timestamps)

    def has(self, tables) -> bool:
        """Whether the block (not sealed yet) has rows of any of `tables`."""
        return any(t in self._parts for t in tables)

    def seal(self) -> "OverflowBlock":
        """Sorts each table's keys (find looks them up by bisection)."""
        for t, parts in self._parts.items():
            keys, rows, scores = (torch.cat(x) for x in zip(*parts))
            order = torch.argsort(keys)
            self.tables[t] = (keys[order], rows[order], scores[order])
            if t in self._times:
                self.timestamps[t] = torch.cat(self._times[t])[order]
        self._parts, self._times = {}, {}
        return self

    def __bool__(self) -> bool:
        return bool(self.tables) or bool(self._parts)


def block_rows(blocks, keys: torch.Tensor, table_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows, with the row of each key that has none (-1) but sits in one of
    the (sealed) blocks set to its block row."""
    for block in blocks:
        for t, (bkeys, brows, _) in block.tables.items():
            ask = (table_ids == t) & (rows < 0)
            if not bool(ask.any()):
                continue
            pos = torch.searchsorted(bkeys, keys).clamp_(max=bkeys.numel() - 1)
            hit = ask & (bkeys[pos] == keys)
            rows = torch.where(hit, brows.to(rows.device)[pos], rows)
    return rows


def in_blocks(blocks, keys: torch.Tensor, t: int) -> torch.Tensor:
    """Whether each of table t's keys sits in one of the blocks."""
    found = torch.zeros(keys.shape, dtype=torch.bool, device=keys.device)
    for block in blocks:
        if t in block.tables:
            bkeys = block.tables[t][0]
            pos = torch.searchsorted(bkeys, keys).clamp_(max=bkeys.numel() - 1)
            found |= bkeys[pos] == keys
    return found


def insert_scores_of(ht, scores, pos: torch.Tensor) -> torch.Tensor:
    """The scores the keys at `pos` of an insert call would get in a table
    that holds them (ScoredHashTable.insert's `scores` rules: a step, a
    caller's score, an access count, else the table's clock); a key with a
    stored count adds it (counts_accesses), as the cache does."""
    n = pos.numel()
    if isinstance(scores, torch.Tensor):
        return scores.index_select(0, pos).to(torch.int64)
    if scores is None:
        call = ht.step if rules.scored_by_step(ht.strategy) else ht.now()
    else:
        call = int(scores)
    return torch.full((n,), call, dtype=torch.int64, device=pos.device)


class SpareRows:
    """The spare rows after each cached table's cache rows in its weights,
    which overflow blocks use: allocated upwards while blocks live, from the
    start again once none does."""

    def __init__(self, weights: List[torch.Tensor]):
        self._weights = weights  # the storage's list, by reference (an item is replaced to grow it)
        self._base = [w.shape[0] for w in weights]  # the cache's rows
        self._top = [0] * len(weights)

    def take(self, t: int, n: int) -> torch.Tensor:
        """n spare rows of table t (the weights grow when it has too few)."""
        w = self._weights[t]
        begin = self._base[t] + self._top[t]
        if begin + n > w.shape[0]:
            grown = torch.empty(max(begin + n, self._base[t] + 2 * (w.shape[0] - self._base[t])), w.shape[1],
                                dtype=w.dtype, device=w.device, pin_memory=w.is_pinned())
            grown[:w.shape[0]] = w
            self._weights[t] = grown
        self._top[t] += n
        return torch.arange(begin, begin + n, dtype=torch.int64, device=w.device)

    def reset(self) -> None:
        """No block lives any more: every spare row is free."""
        self._top = [0] * len(self._top)


def pending(pins) -> List[OverflowBlock]:
    """The live blocks of pins (a pin's `block`, None when it has none)."""
    return [p.block for p in pins if getattr(p, "block", None)]


def warn_or_raise(mode, message: str, warned: set, t: int) -> Optional[str]:
    """Under ERROR, raises; under WARNING, the message the first time for
    table t (None after, and under IGNORE)."""
    if mode == DynamicEmbCheckMode.ERROR:
        raise RuntimeError(message)
    if mode == DynamicEmbCheckMode.WARNING and t not in warned:
        warned.add(t)
        return message
    return None
