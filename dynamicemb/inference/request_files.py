"""Request and output files of the C++ serving client (examples/serve_cpp):
safetensors files, so a program without Python reads them with a few lines.

A request file holds, for request i = 0, 1, ...: ``values.i`` (int64 ids),
``offsets.i`` (int64, TBE layout [F * B + 1]) and, for a weighted program,
``weights.i`` (float32 per id). The client's output file holds thread t's
output of request i as ``out.t.i``."""
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

from dynamicemb.inference.table import InferenceEmbeddingTable


def save_requests(path: str, batches: Sequence[Tuple[torch.Tensor, ...]]) -> str:
    """Writes `batches` ((values, offsets[, weights]) each, the inputs of an
    exported InferenceEmbeddingTable) as a request file."""
    tensors = {}
    for i, batch in enumerate(batches):
        for name, t, dtype in zip(("values", "offsets", "weights"), batch, (torch.int64, torch.int64, torch.float32)):
            if t.dtype != dtype:
                raise ValueError(f"request {i}: {name} must be {dtype}, not {t.dtype}")
            tensors[f"{name}.{i}"] = t.detach().cpu().contiguous()
    save_file(tensors, path, metadata={"format": "dynamicemb-requests", "count": str(len(batches))})
    return path


def load_requests(path: str) -> List[Tuple[torch.Tensor, ...]]:
    """The batches of a request file, in order."""
    tensors = load_file(path)
    out = []
    while f"values.{len(out)}" in tensors:
        i = len(out)
        out.append(tuple(tensors[f"{n}.{i}"] for n in ("values", "offsets", "weights") if f"{n}.{i}" in tensors))
    return out


def load_outputs(path: str) -> Dict[int, List[torch.Tensor]]:
    """The client's output file: thread -> its outputs, in request order."""
    found: Dict[int, Dict[int, torch.Tensor]] = {}
    for name, t in load_file(path).items():
        m = re.fullmatch(r"out\.(\d+)\.(\d+)", name)
        if m:
            found.setdefault(int(m[1]), {})[int(m[2])] = t
    return {t: [outs[i] for i in sorted(outs)] for t, outs in sorted(found.items())}


def stored_keys(module: InferenceEmbeddingTable) -> List[torch.Tensor]:
    """The keys stored in each of the module's tables."""
    bc, buckets = module.bucket_capacity, module.table_buckets.tolist()
    live = module.slot_digests.ne(0)
    return [module.slot_keys[buckets[t] * bc:buckets[t + 1] * bc][live[buckets[t] * bc:buckets[t + 1] * bc]]
            for t in range(len(module.table_names))]


def sample_requests(module: InferenceEmbeddingTable, count: int, batch: int, ids_per_bag: int = 4,
                    miss: float = 0.1, weighted: Optional[bool] = None, seed: int = 0
                    ) -> List[Tuple[torch.Tensor, ...]]:
    """`count` batches of `batch` samples for the module's features: each bag
    has 0 to 2 * ids_per_bag ids, keys stored in its table except a `miss`
    fraction of random keys (most not stored: they read the initializer)."""
    g = torch.Generator().manual_seed(seed)
    keys = stored_keys(module)
    weighted = module.is_weighted if weighted is None else weighted
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 2 * ids_per_bag + 1, (len(module.feature_names), batch), generator=g)
        values = []
        for f, t in enumerate(module.feature_table_map):
            n = int(lengths[f].sum())
            k = keys[t]
            picked = k[torch.randint(0, max(k.numel(), 1), (n,), generator=g)] if k.numel() else \
                torch.zeros(n, dtype=torch.int64)
            random = torch.randint(0, 2**62, (n,), generator=g)
            values.append(torch.where(torch.rand(n, generator=g) < miss, random, picked))
        values = torch.cat(values)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.flatten().cumsum(0)])
        out.append((values, offsets) + ((torch.rand(values.numel(), generator=g),) if weighted else ()))
    return out
