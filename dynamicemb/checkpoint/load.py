"""DynamicEmbLoad: loads a dump into a model of any world size. Each rank
keeps exactly the keys its routing assigns to it, and a loaded table holds
exactly the dump's keys afterwards (what it held before is removed).

A load runs in two phases, each closed by an all-gather of every rank's status,
so that a failure on one rank raises on every rank instead of leaving the
others waiting in a collective:

1. Checks, without changing the model: the manifest against the model, every
   file this rank reads against the manifest (size, checksum, tensor names,
   dtypes and shapes, row counts), and the keys (read alone, and routed) that
   each table receives on this rank against its maximum capacity; admission
   counters (counter=True) are built aside. One rank's failed check refuses
   the load on every rank, with the model unchanged.
2. The load: each table is cleared, then filled. A failure here (e.g. the keys
   of one bucket do not fit, which phase 1 cannot see) raises on every rank,
   naming the table and the file; the failing rank's tables are then partly
   loaded, and the model must be loaded again."""
import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from dynamicemb import rules
from dynamicemb.checkpoint.clock import latest_of_one_clock, restore_base
from dynamicemb.checkpoint.format import (CheckpointError, check_file, check_tensors, dtype_code, read_manifest,
                                          read_part, read_tensors)
from dynamicemb.checkpoint.rank_errors import raise_any, status
from dynamicemb.checkpoint.tables import check_group, model_tables, rank_world
from dynamicemb.routing import owners
from dynamicemb.storage_protocol import RowBatch
from dynamicemb.types import strategy_name


OPTIM_FALSE = "load with optim=False"  # DynamicEmbLoad's way past a refused optimizer state


def check_table(where: str, ref, meta: dict, optim: bool, skip: str = OPTIM_FALSE) -> None:
    """Refuses, naming the table (`where`), a checkpoint of it whose dim,
    dtype, dist_type, optimizer (with optim) or score strategy differ from
    the model's; `skip`: how the caller's user loads the values alone."""
    mine = ref.meta()
    for key in ("dim", "dtype", "dist_type"):
        if meta[key] != mine[key]:
            raise CheckpointError(f"{where}: {key} is {meta[key]!r}, the model's is {mine[key]!r}")
    if optim:
        if not meta["has_optimizer_state"]:
            raise CheckpointError(f"{where}: the dump has no optimizer state; {skip}")
        if not ref.options.training and meta["optimizer_state_width"] > 0:
            raise CheckpointError(f"{where}: the model's table keeps no optimizer state (training=False); {skip} "
                                  f"to load its values alone")
        if meta["optimizer"] != mine["optimizer"] or meta["optimizer_state_width"] != mine["optimizer_state_width"]:
            raise CheckpointError(f"{where}: optimizer {_optimizer_name(meta['optimizer'])} (state width "
                                  f"{meta['optimizer_state_width']}) does not match the model's "
                                  f"{_optimizer_name(mine['optimizer'])} (state width "
                                  f"{mine['optimizer_state_width']}); {skip} to load its values alone")
    if meta["score_strategy"] != mine["score_strategy"]:
        raise CheckpointError(f"{where}: score strategy {strategy_name(meta['score_strategy'])} does not match the "
                              f"model's {strategy_name(mine['score_strategy'])}")


def _optimizer_name(code: int) -> str:
    try:
        return rules.optimizer(code).name
    except KeyError:  # (a manifest of a newer version)
        return f"code {code}"


def restore_rows(ref, strategy: int, base: int, part: Dict[str, torch.Tensor], optim: bool) -> None:
    """Stores one part of a table's checkpoint (keys, values, scores, and
    optimizer_state, timestamps when present): clock scores and access
    times, saved as ages, become readings of the table's clock counted back
    from `base` (clock.py)."""
    scores = base - part["scores"] if rules.score_is_clock(strategy) else part["scores"]
    ts = base - part["timestamps"] if rules.keeps_timestamps(strategy) and part.get("timestamps") is not None \
        else None
    ref.storage.load_rows(ref.index, RowBatch(part["keys"], part["values"], part.get("optimizer_state")
                                              if optim else None, scores, ts))


def part_bases(ref, meta: dict):
    """(base of each file's ages (restore_rows), exact, the saving clock's
    latest reading) for one table of a dump, from the manifest's clock
    readings of its ranks (clock.py)."""
    files = meta["files"]
    if not rules.access_time_is_clock(ref.storage.strategy(ref.index)):
        return [0] * len(files), True, None  # (no clock ages)
    readings = meta.get("clock_readings")
    latest = latest_of_one_clock(readings) if readings else None
    base, exact = restore_base(ref.storage, ref.index, latest)
    if latest is None:
        return [base] * len(files), exact, None
    return [base - (latest["clock"] - readings[e["rank"]]["clock"]) for e in files], exact, latest["clock"]


