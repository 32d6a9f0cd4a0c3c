"""DynamicEmbDump: every rank writes its shard of every dynamic table in
parallel, in chunks, into PATH.tmp-<id> beside PATH, fsyncing each file; once
all ranks have finished, rank 0 writes the manifest, fsyncs the directories
and publishes with a rename (an existing PATH: an atomic exchange, see
_publish), then fsyncs the parent. Each step ends in a collective carrying
every rank's status, so that an error on one rank raises on all of them: a
write error removes PATH.tmp-<id> and publishes nothing. A dump that dies
midway leaves PATH as it was, and its PATH.tmp-<id> (or PATH.old-<id>) behind:
dumps never remove other dumps' siblings, as another dump may be writing
them; `python -m dynamicemb.checkpoint PATH` lists them, and they can be
deleted when no dump to PATH is running."""
import ctypes
import errno
import os
import shutil
import threading
import time
import uuid
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from dynamicemb import rules
from dynamicemb.checkpoint.clock import saved_reading
from dynamicemb.checkpoint.format import FORMAT_VERSION, MANIFEST, Syncer, part_name, write_manifest, write_part
from dynamicemb.checkpoint.rank_errors import raise_any, status
from dynamicemb.checkpoint.tables import check_group, model_tables, rank_world
from dynamicemb.fsync import fsync_dir

DEFAULT_CHUNK_ROWS = 1 << 18


def shard_parts(name, ref, optim, chunk_rows, now: Optional[int] = None):
    """One pass over a table's shard: the tensors of each part file. Clock
    scores become ages against the table's own clock (GPU time on CUDA) at
    `now` (read here when None)."""
    strategy = ref.storage.strategy(ref.index)
    now = ref.storage.now(ref.index) if now is None else now
    for b in ref.storage.export_rows(ref.index, chunk_rows, lazy=True):  # rows streamed by write_part
        part = {"keys": b.keys, "values": b.values,
                "scores": now - b.scores if rules.score_is_clock(strategy) else b.scores}
        if optim:
            part["optimizer_state"] = b.optimizer_state
        if b.timestamps is not None and rules.keeps_timestamps(strategy):
            part["timestamps"] = now - b.timestamps
        yield part


def snapshot_of(v) -> torch.Tensor:
    """A snapshot of a part's tensor (or of its lazily read rows)."""
    return v.clone() if isinstance(v, torch.Tensor) else v.materialize()


def counter_parts(ref, chunk_rows):
    counter = ref.storage.admission_counter(ref.index)
    if counter is None:
        return
    for keys, counts in counter.export(chunk_rows):
        yield {"keys": keys, "counts": counts}


def _write_shard(root, rank, tables, optim, counter, chunk_rows, parts_of=None) -> Dict[str, dict]:
    """Writes this rank's files; returns per table its file entries and rows."""
    out, syncer = {}, Syncer()
    try:
        _write_tables(root, rank, tables, optim, counter, chunk_rows, parts_of, syncer, out)
    finally:
        syncer.wait()  # every file durable (or closed, on an error)
    return out


def _write_tables(root, rank, tables, optim, counter, chunk_rows, parts_of, syncer, out):
    for name, ref in tables.items():
        files, rows = [], 0
        # The clock the ages count from (clock.py), in the manifest; None: no clock scores.
        when = parts_of[name + "\0clock"] if parts_of is not None else saved_reading(ref.storage, ref.index)
        source = parts_of[name] if parts_of is not None else \
            shard_parts(name, ref, optim, chunk_rows, when["clock"] if when else None)
        for k, part in enumerate(source):
            files.append(dict(write_part(root, part_name(name, rank, "part", k), part, syncer), rank=rank,
                              kind="part"))
            rows += files[-1]["rows"]
        if counter:
            csrc = parts_of[name + "\0counter"] if parts_of is not None else counter_parts(ref, chunk_rows)
            for k, part in enumerate(csrc):
                files.append(dict(write_part(root, part_name(name, rank, "counter", k), part, syncer),
                                  rank=rank, kind="counter"))
        out[name] = {"files": files, "rows": rows, "clock_reading": when}


def _manifest(metas: Dict[str, dict], shards: List[Dict[str, dict]], world, optim, counter) -> dict:
    mt = {}
    for name, meta in metas.items():
        meta = dict(meta)
        meta["rows_per_rank"] = [s[name]["rows"] for s in shards]
        if any(s[name]["clock_reading"] for s in shards):  # the clock each rank's ages count from (clock.py)
            meta["clock_readings"] = [s[name]["clock_reading"] for s in shards]
        meta["files"] = [f for s in shards for f in s[name]["files"]]
        meta["has_optimizer_state"] = optim
        meta["has_counter"] = counter
        mt[name] = meta
    return {"format": "dynamicemb", "format_version": FORMAT_VERSION, "world_size": world,
            "created_unix": time.time(), "score_ages": "clock scores are stored as ns ages at dump time",
            "tables": mt}


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths atomically (Linux renameat2); False where unsupported."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # old kernel, or a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), b)


