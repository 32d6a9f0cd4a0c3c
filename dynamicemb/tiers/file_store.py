"""FileStore: a backing store on local disk, for tables larger than RAM.

A store's directory (make_storage gives each rank its own,
<storage_path>/rank<NNNNN>) holds, per table <t>:

    <t>.rows.<g>                 the rows of generation g: records of
                                 width x dtype bytes (native byte order) at
                                 positions 0, 1, ...; a row the committed
                                 snapshot addresses is never overwritten;
                                 read and written through a memory map (the
                                 file grows sparse, by doubling)
    <t>.index.<s>.safetensors    snapshot s of the table's key index: keys,
                                 row positions and scores (int64), and in its
                                 metadata the generation, the rows it covers,
                                 width, dtype, a CRC-32 of the tensors and the
                                 state its owner saved (save_state)
    <t>.rows.lock                locked (flock) while a FileStore has the table
                                 open: a second opener gets an error

and for the whole directory `manifest.json` ({"tables": {<t>: {"index": s}}}),
the committed snapshot of every table, replaced atomically.

Durability: flush() makes everything put so far durable, for all of the
store's tables at once: it syncs each rows file (msync, fsync), writes and
fsyncs a new index snapshot beside the committed one, fsyncs the directory,
then commits by replacing manifest.json (write, fsync, rename, fsync the
directory), and only then removes the superseded snapshots and generations.
A process killed at any point (or a machine losing power, on a file system
that honours fsync) leaves the directory as of the last completed flush: the
manifest names complete files only, and no row a committed snapshot addresses
is ever overwritten. Opening a table removes what a crash left behind
(uncommitted snapshots and generations); rows appended after the last flush
are overwritten by the next appends.

Appends write pages a background thread faulted in ahead of them (up to
8 MiB past the last append of each map: their blocks allocated, and written
by the next flush as they are), so that a new page's allocation does not
fall on the training step.

Rows taken out or evicted become garbage. Puts append while at most half
of the rows file is garbage; beyond, they first overwrite garbage rows that
the committed snapshot does not address (freed since this process opened
the table: those written since the last flush at once, the others once the
next flush commits). So between flushes the file stays within about twice
the rows the table holds (appends write fresh pages in sequence: cheaper
than rows scattered over the map). A flush that finds more garbage than
live rows in a table first copies its live rows into a new generation
(compaction). The key index lives in memory (26 bytes a slot); each
flush writes it whole (24 bytes a key).
"""
import contextlib
import fcntl
import json
import mmap
import os
import re
import threading
import zlib
from typing import Dict, Iterator, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dynamicemb.fsync import fsync_dir, fsync_file
from dynamicemb.tiers import prefault
from dynamicemb.tiers.index import KeyIndex, TableView
from dynamicemb.tiers.store import CPU, DEFAULT_BUCKET, FreeList, IndexedStore, write_rows, write_rows_at

FORMAT = "dynamicemb.FileStore"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_MANIFEST_LOCK = "manifest.lock"  # no table's file has this name (theirs end in .rows.*, .index.*)
_GARBAGE_SHARE = 0.5  # a flush compacts a table whose rows file is more than this share garbage
_MIN_MAP_BYTES = 1 << 20  # a rows file's first mapping
_COPY_BYTES = 64 << 20  # compaction copies rows in blocks of about this size


def _crc(tensors: Dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy(), crc)
    return crc


