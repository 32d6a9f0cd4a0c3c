"""Where a frozen table's content comes from: a dump directory (any world
size: every rank's files are read, and each key is in exactly one of them),
a torch.distributed.checkpoint directory of model.state_dict() (every slot
of each dynamic table read in this process), or a live model (every rank's
rows gathered over a process group)."""
import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
from dynamicemb.checkpoint.format import CheckpointError, check_file, check_tensors, read_manifest, read_tensors
from dynamicemb.checkpoint.load import expected_tensors
from dynamicemb.storage_protocol import require_checkpoint_protocol
from dynamicemb.types import checked_table_names
from dynamicemb.inference.frozen import ZEROS_INIT, FrozenTable, packed_init


def _entry(name: str, keys: List[torch.Tensor], values: List[torch.Tensor], meta: dict,
           feature_names: Optional[Dict[str, List[str]]]) -> dict:
    """A table's {"table": FrozenTable, "pooling", "seed"} from its rows (in
    pieces) and the meta a dump's manifest, or a state-dict slot, records."""
    dim, dtype = meta["dim"], getattr(torch, meta["dtype"])
    feats = (feature_names or {}).get(name) or meta.get("feature_names") or [name]
    return {
        "table": FrozenTable(name, torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64),
                             torch.cat(values) if values else torch.zeros(0, dim, dtype=dtype), list(feats),
                             packed_init(meta.get("eval_initializer", ZEROS_INIT))),
        "pooling": meta.get("pooling", "SUM"),
        "seed": meta.get("seed", 0),
        "is_weighted": meta.get("is_weighted"),  # (None: not recorded)
    }


def _chosen(names: List[str], table_names: Optional[Sequence[str]], where: str,
            feature_names: Optional[Dict[str, List[str]]] = None) -> List[str]:
    chosen = names if table_names is None else checked_table_names(table_names, f"{where} (tables {sorted(names)})")
    missing = [n for n in chosen if n not in names]
    if missing:
        raise CheckpointError(f"table {missing[0]!r}: {where} has no such table (it has {sorted(names)})")
    for name, feats in (feature_names or {}).items():
        if name not in chosen:
            raise ValueError(f"feature_names names table {name!r}, which is not among the tables served "
                             f"({chosen})")
        if isinstance(feats, str) or not feats:
            raise ValueError(f"feature_names[{name!r}] must be a non-empty list of feature names, got {feats!r}")
    return chosen


def dump_tables(path: str, table_names: Optional[Sequence[str]] = None,
                feature_names: Optional[Dict[str, List[str]]] = None) -> Dict[str, dict]:
    """{table: {"table": FrozenTable, "pooling", "seed"}} from the dump at
    `path`, every file verified (size, checksum, tensors) before it is read,
    or from the torch.distributed.checkpoint at `path` (dcp_tables).
    `feature_names` overrides the features the manifest records."""
    path = os.path.abspath(path)
    if is_dcp_checkpoint(path):
        return dcp_tables(path, table_names, feature_names)
    manifest = read_manifest(path)
    names = _chosen(list(manifest["tables"]), table_names, os.path.join(path, "manifest.json"), feature_names)
    out = {}
    for name in names:
        meta = manifest["tables"][name]
        keys, values = [], []
        for entry in meta["files"]:
            if entry["kind"] != "part":
                continue
            check_file(path, entry, name)
            check_tensors(path, entry, name, expected_tensors(meta, entry))
            part = read_tensors(path, entry, ["keys", "values"])
            keys.append(part["keys"])
            values.append(part["values"])
        out[name] = _entry(name, keys, values, meta, feature_names)
    return out


def is_dcp_checkpoint(path: str) -> bool:
    """Whether `path` is a torch.distributed.checkpoint directory (its
    .metadata file) rather than a dump (its manifest.json)."""
    return os.path.isfile(os.path.join(path, ".metadata")) and not os.path.isfile(os.path.join(path, "manifest.json"))


