"""Dynamic tables in a sharded collection's state_dict(), for
torch.distributed.checkpoint (DCP) and load_state_dict() (API.md §5; the
reasoning behind this layout is written there).

DCP loads a tensor only into a destination of the saved size, and a fresh
model cannot know how many rows each rank saved; an entry that is not a
tensor is saved as bytes and loads whatever its size. A bytes entry has one
writer, so each rank writes entries of its own, and the names of the entries
must not depend on the world size: a load on another world size would
otherwise ask for entries the save never wrote (an error) or leave some
unread (lost rows). So each dynamic table has SLOTS entries
`<collection>.<table>.dynamicemb.slot<s>`, each rank holding those with
s % world == rank: at a save, slot s holds an even share of the rows of
rank s % W; at a load, rank s % W' reads slot s and sends each row (with its
optimizer state, score and admission count) to the rank that owns its key
(dynamicemb.routing.owners, as DynamicEmbLoad).

An entry exports its rows only when DCP serializes it (state_dict() itself
copies nothing). torch.save and pickle refuse it: a rank's state_dict holds
only its own slots.
"""
import os
import warnings
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dynamicemb import rules
from dynamicemb.admission import CounterNotCheckpointable
from dynamicemb.checkpoint.clock import latest_of_one_clock, restore_base, saved_reading
from dynamicemb.checkpoint.dump import counter_parts, shard_parts
from dynamicemb.checkpoint.format import CheckpointError
from dynamicemb.checkpoint.load import build_counter, check_distinct, check_table, note_clock_restore, restore_rows
from dynamicemb.checkpoint.native_rows import WEIGHT, check_cover, weight_rows
from dynamicemb.checkpoint.rank_errors import raise_any, status
from dynamicemb.checkpoint.tables import model_tables
from dynamicemb.routing import owners
from dynamicemb.stats import collective_device
from dynamicemb.storage_protocol import RowBlocks, missing_checkpoint_methods

__all__ = ["TableSlot", "state_dict_slots"]

SLOTS_ENV = "DYNAMICEMB_STATE_DICT_SLOTS"
DEFAULT_SLOTS = 128
FORMAT, VERSION = "dynamicemb.state_dict", 1
KEY = "dynamicemb"  # <collection>.<table>.dynamicemb.slot<s>
CHUNK_ROWS = 1 << 18
_DUMP = "DynamicEmbDump / DynamicEmbLoad (dynamicemb.checkpoint)"


def state_dict_slots() -> int:
    """Entries per dynamic table (DYNAMICEMB_STATE_DICT_SLOTS, default 128):
    the most ranks a state dict can be saved from or loaded on; a save and
    its load must use the same number."""
    raw = os.environ.get(SLOTS_ENV, str(DEFAULT_SLOTS))
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"{SLOTS_ENV}={raw!r}: expected a positive integer")
    return int(raw)


def slot_name(s: int) -> str:
    """Slot s's last name component (its key ends `<table>.{KEY}.slot<s>`)."""
    return f"slot{s}"


def slot_number(name: str) -> Optional[int]:
    """s of a slot's last name component `slot<s>`; None for another name."""
    return int(name[4:]) if name.startswith("slot") and name[4:].isdigit() else None


def slot_key(head: str, name: str, s: int) -> str:
    return f"{head}{name}.{KEY}.{slot_name(s)}"


class _EntryPath:
    """The attribute path of a table's entries: torch's distributed state
    dict (get_model_state_dict / set_model_state_dict) resolves each
    state-dict key by getattr along its dotted name, so `<table module>.{KEY}`
    answers every `slot<s>` (the entries themselves live in state_dict())."""

    def __getattr__(self, name: str):
        if slot_number(name) is not None:
            return None
        raise AttributeError(name)


def add_entry_paths(table_modules) -> None:
    """Gives each dynamic table's module in a sharded collection (its
    `embedding_bags` / `embeddings` entry) the path of its entries."""
    for m in table_modules:
        setattr(m, KEY, _EntryPath())