def note_clock_restore(ref, exact: bool, saved_at: Optional[int]) -> None:
    """After a table's load: what incremental_dump checks its thresholds
    against (_warn_threshold_before_load): the table's clock at the load, and the
    saving clock's latest reading when the clock scores came back as saved."""
    if rules.access_time_is_clock(ref.storage.strategy(ref.index)):
        ref.module.clock_loads[ref.index] = {"loaded_at": ref.storage.now(ref.index),
                                             "saved_at": saved_at if exact else None}


def check_distinct(name: str, keys: List[torch.Tensor], source: str, rank: int, world: int) -> int:
    """The number of keys of table `name` that a load gives this rank;
    refuses a key given twice (a table holds each key once: a load would
    keep one of its rows and drop the other unsaid)."""
    k = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
    distinct, counts = torch.unique(k, return_counts=True)
    if distinct.numel() != k.numel():
        twice = distinct[counts > 1]
        raise CheckpointError(f"table {name!r}: {int((counts - 1).sum())} of the {k.numel()} keys of {source} that "
                              f"go to rank {rank} of {world} repeat keys given before (key {int(twice[0])}, "
                              f"{int(counts.max())} times); a checkpoint holds each key once, so it is damaged or "
                              f"merged from overlapping ones")
    return k.numel()


def build_counter(name: str, adm, keys: torch.Tensor, counts: torch.Tensor, source: str, rank: int, world: int,
                  fix: str):
    """The admission count table of `keys` (distinct) and `counts` that a
    load gives table `name` on this rank, built aside (AdmissionCounter.build);
    refuses counts that exceed the counter or do not fit its buckets."""
    adm.check_checkpointable()
    if adm.capacity() is not None and keys.numel() > adm.capacity():
        raise CheckpointError(f"table {name!r}: {keys.numel()} admission counts of {source} go to rank {rank} of "
                              f"{world}, more than the counter's capacity there ({adm.capacity()}); {fix}")
    table, dropped = adm.build(keys, counts)
    if dropped:
        raise CheckpointError(f"table {name!r}: {dropped} of the {keys.numel()} admission counts of {source} that go "
                              f"to rank {rank} of {world} do not fit the counter (capacity {adm.capacity()}: their "
                              f"buckets are full); {fix}")
    return table


def _check_rows(name: str, meta: dict, world_size: int, path: str) -> None:
    """The manifest's own consistency: its files' row counts add up to rows_per_rank."""
    where = f"table {name!r} in {os.path.join(path, 'manifest.json')}"
    per_rank = meta["rows_per_rank"]
    if len(per_rank) != world_size:
        raise CheckpointError(f"{where}: rows_per_rank has {len(per_rank)} entries for world size {world_size}")
    summed = [0] * world_size
    for e in meta["files"]:
        if not 0 <= e["rank"] < world_size:
            raise CheckpointError(f"{where}: file {e['file']} is of rank {e['rank']}, outside the world of "
                                  f"{world_size}")
        if e["kind"] == "part":
            summed[e["rank"]] += e["rows"]
    if summed != per_rank:
        raise CheckpointError(f"{where}: the part files hold {summed} rows per rank, rows_per_rank says {per_rank}")


def expected_tensors(meta: dict, entry: dict) -> Dict[str, tuple]:
    """{tensor: (safetensors dtype, shape)} that the manifest implies for one file."""
    n = entry["rows"]
    if entry["kind"] == "counter":
        return {"keys": ("I64", (n,)), "counts": ("I64", (n,))}
    vdt = dtype_code(meta["dtype"])
    out = {"keys": ("I64", (n,)), "values": (vdt, (n, meta["dim"])), "scores": ("I64", (n,))}
    if meta["has_optimizer_state"]:
        out["optimizer_state"] = (vdt, (n, meta["optimizer_state_width"]))
    if rules.keeps_timestamps(meta["score_strategy"]):
        out["timestamps"] = ("I64", (n,))
    return out


def _gather_status(error: Optional[Exception], world: int, pg, distributed: bool, after: str) -> None:
    """Every rank learns every rank's status; if one failed, every rank
    raises: the failing rank its own error, the others a CheckpointError
    naming that rank and its error."""
    msgs: List[Optional[str]] = [None] * world
    if distributed:
        dist.all_gather_object(msgs, status(error), group=pg)
    raise_any(msgs, error, lambda r, m: CheckpointError(f"{m} (found by rank {r}{after})"))


