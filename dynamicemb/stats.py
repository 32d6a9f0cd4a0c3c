"""Finding a model's dynamic tables, and their counters (API.md §3)."""
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables

__all__ = ["dynamic_modules", "dynamic_tables", "table_stats"]

STAT_KEYS = ("size", "capacity", "inserted", "evicted", "failed", "admission_rejected", "nonfinite_grads")
# Tables with caching=True also report their tiers: forward lookups found in
# the cache (hits) or not (misses), cache rows written back to the backing
# store, keys a step served outside a too small cache (bypassed), rows in
# each tier, and the cache's capacity. Tables with an HBM share
# (global_hbm_for_values, without caching) report their keys whose rows are
# in device memory and in host memory, and the device part's rows.
TIER_KEYS = ("hits", "misses", "write_backs", "bypassed", "cache_rows", "store_rows", "cache_capacity",
             "device_rows", "host_rows", "device_capacity")


def dynamic_modules(model: torch.nn.Module) -> Iterator[BatchedDynamicEmbeddingTables]:
    """Every BatchedDynamicEmbeddingTables of a model, those inside TorchRec's
    sharded collections included (their lookups sit in a plain list)."""
    seen = set()

    def visit(m):
        for sub in m.modules():
            if isinstance(sub, BatchedDynamicEmbeddingTables) and id(sub) not in seen:
                seen.add(id(sub))
                yield sub
            lookups = sub.__dict__.get("_lookups")
            if isinstance(lookups, list):
                for lookup in lookups:
                    yield from visit(lookup)

    yield from visit(model)


def dynamic_tables(model: torch.nn.Module) -> List[Tuple[str, BatchedDynamicEmbeddingTables, int]]:
    """(name, module, index in the module) of every dynamic table of a model.
    Stats, dumps and checkpoints address a table by its name: two tables of
    one name raise (DynamicEmbeddingShardingPlanner refuses such a model;
    a hand-made plan can build one)."""
    out, seen = [], set()
    for m in dynamic_modules(model):
        for i, name in enumerate(m.table_names):
            if name in seen:
                raise ValueError(f"two dynamic tables are named {name!r}; table_stats, dumps and checkpoints "
                                 f"need unique table names")
            seen.add(name)
            out.append((name, m, i))
    return out


def table_stats(model: torch.nn.Module, pg: Optional[dist.ProcessGroup] = None) -> Dict[str, Dict[str, int]]:
    """{table_name: {size, capacity, inserted, evicted, failed,
    admission_rejected, nonfinite_grads}}: this rank's, or summed over the ranks of `pg`."""
    modules = dict.fromkeys(m for _, m, _ in dynamic_tables(model))  # (names checked unique)
    stats = {name: {k: s[k] for k in STAT_KEYS + TIER_KEYS if k in s}
             for m in modules for name, s in m.table_stats().items()}
    if pg is None:
        return stats
    names = sorted(stats)
    keys = [STAT_KEYS + tuple(k for k in TIER_KEYS if k in stats[n]) for n in names]
    width = max((len(k) for k in keys), default=len(STAT_KEYS))
    t = torch.tensor([[stats[n][k] for k in ks] + [0] * (width - len(ks)) for n, ks in zip(names, keys)],
                     dtype=torch.int64, device=collective_device(pg)).reshape(-1, width)
    dist.all_reduce(t, group=pg)
    return {n: dict(zip(ks, row)) for n, ks, row in zip(names, keys, t.tolist())}


def collective_device(pg: dist.ProcessGroup) -> torch.device:
    """Where a tensor for a collective over `pg` must live: the current CUDA
    device when the group has only NCCL (which rejects CPU tensors), else the
    CPU (gloo, or a group with a CPU backend beside NCCL)."""
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
