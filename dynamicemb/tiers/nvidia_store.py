"""An NVIDIA dynamicemb `Storage` (its `external_storage` option: a parameter
server client, say) as our BackingStore, so that ported code keeps its store
(API.md "Coming from NVIDIA dynamicemb"). The storage implements NVIDIA's
interface; the methods used here:

    find(keys, table_ids, copy_mode, lfu_accumulated_frequency=None)
        -> (num_missing, missing_keys, missing_indices, missing_scores, founds, scores, values)
    insert(keys, table_ids, values, scores=None, preserve_existing=False)
    export_keys_values(device, batch_size, table_id) -> iter of (keys, embeddings, opt_states, scores)
    embedding_dim(table_id), value_dim(table_id), max_embedding_dim(), max_value_dim()
    erase(keys, table_ids)   (optional)

Values travel in NVIDIA's padded layout: [embedding (padded to
max_embedding_dim) | optimizer state (padded to max_value_dim -
max_embedding_dim)]. Our cache takes a key's row out of the store while it
holds the key; a storage without `erase` keeps its copy, which this adapter
hides (from reads, exports and sizes) until the cache puts the key back.
Evictions inside the storage are its own: put reports none."""
import enum
from typing import Dict, Iterator

import torch

from dynamicemb.tiers.store import CPU, BackingStore, Rows

__all__ = ["CopyMode", "NvidiaStorageStore"]


class CopyMode(enum.Enum):
    """NVIDIA's find copy modes (import this one in a ported Storage)."""

    EMBEDDING = "embedding"
    VALUE = "value"


class NvidiaStorageStore(BackingStore):
    """BackingStore over an NVIDIA-style Storage instance (one per module:
    its table ids are the tables in the order the module opens them)."""

    def __init__(self, storage):
        self.storage = storage
        self._ids: Dict[str, int] = {}
        self._width: Dict[str, int] = {}
        self._dtype: Dict[str, torch.dtype] = {}
        self._hidden: Dict[str, torch.Tensor] = {}  # keys taken by the cache (storages without erase)

    def open_table(self, name, width, dtype, max_rows):
        self._ids.setdefault(name, len(self._ids))
        self._width[name], self._dtype[name] = width, dtype
        self._hidden[name] = torch.zeros(0, dtype=torch.int64)

    def _tids(self, name, n):
        return torch.full((n,), self._ids[name], dtype=torch.int64)

    def _ours(self, name, values: torch.Tensor) -> torch.Tensor:
        """Rows [n, width] from NVIDIA's padded values."""
        t = self._ids[name]
        dim, maxe = self.storage.embedding_dim(t), self.storage.max_embedding_dim()
        state = self._width[name] - dim
        rows = torch.cat([values[:, :dim], values[:, maxe:maxe + state]], 1)
        return rows.to(device=CPU, dtype=self._dtype[name])

    def _theirs(self, name, rows: torch.Tensor) -> torch.Tensor:
        t = self._ids[name]
        dim, maxe = self.storage.embedding_dim(t), self.storage.max_embedding_dim()
        out = torch.zeros(rows.shape[0], self.storage.max_value_dim(), dtype=rows.dtype)
        out[:, :dim] = rows[:, :dim]
        out[:, maxe:maxe + rows.shape[1] - dim] = rows[:, dim:]
        return out

    def read(self, name, keys):
        n = keys.numel()
        if not n:
            return (torch.zeros(0, dtype=torch.bool), torch.zeros(0, self._width[name], dtype=self._dtype[name]),
                    torch.zeros(0, dtype=torch.int64))
        res = self.storage.find(keys, self._tids(name, n), CopyMode.VALUE)
        founds, scores, values = res[4].to(CPU), res[5], res[6]
        founds = founds & ~torch.isin(keys, self._hidden[name])
        rows = self._ours(name, values)
        rows[~founds] = 0
        scores = torch.zeros(n, dtype=torch.int64) if scores is None else scores.to(CPU, torch.int64)
        return founds, rows, torch.where(founds, scores, torch.zeros_like(scores))

    def take(self, name, keys):
        found, rows, scores = self.read(name, keys)
        taken = keys[found]
        if taken.numel():
            if hasattr(self.storage, "erase"):
                self.storage.erase(taken, self._tids(name, taken.numel()))
            else:
                self._hidden[name] = torch.cat([self._hidden[name], taken]).unique()
        return found, rows, scores

    def put(self, name, keys, rows, scores):
        if keys.numel():
            self.storage.insert(keys, self._tids(name, keys.numel()), self._theirs(name, rows), scores)
            hidden = self._hidden[name]
            self._hidden[name] = hidden[~torch.isin(hidden, keys)]
        return 0

    def items(self, name, batch_size=1 << 16) -> Iterator[Rows]:
        t = self._ids[name]
        dim = self.storage.embedding_dim(t)
        for keys, emb, opt, scores in self.storage.export_keys_values(CPU, batch_size, t):
            keep = ~torch.isin(keys.to(CPU), self._hidden[name])
            state = self._width[name] - dim
            opt = torch.zeros(keys.numel(), state) if opt is None else opt[:, :state]
            rows = torch.cat([emb[:, :dim].to(CPU), opt.to(CPU)], 1).to(self._dtype[name])
            scores = torch.zeros(keys.numel(), dtype=torch.int64) if scores is None else scores.to(CPU, torch.int64)
            if bool(keep.any()):
                yield keys.to(CPU)[keep], rows[keep], scores[keep]

    def size(self, name):
        return sum(k.numel() for k, _, _ in self.items(name))

    def clear(self, name):
        keys = [k for k, _, _ in self.items(name)]
        if not keys:
            return
        keys = torch.cat(keys)
        if hasattr(self.storage, "erase"):
            self.storage.erase(keys, self._tids(name, keys.numel()))
        else:  # hidden until put again
            self._hidden[name] = torch.cat([self._hidden[name], keys]).unique()
