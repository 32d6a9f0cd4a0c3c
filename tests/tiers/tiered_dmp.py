"""What the TorchRec tier tests share: DMP models whose dynamic tables keep a
cache of about 10% of their keys (or all their keys in memory), Zipf batches
with mostly new keys (so the cache must evict and fetch back), a plain
training loop, a sparse + dense model for TorchRec's pipelines, and every row
of a table read back from every rank and both tiers."""
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torchrec
from torch import nn

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_TESTS, os.path.join(_TESTS, "torchrec")):  # multiprocess.py; models.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

import models  # noqa: E402
from multiprocess import run_ranks  # noqa: E402,F401  (for the tests)
from dynamicemb import get_table_value_bytes  # noqa: E402
from dynamicemb.optimizer import EmbOptimType  # noqa: E402
from dynamicemb.stats import dynamic_modules  # noqa: E402

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
DIM = 8
KEYS = 20000  # id range (the tables' num_embeddings)
BUCKET = 16
BATCH = 32  # global samples per step; bags of 0-3 ids
STEPS = 100  # ~3400 distinct keys per table in all
CACHE_ROWS = 340  # per table over all ranks: ~10% of the keys trained
OPTIMIZERS = {
    "sgd": dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
    "adam": dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05, eps=1e-3, beta1=0.8, beta2=0.9),
}


def cache_bytes(fused_params, rows: int) -> int:
    """global_hbm_for_values for a cache of `rows` rows over all ranks: the
    bytes of their values and optimizer state."""
    return get_table_value_bytes(rows, DIM, torch.float32, fused_params["optimizer"])


def local_cache_rows(fused_params, rows: int, world: int) -> int:
    """The cache rows a rank gets: its share of global_hbm_for_values
    (options.num_shards = world size), in whole buckets."""
    per_rank = cache_bytes(fused_params, rows) // world // cache_bytes(fused_params, 1)
    return per_rank // BUCKET * BUCKET


def process_groups() -> List[dist.ProcessGroup]:
    """The groups a 2-rank run trains its models on: the world, then, on
    rank 0 only, a 1-rank group (rank 1 has finished its collectives by
    then, so the 1-rank models are trained once, not on both ranks)."""
    world, own = models.rank_groups()
    return [world] + ([own] if dist.get_rank() == 0 else [])


def configs(kind: str):
    if kind == "ec":
        return models.ec_configs(TABLES, dim=DIM, num_embeddings=KEYS)
    return models.ebc_configs(TABLES, dim=DIM, num_embeddings=KEYS)


def build(kind: str, pg: dist.ProcessGroup, fused_params, cache_rows: Optional[int] = None, wrap=None,
          **options):
    """A collection ("ebc" or "ec") of TABLES sharded over `pg` by our planner
    and sharders; with `cache_rows`, each table is cached (caching=True) with
    that many rows over all ranks in front of a host store (or `options`'
    backing_store / storage_path)."""
    if cache_rows is not None:
        options.update(caching=True, global_hbm_for_values=cache_bytes(fused_params, cache_rows))
    constraints = models.dynamic_constraints(TABLES, bucket_capacity=BUCKET, **options)
    return models.build(kind, configs(kind), pg, constraints, fused_params, wrap=wrap)


def zipf_batches(steps: int = STEPS, batch_size: int = BATCH, seed: int = 0) -> List[Dict[str, List[List[int]]]]:
    """Global batches {feature: bags}: ids KEYS * u**3 (a few hot keys, many
    new ones every step)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        batch = {}
        for f in FEATURES:
            lengths = torch.randint(0, 4, (batch_size,), generator=g).tolist()
            ids = (torch.rand(sum(lengths), generator=g) ** 3 * KEYS).long().tolist()
            starts = [sum(lengths[:i]) for i in range(batch_size)]
            batch[f] = [ids[s:s + n] for s, n in zip(starts, lengths)]
        out.append(batch)
    return out


def local_kjt(batch, pg: dist.ProcessGroup) -> torchrec.KeyedJaggedTensor:
    """This rank's samples of a global batch."""
    return models.kjt(batch, models.local_samples(len(batch[FEATURES[0]]), pg))


def train(model, batches, pg: dist.ProcessGroup, between=None) -> List[torch.Tensor]:
    """A plain loop (forward, backward of models.loss_of); the outputs of
    every step. `between(step)` runs between a forward and its backward."""
    outputs = []
    for step, batch in enumerate(batches):
        out = models.resolved(model(local_kjt(batch, pg)))
        outputs.append(models.output_values(out).detach().clone())
        if between is not None:
            between(step)
        models.loss_of(out).backward()
    return outputs


def all_rows(model, table: str, pg: dist.ProcessGroup) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keys, rows = [value | optimizer state]) of every key of a dynamic
    table on every rank of `pg`, in every tier, sorted by key; asserts that
    no key is in two places (two ranks, or a rank's cache and store)."""
    mods = [(m, m.table_names.index(table)) for m in dynamic_modules(model) if table in m.table_names]
    assert len(mods) == 1, f"table {table!r} found in {len(mods)} dynamic modules"
    m, t = mods[0]
    keys, rows = [], []
    for b in m.storage.export_rows(t):
        keys.append(b.keys.cpu())
        state = b.optimizer_state if b.optimizer_state is not None else b.values[:, :0]
        rows.append(torch.cat([b.values, state], 1).cpu())
    local = (torch.cat(keys), torch.cat(rows)) if keys else (torch.zeros(0, dtype=torch.int64), None)
    gathered = [None] * pg.size()
    dist.all_gather_object(gathered, local, group=pg)
    keys = torch.cat([k for k, _ in gathered])
    rows = torch.cat([r for k, r in gathered if r is not None])
    assert keys.unique().numel() == keys.numel(), f"table {table!r}: keys in two places"
    order = keys.argsort()
    return keys[order], rows[order]


def assert_same_rows(model, ref, pg: dist.ProcessGroup, what: str, ref_pg: Optional[dist.ProcessGroup] = None):
    """Both models hold the same keys with the same values and optimizer
    state (bit for bit) in every table."""
    for t in TABLES:
        (k, r), (k_ref, r_ref) = all_rows(model, t, pg), all_rows(ref, t, ref_pg or pg)
        assert k.numel() > 0 and torch.equal(k, k_ref), f"{what} {t}: stored keys differ"
        assert torch.equal(r, r_ref), f"{what} {t}: rows differ at {int((r != r_ref).any(1).sum())} keys"


class SparseDenseModel(nn.Module):
    """collection -> per-feature sums of the ids' rows (EC) -> linear -> BCE
    loss; forward(Batch) -> (loss, logits), as TorchRec's pipelines expect."""

    def __init__(self, collection):
        super().__init__()
        self.sparse = collection
        self.sequence = isinstance(collection, torchrec.EmbeddingCollection)
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM * len(TABLES), 1)

    def forward(self, batch):
        out = self.sparse(batch.sparse_features)
        if self.sequence:  # {feature: JaggedTensor of rows}
            out = models.resolved(out)
            pooled = torch.cat([out[f].to_padded_dense().sum(1) for f in FEATURES], 1)
        else:
            pooled = out.values()
        logits = self.dense(pooled).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        return loss, logits.detach()
