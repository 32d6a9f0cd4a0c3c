"""KeyIndex: key -> (row position, score) of one table of a backing store,
on a ScoredHashTable that grows (doubling) as keys arrive and, once at its
maximum capacity, evicts the lowest-scored key of a full bucket. Positions
address rows the store keeps elsewhere (a host tensor, a file)."""
from typing import Iterator, Tuple

import torch

from dynamicemb.table import ScoredHashTable, doubling_capacities
from dynamicemb.types import DynamicEmbScoreStrategy, InsertResult

_MIN_SLOTS = 1024


class KeyIndex:
    def __init__(self, name: str, max_rows: int, bucket_capacity: int = 128, init_rows: int = _MIN_SLOTS):
        self.name = name
        self.bucket_capacity = bucket_capacity
        self.max_rows = max_rows
        self._layout(init_rows)
        self._reset(self.min_slots)

    def _layout(self, init_rows: int) -> None:
        # Where it starts (and starts again when cleared) and its maximum, which
        # the start doubles into exactly (grow takes multiples only).
        self.min_slots, self.max_slots = doubling_capacities(init_rows, self.max_rows, self.bucket_capacity)

    def _reset(self, slots: int) -> None:
        slots = -(-slots // self.bucket_capacity) * self.bucket_capacity
        # CUSTOMIZED: the table keeps the scores it is given (clock readings,
        # steps or counts of the caching table's own strategy).
        self.ht = ScoredHashTable(slots, bucket_capacity=self.bucket_capacity,
                                  score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED, table_names=[self.name])
        self.pos = torch.full((slots,), -1, dtype=torch.int64)

    def __len__(self) -> int:
        return self.ht.size()

    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(found, positions, scores) of the keys (-1 / 0 where missing)."""
        slots, found = self.ht.lookup(keys)
        safe, missing = slots.clamp(min=0), ~found
        # index_select: several times faster than advanced indexing on the CPU
        pos = self.pos.index_select(0, safe).masked_fill_(missing, -1)
        return found, pos, self.ht.slot_scores.index_select(0, safe).masked_fill_(missing, 0)

    def take_found(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Removes the keys the index holds; returns (their positions in keys,
        ascending, their row positions, their scores)."""
        slots, found = self.ht.lookup(keys)
        at = found.nonzero().squeeze(1)
        if not at.numel():
            return at, at, at
        held = slots.index_select(0, at)
        pos, scores = self.pos.index_select(0, held), self.ht.slot_scores.index_select(0, held)
        self.ht.erase(keys.index_select(0, at))
        return at, pos, scores

    def add(self, keys: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor):
        """Adds distinct keys not in the index. Returns (evicted keys, their
        positions, their scores): keys displaced once the index is at its
        maximum (the lowest-scored of a full bucket), to be freed by the store."""
        empty = keys.new_empty(0)
        if not keys.numel():
            return empty, empty, empty
        out = self.ht.insert(keys, scores=scores, evict=False)
        failed = out.results == InsertResult.FAILED
        if not bool(failed.any()):  # the usual case: every key found a free slot
            self.pos.index_copy_(0, out.indices, positions)
            return empty, empty, empty
        ok = (~failed).nonzero().squeeze(1)
        self.pos[out.indices[ok]] = positions[ok]
        while bool(failed.any()):  # grow (doubling) while below the maximum; positions move with the slots
            if self.ht.capacity() >= self.max_slots:
                break
            self._grow(min(self.max_slots, 2 * self.ht.capacity()))
            sel = failed.nonzero().squeeze(1)
            out = self.ht.insert(keys[sel], scores=scores[sel], evict=False, same_call=True)
            ok = out.results != InsertResult.FAILED
            self.pos[out.indices[ok]] = positions[sel[ok]]
            failed = failed.clone()
            failed[sel[ok]] = False
        evicted = []
        while bool(failed.any()):  # at the maximum: evict (a new call, so this put's own keys may go too)
            last = self.ht.insert(keys[failed], scores=scores[failed], evict=True)
            ev = last.evicted
            evicted.append((ev.keys, self.pos[ev.indices].clone(), ev.scores))
            ok = last.results != InsertResult.FAILED
            sel = failed.nonzero().squeeze(1)[ok]
            self.pos[last.indices[ok]] = positions[sel]
            failed = failed.clone()
            failed[sel] = False
        if not evicted:
            return empty, empty, empty
        return tuple(torch.cat(parts) for parts in zip(*evicted))

    def reserve(self, rows: int) -> None:
        """Starts with slots for `rows` keys (at most the maximum), where it
        holds none yet."""
        if not len(self) and rows > self.min_slots:
            self._layout(rows)
            self._reset(self.min_slots)

    def _grow(self, slots: int) -> None:
        old_idx, new_idx = self.ht.grow(slots)
        pos = torch.full((slots,), -1, dtype=torch.int64)
        pos[new_idx] = self.pos[old_idx]
        self.pos = pos

    def items(self, batch_size: int = 1 << 16) -> Iterator[Tuple[torch.Tensor, ...]]:
        """(keys, positions, scores) of every key."""
        for b in self.ht.export(batch_size=batch_size):
            yield b.keys, self.pos[b.indices], b.scores

    def live_slots(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots, positions) of every key, in the order of their positions
        (a store compacting its rows copies them in that order)."""
        slots = [b.indices for b in self.ht.export(batch_size=1 << 20)]
        slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        pos = self.pos[slots]
        order = pos.argsort()
        return slots[order], pos[order]

    def move(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New positions of the keys at `slots` (from live_slots, no insert since)."""
        self.pos[slots] = positions

    def shift_scores(self, delta: int) -> None:
        """Adds delta to every key's score (clock readings carried to another clock)."""
        for b in self.ht.export(batch_size=1 << 20):
            self.ht.slot_scores[b.indices] += delta

    def clear(self) -> None:
        self._reset(self.min_slots)
