"""Backing stores: where a cached table's rows live when they are not in its
cache (API.md §1: caching). A store holds, per table, key -> (row, score),
each key at most once; the cache takes a key's row out when it needs it and
puts it back when it evicts it, so a key is in exactly one place.

`BackingStore` is the interface (implement it for, e.g., a parameter-server
client); `HostStore` keeps rows in host memory (pinned and mapped in front
of a CUDA cache: the device's kernels read and write them in place);
`FileStore` (file_store.py) in a memory-mapped file on local disk, for
tables larger than RAM.
"""
import abc
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch

from dynamicemb import memory
from dynamicemb._ops import ops
from dynamicemb.positions import by_group, scatter_rows, where_true
from dynamicemb.tiers.index import KeyIndex

CPU = torch.device("cpu")

Rows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys, rows [n, width], scores


def timestamp_columns(dtype: torch.dtype) -> int:
    """Columns of `dtype` that hold one int64 access time at a stored row's end."""
    return 8 // torch.empty((), dtype=dtype).element_size()


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


def grouped(tids: torch.Tensor, n_tables: Optional[int], *entries: torch.Tensor
            ) -> Iterator[Tuple[torch.Tensor, ...]]:
    """(table id, then each of `entries` cut to that table's) per table
    present in tids, in table order; `entries` are aligned with tids, and
    a table's keep their order. One grouping of the positions
    (positions.by_group) and one gather per tensor, none when a single
    table is present. `n_tables` (default: the largest id + 1) == 1: every
    entry is of table 0 (nothing to count)."""
    if not tids.numel():
        return
    if n_tables == 1:
        yield (0, *entries)
        return
    order, counts = by_group(tids, n_tables or int(tids.max()) + 1)
    present = [j for j, c in enumerate(counts) if c]
    if len(present) == 1:
        yield (present[0], *entries)
        return
    entries = tuple(x.index_select(0, order) for x in entries)
    start = 0
    for j, c in enumerate(counts):
        if c:
            yield (j, *(x[start:start + c] for x in entries))
        start += c


class RowsAt:
    """Rows `rows` of `source` [R, width], not gathered yet: a CPU cache hands
    its evicted rows so to a store that copies them once, into place
    (BackingStore.puts_rows_at), instead of gathering them into a tensor
    that the store then copies again. Like a tensor of the rows, it has a
    length and slices. `tail`: columns after each row ([n, k], the source's
    dtype; a (TIMESTAMP, LFU) row's access time), written beside it."""

    __slots__ = ("source", "rows", "tail")

    def __init__(self, source: torch.Tensor, rows: torch.Tensor, tail: Optional[torch.Tensor] = None):
        self.source, self.rows, self.tail = source, rows, tail

    def __len__(self) -> int:
        return self.rows.numel()

    def __getitem__(self, part: slice) -> "RowsAt":
        return RowsAt(self.source, self.rows[part], None if self.tail is None else self.tail[part])

    def gather(self) -> torch.Tensor:
        rows = self.source.index_select(0, self.rows)
        return rows if self.tail is None else torch.cat([rows, self.tail], 1)


def write_rows(out: torch.Tensor, rows) -> None:
    """out[:] = rows: a tensor copied, or RowsAt gathered straight into out."""
    if not isinstance(rows, RowsAt):
        out.copy_(rows)
    elif rows.tail is None:
        ops.store_gather(rows.source, rows.rows, out)
    else:  # the rows gathered into their columns of out, then the tail beside them
        width = rows.source.shape[1]
        torch.index_select(rows.source, 0, rows.rows, out=out[:, :width])
        out[:, width:].copy_(rows.tail)


def write_rows_at(dest: torch.Tensor, positions: torch.Tensor, rows) -> None:
    """dest[positions] = rows at distinct positions: a tensor (cast to dest's
    dtype), or RowsAt gathered first."""
    scatter_rows(dest, positions, rows.gather() if isinstance(rows, RowsAt) else rows.to(dest.dtype))


class FreeList:
    """Row positions free for reuse: a stack (grown by doubling, not copied
    per push); the last pushed are popped first."""

    def __init__(self):
        self._pos = torch.zeros(0, dtype=torch.int64)
        self.count = 0

    def push(self, positions: torch.Tensor) -> None:
        n = self.count + positions.numel()
        if n > self._pos.numel():
            grown = torch.empty(max(2 * self._pos.numel(), n, 1024), dtype=torch.int64)
            grown[:self.count] = self._pos[:self.count]
            self._pos = grown
        self._pos[self.count:n] = positions
        self.count = n

    def pop(self, k: int) -> torch.Tensor:
        """The last k pushed (at most count), in a tensor of their own."""
        k = min(k, self.count)
        self.count -= k
        return self._pos[self.count:self.count + k].clone()

    def clear(self) -> None:
        self.count = 0


