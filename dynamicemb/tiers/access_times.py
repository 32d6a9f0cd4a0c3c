"""The access times of a cached (TIMESTAMP, LFU) table across its tiers.

The pair keeps an int64 access time next to each count (the count is the
score, which the store keeps per key). In the backing store the time rides
as the row's last columns (the int64's bits: `timestamp_columns` of the
row's dtype), so it moves with the row, bit for bit, through any store.

In the cache it is the hash table's slot_timestamps. An insert that evicts a
key writes the new key's time over the slot at once, so each group keeps a
copy of its slots' times as the last call left them: the copy still holds
the evicted key's time when its row goes to the store.
"""
from typing import List, Optional, Sequence

import torch

from dynamicemb import rules
from dynamicemb.positions import where_true
from dynamicemb.tiers.store import timestamp_columns


class AccessTimes:
    """Per table: the time columns of its stored rows (0: none) and the shift
    of a reopened store's times to the table's clock; per group: the copy."""

    def __init__(self, strategies: Sequence[int], cached: Sequence[bool], widths: Sequence[int], dtype: torch.dtype,
                 groups, group_cached: Sequence[bool]):
        self.cols = [timestamp_columns(dtype) if c and rules.keeps_timestamps(s) else 0
                     for s, c in zip(strategies, cached)]
        self.shift = [0] * len(self.cols)  # stored time + shift: a reading of the table's clock
        self.widths = list(widths)
        self._copy: List[Optional[torch.Tensor]] = [
            ht.slot_timestamps.clone() if c and rules.keeps_timestamps(ht.strategy) else None
            for (ht, _), c in zip(groups, group_cached)]

    def columns(self, t: int, times: Optional[torch.Tensor], n: int, dtype: torch.dtype, now: int) -> torch.Tensor:
        """The [n, cols] of `dtype` that hold n access times of table t in its store (times None: `now`)."""
        if times is None:
            times = torch.full((n,), now, dtype=torch.int64)
        return (times.to(torch.int64) - self.shift[t]).contiguous().view(dtype).view(n, self.cols[t])

    def join(self, t: int, rows: torch.Tensor, times: Optional[torch.Tensor], now: int) -> torch.Tensor:
        """Table t's rows as its store holds them (times None: `now`)."""
        tail = self.columns(t, None if times is None else times.to(rows.device), rows.shape[0], rows.dtype, now)
        return torch.cat([rows, tail.to(rows.device)], 1)

    def split(self, t: int, rows: torch.Tensor):
        """(rows, access times or None) of rows as table t's store holds them."""
        if not self.cols[t]:
            return rows, None
        width = self.widths[t]
        # A copy of its own: a view's storage offset need not be a multiple of the int64's columns.
        bits = rows[:, width:].clone(memory_format=torch.contiguous_format)
        return rows[:, :width], bits.view(torch.int64).view(-1) + self.shift[t]

    def evicted(self, g: int, slots: torch.Tensor) -> torch.Tensor:
        """The times of the keys just evicted from group g's `slots`."""
        return self._copy[g].index_select(0, slots)

    def keep_all(self, g: int, ht) -> None:
        """Copies every slot's time of group g (after a load wrote them)."""
        if self._copy[g] is not None:
            self._copy[g].copy_(ht.slot_timestamps)

    def keep(self, g: int, ht, slots: torch.Tensor) -> None:
        """Copies the times of group g's `slots` (-1: none) after a call that changed them."""
        copy = self._copy[g]
        if copy is not None:
            at = slots.index_select(0, where_true(slots >= 0))
            copy.index_copy_(0, at, ht.slot_timestamps.index_select(0, at))
