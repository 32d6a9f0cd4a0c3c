"""Shared helpers of the embedding-module tests: building modules, random TBE
batches, reading stored rows, and the hand-computable DEBUG initial value.
Modules and batches go on `device` (the conftest fixture's "cpu" / "cuda");
what the helpers read back is on the CPU, where the references are."""
from typing import List, Optional, Sequence, Tuple

import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    EmbOptimType,
)

DEBUG_INIT = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.DEBUG)


def debug_rows(keys: Sequence[int], dim: int) -> torch.Tensor:
    """The DEBUG initializer by hand: (key mod 100000) / 100 + j / 10000
    (Python's % is a floor mod, like the kernel's)."""
    return torch.tensor([[(k % 100000) * 0.01 + j * 0.0001 for j in range(dim)] for k in keys],
                        dtype=torch.float32)


def make_module(dims: Sequence[int], pooling=DynamicEmbPoolingMode.SUM, optimizer=EmbOptimType.EXACT_SGD,
                feature_table_map: Optional[Sequence[int]] = None, max_capacity: int = 1024,
                bucket_capacity: int = 16, module_kwargs: Optional[dict] = None, device: str = "cpu",
                **option_kwargs) -> BatchedDynamicEmbeddingTables:
    """One DynamicEmbTableOptions per dim, all with the same extra options."""
    opts = [DynamicEmbTableOptions(dim=d, max_capacity=max_capacity, bucket_capacity=bucket_capacity,
                                   **option_kwargs) for d in dims]
    return BatchedDynamicEmbeddingTables(opts, feature_table_map=feature_table_map, pooling_mode=pooling,
                                         optimizer=optimizer, device=device, **(module_kwargs or {}))


def random_batch(gen: torch.Generator, feature_table_map: Sequence[int], num_keys: Sequence[int], batch: int,
                 max_len: int, min_len: int = 0, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """TBE input: bag j = f * batch + b holds min_len..max_len keys of
    table feature_table_map[f], drawn from [0, num_keys[table])."""
    F = len(feature_table_map)
    lengths = torch.randint(min_len, max_len + 1, (F * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    parts = [torch.randint(0, num_keys[feature_table_map[j // batch]], (int(n),), generator=gen)
             for j, n in enumerate(lengths.tolist())]
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return indices.to(device=device, dtype=torch.int64), offsets.to(device)


def bags(lists: List[List[int]], device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices, offsets) from explicit bags, in TBE order."""
    offsets = [0]
    for b in lists:
        offsets.append(offsets[-1] + len(b))
    flat = [k for b in lists for k in b]
    return (torch.tensor(flat, dtype=torch.int64, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device))


def stored(module: BatchedDynamicEmbeddingTables, table_id: int, keys) -> Tuple[torch.Tensor, torch.Tensor]:
    """(found mask, rows [n, dim + state] as float32, zeros where missing), on the CPU."""
    keys = torch.as_tensor(keys, dtype=torch.int64).to(module.device)
    rows = module.storage.find(keys, torch.full_like(keys, table_id)).cpu()
    # Both parts of a hybrid table (HashTableStorage.rows_of), else the storage's rows.
    rows_of = getattr(module.storage, "rows_of", None)
    w = rows_of(table_id) if rows_of is not None else module.storage.weights()[table_id]
    out = torch.zeros(keys.numel(), w.shape[1], dtype=torch.float32)
    found = rows >= 0
    out[found] = w.index_select(0, rows[found].to(w.device)).cpu().float()  # a cache's rows: on its device
    return found, out


def stored_keys(module: BatchedDynamicEmbeddingTables, table_id: int) -> set:
    return {k for keys, _, _ in module.storage.export(table_id) for k in keys.tolist()}


def stored_scores(module: BatchedDynamicEmbeddingTables, table_id: int) -> dict:
    return {k: s for keys, _, scores in module.storage.export(table_id)
            for k, s in zip(keys.tolist(), scores.tolist())}

