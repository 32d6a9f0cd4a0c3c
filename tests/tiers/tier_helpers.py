"""What the tier tests share: a user backing store over Python dicts, modules
with and without a cache built alike, Zipf batches, and every row of a
module read back (both tiers)."""
from typing import Dict

import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
from dynamicemb.tiers import BackingStore, FileStore, HostStore

DIM = 8
BUCKET = 16
NUM_KEYS = 20000  # id range
BATCH = 64  # ids per feature per step


class DictStore(BackingStore):
    """A user's store: {table: {key: (row, score)}} (loops are fine here)."""

    def __init__(self):
        self.tables: Dict[str, dict] = {}
        self.meta = {}

    def open_table(self, name, width, dtype, max_rows):
        self.tables[name] = {}
        self.meta[name] = (width, dtype)

    def _get(self, name, keys, remove):
        width, dtype = self.meta[name]
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        rows = torch.zeros(keys.numel(), width, dtype=dtype)
        scores = torch.zeros(keys.numel(), dtype=torch.int64)
        for i, k in enumerate(keys.tolist()):
            entry = self.tables[name].pop(k, None) if remove else self.tables[name].get(k)
            if entry is not None:
                found[i] = True
                rows[i], scores[i] = entry
        return found, rows, scores

    def take(self, name, keys):
        return self._get(name, keys, True)

    def read(self, name, keys):
        return self._get(name, keys, False)

    def put(self, name, keys, rows, scores):
        for k, r, s in zip(keys.tolist(), rows, scores.tolist()):
            assert k not in self.tables[name], f"key {k} put twice"
            self.tables[name][k] = (r.clone(), s)
        return 0

    def items(self, name, batch_size=1 << 16):
        t = self.tables[name]
        if t:
            keys = list(t)
            yield (torch.tensor(keys), torch.stack([t[k][0] for k in keys]),
                   torch.tensor([t[k][1] for k in keys]))

    def size(self, name):
        return len(self.tables[name])

    def clear(self, name):
        self.tables[name] = {}


def make_store(kind: str, tmp_path=None):
    if kind == "host":
        return HostStore(bucket_capacity=BUCKET)
    if kind == "file":
        return FileStore(str(tmp_path / "store"), bucket_capacity=BUCKET)
    return DictStore()


def module(optimizer=EmbOptimType.EXACT_SGD, store=None, cache_rows: int = 256, strategy=None, tables=2,
           storage_path=None, device="cpu", **options):
    """Two tables; with `store` (or a FileStore in `storage_path`), each
    keeps cache_rows rows in its cache; `options`: more table options."""
    width = DIM * (3 if optimizer == EmbOptimType.ADAM else 1) + (1 if optimizer ==
                                                                   EmbOptimType.EXACT_ROWWISE_ADAGRAD else 0)
    extra = {"max_capacity": 1 << 15, **options}
    if strategy is not None:
        extra["score_strategy"] = strategy
    cached = store is not None or storage_path is not None
    opts = [DynamicEmbTableOptions(dim=DIM, bucket_capacity=BUCKET, caching=cached,
                                   global_hbm_for_values=cache_rows * width * 4 if cached else 0,
                                   backing_store=store, storage_path=storage_path, **extra) for _ in range(tables)]
    return BatchedDynamicEmbeddingTables(opts, table_names=[f"t{i}" for i in range(tables)], optimizer=optimizer,
                                         learning_rate=0.1, seed=3, device=device)


def batches(n: int, seed: int = 0, tables: int = 2):
    """n TBE batches: BATCH Zipf-like ids per feature (one feature per table), bags of 4."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = (torch.rand(tables * BATCH, generator=g) ** 2 * NUM_KEYS).long()
        out.append((ids, torch.arange(0, tables * BATCH + 1, 4)))
    return out


def step(m, batch) -> torch.Tensor:
    """One training step (the batch moved to the module's device); returns
    the forward's output."""
    y = m(*(x.to(m.device) for x in batch))
    (y * torch.arange(y.numel(), dtype=y.dtype, device=y.device).view_as(y) / 100).sum().backward()
    return y.detach()


def all_rows(m, t: int) -> Dict[int, torch.Tensor]:
    """{key: [value | optimizer state]} of every key of table t, in every tier;
    asserts that no key is in two places."""
    out = {}
    for b in m.storage.export_rows(t):
        for k, v, s in zip(b.keys.tolist(), b.values, b.optimizer_state):
            assert k not in out, f"key {k} is in two places"
            out[k] = torch.cat([v, s]).cpu()
    return out