class BackingStore(abc.ABC):
    """Per table (by name): distinct int64 keys -> a row [width] of the
    table's dtype ([value | optimizer state]) and an int64 score. Tensors
    in and out are on the CPU, except the rows of take_group and put_group:
    on rows_device()."""

    # Whether put_group takes RowsAt for rows on the CPU (of the store's dtype).
    puts_rows_at = False

    def rows_device(self, cache_device: torch.device) -> torch.device:
        """Where take_group returns rows and put_group takes them, for a
        cache on `cache_device` (each storage asks once, before open_table):
        the CPU by default. A store that the cache's device reads in place
        answers that device (HostStore, in front of a CUDA cache)."""
        return CPU

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

    def contains(self, name: str, keys: torch.Tensor) -> torch.Tensor:
        """found [n] bool of keys, nothing moved (admission asks which keys
        a table stores); default: read's."""
        return self.read(name, keys)[0]

    def take_found(self, name: str, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """take, of the found keys only: (their positions in keys, ascending,
        their rows, their scores); they leave the store. The cache calls this
        one; override it when a store can skip the rows of missing keys."""
        found, rows, scores = self.take(name, keys)
        at = where_true(found)
        return at, rows[at], scores[at]

    def take_group(self, names: Sequence[str], keys: torch.Tensor, tids: torch.Tensor
                   ) -> Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """take_found of several tables in one call: key i is of table
        names[tids[i]] (distinct within a table). Per table j with keys
        found: (their positions in keys, ascending, rows, scores), the rows
        on rows_device(). The cache calls this one; by default it calls
        take_found per table."""
        out = {}
        for j, sel, k in grouped(tids, None, torch.arange(keys.numel()), keys):
            at, rows, scores = self.take_found(names[j], k)
            if at.numel():
                out[j] = (sel.index_select(0, at), rows, scores)
        return out

    def put_group(self, names: Sequence[str], parts: Dict[int, Rows]) -> Dict[int, int]:
        """put of several tables in one call: parts[j] = (keys, rows, scores)
        of table names[j], the rows on rows_device() (or RowsAt, where
        puts_rows_at). Per table j, the keys
        it evicted. The cache calls this one; by default it calls put per
        table."""
        return {j: self.put(names[j], *part) for j, part in parts.items()}

    @abc.abstractmethod
    def put(self, name: str, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int:
        """Stores distinct keys that are not in the store; returns how many
        keys (these or others) it evicted to stay within max_rows."""

    def put_if_room(self, name: str, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor
                    ) -> Tuple[torch.Tensor, int]:
        """put for a checkpoint load, which must not displace keys: (a mask of
        the keys left out for want of room, how many keys it evicted). A
        store that can leave keys out stores the others and evicts none (the
        cache then takes those keys); by default: put, evicting."""
        return torch.zeros(keys.shape, dtype=torch.bool), self.put(name, keys, rows, scores)

    def room(self, name: str) -> Optional[int]:
        """The most keys table `name` holds (at least open_table's max_rows,
        where a store rounds it up); None where the store cannot tell."""
        return None

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

    def close(self) -> None:
        """Releases what the store holds (files, locks, connections); what
        was put since the last flush may be lost. Nothing by default."""

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


DEFAULT_BUCKET = 128  # the key index's slots per bucket, unless a store is given another


class IndexedStore(BackingStore):
    """A store whose keys are in one KeyIndex, a logical table per table of
    the store (a take or put of several tables is one hash table call), and
    whose rows a subclass keeps per table at positions: _gather, _write and
    _drop say how."""

    def __init__(self, bucket_capacity: int = DEFAULT_BUCKET):
        self.bucket_capacity = bucket_capacity
        self._index: Optional[KeyIndex] = None
        self._tid: Dict[str, int] = {}  # table name -> its id in the index
        self._rows_dev = CPU  # rows_device()

    # ---- what a subclass provides ------------------------------------------------------------

    @abc.abstractmethod
    def _gather(self, name: str, positions: torch.Tensor, device: torch.device = CPU) -> torch.Tensor:
        """Table name's rows at positions, on `device` (the CPU or
        rows_device())."""

    @abc.abstractmethod
    def _write(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Stores rows of table name (on the CPU or rows_device()); returns
        their positions."""

    @abc.abstractmethod
    def _drop(self, name: str, positions: torch.Tensor) -> None:
        """Rows that no key addresses any more (taken out or evicted)."""

    def _where(self) -> str:
        return "this backing store"

    def reserve(self, name, rows):
        """The key index's slots for the table's first `rows` keys (no
        growth, each a rehash of the table, while training); a subclass
        adds its rows."""
        t = self._table(name)
        self._index.reserve(t, min(rows, self._index.max_slots[t]))

    # ---- the index -------------------------------------------------------------------------------

    def _index_table(self, name: str, max_rows: int) -> int:
        """Declares a table in the index (empty); returns its id."""
        if self._index is None:
            self._index = KeyIndex(name, max_rows, self.bucket_capacity)
            self._tid[name] = 0
        else:
            self._tid[name] = self._index.add_table(name, max_rows)
        return self._tid[name]

    def _table(self, name: str) -> int:
        try:
            return self._tid[name]
        except KeyError:
            raise KeyError(f"table {name!r} is not open in {self._where()}") from None

    def _ids(self, names: Sequence[str], tids: torch.Tensor) -> torch.Tensor:
        """The index's table ids of keys of tables names[tids]."""
        return torch.tensor([self._table(n) for n in names], dtype=torch.int64).index_select(0, tids)

    # ---- BackingStore ----------------------------------------------------------------------------

    def read(self, name, keys):
        t = self._table(name)  # first: a table not open is a KeyError naming it
        found, pos, scores = self._index.find(keys, torch.full_like(keys, t))
        at = where_true(found)
        rows = self._gather(name, pos.index_select(0, at))
        out = rows.new_zeros(keys.numel(), rows.shape[1])
        out.index_copy_(0, at, rows)
        return found, out, scores

    def contains(self, name, keys):
        return self._index.find(keys, torch.full_like(keys, self._table(name)))[0]

    def take(self, name, keys):
        return take_from_found(keys.numel(), *self.take_found(name, keys))

    def take_found(self, name, keys):
        got = self.take_group([name], keys, torch.zeros_like(keys))
        if got:
            return got[0]
        empty = keys.new_zeros(0)
        return empty, self._gather(name, empty), empty

    def take_group(self, names, keys, tids):
        ids = self._ids(names, tids)
        at, pos, scores = self._index.take_found(keys, ids)
        out = {}
        if not at.numel():
            return out
        for j, a, p, s in grouped(tids.index_select(0, at), len(names), at, pos, scores):
            out[j] = (a, self._gather(names[j], p, self._rows_dev), s)
            self._drop(names[j], p)
        return out

    def put(self, name, keys, rows, scores):
        return self.put_group([name], {0: (keys, rows, scores)})[0]

    def put_if_room(self, name, keys, rows, scores):
        t = self._table(name)
        if not keys.numel():
            return torch.zeros(0, dtype=torch.bool), 0
        positions = self._write(name, rows)
        left_out = self._index.add_if_room(keys, positions, scores, torch.full_like(keys, t))
        if bool(left_out.any()):
            self._drop(name, positions[left_out])
        return left_out, 0

    def room(self, name):
        return self._index.max_slots[self._table(name)]

    def put_group(self, names, parts):
        lost = {j: 0 for j in parts}
        parts = {j: p for j, p in parts.items() if p[0].numel()}
        if not parts:
            return lost
        ids = [self._table(names[j]) for j in parts]
        positions = [self._write(names[j], rows) for j, (_, rows, _) in parts.items()]
        keys = torch.cat([p[0] for p in parts.values()])
        scores = torch.cat([p[2] for p in parts.values()])
        tids = torch.cat([torch.full((p[0].numel(),), t, dtype=torch.int64) for p, t in zip(parts.values(), ids)])
        ev = self._index.add(keys, torch.cat(positions), scores, tids)
        if ev.keys.numel():
            by_id = {t: j for j, t in zip(parts, ids)}  # an evicted key is of the table whose key took its bucket
            for t, p in grouped(ev.table_ids, None, ev.positions):
                self._drop(names[by_id[t]], p)
                lost[by_id[t]] += p.numel()
        return lost

    def items(self, name, batch_size=1 << 16):
        t = self._table(name)
        for keys, pos, scores in self._index.items(batch_size, t):
            yield keys, self._gather(name, pos), scores

    def size(self, name):
        t = self._table(name)
        return self._index.size(t)

    def shift_scores(self, name, delta):
        t = self._table(name)
        self._index.shift_scores(delta, t)


# A HostStore's rows grow past its table's room by at most 1 / ROOM_MARGIN
# (unless one put needs more): the rows a full table's put writes before
# its evictions free as many.
ROOM_MARGIN = 16


class HostStore(IndexedStore):
    """Rows in host memory (a tensor per table with a free list), keys in
    the store's KeyIndex. In front of a CUDA cache the rows are in pinned
    host memory that the device's kernels gather and write in place
    (store_gather, store_scatter: mapped), so rows go between the tiers
    without a copy on the host; a HostStore then serves caches on that
    device only."""

    puts_rows_at = True

    def __init__(self, bucket_capacity: int = DEFAULT_BUCKET):
        super().__init__(bucket_capacity)
        self._rows: Dict[str, torch.Tensor] = {}
        self._free: Dict[str, FreeList] = {}
        self._used: Dict[str, int] = {}  # positions ever handed out

    def rows_device(self, cache_device):
        cache_device = torch.device(cache_device)
        if cache_device.type == "cuda" and cache_device.index is None:
            cache_device = torch.device("cuda", torch.cuda.current_device())
        want = cache_device if cache_device.type == "cuda" else CPU
        if want != self._rows_dev:
            if self._rows:  # rows allocated for the other device
                raise ValueError(f"a HostStore serves caches on one device: this one holds tables "
                                 f"{sorted(self._rows)} for caches on {self._rows_dev}, not {cache_device}; "
                                 f"give the caches on {cache_device} a HostStore of their own")
            self._rows_dev = want
        return want

    def _pinned(self) -> bool:
        return self._rows_dev.type == "cuda"

    def _new_rows(self, rows: int, width: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """Rows of a table: pinned in front of a CUDA cache; else zero-filled
        on 2 MiB pages where offered, or left unwritten (written before read)."""
        if self._pinned():
            return (torch.zeros if zero else torch.empty)(rows, width, dtype=dtype, pin_memory=True)
        return memory.zeros((rows, width), dtype, "cpu") if zero else torch.empty(rows, width, dtype=dtype)

    def _host_access(self) -> None:
        """Before the host reads or writes pinned rows: the device's gathers
        and writes queued so far have run."""
        if self._pinned():
            torch.cuda.synchronize(self._rows_dev)

    def open_table(self, name, width, dtype, max_rows):
        if name in self._tid:  # opened again (a module built anew over this store): it starts empty
            self.clear(name)
        else:
            self._index_table(name, max_rows)
        self._rows[name] = self._new_rows(0, width, dtype, zero=True)
        self._free[name] = FreeList()
        self._used[name] = 0

    def reserve(self, name, rows):
        super().reserve(name, rows)
        have = self._rows[name]
        rows = min(rows, self._index.max_slots[self._table(name)])
        if rows > have.shape[0]:
            # Zero-filled now: puts later write rows whose pages are there already.
            grown = self._new_rows(rows, have.shape[1], have.dtype, zero=True)
            self._host_access()
            grown[:self._used[name]] = have[:self._used[name]]
            self._rows[name] = grown

    def _gather(self, name, positions, device=CPU):
        rows = self._rows[name]
        if device.type == "cuda":
            out = torch.empty(positions.numel(), rows.shape[1], dtype=rows.dtype, device=device)
            ops.store_gather(rows, positions, out)
            return out
        self._host_access()
        return rows.index_select(0, positions)

    def _write(self, name, rows):
        pos, fresh = self._alloc(name, len(rows))
        dest = self._rows[name]
        if not isinstance(rows, RowsAt):  # (RowsAt: a CPU cache's rows, of the store's dtype)
            rows = rows.to(dest.dtype)
            if rows.device.type == "cuda":
                ops.store_scatter(dest, pos, rows.contiguous())
                return pos
        self._host_access()
        if fresh:  # a block, written in one copy (RowsAt: gathered straight into it)
            start = int(pos[0])
            write_rows(dest[start:start + fresh], rows[:fresh])
        if fresh < pos.numel():  # freed positions, scattered
            write_rows_at(dest, pos[fresh:], rows[fresh:])
        return pos

    def _drop(self, name: str, positions: torch.Tensor) -> None:
        self._free[name].push(positions)

    def _alloc(self, name: str, n: int) -> Tuple[torch.Tensor, int]:
        """n positions: first fresh ones (consecutive: written in one copy,
        where freed ones are scattered) while the rows allocated last, then
        the last freed ones (top of the stack), then fresh ones past the rows
        grown (only once no freed one is left: the rows stay within the most
        keys held at once). Returns them, the fresh ones first, and how many
        are fresh."""
        start, rows = self._used[name], self._rows[name]
        reuse = self._free[name].pop(max(0, n - (rows.shape[0] - start)))
        fresh = n - reuse.numel()
        if start + fresh > rows.shape[0]:
            # Doubling, but not past the table's room and a margin: a full
            # table's put writes its rows before the index evicts (and frees)
            # as many, which doubled the rows to twice the room.
            room = self._index.max_slots[self._table(name)]
            size = max(min(2 * rows.shape[0], room + room // ROOM_MARGIN), start + fresh, 1024)
            # Rows past `used` are written (put) before they are read: no zero fill.
            grown = self._new_rows(size, rows.shape[1], rows.dtype, zero=False)
            self._host_access()
            grown[:start] = rows[:start]
            self._rows[name] = grown
        self._used[name] = start + fresh
        if not fresh:
            return reuse, 0
        return torch.cat([torch.arange(start, start + fresh, dtype=torch.int64), reuse]), fresh

    def clear(self, name):
        t = self._table(name)
        self._index.clear(t)
        self._free[name].clear()
        self._used[name] = 0
