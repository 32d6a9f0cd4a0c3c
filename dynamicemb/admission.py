"""Admission: which new keys a table stores (API reference §4, "Admission").

Two pluggable parts, each one subclass for a user:
- a `Counter` counts the sightings of keys not stored yet (one instance per
  table and rank, made by `create` from the one in the options);
- an `AdmissionStrategy` decides from those counts which keys are stored,
  and says what a key not admitted reads (`initializer_args`).
The built-in pair is `FrequencyAdmissionStrategy` (a key is stored once
seen `threshold` times) over a `KVCounter` (counts in a bounded
ScoredHashTable with the LFU strategy: the lowest counts are evicted).
A key's count is dropped once the key is stored (`erase`), so a key
admitted but not stored (its bucket full) keeps its count.

`AdmissionCounter` is a table's admission on one rank, as the storage and
the checkpoints use it.
"""
import abc
import copy
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Tuple

import torch

from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy


class CounterNotCheckpointable(TypeError):
    """A table's admission counter cannot be dumped or loaded: its Counter
    subclass implements no `export` / `load`."""


class Counter(abc.ABC):
    """Counts sightings of keys not yet admitted. Subclass it and implement
    `add` and `erase` to train; `export` and `load` as well to checkpoint the
    counts (DynamicEmbDump(counter=True), the sharded state_dict).

    The object given in the options is a template: `create` makes each
    table's own instance on each rank (default: a deep copy)."""

    def create(self, device: torch.device, table_name: str) -> "Counter":
        """The counter of table `table_name` on this rank, its tensors on `device`."""
        return copy.deepcopy(self)

    @abc.abstractmethod
    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Adds `counts` sightings (int64) to distinct `keys` (int64, none of
        them stored in the table); returns each key's total count so far
        (int64, same shape). A key the counter cannot hold may get just
        this call's count."""

    @abc.abstractmethod
    def erase(self, keys: torch.Tensor) -> None:
        """Forgets `keys` (now stored in the table); keys not counted are ignored."""

    def max_keys(self) -> Optional[int]:
        """The most keys it counts (None: no limit); a load refuses more."""
        return None

    # ---- checkpoint (optional) ---------------------------------------------------------------

    def export(self, batch_size: int = 1 << 16) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Every (keys, counts) it holds, in batches of int64 tensors."""
        raise CounterNotCheckpointable(f"{type(self).__name__} implements no export()")

    def load(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Replaces every count with `counts` of distinct `keys`."""
        raise CounterNotCheckpointable(f"{type(self).__name__} implements no load()")

    def stage(self, keys: torch.Tensor, counts: torch.Tensor) -> Tuple[Any, int]:
        """A load's first half, run on every rank before any changes: the
        counts to swap in (given to `commit`) and how many of the keys it
        would drop (a load refuses any). Default: `load` them at commit."""
        return (keys, counts), 0

    def commit(self, staged: Any) -> None:
        """A load's second half: swaps in what `stage` returned."""
        self.load(*staged)

    @classmethod
    def checkpointable(cls) -> bool:
        """Whether it implements export and load."""
        return cls.export is not Counter.export and cls.load is not Counter.load