def dcp_tables(path: str, table_names: Optional[Sequence[str]] = None,
               feature_names: Optional[Dict[str, List[str]]] = None) -> Dict[str, dict]:
    """dump_tables' result from a torch.distributed.checkpoint of a model's
    state_dict() (saved on any number of ranks, under any prefix): every
    slot of each dynamic table, read here with no process group. The table
    is the name before `.dynamicemb.slot<s>`; every slot must be there."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from dynamicemb.checkpoint.state_dict import FORMAT, KEY, slot_number

    entries: Dict[str, Dict[int, str]] = {}  # table -> {slot: the entry's name}
    for fqn, md in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        head, sep, slot = fqn.rpartition(f".{KEY}.")
        s = slot_number(slot) if sep else None
        if s is None or not isinstance(md, BytesStorageMetadata):
            continue
        name = head.rpartition(".")[2]
        other = entries.setdefault(name, {}).setdefault(s, fqn)
        if other != fqn:
            raise CheckpointError(f"table {name!r}: {path} holds it twice ({other!r} and {fqn!r}): one model's "
                                  f"state dict per checkpoint")
    if not entries:
        raise CheckpointError(f"{path}: a torch.distributed.checkpoint with no dynamic table (no "
                              f"'<table>.{KEY}.slot<s>' entry)")
    names = _chosen(sorted(entries), table_names, path, feature_names)
    state = {fqn: "" for n in names for fqn in entries[n].values()}  # bytes entries: replaced by what was saved
    load(state, checkpoint_id=path, no_dist=True)
    out = {}
    for name in names:
        slots = [state[entries[name][s]] for s in sorted(entries[name])]
        bad = [d for d in slots if not isinstance(d, dict) or d.get("format") != FORMAT]
        if bad:
            raise CheckpointError(f"table {name!r} in {path}: an entry is a {type(bad[0]).__name__}, not a "
                                  f"dynamicemb slot")
        if sorted(entries[name]) != list(range(slots[0]["slots"])):
            absent = sorted(set(range(slots[0]["slots"])) - set(entries[name]))
            raise CheckpointError(f"table {name!r} in {path}: slots {absent[:8]} of {slots[0]['slots']} are absent")
        out[name] = _entry(name, [d["keys"] for d in slots], [d["values"] for d in slots], slots[0]["meta"],
                           feature_names)
    return out


def _gather_rows(keys: torch.Tensor, values: torch.Tensor, pg) -> tuple:
    """Every rank's (keys, values) of one table, concatenated on every rank."""
    if pg is None and not (dist.is_initialized() and dist.get_world_size() > 1):
        return keys, values
    world = dist.get_world_size(pg)
    n = torch.tensor([keys.numel()], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, n, group=pg)
    counts = [int(c) for c in counts]
    most = max(counts)
    # Rows travel as float64 beside their keys (a lossless carrier for every value dtype).
    packed = torch.zeros(most, 1 + values.shape[1], dtype=torch.float64)
    packed[:keys.numel(), 1:] = values.to(torch.float64)
    key_buf = torch.zeros(most, dtype=torch.int64)
    key_buf[:keys.numel()] = keys
    all_keys = [torch.zeros(most, dtype=torch.int64) for _ in range(world)]
    all_rows = [torch.zeros_like(packed) for _ in range(world)]
    dist.all_gather(all_keys, key_buf, group=pg)
    dist.all_gather(all_rows, packed, group=pg)
    keys = torch.cat([k[:c] for k, c in zip(all_keys, counts)])
    values = torch.cat([r[:c, 1:] for r, c in zip(all_rows, counts)]).to(values.dtype)
    return keys, values


def module_tables(module: BatchedDynamicEmbeddingTables, pg: Optional[dist.ProcessGroup] = None
                  ) -> List[FrozenTable]:
    """The tables of a training module, with every rank's rows of `pg`
    (collective: every rank of `pg` calls it)."""
    require_checkpoint_protocol(module.storage, module.table_names, "to_inference")
    out = []
    for t, name in enumerate(module.table_names):
        keys, values = [], []
        for b in module.storage.export_rows(t):
            keys.append(b.keys.cpu())
            values.append(b.values.cpu())
        dim = module.dims[t]
        k = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
        v = torch.cat(values) if values else torch.zeros(0, dim, dtype=module.embedding_dtype)
        k, v = _gather_rows(k, v, pg)
        out.append(FrozenTable(name, k, v, module.feature_names_of(t),
                               module.storage.eval_init_params[t].tolist()))
    return out
