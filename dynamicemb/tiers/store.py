"""Backing stores: where a cached table's rows live when they are not in its
cache (API.md §1: caching). A store holds, per table, key -> (row, score),
each key at most once; the cache takes a key's row out when it needs it and
puts it back when it evicts it, so a key is in exactly one place.

`BackingStore` is the interface (implement it for, e.g., a parameter-server
client); `HostStore` keeps rows in host memory; `FileStore` (file_store.py)
in a memory-mapped file on local disk, for tables larger than RAM.
"""
import abc
from typing import Dict, Iterator, Optional, Tuple

import torch

from dynamicemb import memory
from dynamicemb.tiers.index import KeyIndex

Rows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys, rows [n, width], scores


def take_from_found(n: int, at: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor):
    """take's (found [n], rows [n, width], scores [n]) from take_found's
    (positions, rows, scores) of the n keys looked up (zeros where missing)."""
    found = torch.zeros(n, dtype=torch.bool)
    found[at] = True
    out = torch.zeros(n, rows.shape[1], dtype=rows.dtype)
    out.index_copy_(0, at, rows)
    all_scores = torch.zeros(n, dtype=torch.int64)
    all_scores.index_copy_(0, at, scores)
    return found, out, all_scores


class BackingStore(abc.ABC):
    """Per table (by name): distinct int64 keys -> a row [width] of the
    table's dtype ([value | optimizer state]) and an int64 score."""

    @abc.abstractmethod
    def open_table(self, name: str, width: int, dtype: torch.dtype, max_rows: int) -> None:
        """Declares a table (called once by the storage, before any use);
        `max_rows`: the most keys it may hold (beyond, put evicts)."""

    def reserve(self, name: str, rows: int) -> None:
        """Room for a table's first `rows` keys made up front (the table's
        init_capacity, as an in-memory table allocates it), so that puts up
        to there neither grow nor touch new memory; nothing by default."""

    @abc.abstractmethod
    def take(self, name: str, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(found [n] bool, rows [n, width], scores [n]) of distinct keys;
        the found keys leave the store."""

    @abc.abstractmethod
    def read(self, name: str, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """take without removing (eval lookups)."""

    def take_found(self, name: str, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """take, of the found keys only: (their positions in keys, ascending,
        their rows, their scores); they leave the store. The cache calls this
        one; override it when a store can skip the rows of missing keys."""
        found, rows, scores = self.take(name, keys)
        at = found.nonzero().squeeze(1)
        return at, rows[at], scores[at]

    @abc.abstractmethod
    def put(self, name: str, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int:
        """Stores distinct keys that are not in the store; returns how many
        keys (these or others) it evicted to stay within max_rows."""

    @abc.abstractmethod
    def items(self, name: str, batch_size: int = 1 << 16) -> Iterator[Rows]:
        """Every (keys, rows, scores) of a table, in batches."""

    @abc.abstractmethod
    def size(self, name: str) -> int:
        """Keys of a table in the store."""

    @abc.abstractmethod
    def clear(self, name: str) -> None:
        """Removes every key of a table."""

    def flush(self) -> None:
        """Makes what was put durable (a store on disk); nothing by default."""

    # A persistent store (FileStore) also keeps, per table, a small state
    # that its owner saves with each flush and reads back when the store is
    # reopened (the module's step counters, the clock its scores were read
    # on). A store that keeps nothing across processes needs none of these.

    def save_state(self, name: str, state: dict) -> None:
        """A JSON-able state of a table, made durable by the next flush;
        nothing by default."""

    def load_state(self, name: str) -> Optional[dict]:
        """The state of a table as of the last flush (None: none kept)."""
        return None

    def shift_scores(self, name: str, delta: int) -> None:
        """Adds delta to every score of a table (a reopened store's clock
        readings carried to the new clock); needed with load_state only."""
        raise NotImplementedError(f"{type(self).__name__} does not shift scores")


class HostStore(BackingStore):
    """Rows in host memory (a tensor per table, grown by doubling, with a
    free list), keys in a KeyIndex."""

    def __init__(self, bucket_capacity: int = 128):
        self.bucket_capacity = bucket_capacity
        self._index: Dict[str, KeyIndex] = {}
        self._rows: Dict[str, torch.Tensor] = {}
        self._free: Dict[str, torch.Tensor] = {}  # free positions: a stack, its first _n_free[name] entries
        self._n_free: Dict[str, int] = {}
        self._used: Dict[str, int] = {}  # positions ever handed out

    def open_table(self, name, width, dtype, max_rows):
        self._index[name] = KeyIndex(name, max_rows, self.bucket_capacity)
        self._rows[name] = torch.zeros(0, width, dtype=dtype)
        self._free[name] = torch.zeros(0, dtype=torch.int64)
        self._n_free[name] = 0
        self._used[name] = 0

    def reserve(self, name, rows):
        index, have = self._table(name), self._rows[name]
        rows = min(rows, index.max_slots)
        if rows > have.shape[0]:
            # Zero-filled now (on 2 MiB pages where offered): puts later write
            # rows whose pages are there already.
            grown = memory.zeros((rows, have.shape[1]), have.dtype, "cpu")
            grown[:self._used[name]] = have[:self._used[name]]
            self._rows[name] = grown
        index.reserve(rows)

    def _table(self, name) -> KeyIndex:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"table {name!r} is not open in this backing store") from None

    def _release(self, name: str, positions: torch.Tensor) -> None:
        """Pushes positions on the free stack (grown by doubling, not copied per push)."""
        n, free = self._n_free[name], self._free[name]
        if n + positions.numel() > free.numel():
            grown = torch.empty(max(2 * free.numel(), n + positions.numel(), 1024), dtype=torch.int64)
            grown[:n] = free[:n]
            self._free[name] = free = grown
        free[n:n + positions.numel()] = positions
        self._n_free[name] = n + positions.numel()

    def _alloc(self, name: str, n: int) -> torch.Tensor:
        """n positions: the last freed ones (top of the stack, in push order), then fresh ones."""
        top = self._n_free[name]
        reuse = self._free[name][top - min(n, top):top]
        self._n_free[name] = top - reuse.numel()
        fresh = n - reuse.numel()
        start = self._used[name]
        rows = self._rows[name]
        if start + fresh > rows.shape[0]:
            # Rows past `used` are written (put) before they are read: no zero fill.
            grown = torch.empty(max(2 * rows.shape[0], start + fresh, 1024), rows.shape[1], dtype=rows.dtype)
            grown[:start] = rows[:start]
            self._rows[name] = grown
        self._used[name] = start + fresh
        if not fresh:
            return reuse.clone()  # the stack's entries get overwritten by later pushes
        return torch.cat([reuse, torch.arange(start, start + fresh, dtype=torch.int64)])

    def read(self, name, keys):
        found, pos, scores = self._table(name).find(keys)
        rows = self._rows[name]
        out = torch.zeros(keys.numel(), rows.shape[1], dtype=rows.dtype)
        out[found] = rows[pos[found]]
        return found, out, scores

    def take(self, name, keys):
        return take_from_found(keys.numel(), *self.take_found(name, keys))

    def take_found(self, name, keys):
        at, pos, scores = self._table(name).take_found(keys)
        rows = self._rows[name].index_select(0, pos)
        if pos.numel():
            self._release(name, pos)
        return at, rows, scores

    def put(self, name, keys, rows, scores):
        if not keys.numel():
            return 0
        pos = self._alloc(name, keys.numel())
        self._rows[name].index_copy_(0, pos, rows.to(self._rows[name].dtype))
        ev_keys, ev_pos, _ = self._table(name).add(keys, pos, scores)
        if ev_keys.numel():
            self._release(name, ev_pos)
        return int(ev_keys.numel())

    def items(self, name, batch_size=1 << 16):
        rows = self._rows[name]
        for keys, pos, scores in self._table(name).items(batch_size):
            yield keys, rows[pos], scores

    def size(self, name):
        return len(self._table(name))

    def clear(self, name):
        self._table(name).clear()
        self._n_free[name] = 0
        self._used[name] = 0
