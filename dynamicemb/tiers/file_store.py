"""FileStore: a backing store on local disk, for tables larger than RAM.

Per table, in the store's directory:

    <table>.rows.<generation>    the rows, appended one after another
    <table>.index.safetensors    keys, row positions and scores as of the
                                 last flush, and how many rows the rows
                                 file held then

Rows are only ever appended, never overwritten: a row taken out or evicted
becomes garbage, and a flush that finds more garbage than live rows writes
the live ones to a new generation. The index is written to a temporary file,
fsynced and renamed over the old one after the rows it names are fsynced, so
a process killed at any point leaves the table as of its last flush; rows
appended after it are cut off when the table is opened again. The keys'
index lives in memory (about 25 bytes a slot); rows are read through a
memory map of the rows file.
"""
import json
import os
from typing import Dict, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dynamicemb.tiers.index import KeyIndex
from dynamicemb.tiers.store import BackingStore

_GARBAGE_SHARE = 0.5  # a flush compacts a file more than this share garbage


class _TableFile:
    def __init__(self, root: str, name: str, width: int, dtype: torch.dtype, max_rows: int, bucket_capacity: int):
        self.root, self.name, self.width, self.dtype = root, name, width, dtype
        self.row_bytes = width * torch.empty((), dtype=dtype).element_size()
        self.index = KeyIndex(name, max_rows, bucket_capacity)
        self.generation, self.rows, self.garbage = 0, 0, 0
        self._map: Optional[np.memmap] = None
        self._open_existing()
        self._file = open(self._rows_path(), "r+b" if os.path.exists(self._rows_path()) else "w+b")
        self._file.truncate(self.rows * self.row_bytes)  # rows appended after the last flush are gone
        self._file.seek(0, os.SEEK_END)

    # ---- files ---------------------------------------------------------------------------------

    def _rows_path(self, generation: Optional[int] = None) -> str:
        return os.path.join(self.root, f"{self.name}.rows.{self.generation if generation is None else generation}")

    def _index_path(self) -> str:
        return os.path.join(self.root, f"{self.name}.index.safetensors")

    def _open_existing(self) -> None:
        path = self._index_path()
        if not os.path.exists(path):
            return
        with safe_open(path, framework="pt") as f:
            meta = json.loads(f.metadata()["dynamicemb"])
            keys, pos, scores = f.get_tensor("keys"), f.get_tensor("positions"), f.get_tensor("scores")
        if meta["width"] != self.width or meta["dtype"] != str(self.dtype):
            raise ValueError(f"table {self.name!r}: the file store at {self.root} holds rows of width "
                             f"{meta['width']} ({meta['dtype']}), the table's are {self.width} ({self.dtype})")
        self.generation, self.rows = meta["generation"], meta["rows"]
        if os.path.getsize(self._rows_path()) < self.rows * self.row_bytes:
            raise ValueError(f"table {self.name!r}: {self._rows_path()} is shorter than its index says "
                             f"({self.rows} rows of {self.row_bytes} bytes)")
        lost = self.index.add(keys, pos, scores)[0].numel()
        if lost:
            raise ValueError(f"table {self.name!r}: the file store holds more keys than the table's maximum")
        self.garbage = self.rows - keys.numel()

    def _write_index(self) -> None:
        keys, pos, scores = [], [], []
        for k, p, s in self.index.items():
            keys.append(k)
            pos.append(p)
            scores.append(s)
        empty = torch.zeros(0, dtype=torch.int64)
        tensors = {"keys": torch.cat(keys) if keys else empty, "positions": torch.cat(pos) if pos else empty,
                   "scores": torch.cat(scores) if scores else empty}
        meta = {"generation": self.generation, "rows": self.rows, "width": self.width, "dtype": str(self.dtype)}
        tmp = self._index_path() + ".tmp"
        save_file(tensors, tmp, metadata={"dynamicemb": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self._index_path())
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- rows ----------------------------------------------------------------------------------

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Appends rows; returns their positions."""
        start = self.rows
        data = rows.to(self.dtype).contiguous().view(torch.uint8).numpy()
        self._file.write(memoryview(data).cast("B"))
        self.rows += rows.shape[0]
        return torch.arange(start, self.rows, dtype=torch.int64)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows at positions ([n, width] of the table's dtype)."""
        if not positions.numel():
            return torch.zeros(0, self.width, dtype=self.dtype)
        if self._map is None or self._map.shape[0] < self.rows:
            self._file.flush()
            self._map = np.memmap(self._rows_path(), dtype=np.uint8, mode="r", shape=(self.rows, self.row_bytes))
        raw = torch.from_numpy(np.ascontiguousarray(self._map[positions.numpy()]))
        return raw.view(self.dtype).reshape(positions.numel(), self.width)

    def flush(self) -> None:
        live = len(self.index)
        if self.garbage > _GARBAGE_SHARE * max(1, self.rows):
            self._compact()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._write_index()
        self.garbage = self.rows - live

    def _compact(self) -> None:
        """The live rows into a new generation's file (the old one is removed
        once the index naming the new one is durable: see flush)."""
        old_gen, old_map_rows = self.generation, self.rows
        keys, pos, scores = [], [], []
        for k, p, s in self.index.items():
            keys.append(k)
            pos.append(p)
            scores.append(s)
        self._file.flush()
        self.generation += 1
        new = open(self._rows_path(), "w+b")
        self.rows = 0
        index = KeyIndex(self.name, self.index.max_slots, self.index.bucket_capacity)
        old_file, self._file = self._file, new
        for k, p, s in zip(keys, pos, scores):
            rows = self._gather_from(old_gen, old_map_rows, p)
            index.add(k, self.append(rows), s)
        self.index = index
        old_file.close()
        self._map = None
        self._stale = self._rows_path(old_gen)

    def _gather_from(self, generation: int, rows: int, positions: torch.Tensor) -> torch.Tensor:
        mm = np.memmap(self._rows_path(generation), dtype=np.uint8, mode="r", shape=(rows, self.row_bytes))
        raw = torch.from_numpy(np.ascontiguousarray(mm[positions.numpy()]))
        return raw.view(self.dtype).reshape(positions.numel(), self.width)

    def remove_stale(self) -> None:
        stale = getattr(self, "_stale", None)
        if stale and os.path.exists(stale):
            os.remove(stale)
        self._stale = None

    def clear(self) -> None:
        self.index.clear()
        self.garbage = self.rows  # every row written so far

    def close(self) -> None:
        self._file.close()
        self._map = None


class FileStore(BackingStore):
    """Rows on local disk under `root` (a directory, created when missing);
    a store reopened on the same directory (in this process or another)
    holds what the last flush() wrote."""

    def __init__(self, root: str, bucket_capacity: int = 128):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.bucket_capacity = bucket_capacity
        self._tables: Dict[str, _TableFile] = {}

    def open_table(self, name, width, dtype, max_rows):
        if os.sep in name or name.startswith("."):
            raise ValueError(f"table name {name!r} cannot name a file")
        self._tables[name] = _TableFile(self.root, name, width, dtype, max_rows, self.bucket_capacity)

    def _table(self, name) -> _TableFile:
        try:
            return self._tables[name]
        except KeyError:
            raise KeyError(f"table {name!r} is not open in the file store at {self.root}") from None

    def read(self, name, keys):
        t = self._table(name)
        found, pos, scores = t.index.find(keys)
        out = torch.zeros(keys.numel(), t.width, dtype=t.dtype)
        out[found] = t.gather(pos[found])
        return found, out, scores

    def take(self, name, keys):
        found, out, scores = self.read(name, keys)
        if bool(found.any()):
            t = self._table(name)
            t.index.remove(keys[found])
            t.garbage += int(found.sum())
        return found, out, scores

    def put(self, name, keys, rows, scores):
        if not keys.numel():
            return 0
        t = self._table(name)
        ev_keys, _, _ = t.index.add(keys, t.append(rows), scores)
        t.garbage += ev_keys.numel()
        return int(ev_keys.numel())

    def items(self, name, batch_size=1 << 16):
        t = self._table(name)
        for keys, pos, scores in t.index.items(batch_size):
            yield keys, t.gather(pos), scores

    def size(self, name):
        return len(self._table(name).index)

    def clear(self, name):
        self._table(name).clear()

    def flush(self):
        for t in self._tables.values():
            t.flush()
            t.remove_stale()

    def close(self) -> None:
        for t in self._tables.values():
            t.close()