def _share(parts: List[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the concatenation of `parts`, as a tensor of their
    own (a view would serialize its whole storage)."""
    pieces, at = [], 0
    for p in parts:
        a, b = max(lo - at, 0), min(hi - at, p.shape[0])
        if a < b:
            pieces.append(p if (a, b) == (0, p.shape[0]) and p._base is None else p[a:b])
        at += p.shape[0]
    if len(pieces) == 1 and pieces[0]._base is None:
        return pieces[0]
    return torch.cat(pieces) if pieces else parts[0][:0].clone()


class _Export:
    """One table's rows on this rank, exported when DCP serializes the first
    of the rank's slots of it, and split evenly over those slots. Each share
    is handed out once; a slot asked again (a second save of the same state
    dict) gets a new export."""

    def __init__(self, ref, name: str, rank: int, world: int, slots: int):
        self.ref, self.name, self.rank, self.world, self.slots = ref, name, rank, world, slots
        self.mine = list(range(rank, slots, world))
        self.cols: Dict[str, Optional[List[torch.Tensor]]] = {}
        self.left: set = set()

    def take(self, s: int) -> "OrderedDict":
        if s not in self.left:
            self._export()
        self.left.discard(s)
        j, m = self.mine.index(s), len(self.mine)
        out = OrderedDict(format=FORMAT, version=VERSION, table=self.name, slot=s, slots=self.slots,
                          world_size=self.world, rank=self.rank, meta=self.meta)
        for col, parts in self.cols.items():
            n = sum(p.shape[0] for p in parts) if parts else 0
            out[col] = _share(parts, j * n // m, (j + 1) * n // m) if parts else None
        if not self.left:
            self.cols = {}  # every slot has its rows: the export goes
        return out

    def _export(self) -> None:
        ref = self.ref
        self.meta = dict(ref.meta(), has_optimizer_state=True)
        # The clock its ages count from (clock.py); none without clock scores.
        when = saved_reading(ref.storage, ref.index)
        if when is not None:
            self.meta["clock_reading"] = when
        dim, width = self.meta["dim"], self.meta["optimizer_state_width"]
        dtype = getattr(torch, self.meta["dtype"])
        i64 = torch.zeros(0, dtype=torch.int64)
        cols: Dict[str, Optional[List[torch.Tensor]]] = {
            "keys": [i64], "values": [torch.zeros(0, dim, dtype=dtype)],
            "optimizer_state": [torch.zeros(0, width, dtype=dtype)], "scores": [i64], "timestamps": None,
            "counter_keys": None, "counter_counts": None}
        for part in shard_parts(self.name, ref, True, CHUNK_ROWS, when["clock"] if when else None):
            n = part["keys"].numel()
            for col, v in part.items():
                if v is None and col == "optimizer_state":
                    v = torch.zeros(n, width, dtype=dtype)
                if v is not None:  # export_rows' rows are copies (RowBlocks: read now), on the CPU for DCP
                    v = (v.materialize() if isinstance(v, RowBlocks) else v).cpu()
                    cols[col] = (cols[col] or []) + [v if v._base is None else v.clone()]
        if ref.storage.admission_counter(ref.index) is not None:
            cols["counter_keys"], cols["counter_counts"] = [i64], [i64]
            for part in counter_parts(ref, CHUNK_ROWS):
                cols["counter_keys"].append(part["keys"].cpu().clone())
                cols["counter_counts"].append(part["counts"].cpu().clone())
        self.cols, self.left = cols, set(self.mine)


class TableSlot:
    """A dynamic table's entry in state_dict() (one slot, see the module's
    doc). DCP saves it as bytes, exporting its rows then; load_state_dict()
    takes it, or what DCP loaded in its place (a dict)."""

    __slots__ = ("table", "slot", "_source", "_data", "_names", "_refusal", "_dcp")

    def __init__(self, table: str, slot: int, source: Optional[_Export] = None, data=None, names=(),
                 refusal: Optional[str] = None):
        self.table, self.slot, self._source, self._data = table, slot, source, data
        self._names, self._refusal, self._dcp = list(names), refusal, False

    def data(self) -> "OrderedDict":
        if self._refusal:
            raise self._refused()
        return self._data if self._data is not None else self._source.take(self.slot)

    def _refused(self) -> Exception:
        return CounterNotCheckpointable(self._refusal) if "admission counter" in self._refusal else \
            TypeError(self._refusal)

    # DCP's save planner asks each entry for its write items: a bytes item,
    # whose data it then serializes with torch.save.
    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        if self._refusal:
            raise self._refused()
        self._dcp = True
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]

    def __reduce_ex__(self, protocol):
        if not self._dcp and self._data is not None:
            # A snapshot (copy.deepcopy: what dcp.async_save stages) travels as one, so that DCP's
            # checkpoint process, which receives it pickled, still writes it as this slot's bytes.
            return TableSlot, (self.table, self.slot, None, self._data, self._names)
        if not self._dcp:
            raise TypeError(
                f"dynamicemb: the dynamic tables {self._names} cannot be saved with torch.save or pickle: each "
                f"rank's state_dict() holds only its share of their rows (entries '<table>.{KEY}.slot<s>'), and "
                f"a load must gather every rank's. Save the state dict with torch.distributed.checkpoint "
                f"(dcp.save(model.state_dict(), ...) on every rank), or the tables with {_DUMP}")
        self._dcp = False  # DCP's write of this item only: a later torch.save of the same dict is refused too
        return self.data().__reduce_ex__(protocol)  # a plain OrderedDict: loads with weights_only=True

    def __deepcopy__(self, memo) -> "TableSlot":
        """A snapshot of the slot's rows now (for an in-memory copy of a state dict)."""
        return TableSlot(self.table, self.slot, data=self.data(), names=self._names)

    def __repr__(self) -> str:
        return f"TableSlot(table={self.table!r}, slot={self.slot}{', exported' if self._data is not None else ''})"


def _env(module):
    env = module._env
    pg = env.process_group
    world = env.world_size
    return pg, (env.rank if world > 1 else 0), world


def _counter_checkpointable(ref) -> bool:
    adm = ref.storage.admission_counter(ref.index)
    return adm is None or adm.counter.checkpointable()


def add_tables(module, destination: dict, prefix: str, collection: str) -> None:
    """The post-hook of our sharded collections' state_dict(): this rank's
    slots of each dynamic table, unexported."""
    tables = model_tables(module, check=False)
    if not tables:
        return
    _, rank, world = _env(module)
    slots = state_dict_slots()
    names = sorted(tables)
    head = f"{prefix}{collection}."
    for name in names:
        ref = tables[name]
        refusal = None
        missing = missing_checkpoint_methods(ref.storage)
        if missing:
            refusal = (f"dynamicemb: the storage of dynamic table {name!r} ({type(ref.storage).__name__}) does not "
                       f"implement the checkpoint protocol ({', '.join(missing)} missing; "
                       f"dynamicemb.storage_protocol): state_dict() cannot carry its rows, nor can {_DUMP}")
            warnings.warn(refusal, RuntimeWarning, stacklevel=4)
        elif not _counter_checkpointable(ref):
            refusal = (f"dynamicemb: table {name!r}: its admission counter "
                       f"({type(ref.storage.admission_counter(ref.index).counter).__name__}) implements no export() / "
                       f"load() (dynamicemb.Counter): state_dict() cannot carry its counts")
            warnings.warn(refusal, RuntimeWarning, stacklevel=4)
        elif world > slots:
            refusal = (f"dynamicemb: {world} ranks, more than the {slots} state-dict slots of each dynamic table "
                       f"({names}); set {SLOTS_ENV} to at least {world} for both the save and the load, or use "
                       f"{_DUMP}")
        source = _Export(ref, name, rank, world, slots)
        for s in (range(rank, slots, world) if rank < slots else [rank]):
            destination[slot_key(head, name, s)] = TableSlot(name, s, source, names=names, refusal=refusal)


# ---- load_state_dict -------------------------------------------------------------------------

_COLS = ("keys", "values", "optimizer_state", "scores", "timestamps")


def _agree(error, info, pg, world: int, after: str) -> list:
    """Every rank's (status, info); raises on every rank if one failed."""
    mine = (status(error), info)
    out = [mine]
    if world > 1:
        out = [None] * world
        dist.all_gather_object(out, mine, group=pg)
    raise_any([s for s, _ in out], error, lambda r, m: CheckpointError(f"{m} (found by rank {r}{after})"))
    return [i for _, i in out]


def _template(ref) -> dict:
    """Empty columns of one table as the model holds it (dtypes, widths)."""
    dim = ref.options.dim
    width = ref.storage.weights()[ref.index].shape[1] - dim
    dt, i64 = ref.module.embedding_dtype, torch.zeros(0, dtype=torch.int64)
    out = {"keys": i64, "values": torch.zeros(0, dim, dtype=dt), "optimizer_state": torch.zeros(0, width, dtype=dt),
           "scores": i64}
    if rules.keeps_timestamps(ref.storage.strategy(ref.index)):
        out["timestamps"] = i64
    if ref.storage.admission_counter(ref.index) is not None:
        out.update(counter_keys=i64, counter_counts=i64)
    return out


def _rows_of(name: str, ref, entries: Dict[str, object], slots: int) -> dict:
    """Checks this rank's slots of one table against the model; returns
    their slot numbers, meta and rows: per column, a list of tensors (the
    model's empty template, then each slot's, as DCP loaded them)."""
    where = f"table {name!r} in the state dict"
    cols = {c: [t] for c, t in _template(ref).items()}
    got, meta, given, readings = [], None, [], [None]  # readings: each piece's clock (the template's none)
    for key, value in entries.items():
        data = value.data() if isinstance(value, TableSlot) else value
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{where}: entry {key!r} is a {type(data).__name__}, not a dynamicemb slot")
        if data["version"] != VERSION or data["slots"] != slots or key != slot_name(data["slot"]):
            raise CheckpointError(f"{where}: entry {key!r} holds slot {data['slot']} of {data['slots']} (format "
                                  f"version {data['version']}); this model reads {slots} slots ({SLOTS_ENV}) of "
                                  f"format version {VERSION}")
        given.append(data)
    # In slot order, which is the save's export order on each rank (a cached
    # table's load relies on it: its store's rows come first, see load_rows).
    for data in sorted(given, key=lambda d: d["slot"]):
        check_table(where, ref, data["meta"], True, skip="DCP loads the optimizer state with the rows: give the model "
                                                         "the checkpoint's optimizer, or DynamicEmbLoad(optim=False) "
                                                         "a DynamicEmbDump of the tables")
        if data.get("counter_keys") is not None and "counter_keys" not in cols:
            raise CheckpointError(f"{where}: it holds admission counts, but the model's table has no admission "
                                  f"counter (admit_strategy / admission_counter)")
        n = data["keys"].numel()
        for c in cols:
            v = data.get(c)
            if v is None:  # none saved: fresh optimizer state, access times now, no counts
                v = torch.zeros((0,) if c.startswith("counter") else (n,) + tuple(cols[c][0].shape[1:]),
                                dtype=cols[c][0].dtype)
            cols[c].append(v)
        got.append(data["slot"])
        meta = data["meta"]
        readings.append(meta.get("clock_reading"))
    return {"slots": sorted(got), "meta": meta, "cols": cols, "readings": readings}


def _exchange(cols: List[List[torch.Tensor]], dests: List[torch.Tensor], pg, rank: int, world: int
              ) -> List[List[torch.Tensor]]:
    """Sends row i of every column (a list of pieces, dests: each piece's
    ranks) to its rank; returns, per column, pieces of the rows this rank
    gets. A collective. When every row stays (a load on the world size of
    the save) nothing is copied; else the rows that move go in one
    all_to_all, as bytes."""
    if all(bool((d == rank).all()) for d in dests):
        kept, moving, dest = cols, [c[0][:0] for c in cols], dests[0][:0]
    else:
        flat, dest = [torch.cat(c) for c in cols], torch.cat(dests)
        stay = dest == rank
        kept, moving, dest = [[f[stay]] for f in flat], [f[~stay] for f in flat], dest[~stay]
    order = torch.argsort(dest, stable=True)
    parts = [(c[order] if c.dim() > 1 else c[order].unsqueeze(1)).contiguous().view(torch.uint8) for c in moving]
    device = collective_device(pg)
    send = torch.bincount(dest, minlength=world).to(device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    buf = torch.cat(parts, 1).to(device)
    out = torch.empty(int(recv.sum()), buf.shape[1], dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, buf, recv.tolist(), send.tolist(), group=pg)
    out, res, at = out.cpu(), [], 0
    for c, p, k in zip(moving, parts, kept):
        w = p.shape[1]
        shape = (out.shape[0],) + tuple(c.shape[1:])
        if w == 0:  # (SGD's optimizer state)
            got = torch.zeros(shape, dtype=c.dtype)
        else:
            got = out[:, at:at + w].clone(memory_format=torch.contiguous_format).view(c.dtype).reshape(shape)
        res.append(k + [got])
        at += w
    return res


def _route(ref, cols: dict, pg, rank: int, world: int) -> dict:
    """The rows and admission counts of one table that this rank owns
    (columns as lists of pieces, as _rows_of gives them)."""
    if world == 1:
        return cols
    dist_type, num_embeddings = ref.options.dist_type, ref.options.num_embeddings
    out = {}
    for key, names in (("keys", [c for c in _COLS if c in cols]), ("counter_keys", ["counter_keys", "counter_counts"])):
        if key in cols:  # the same on every rank: the model's table decides
            dests = [owners(k, dist_type, world, num_embeddings) for k in cols[key]]
            out.update(zip(names, _exchange([cols[c] for c in names], dests, pg, rank, world)))
    return out


def _rebase_ages(ref, found: dict, latest: dict) -> None:
    """Each slot's clock ages (against its saving rank's clock) made ages
    against `latest`, the latest saving clock (one clock: clock.py)."""
    strategy = ref.storage.strategy(ref.index)
    cols = [c for c, on in (("scores", rules.score_is_clock(strategy)),
                            ("timestamps", rules.keeps_timestamps(strategy))) if on and c in found["cols"]]
    for c in cols:
        found["cols"][c] = [v if r is None else v + (latest["clock"] - r["clock"])
                            for v, r in zip(found["cols"][c], found["readings"])]


def _few(slots: List[int]) -> str:
    return f"{slots[:8]}{'...' * (len(slots) > 8)}"


def load_tables(module, state_dict: dict, prefix: str, collection: str, missing_keys: list) -> None:
    """The pre-hook of our sharded collections' load_state_dict(): takes the
    dynamic tables' slots out of `state_dict` and loads them, each row on
    the rank that owns its key, replacing what the tables held. A collective:
    every rank of the collection's process group calls it. A failed check on
    any rank raises on all of them with the model unchanged; a table whose
    slots are all absent is reported missing (and left as it is). A rank
    given every slot of a table (a whole state dict, as dcp_to_torch_save
    writes one) reads its share of them, s % world == rank. A native
    table's `weight` given for a dynamic table loads instead of slots
    (dynamicemb.checkpoint.native_rows: key i gets row i)."""
    tables = model_tables(module, check=False)
    if not tables:
        return
    pg, rank, world = _env(module)
    slots = state_dict_slots()
    head = f"{prefix}{collection}."
    given: Dict[str, dict] = {n: {} for n in tables}
    for key in [k for k in state_dict if k.startswith(head)]:
        name, sep, rest = key[len(head):].rpartition(f".{KEY}.")
        if sep and name in given:
            value = state_dict.pop(key)
            if value is not None:  # DCP's partial load (allow_partial_load) leaves what it did not find as None
                given[name][rest] = value
    names = sorted(tables)
    weights = {n: state_dict.pop(f"{head}{n}.{WEIGHT}") for n in names if f"{head}{n}.{WEIGHT}" in state_dict}
    every = {slot_name(s) for s in range(slots)}
    for name in names:
        if world > 1 and given[name].keys() == every:
            # A whole state dict on this rank (every rank's slots: dcp_to_torch_save's file, say): its share.
            given[name] = {k: v for k, v in given[name].items() if slot_number(k) % world == rank}
    # 1. This rank's slots against the model; every rank learns which slots were given.
    found, error = {}, None
    try:
        for name in names:
            if given[name] and name in weights:
                raise CheckpointError(f"table {name!r} in the state dict: both its dynamic slots and a native "
                                      f"weight; give one of them")
            if given[name]:
                found[name] = _rows_of(name, tables[name], given[name], slots)
            elif name in weights:
                found[name] = weight_rows(name, tables[name], weights[name], _template(tables[name]), rank, world)
    except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
        error = e
    info = {n: (f["slots"], f["meta"]["step"], f["meta"]["optimizer_step"], f["meta"]["custom_score"],
                f.get("readings", [None, None])[1:]) for n, f in found.items()}
    infos = _agree(error, info, pg, world, "; the model is unchanged")
    todo, saved = [], {}
    for name in names:
        covers = [i[name][0] for i in infos if name in i]
        if any(isinstance(c, dict) for c in covers):  # a native weight (on some rank)
            try:
                if not all(isinstance(c, dict) for c in covers):
                    raise CheckpointError(f"table {name!r} in the state dict: dynamic slots on some ranks and a "
                                          f"native weight on others")
                check_cover(name, covers, world)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; the model is unchanged") from None
            todo.append(name)
            saved[name] = [i[name][1:] for i in infos if name in i]
            continue
        held = sorted(s for c in covers for s in c)
        if not held:
            missing_keys.append(f"{head}{name}.{KEY}")
            continue
        if held != list(range(slots)):
            absent = sorted(set(range(slots)) - set(held))
            twice = sorted({s for s in held if held.count(s) > 1})
            wrong = ([f"slots {_few(absent)} of {slots} are absent"] if absent else []) + \
                ([f"slots {_few(twice)} of {slots} are on more than one rank"] if twice else [])
            raise CheckpointError(f"table {name!r} in the state dict: {' and '.join(wrong)}; a state dict of "
                                  f"dynamic tables must come whole from model.state_dict() on every rank (dcp.save / "
                                  f"dcp.load), or whole on each rank; the model is unchanged")
        todo.append(name)
        saved[name] = [i[name][1:] for i in infos if name in i]
    # Clock ages made relative to the latest saving clock, before the rows move (clock.py).
    latest = {n: latest_of_one_clock([r for i in infos if n in i for r in i[n][4]]) for n in todo}
    for n in todo:
        if latest[n] is not None and n in found:
            _rebase_ages(tables[n], found[n], latest[n])
    # 2. Each row to its owner, then every check that needs no change to the model.
    routed = {n: _route(tables[n], found[n]["cols"] if n in found else
                        {c: [t] for c, t in _template(tables[n]).items()}, pg, rank, world) for n in todo}
    counters, error = {}, None
    try:
        for name in todo:
            ref, rows = tables[name], routed[name]
            cap, n = ref.storage.max_rows(ref.index), check_distinct(name, rows["keys"], "the state dict", rank, world)
            if cap is not None and n > cap:
                raise CheckpointError(f"table {name!r}: {n} keys of the state dict go to rank {rank} of {world}, "
                                      f"more than the table's maximum capacity there ({cap} rows)")
            adm = ref.storage.admission_counter(ref.index)
            if adm is not None:  # (its columns are there: _template)
                counters[name] = build_counter(name, adm, torch.cat(rows["counter_keys"]),
                                               torch.cat(rows["counter_counts"]), "the state dict", rank, world,
                                               "give the table a larger counter (KVCounter)")
    except Exception as e:  # noqa: BLE001
        error = e
    _agree(error, None, pg, world, "; the model is unchanged")
    # 3. Each table's content replaced by the state dict's.
    name = None
    try:
        steps: Dict[int, list] = {}
        for name in todo:
            ref, rows = tables[name], routed[name]
            strategy = ref.storage.strategy(ref.index)
            ref.storage.clear_table(ref.index)
            base, exact = restore_base(ref.storage, ref.index, latest[name])  # ages become readings of its clock
            for i, keys in enumerate(rows["keys"]):  # piece by piece (a slot's, or what came from others)
                for lo in range(0, keys.shape[0], CHUNK_ROWS):
                    restore_rows(ref, strategy, base, {c: rows[c][i][lo:lo + CHUNK_ROWS] for c in _COLS if c in rows},
                                 True)
            note_clock_restore(ref, exact, latest[name]["clock"] if latest[name] else None)
            if name in counters:
                ref.storage.admission_counter(ref.index).replace(counters[name])
            ref.storage.custom_scores[ref.index] = saved[name][0][2]
            steps.setdefault(id(ref.module), [ref.module, 0, 0])
            entry = steps[id(ref.module)]
            entry[1] = max([entry[1]] + [s[0] for s in saved[name]])
            entry[2] = max([entry[2]] + [s[1] for s in saved[name]])
        for m, step, optimizer_step in steps.values():
            m.step, m.optimizer_step = step, optimizer_step
    except Exception as e:  # noqa: BLE001 - what phase 2 cannot see (keys of one bucket that do not fit)
        error = CheckpointError(f"table {name!r}: loading its rows from the state dict on rank {rank} of {world} "
                                f"failed: {e}; this rank's tables are now partly loaded: load the model again "
                                f"(e.g. into one with more capacity)")
        error.__cause__ = e
    _agree(error, None, pg, world, " while loading: that rank's tables are partly loaded; load the model again")