class _Plan:
    """What phase 1 found: per table the files this rank reads, whether its
    keys are exactly one dump rank's, and the admission counts built aside."""

    def __init__(self):
        self.manifest: dict = {}
        self.tables: dict = {}
        self.files: Dict[str, list] = {}
        self.same_layout: Dict[str, bool] = {}
        self.counters: Dict[str, object] = {}


def _mine(part: Dict[str, torch.Tensor], same: bool, meta: dict, world: int, rank: int, num_embeddings):
    """The entries of a file that routing gives to this rank."""
    if same or world == 1:
        return part
    keep = owners(part["keys"], meta["dist_type"], world, num_embeddings) == rank
    return {k: v[keep] for k, v in part.items()}


def _prepare(path, model, table_names, optim, counter, pg, rank, world) -> _Plan:
    """Phase 1: every check that needs no change to the model."""
    plan = _Plan()
    plan.tables = tables = model_tables(model, table_names, "DynamicEmbLoad")
    check_group(tables, pg, "DynamicEmbLoad")
    plan.manifest = manifest = read_manifest(path)
    # Every table is checked against the manifest before any file is read.
    for name, ref in tables.items():
        meta = manifest["tables"].get(name)
        if meta is None:
            raise CheckpointError(f"table {name!r}: {os.path.join(path, 'manifest.json')} has no table {name!r} "
                                  f"(it has {sorted(manifest['tables'])})")
        check_table(f"table {name!r} in {os.path.join(path, 'manifest.json')}", ref, meta, optim)
        _check_rows(name, meta, manifest["world_size"], path)
        if counter:
            if not meta["has_counter"]:
                raise CheckpointError(f"table {name!r}: the dump at {path} holds no admission counters")
            # Manifests before "admission_counter": a counter file says the table had one.
            dumped = meta.get("admission_counter", any(e["kind"] == "counter" for e in meta["files"]))
            if dumped and ref.storage.admission_counter(ref.index) is None:
                raise CheckpointError(f"table {name!r}: counter=True, but the model's table has no admission "
                                      f"counter (admit_strategy / admission_counter); load with counter=False")
        # Keys go where the *model's* routing sends them. Same world size and
        # routing (continuous routing also depends on num_embeddings): this
        # rank's keys are exactly dump rank `rank`'s, in its files alone.
        plan.same_layout[name] = same = manifest["world_size"] == world and (
            meta["dist_type"] != "continuous" or meta["num_embeddings"] == ref.options.num_embeddings)
        plan.files[name] = [e for e in meta["files"]
                            if not (same and e["rank"] != rank) and (e["kind"] != "counter" or counter)]
    if table_names is None:  # every table of the dump has a place: none is left behind unsaid
        left = sorted(set(manifest["tables"]) - set(tables))
        if left:
            raise CheckpointError(f"{os.path.join(path, 'manifest.json')} holds tables {left} that the model has "
                                  f"no dynamic table for; name the tables to load (table_names={sorted(tables)}) "
                                  f"to leave them out")
    _check_shared_counters(tables, manifest, optim)
    # Every file this rank reads is verified (size, checksum streamed 8 MiB at
    # a time, tensors against the manifest) before any row is loaded.
    for name, entries in plan.files.items():
        meta = manifest["tables"][name]
        for entry in entries:
            check_file(path, entry, name)
            check_tensors(path, entry, name, expected_tensors(meta, entry))
    # The keys each table receives here (read alone) against its capacity;
    # admission counts are built aside, to be swapped in by phase 2.
    for name, ref in tables.items():
        meta, same = manifest["tables"][name], plan.same_layout[name]
        num_embeddings = ref.options.num_embeddings
        keys, ckeys, ccounts = [], [], []
        for entry in plan.files[name]:
            if entry["kind"] == "part":
                keys.append(_mine(read_tensors(path, entry, ["keys"]), same, meta, world, rank,
                                  num_embeddings)["keys"])
            else:
                c = _mine(read_tensors(path, entry, ["keys", "counts"]), same, meta, world, rank, num_embeddings)
                ckeys.append(c["keys"])
                ccounts.append(c["counts"])
        rows = check_distinct(name, keys, f"the dump at {path}", rank, world)
        cap = ref.storage.max_rows(ref.index)
        if cap is not None and rows > cap:
            raise CheckpointError(f"table {name!r}: {rows} keys of the dump at {path} go to rank {rank} of {world}, "
                                  f"more than the table's maximum capacity there ({cap} rows)")
        adm = ref.storage.admission_counter(ref.index) if counter else None
        if adm is not None:
            keys = torch.cat(ckeys) if ckeys else torch.zeros(0, dtype=torch.int64)
            counts = torch.cat(ccounts) if ccounts else torch.zeros(0, dtype=torch.int64)
            table = build_counter(name, adm, keys, counts, f"the dump at {path}", rank, world,
                                  "load with counter=False or a larger counter (KVCounter)")
            plan.counters[name] = table
    return plan


