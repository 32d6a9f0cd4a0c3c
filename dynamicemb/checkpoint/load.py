"""DynamicEmbLoad: loads a dump into a model of any world size. Each rank
keeps exactly the keys its routing assigns to it. Every file a rank reads is
checked against the manifest (size, checksum) before any row is loaded, and a
damaged one refuses the load on every rank: the model is left unchanged."""
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dynamicemb.checkpoint.format import CheckpointError, check_file, read_manifest, read_part
from dynamicemb.checkpoint.tables import clock_scored, has_timestamps, model_tables, rank_world
from dynamicemb.routing import owners
from dynamicemb.storage import RowBatch


def _check_table(name: str, ref, meta: dict, optim: bool, path: str) -> None:
    mine = ref.meta()
    where = f"table {name!r} in {os.path.join(path, 'manifest.json')}"
    for key in ("dim", "dtype", "dist_type"):
        if meta[key] != mine[key]:
            raise CheckpointError(f"{where}: {key} is {meta[key]!r}, the model's is {mine[key]!r}")
    if optim:
        if not meta["has_optimizer_state"]:
            raise CheckpointError(f"{where}: the dump has no optimizer state; load with optim=False")
        if meta["optimizer"] != mine["optimizer"] or meta["optimizer_state_width"] != mine["optimizer_state_width"]:
            raise CheckpointError(f"{where}: optimizer {meta['optimizer']} (state width "
                                  f"{meta['optimizer_state_width']}) does not match the model's {mine['optimizer']} "
                                  f"(state width {mine['optimizer_state_width']}); load with optim=False to skip it")
    if meta["score_strategy"] != mine["score_strategy"]:
        raise CheckpointError(f"{where}: score strategy {meta['score_strategy']} does not match the model's "
                              f"{mine['score_strategy']}")


def DynamicEmbLoad(path: str, model: torch.nn.Module, table_names: Optional[Sequence[str]] = None,
                   optim: bool = True, counter: bool = False, pg: Optional[dist.ProcessGroup] = None) -> None:
    """Loads the dump at `path` into the model's dynamic tables (API.md §4)."""
    path = os.path.abspath(path)
    manifest = read_manifest(path)
    rank, world = rank_world(pg)
    tables = model_tables(model, table_names)
    steps = {}
    distributed = dist.is_initialized() and world > 1
    files, same_layouts = {}, {}
    # Every table is checked against the manifest before any row is loaded,
    # so that a mismatch refuses the load without changing the model.
    for name, ref in tables.items():
        meta = manifest["tables"].get(name)
        if meta is None:
            raise CheckpointError(f"table {name!r}: {os.path.join(path, 'manifest.json')} has no table {name!r} "
                                  f"(it has {sorted(manifest['tables'])})")
        _check_table(name, ref, meta, optim, path)
        if counter and not meta["has_counter"]:
            raise CheckpointError(f"table {name!r}: the dump at {path} holds no admission counters")
        # Keys go where the *model's* routing sends them. Same world size and
        # routing (continuous routing also depends on num_embeddings): this
        # rank's keys are exactly dump rank `rank`'s, in its files alone.
        same_layouts[name] = same = manifest["world_size"] == world and (
            meta["dist_type"] != "continuous" or meta["num_embeddings"] == ref.options.num_embeddings)
        files[name] = [e for e in meta["files"]
                       if not (same and e["rank"] != rank) and (e["kind"] != "counter" or counter)]
    # Every file this rank reads is verified (streamed, 8 MiB at a time) before
    # any row is loaded; one rank's damaged file refuses the load on all ranks.
    error = None
    try:
        for name, entries in files.items():
            for entry in entries:
                check_file(path, entry, name)
    except CheckpointError as e:
        error = str(e)
    if distributed:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=pg)
        bad = next((r for r, e in enumerate(errors) if e is not None), None)
        if bad is not None:
            raise CheckpointError(errors[bad] if bad == rank else f"{errors[bad]} (found by rank {bad})")
    elif error is not None:
        raise CheckpointError(error)
    for name, ref in tables.items():
        meta = manifest["tables"][name]
        strategy = meta["score_strategy"]
        num_embeddings = ref.options.num_embeddings
        now = ref.storage.now(ref.index)  # ages become scores on the table's own clock
        for entry in files[name]:
            part = read_part(path, entry, name, crc=False)
            keys = part["keys"]
            if not same_layouts[name] and world > 1:
                keep = owners(keys, meta["dist_type"], world, num_embeddings) == rank
                part = {k: v[keep] for k, v in part.items()}
                keys = part["keys"]
            if not keys.numel():
                continue
            if entry["kind"] == "counter":
                ref.storage.admission[ref.index].counts.insert(keys, scores=part["counts"])
                continue
            scores = now - part["scores"] if clock_scored(strategy) else part["scores"]
            ts = now - part["timestamps"] if has_timestamps(strategy) and "timestamps" in part else None
            ref.storage.load_rows(ref.index, RowBatch(keys, part["values"], part.get("optimizer_state") if optim
                                                      else None, scores, ts))
        ref.storage.custom_scores[ref.index] = meta.get("custom_score", 0)
        steps.setdefault(id(ref.module), (ref.module, meta))
    for module, meta in steps.values():
        module.step = meta["step"]
        if optim:
            module.optimizer_step = meta["optimizer_step"]
    if distributed:
        dist.barrier(group=pg)
