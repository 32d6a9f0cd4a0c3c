"""DynamicEmbLoad: loads a dump into a model of any world size. Each rank
keeps exactly the keys its routing assigns to it; every file is checked
against the manifest (size, checksum) before use."""
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dynamicemb.checkpoint.format import CheckpointError, read_manifest, read_part
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
    now = time.monotonic_ns()
    steps = {}
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
    for name, ref in tables.items():
        meta = manifest["tables"][name]
        strategy = meta["score_strategy"]
        # Keys go where the *model's* routing sends them. Same world size and
        # routing (continuous routing also depends on num_embeddings): this
        # rank's keys are exactly dump rank `rank`'s.
        num_embeddings = ref.options.num_embeddings
        same_layout = manifest["world_size"] == world and (
            meta["dist_type"] != "continuous" or meta["num_embeddings"] == num_embeddings)
        for entry in meta["files"]:
            if same_layout and entry["rank"] != rank or entry["kind"] == "counter" and not counter:
                continue
            part = read_part(path, entry, name)
            keys = part["keys"]
            if not same_layout and world > 1:
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
    if dist.is_initialized() and world > 1:
        dist.barrier(group=pg)