def _check_replaceable(path: str, allow_overwrite: bool) -> None:
    """A dump replaces only what a dump wrote: an existing path must be a
    dump (its manifest.json) or an empty directory, and allow_overwrite set."""
    if not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory; a dump goes to a new path (nothing there is "
                              f"replaced but an earlier dump)")
    own = os.listdir(path)
    if own and not os.path.isfile(os.path.join(path, MANIFEST)):
        raise FileExistsError(f"{path} exists and is not a dynamicemb dump (no {MANIFEST}; it holds "
                              f"{sorted(own)[:5]}{'...' if len(own) > 5 else ''}); a dump replaces only an earlier "
                              f"dump, so give it a path of its own")
    if not allow_overwrite:
        raise FileExistsError(f"{path} exists; pass allow_overwrite=True to replace it")


def _publish(tmp: str, path: str, allow_overwrite: bool) -> None:
    """Moves the finished tmp directory to path. Replacing an existing path
    swaps the two atomically, so that a crash leaves the old or the new dump
    at path; where renameat2(RENAME_EXCHANGE) is unavailable it falls back to
    path -> path.old-<id>, tmp -> path, leaving no dump at path for a crash
    between the two renames (the old one is then in path.old-<id>, which a
    load's "no checkpoint" error names). An error (not a crash) in between
    moves the old dump back."""
    parent = os.path.dirname(path)
    old = None
    if not os.path.exists(path):
        os.rename(tmp, path)
    elif not allow_overwrite:
        raise FileExistsError(f"{path} exists; pass allow_overwrite=True to replace it")
    elif _exchange(tmp, path):
        old = tmp  # the old dump, now at tmp
    else:
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    fsync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _raise_any(errors: List[Optional[str]], mine: Optional[BaseException], what: str) -> None:
    """rank_errors.raise_any: the others raise a RuntimeError naming the rank."""
    raise_any(errors, mine, lambda r, e: RuntimeError(f"dynamicemb dump: {what} failed on rank {r}: {e}"))


# Non-blocking dumps: one background gloo group per set of ranks, made on the
# first non-blocking dump (collectively) and reused; the last dump's thread.
_BACKGROUND = {"world": None, "groups": {}, "created": 0, "last": None}


def _background_group(pg: Optional[dist.ProcessGroup]):
    world = dist.group.WORLD
    if _BACKGROUND["world"] is not world:  # a new default group: the old groups are gone
        _BACKGROUND.update(world=world, groups={})
    ranks: Tuple[int, ...] = tuple(dist.get_process_group_ranks(pg if pg is not None else world))
    group = _BACKGROUND["groups"].get(ranks)
    if group is None:
        # A subgroup's ranks make it alone (the others do not call the dump).
        local = len(ranks) < dist.get_world_size()
        group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=local)
        _BACKGROUND["groups"][ranks] = group
        _BACKGROUND["created"] += 1
    return group


def _wait_for_background() -> None:
    """At interpreter exit: the last non-blocking dump finishes (its error, if any, was warned)."""
    last = _BACKGROUND["last"]
    if last is not None:
        last.join()


class DumpHandle:
    """A dump running in the background; wait() returns when it is published
    (and re-raises its error)."""

    def __init__(self, thread: threading.Thread, errors: list):
        self._thread, self._errors = thread, errors

    def wait(self) -> None:
        self._thread.join()
        if self._errors:
            raise self._errors[0]

    def done(self) -> bool:
        return not self._thread.is_alive()