class AdmissionStrategy(abc.ABC):
    """Decides which counted keys a table stores. Subclass it and implement
    `admit`. `initializer_args` (a DynamicEmbInitializerArgs, or None: the
    table's own initializer_args) is what a training lookup of a key the
    table does not store reads: one not admitted yet (or, rarely, one that
    found no slot); such a key gets no update."""

    initializer_args: Optional[Any] = None

    @abc.abstractmethod
    def admit(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The bool mask of the distinct `keys` to store, given their total
        counts (from the table's Counter, this step's sightings included)."""

    def get_initializer_args(self):
        """What a key not stored reads in training (None: the table's initializer)."""
        return self.initializer_args


def _positive_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0


@dataclass
class FrequencyAdmissionStrategy(AdmissionStrategy):
    """Store a new key only once it has been seen `threshold` times."""

    threshold: int
    initializer_args: Optional[Any] = None

    def __post_init__(self):
        if not _positive_int(self.threshold):
            raise ValueError(f"admission threshold must be >= 1, got {self.threshold}")

    def admit(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return counts >= self.threshold


@dataclass
class KVCounter(Counter):
    """Counts sightings of keys not yet admitted, in a table of `capacity`
    slots (the lowest counts are evicted when it is full)."""

    capacity: int
    bucket_capacity: int = 128
    table: Optional[ScoredHashTable] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not _positive_int(self.capacity):
            raise ValueError(f"KVCounter.capacity must be a positive int, got {self.capacity!r}")
        if not _positive_int(self.bucket_capacity) or self.bucket_capacity % 16:
            raise ValueError(f"KVCounter.bucket_capacity must be a positive multiple of 16, got "
                             f"{self.bucket_capacity!r}")

    def create(self, device, table_name):
        made = KVCounter(self.capacity, self.bucket_capacity)
        made.name, made.device = table_name + ".admission_counter", device
        made.table = made._empty()
        return made

    def _empty(self) -> ScoredHashTable:
        slots = -(-self.capacity // self.bucket_capacity) * self.bucket_capacity
        return ScoredHashTable(slots, bucket_capacity=self.bucket_capacity, score_strategy=DynamicEmbScoreStrategy.LFU,
                               device=self.device, table_names=[self.name])

    def max_keys(self) -> int:
        return self.table.capacity() if self.table is not None else self.capacity

    def add(self, keys, counts):
        out = self.table.insert(keys, scores=counts, hold_stored=True)  # a batch's counts never evict each other
        return torch.where(out.indices >= 0, self.table.slot_scores[out.indices.clamp(min=0)], counts)

    def erase(self, keys):
        if keys.numel():
            self.table.erase(keys)

    def export(self, batch_size=1 << 16):
        for b in self.table.export(batch_size=batch_size):
            yield b.keys, b.scores

    def load(self, keys, counts):
        self.commit(self.stage(keys, counts)[0])

    def stage(self, keys, counts):
        """A new count table holding `keys` with `counts`, built aside: in
        the given (export's slot) order when every key fits, so that a
        resumed counter breaks ties between equal counts (the lowest slot
        goes first) as before; else the highest counts are placed first, so
        those dropped (their buckets full) are the lowest of their bucket."""
        table = self._empty()
        if not keys.numel():
            return table, 0
        out = table.insert(keys.to(table.device), scores=counts.to(table.device), evict=False)
        if bool((out.indices >= 0).all()):
            return table, 0
        table = self._empty()
        order = torch.argsort(counts, descending=True, stable=True)
        # One call: keys placed earlier in it are never evicted by later ones (they fail instead).
        out = table.insert(keys[order].to(table.device), scores=counts[order].to(table.device))
        return table, int((out.indices < 0).sum()) + out.evicted.keys.numel()

    def commit(self, staged):
        self.table = staged


class AdmissionCounter:
    """A table's admission on one rank: its strategy and its own counter."""

    def __init__(self, strategy: AdmissionStrategy, counter: Counter, table_name: str, device):
        self.strategy, self.table_name = strategy, table_name
        self.counter = counter.create(torch.device(device), table_name)
        if not isinstance(self.counter, Counter):
            raise TypeError(f"table {table_name!r}: {type(counter).__name__}.create returned "
                            f"{type(self.counter).__name__}, not a dynamicemb.Counter")

    @property
    def counts(self) -> ScoredHashTable:
        """A KVCounter's count table (keys -> counts as LFU scores)."""
        return self.counter.table

    @property
    def threshold(self) -> Optional[int]:
        return getattr(self.strategy, "threshold", None)

    def capacity(self) -> Optional[int]:
        """The most keys its counter holds (None: no limit)."""
        return self.counter.max_keys()

    def admit(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Adds `counts` sightings to `keys` (distinct, not stored yet); returns
        the mask of the keys to store (the caller stores them, then forgets
        those it stored)."""
        total = self.counter.add(keys, counts).to(keys.device)
        mask = self.strategy.admit(keys, total)
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == keys.shape):
            raise TypeError(f"table {self.table_name!r}: {type(self.strategy).__name__}.admit must return a bool "
                            f"tensor of shape {tuple(keys.shape)}, got {getattr(mask, 'dtype', type(mask))} "
                            f"{tuple(getattr(mask, 'shape', ()))}")
        return mask.to(keys.device)

    def forget(self, keys: torch.Tensor) -> None:
        """Drops the counts of keys now stored in the table."""
        if keys.numel():
            self.counter.erase(keys)

    # ---- checkpoint ------------------------------------------------------------------------------

    def check_checkpointable(self) -> None:
        """Raises CounterNotCheckpointable, naming the table, when its counter cannot be saved."""
        if not self.counter.checkpointable():
            raise CounterNotCheckpointable(
                f"table {self.table_name!r}: its admission counter ({type(self.counter).__name__}) cannot be "
                f"checkpointed: implement export() and load() on it (dynamicemb.Counter), or leave the counts "
                f"out (DynamicEmbDump / DynamicEmbLoad with counter=False)")

    def export(self, batch_size: int = 1 << 16) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        self.check_checkpointable()
        for keys, counts in self.counter.export(batch_size):
            yield keys.to(torch.int64), counts.to(torch.int64)

    def build(self, keys: torch.Tensor, counts: torch.Tensor) -> Tuple[Any, int]:
        """The counts a load swaps in, built aside without touching those in
        use (a checkpoint load builds them on every rank, then calls
        replace()); and how many keys did not fit."""
        self.check_checkpointable()
        return self.counter.stage(keys, counts)

    def replace(self, staged: Any) -> None:
        """Swaps in counts made by build()."""
        self.counter.commit(staged)
