"""Frequency admission: a new key is stored only once seen `threshold` times.

The counts of keys not yet admitted live in a ScoredHashTable with the LFU
strategy (the score is the count), so memory stays bounded by the counter's
capacity; a key's count is dropped once the key is stored (`forget`), so a
key admitted but not stored (its bucket full) keeps its count.
"""
from typing import List, Tuple

import torch

from dynamicemb.options import FrequencyAdmissionStrategy, KVCounter
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy


class AdmissionCounter:
    def __init__(self, strategy: FrequencyAdmissionStrategy, counter: KVCounter, table_name: str, device):
        cap = -(-counter.capacity // counter.bucket_capacity) * counter.bucket_capacity
        self.threshold = strategy.threshold
        self.table_name = table_name
        self.counts = self._empty(cap, counter.bucket_capacity, device)

    def _empty(self, capacity: int, bucket_capacity: int, device) -> ScoredHashTable:
        return ScoredHashTable(capacity, bucket_capacity=bucket_capacity,
                               score_strategy=DynamicEmbScoreStrategy.LFU, device=device,
                               table_names=[self.table_name + ".admission_counter"])

    def capacity(self) -> int:
        return self.counts.capacity()

    def build(self, keys: torch.Tensor, counts: torch.Tensor) -> Tuple[ScoredHashTable, int]:
        """A new count table of this counter's size holding `keys` (distinct)
        with `counts`, without touching the current one (a checkpoint load
        builds it before changing anything, then calls replace()). Returns it
        and how many keys did not fit (their buckets full): the highest counts
        are placed first, so those dropped are the lowest of their bucket."""
        table = self._empty(self.counts.capacity(), self.counts.bucket_capacity, self.counts.device)
        if keys.numel():
            order = torch.argsort(counts, descending=True, stable=True)
            # One call: keys placed earlier in it are never evicted by later ones (they fail instead).
            out = table.insert(keys[order].to(table.device), scores=counts[order].to(table.device))
            dropped = int((out.indices < 0).sum()) + out.evicted.keys.numel()
        else:
            dropped = 0
        return table, dropped

    def replace(self, table: ScoredHashTable) -> None:
        """Swaps in a count table made by build()."""
        self.counts = table

    def admit(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Adds `counts` sightings to `keys` (distinct, not stored yet); returns
        the mask of keys whose count reached the threshold (the caller stores
        them, then forgets those it stored)."""
        out = self.counts.insert(keys, scores=counts)
        total = torch.where(out.indices >= 0, self.counts.slot_scores[out.indices.clamp(min=0)], counts)
        return total >= self.threshold

    def forget(self, keys: torch.Tensor) -> None:
        """Drops the counts of keys now stored in the table."""
        if keys.numel():
            self.counts.erase(keys)

    def export(self) -> List:
        return list(self.counts.export())
