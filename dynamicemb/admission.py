"""Frequency admission: a new key is stored only once seen `threshold` times.

The counts of keys not yet admitted live in a ScoredHashTable with the LFU
strategy (the score is the count), so memory stays bounded by the counter's
capacity; a key's count is dropped once the key is stored (`forget`), so a
key admitted but not stored (its bucket full) keeps its count.
"""
from typing import List

import torch

from dynamicemb.options import FrequencyAdmissionStrategy, KVCounter
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy


class AdmissionCounter:
    def __init__(self, strategy: FrequencyAdmissionStrategy, counter: KVCounter, table_name: str, device):
        cap = -(-counter.capacity // counter.bucket_capacity) * counter.bucket_capacity
        self.threshold = strategy.threshold
        self.counts = ScoredHashTable(cap, bucket_capacity=counter.bucket_capacity,
                                      score_strategy=DynamicEmbScoreStrategy.LFU, device=device,
                                      table_names=[table_name + ".admission_counter"])

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