def DynamicEmbDump(path: str, model: torch.nn.Module, table_names: Optional[Sequence[str]] = None,
                   optim: bool = True, counter: bool = False, pg: Optional[dist.ProcessGroup] = None,
                   allow_overwrite: bool = False, blocking: bool = True, chunk_rows: int = DEFAULT_CHUNK_ROWS):
    """Dumps the model's dynamic tables to `path` (API.md §4). With
    blocking=False, returns a DumpHandle; the dump holds the tables' state at
    the call while training goes on. Any dump first waits for this process's
    previous non-blocking dump to finish (its errors stay with its handle)."""
    last = _BACKGROUND["last"]
    if last is not None:
        last.join()
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"DynamicEmbDump: path must name a directory, got {path!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"DynamicEmbDump: chunk_rows must be a positive int, got {chunk_rows!r}")
    path = os.path.abspath(path)
    rank, world = rank_world(pg)
    distributed = dist.is_initialized() and world > 1
    # Checks every rank makes, agreed on before anything is written (a rank
    # that raised alone would leave the others waiting in a collective).
    error, tables, metas = None, None, None
    try:
        if os.path.exists(path):
            _check_replaceable(path, allow_overwrite)
        tables = model_tables(model, table_names, "DynamicEmbDump")
        check_group(tables, pg, "DynamicEmbDump")
        if not tables:  # (an empty dump would load into any model as "nothing to load")
            raise ValueError("DynamicEmbDump: the model has no dynamic tables (none of its modules is sharded with "
                             "dynamicemb's sharders, or a BatchedDynamicEmbeddingTables); nothing would be dumped")
        if counter:  # a counter that cannot export its counts is refused before anything is written
            for ref in tables.values():
                adm = ref.storage.admission_counter(ref.index)
                if adm is not None:
                    adm.check_checkpointable()
        # Steps, Adam's step count and CUSTOMIZED scores as at the call: a
        # non-blocking dump writes the manifest while training goes on.
        metas = {name: ref.meta() for name, ref in tables.items()}
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = e
    token = uuid.uuid4().hex[:12]
    if distributed:
        starts = [None] * world
        dist.all_gather_object(starts, (token, status(error)), group=pg)
        token = starts[0][0]
        _raise_any([e for _, e in starts], error, "the checks before writing")
    elif error is not None:
        raise error
    tmp = f"{path}.tmp-{token}"

    def finish(parts_of=None, group=pg):
        # 1. Every rank writes its files; all learn whether all succeeded.
        mine, error = None, None
        try:
            os.makedirs(tmp, exist_ok=True)
            mine = _write_shard(tmp, rank, tables, optim, counter, chunk_rows, parts_of)
        except Exception as e:  # noqa: BLE001
            error = e
        shards = [None] * world
        if distributed:
            dist.all_gather_object(shards, (mine, status(error)), group=group)
        else:
            shards = [(mine, status(error))]
        if any(e is not None for _, e in shards):
            if rank == 0:  # every rank is past its writes: nothing is published, the tmp directory goes
                shutil.rmtree(tmp, ignore_errors=True)
            _raise_any([e for _, e in shards], error, "writing")
        shards = [s for s, _ in shards]
        # 2. Rank 0 writes the manifest and publishes; all learn whether it did.
        if rank == 0:
            try:
                write_manifest(tmp, _manifest(metas, shards, world, optim, counter))
                # The files' directory entries, then the directory's own.
                for d in sorted({os.path.dirname(f["file"]) for s in shards for t in s.values()
                                 for f in t["files"]}):
                    fsync_dir(os.path.join(tmp, d))
                fsync_dir(tmp)
                _publish(tmp, path, allow_overwrite)
            except Exception as e:  # noqa: BLE001
                error = e
                shutil.rmtree(tmp, ignore_errors=True)  # not published (_publish restores PATH on an error)
        if distributed:
            published = [status(error)]
            dist.broadcast_object_list(published, src=dist.get_global_rank(group, 0) if group else 0,
                                       group=group)
            _raise_any([published[0]] + [None] * (world - 1), error, "publishing")
        elif error is not None:
            raise error

    if blocking:
        finish()
        return None
    # Snapshot now (one pass, cloned), write in the background on a group of
    # its own (cached) so that training's collectives do not interleave with ours.
    snapshot = {}
    for name, ref in tables.items():
        when = snapshot[name + "\0clock"] = saved_reading(ref.storage, ref.index)
        snapshot[name] = [{k: snapshot_of(v) for k, v in p.items()}
                          for p in shard_parts(name, ref, optim, chunk_rows, when["clock"] if when else None)]
        if counter:
            snapshot[name + "\0counter"] = [{k: v.clone() for k, v in p.items()} for p in counter_parts(ref, chunk_rows)]
    group = _background_group(pg) if distributed else None
    errors: list = []

    def run():
        try:
            finish(snapshot, group)
        except BaseException as e:  # surfaced by wait(), and said now: a script may never call it
            errors.append(e)
            warnings.warn(f"DynamicEmbDump to {path} (non-blocking) failed: {type(e).__name__}: {e}; nothing was "
                          f"published there (its wait() raises this)", RuntimeWarning)

    # A script that ends without wait() (its last checkpoint, typically) still publishes the dump: the
    # interpreter's exit first waits for it (threading's exit hooks run newest first, so before
    # concurrent.futures', after which the writer's file syncs could not be scheduled).
    thread = threading.Thread(target=run, name="dynamicemb-dump", daemon=False)
    if not _BACKGROUND.get("at_exit"):
        threading._register_atexit(_wait_for_background)
        _BACKGROUND["at_exit"] = True
    thread.start()
    _BACKGROUND["last"] = thread
    return DumpHandle(thread, errors)