def _load(path: str, plan: _Plan, optim: bool, rank: int, world: int) -> None:
    """Phase 2: replaces each table's content by the dump's."""
    steps = {}
    for name, ref in plan.tables.items():
        meta = plan.manifest["tables"][name]
        strategy = meta["score_strategy"]
        num_embeddings = ref.options.num_embeddings
        ref.storage.clear_table(ref.index)  # the table holds the dump's keys alone
        bases, exact, saved_at = part_bases(ref, meta)  # ages become scores on the table's own clock
        base_of = {e["file"]: b for e, b in zip(meta["files"], bases)}
        for entry in plan.files[name]:
            if entry["kind"] == "counter":
                continue  # built in phase 1
            try:
                part = _mine(read_part(path, entry, name, crc=False), plan.same_layout[name], meta, world, rank,
                             num_embeddings)
                keys = part["keys"]
                if not keys.numel():
                    continue
                restore_rows(ref, strategy, base_of[entry["file"]], part, optim)
            except Exception as e:  # noqa: BLE001 - re-raised naming the table and the file
                raise CheckpointError(f"table {name!r}: loading {os.path.join(path, entry['file'])} on rank {rank} "
                                      f"failed: {e}; this rank's tables are now partly loaded: load again") from e
        note_clock_restore(ref, exact, saved_at)
        if name in plan.counters:
            ref.storage.admission_counter(ref.index).replace(plan.counters[name])
        ref.storage.custom_scores[ref.index] = meta.get("custom_score", 0)
        steps.setdefault(id(ref.module), (ref.module, meta))
    for module, meta in steps.values():
        module.step, module.optimizer_step = _counters(meta, optim)


def _counters(meta: dict, optim: bool):
    """The module's (step, optimizer_step) after loading a table of `meta`:
    the dump's; without its optimizer state (optim=False) the update count
    restarts with it."""
    return meta["step"], meta["optimizer_step"] if optim else 0


def _check_shared_counters(tables: dict, manifest: dict, optim: bool) -> None:
    """A module's step counters serve all its tables (STEP scores, Adam's
    bias correction): a load that sets them for some tables would change
    them for the module's other tables that hold keys. Refused, naming
    them, unless the counters already agree."""
    by_module: dict = {}
    for name, ref in tables.items():
        by_module.setdefault(id(ref.module), (ref.module, set(), manifest["tables"][name]))[1].add(ref.index)
    for module, loaded, meta in by_module.values():
        others = [module.table_names[i] for i in range(module.num_tables)
                  if i not in loaded and module.storage.stats(i)["size"] > 0]
        want, now = _counters(meta, optim), (module.step, module.optimizer_step)
        if others and want != now:
            raise CheckpointError(f"tables {sorted(module.table_names[i] for i in loaded)} share their step counters "
                                  f"(step, optimizer_step) with tables {others} of the same module, which this load "
                                  f"leaves as they are; the load would set them from {now} to {want}: load those "
                                  f"tables too (or into a module that holds only the loaded ones)")


def DynamicEmbLoad(path: str, model: torch.nn.Module, table_names: Optional[Sequence[str]] = None,
                   optim: bool = True, counter: bool = False, pg: Optional[dist.ProcessGroup] = None) -> None:
    """Loads the dump at `path` into the model's dynamic tables, replacing
    their content (API.md §4). Every rank of `pg` must call it; a failure on
    any rank raises on all of them (see the module's doc)."""
    path = os.path.abspath(path)
    rank, world = rank_world(pg)
    distributed = dist.is_initialized() and world > 1
    plan, error = None, None
    try:
        plan = _prepare(path, model, table_names, optim, counter, pg, rank, world)
    except Exception as e:  # noqa: BLE001 - every rank raises, after the gather
        error = e
    _gather_status(error, world, pg, distributed, "; the model is unchanged")
    try:
        _load(path, plan, optim, rank, world)
    except Exception as e:  # noqa: BLE001
        error = e
    _gather_status(error, world, pg, distributed,
                   " while loading: that rank's tables are partly loaded; load the model again")