def read_manifest(root: str) -> Dict[str, dict]:
    """{table: {"index": snapshot}} committed in the store at root ({} when none)."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"the file store's manifest {path} cannot be read ({e}): it is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("tables"), dict):
        raise ValueError(f"{path} is not a dynamicemb file store manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has file store format version {manifest.get('version')}; this dynamicemb "
                         f"reads version {FORMAT_VERSION}")
    return manifest["tables"]


class _RowsFile:
    """One generation's rows file (of table `table`), mapped read-write;
    grows by doubling, its space allocated on disk as it grows."""

    def __init__(self, path: str, width: int, dtype: torch.dtype, min_rows: int, fresh: bool, table: str = ""):
        self.path, self.width, self.dtype, self.table = path, width, dtype, table
        self.row_bytes = width * dtype.itemsize
        self.lock = threading.RLock()  # the map's changes, and the prefaulter's work on it
        self.generation = 0
        self._faulted = 0  # bytes of the map faulted in (or requested) from its start
        self._file = open(path, "w+b" if fresh else "r+b" if os.path.exists(path) else "w+b")
        try:
            size = os.fstat(self._file.fileno()).st_size
            self._map_rows(max(size // self.row_bytes, min_rows, _MIN_MAP_BYTES // self.row_bytes, 1))
        except BaseException:
            self._file.close()
            raise

    def _map_rows(self, capacity: int) -> None:
        nbytes = capacity * self.row_bytes
        with self.lock:
            size = os.fstat(self._file.fileno()).st_size
            if size < nbytes:
                # Allocated, not a sparse extension: a store through the map
                # to a page the file system cannot back kills the process
                # (SIGBUS), where this raises while nothing is written yet.
                try:
                    os.posix_fallocate(self._file.fileno(), size, nbytes - size)
                except OSError as e:
                    raise OSError(e.errno, f"dynamicemb FileStore: table {self.table!r}: its rows file {self.path} "
                                           f"cannot grow to {nbytes} bytes ({capacity} rows): {e.strerror}; free "
                                           f"space on its file system or give the store another root") from None
            self._mmap = mmap.mmap(self._file.fileno(), nbytes)
            self.capacity = capacity
            # The old mapping goes with the last tensor over it (rows handed out are copies).
            self.rows = torch.frombuffer(self._mmap, dtype=torch.uint8).view(self.dtype).view(capacity, self.width)
            self.address = self.rows.data_ptr()
            self.generation += 1
            self._faulted = 0

    def write(self, start: int, rows) -> None:
        """Rows (a tensor, or RowsAt: gathered straight into the map) at start on."""
        end = start + len(rows)
        if end > self.capacity:
            self._map_rows(max(2 * self.capacity, end))
        write_rows(self.rows[start:end], rows)
        self._fault_ahead(end * self.row_bytes)

    def write_at(self, positions: torch.Tensor, rows) -> None:
        """Rows (a tensor or RowsAt) at distinct positions within the map."""
        write_rows_at(self.rows, positions, rows)

    def _fault_ahead(self, written: int) -> None:
        """Requests the pages past `written` bytes faulted in, in steps of
        prefault.AHEAD, before the appends reach them."""
        p = prefault.prefaulter()
        if not p.enabled or self._faulted >= written + prefault.AHEAD // 2:
            return
        begin = max(self._faulted, written) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(begin + prefault.AHEAD, self.capacity * self.row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > begin:
            p.submit(self, self.generation, begin, end)
            self._faulted = end

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rows.index_select(0, positions)

    def sync(self) -> None:
        self._mmap.flush()  # msync: the rows written through the map
        os.fsync(self._file.fileno())  # and the file's size

    def close(self) -> None:
        with self.lock:
            self.generation += 1  # the prefaulter's pending requests are void
        self.rows = None
        try:
            self._mmap.close()
        except BufferError:  # a view still held somewhere: unmapped when it goes
            pass
        self._file.close()


class _TableFile:
    def __init__(self, root: str, name: str, width: int, dtype: torch.dtype, max_rows: int, bucket_capacity: int):
        self.root, self.name, self.width, self.dtype = root, name, width, dtype
        self.row_bytes = width * dtype.itemsize
        self.index = KeyIndex(name, max_rows, bucket_capacity)
        self.seq, self.generation, self.rows = -1, 0, 0  # committed snapshot (-1: none), current generation
        self.state: Optional[dict] = None  # to be written by the next flush
        self.committed_state: Optional[dict] = None
        self._lock = open(self._path("rows.lock"), "a+b")
        try:
            try:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"table {name!r} of the file store at {root} is open in another FileStore "
                                   f"(this process or another); close that one first") from None
            entry = read_manifest(root).get(name)
            if entry is not None:
                self._load(int(entry["index"]))
            self.garbage = self.rows - len(self.index)
            # Reopened, the rows the snapshot does not address stay garbage
            # (not reused) until a compaction.
            self._forget_free(self.rows)
            self._remove_stale()
            self.file = _RowsFile(self._rows_path(self.generation), width, dtype, self.rows, fresh=False, table=name)
        except BaseException:
            self._lock.close()
            raise

    # ---- files ---------------------------------------------------------------------------------

    def _path(self, suffix: str) -> str:
        return os.path.join(self.root, f"{self.name}.{suffix}")

    def _rows_path(self, generation: int) -> str:
        return self._path(f"rows.{generation}")

    def _index_path(self, seq: int) -> str:
        return self._path(f"index.{seq}.safetensors")

    def _load(self, seq: int) -> None:
        path = self._index_path(seq)
        where = f"table {self.name!r}: the file store's index {path}"
        if not os.path.exists(path):
            raise ValueError(f"{where}, named by {os.path.join(self.root, MANIFEST)}, is missing")
        try:
            with safe_open(path, framework="pt") as f:
                meta = json.loads((f.metadata() or {})["dynamicemb"])
                tensors = {k: f.get_tensor(k) for k in ("keys", "positions", "scores")}
        except Exception as e:  # noqa: BLE001 - safetensors' errors vary; all mean a damaged file
            raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e}): it is damaged") from None
        if meta.get("crc32") != _crc(tensors):
            raise ValueError(f"{where} fails its checksum: it is damaged")
        if meta["width"] != self.width or meta["dtype"] != str(self.dtype):
            raise ValueError(f"table {self.name!r}: the file store at {self.root} holds its rows with width "
                             f"{meta['width']} ({meta['dtype']}), the table's rows are {self.width} wide "
                             f"({self.dtype}) (dim + optimizer state); open it with the same dim, dtype and "
                             f"optimizer, or use another storage_path")
        gen, rows = int(meta["generation"]), int(meta["rows"])
        rows_path = self._rows_path(gen)
        size = os.path.getsize(rows_path) if os.path.exists(rows_path) else -1
        if size < rows * self.row_bytes:
            raise ValueError(f"table {self.name!r}: the file store's rows file {rows_path} is "
                             f"{'missing' if size < 0 else f'{size} bytes'}; its index {path} needs {rows} rows "
                             f"of {self.row_bytes} bytes")
        pos = tensors["positions"]
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= rows):
            raise ValueError(f"{where} addresses rows outside [0, {rows}): it is damaged")
        lost = self.index.add(tensors["keys"], pos, tensors["scores"])[0].numel()
        if lost:
            raise ValueError(f"table {self.name!r}: the file store at {self.root} holds {pos.numel()} keys, "
                             f"more than the table may hold (at most {self.index.max_slots[0]})")
        self.seq, self.generation, self.rows = seq, gen, rows
        self.committed_state = meta.get("state")

    def _remove_stale(self, listing: Optional[List[str]] = None) -> None:
        """Removes the table's snapshots and generations that are not current
        (superseded, or left by a crash before their commit); `listing`: the
        directory's files, when known."""
        pattern = re.compile(re.escape(self.name) + r"\.(rows|index)\.(\d+)(\.safetensors)?")
        for f in os.listdir(self.root) if listing is None else listing:
            m = pattern.fullmatch(f)
            if m is None or (m.group(1) == "rows") == bool(m.group(3)):
                continue
            keep = self.generation if m.group(1) == "rows" else self.seq
            if int(m.group(2)) != keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.root, f))

    # ---- rows ----------------------------------------------------------------------------------

    def write(self, rows) -> torch.Tensor:
        """Stores rows (a tensor or RowsAt); returns their positions: once
        more than half the file is garbage, free ones (that the committed
        snapshot does not address) first, overwritten in place, then
        appended ones."""
        reuse = self.free.pop(len(rows) if self.garbage > _GARBAGE_SHARE * self.rows else 0)
        k = reuse.numel()
        if k:
            self.file.write_at(reuse, rows[:k])
            self.garbage -= k
        if k == len(rows):
            return reuse
        start = self.rows
        self.file.write(start, rows[k:])
        self.rows += len(rows) - k
        return torch.cat([reuse, torch.arange(start, self.rows, dtype=torch.int64)])

    def drop(self, positions: torch.Tensor) -> None:
        """Rows no key addresses any more: garbage, free for reuse unless the
        committed snapshot addresses them (positions below committed_rows:
        free once the next flush commits)."""
        self.garbage += positions.numel()
        if self.committed_rows:
            late = positions >= self.committed_rows
            self.freed_since_commit.push(positions[~late])
            positions = positions[late]
        self.free.push(positions)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows at positions ([n, width] of the table's dtype)."""
        return self.file.gather(positions)

    # ---- flush ---------------------------------------------------------------------------------

    def write_snapshot(self) -> int:
        """Compacts when due, makes the rows durable and writes the index
        snapshot (not yet committed); returns its number."""
        if self.garbage > _GARBAGE_SHARE * max(1, self.rows):
            self._compact()
        self.file.sync()
        batches = list(self.index.items(1 << 20))
        tensors = {name: torch.cat([b[i] for b in batches]) if batches else torch.zeros(0, dtype=torch.int64)
                   for i, name in enumerate(("keys", "positions", "scores"))}
        state = self.state if self.state is not None else self.committed_state
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "table": self.name, "generation": self.generation,
                "rows": self.rows, "width": self.width, "dtype": str(self.dtype), "crc32": _crc(tensors),
                "state": state}
        seq = self.seq + 1
        path = self._index_path(seq)
        save_file(tensors, path, metadata={"dynamicemb": json.dumps(meta)})
        fsync_file(path)
        self._pending = (seq, state)
        return seq

    def committed(self, listing: List[str]) -> None:
        """The snapshot written last is committed: the ones before go, and
        the rows it does not address are free to overwrite."""
        self.seq, self.committed_state = self._pending
        self.state = None
        self.committed_rows = self.rows
        self.free.push(self.freed_since_commit.pop(self.freed_since_commit.count))
        self._remove_stale(listing)

    def _compact(self) -> None:
        """The live rows into a new generation's file, in the order of their
        old positions (the old file goes once a snapshot naming the new one
        is committed)."""
        slots, old = self.index.live_slots()
        n, gen = old.numel(), self.generation + 1
        path = self._rows_path(gen)
        new = _RowsFile(path, self.width, self.dtype, n, fresh=True, table=self.name)
        try:
            step = max(1, _COPY_BYTES // self.row_bytes)
            for i in range(0, n, step):
                new.write(i, self.file.gather(old[i:i + step]))
        except BaseException:
            new.close()
            os.remove(path)
            raise
        self.file.close()
        self.file, self.generation, self.rows, self.garbage = new, gen, n, 0
        self._forget_free(0)  # no committed snapshot addresses the new generation yet
        self.index.move(slots, torch.arange(n, dtype=torch.int64))

    def _forget_free(self, committed_rows: int) -> None:
        """No free positions (the garbage stays until a compaction), and the
        rows the committed snapshot may address."""
        self.free, self.freed_since_commit, self.committed_rows = FreeList(), FreeList(), committed_rows

    def clear(self) -> None:
        self.index.clear()
        self.garbage = self.rows  # every row written so far
        self._forget_free(self.committed_rows)

    def close(self) -> None:
        self.file.close()
        self._lock.close()  # releases the flock


class FileStore(IndexedStore):
    """Rows on local disk under `root` (a directory, created when missing);
    a store reopened on the same directory (in this process or another)
    holds what the last flush() committed (see the module's doc)."""

    puts_rows_at = True  # gathered straight into the file's map

    def __init__(self, root: str, bucket_capacity: int = DEFAULT_BUCKET):
        super().__init__(bucket_capacity)
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._tables: Dict[str, _TableFile] = {}
        with self._manifest_lock():  # no commit is under way: a crashed one's temporary file goes
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.root, MANIFEST + ".tmp"))

    @contextlib.contextmanager
    def _manifest_lock(self) -> Iterator[None]:
        """Orders the commits of the stores sharing the directory (their tables differ)."""
        with open(os.path.join(self.root, _MANIFEST_LOCK), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield

    def open_table(self, name, width, dtype, max_rows):
        if not name or os.sep in name or name.startswith("."):
            raise ValueError(f"table name {name!r} cannot name a file")
        if name in self._tables:
            raise ValueError(f"table {name!r} is already open in the file store at {self.root}")
        t = _TableFile(self.root, name, width, dtype, max_rows, self.bucket_capacity)
        # Its keys (loaded into an index of its own, checked) join the store's
        # index, where the table has the same room (none is evicted).
        try:
            tid = self._index_table(name, max_rows)
            for keys, pos, scores in t.index.items(1 << 20):
                lost = self._index.add(keys, pos, scores, torch.full_like(keys, tid)).keys.numel()
                if lost:  # cannot happen: the same hash and room place every key as in its own index
                    raise RuntimeError(f"table {name!r}: {lost} keys of the file store at {self.root} found no "
                                       f"slot in the store's index")
        except BaseException:
            t.close()
            raise
        t.index = TableView(self._index, tid)
        self._tables[name] = t

    def _where(self) -> str:
        return f"the file store at {self.root}"

    def _file(self, name) -> "_TableFile":
        self._table(name)
        return self._tables[name]

    def _gather(self, name, positions, device=CPU):
        return self._tables[name].gather(positions).to(device)  # rows_device(): the CPU

    def _write(self, name, rows):
        return self._tables[name].write(rows)

    def _drop(self, name, positions):
        self._tables[name].drop(positions)

    def clear(self, name):
        self._file(name).clear()

    def save_state(self, name, state):
        try:
            self._file(name).state = json.loads(json.dumps(state))
        except (TypeError, ValueError) as e:
            raise ValueError(f"table {name!r}: the state to save in the file store is not JSON: {e}") from None

    def load_state(self, name):
        return self._file(name).committed_state

    def flush(self):
        """Commits every table's rows and index (all tables at once, see the module's doc)."""
        tables = list(self._tables.values())
        seqs = {t.name: t.write_snapshot() for t in tables}
        fsync_dir(self.root)  # the new files' entries before the manifest names them
        self._commit(seqs)
        listing = os.listdir(self.root)
        for t in tables:
            t.committed(listing)

    def _commit(self, seqs: Dict[str, int]) -> None:
        """Names the new snapshots in the manifest (other stores' tables in
        the directory keep theirs; the lock orders concurrent commits)."""
        path = os.path.join(self.root, MANIFEST)
        with self._manifest_lock():
            tables = read_manifest(self.root)
            tables.update({name: {"index": seq} for name, seq in seqs.items()})
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "version": FORMAT_VERSION, "tables": tables}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(self.root)

    def close(self) -> None:
        """Releases the files; what was put since the last flush is not kept."""
        for t in self._tables.values():
            t.close()
        self._tables = {}
        self._index, self._tid = None, {}
