"""The embedding setups that bench_quality.py compares, at one row budget per
table: each a module KeyedJaggedTensor -> KeyedTensor that TorchRec's DLRM
takes as its embedding_bag_collection, so that every setup trains the same
model (dense part, interaction, over-arch) and differs only in how the 22
large-vocabulary features find their rows.

Every table, whatever the setup, is trained by a fused EXACT_ROWWISE_ADAGRAD
(learning rate 0.05, eps 1e-8: the example's) in backward, and a new row
starts uniform in [-0.05, 0.05]:
  fold     FBGEMM's CPU TBE (what TorchRec's FUSED kernel runs), ids folded id % rows;
  mch      TorchRec's ManagedCollisionCollection of MCHManagedCollisionModule
           (LRU_EvictionPolicy, eviction every step) remapping ids into the
           same TBE; evicted rows are reset (weights re-drawn, momentum 0), as
           TorchRec's sharded ManagedCollisionEmbeddingBagCollection does (its
           unsharded module leaves them as they are: `evict` is a TODO there);
  lru, lfu, lfu_admit2, unlimited
           dynamicemb's BatchedDynamicEmbeddingTables (the module TorchRec's
           sharded dynamic tables run): TIMESTAMP, LFU, LFU admitting a key at
           its 2nd sighting, and no row limit (the ceiling).
The 4 small-vocabulary features (example_data.NATIVE_FEATURES) sit on a TBE of
NATIVE_ROWS rows in every setup.
"""
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from example_data import NATIVE_FEATURES, NATIVE_ROWS, SPARSE_FEATURES

LARGE = [f for f in SPARSE_FEATURES if f not in NATIVE_FEATURES]  # the tables a budget applies to
SMALL = list(NATIVE_FEATURES)
FEATURES = LARGE + SMALL  # the KeyedJaggedTensor's key order in the benchmark
LR, EPS, INIT = 0.05, 1e-8, 0.05
BUCKET = 128  # dynamicemb's bucket; budgets are whole buckets, for every setup alike

SETUPS = {  # name -> what it is, for tables and plots
    "fold": "TorchRec native table, id % rows",
    "mch": "TorchRec managed collision (MCH, LRU)",
    "lru": "dynamicemb TIMESTAMP (LRU)",
    "lfu": "dynamicemb LFU",
    "lfu_admit2": "dynamicemb LFU + admission (2 sightings)",
    "unlimited": "dynamicemb, no row limit (ceiling)",
}
BUDGETED = [s for s in SETUPS if s != "unlimited"]


def _tbe(rows: Sequence[int], dim: int, seed: int):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR, eps=EPS, pooling_mode=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in tbe.split_embedding_weights():
            w.uniform_(-INIT, INIT, generator=gen)
    return tbe


class Folded(nn.Module):
    """A TBE of rows[t] rows per table; id -> id % rows[t]."""

    def __init__(self, rows: Sequence[int], dim: int, seed: int):
        super().__init__()
        self.tbe = _tbe(rows, dim, seed)
        self.register_buffer("rows", torch.tensor(list(rows), dtype=torch.int64))
        self.touched = [torch.zeros(n, dtype=torch.bool) for n in rows]  # rows some id was folded into

    def forward(self, kjt) -> torch.Tensor:
        per_feature = kjt.length_per_key()
        idx = kjt.values() % torch.repeat_interleave(self.rows, torch.tensor(per_feature))
        if self.training:
            for t, part in enumerate(idx.split(per_feature)):
                self.touched[t][part] = True
        return self.tbe(idx, kjt.offsets())

    def held(self, kjt) -> Optional[torch.Tensor]:
        return None  # every id has a row, shared with the ids folded onto it

    def stats(self) -> Dict[str, int]:
        return {"rows_held": int(sum(int(t.sum()) for t in self.touched))}


class Managed(nn.Module):
    """TorchRec's MCH remapping (LRU, eviction every step) in front of a TBE of rows[t] rows per table."""

    def __init__(self, rows: Sequence[int], dim: int, seed: int, names: Sequence[str]):
        super().__init__()
        from torchrec import EmbeddingBagConfig
        from torchrec.modules.mc_modules import (LRU_EvictionPolicy, ManagedCollisionCollection,
                                                 MCHManagedCollisionModule)
        configs = [EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=dim, num_embeddings=n)
                   for f, n in zip(names, rows)]
        self.mcc = ManagedCollisionCollection(
            {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=torch.device("cpu"),
                                               eviction_policy=LRU_EvictionPolicy(), eviction_interval=1,
                                               input_hash_size=2**63 - 1)
             for c in configs}, configs)
        self.tables = [c.name for c in configs]
        self.tbe = _tbe(rows, dim, seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.reset_rows = 0

    @torch.no_grad()
    def _reset(self, evictions: Dict[str, Optional[torch.Tensor]]) -> None:
        """Evicted slots start afresh: new weights, zero row-wise momentum."""
        weights = self.tbe.split_embedding_weights()
        momentum = self.tbe.split_optimizer_states()
        for t, name in enumerate(self.tables):
            idx = evictions.get(name)
            if idx is None or idx.numel() == 0:
                continue
            idx = idx.long()
            weights[t][idx] = torch.empty(idx.numel(), weights[t].shape[1]).uniform_(-INIT, INIT,
                                                                                    generator=self.gen)
            momentum[t][0].view(-1)[idx] = 0.0
            self.reset_rows += idx.numel()

    def forward(self, kjt) -> torch.Tensor:
        remapped = self.mcc(kjt)
        if self.training:
            self._reset(self.mcc.evict())
        return self.tbe(remapped.values(), remapped.offsets())

    @torch.no_grad()
    def held(self, kjt) -> torch.Tensor:
        """Per id of `kjt`: whether the remapper holds it (a slot of its own)."""
        out = []
        for m, part in zip(self.mcc._managed_collision_modules.values(), kjt.values().split(kjt.length_per_key())):
            ids = m._mch_sorted_raw_ids
            pos = torch.searchsorted(ids[:-1], part)
            out.append(ids[pos] == part)
        return torch.cat(out)

    def stats(self) -> Dict[str, int]:
        open_slots = sum(int(v) for v in self.mcc.open_slots().values())
        size = sum(m.output_size() for m in self.mcc._managed_collision_modules.values())
        return {"rows_held": size - open_slots, "evicted": self.reset_rows}


class Dynamic(nn.Module):
    """dynamicemb's BatchedDynamicEmbeddingTables, at most rows[t] rows per table."""

    def __init__(self, rows: Sequence[int], dim: int, seed: int, names: Sequence[str], strategy: str,
                 admit: Optional[int] = None):
        super().__init__()
        from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbCheckMode, DynamicEmbInitializerArgs,
                                DynamicEmbInitializerMode, DynamicEmbScoreStrategy, DynamicEmbTableOptions,
                                EmbOptimType, FrequencyAdmissionStrategy, KVCounter)
        init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-INIT, upper=INIT)
        opts = []
        for n in rows:
            extra = {} if admit is None else dict(admit_strategy=FrequencyAdmissionStrategy(admit),
                                                  admission_counter=KVCounter(capacity=n))  # as many slots as rows
            opts.append(DynamicEmbTableOptions(
                # All rows from the start: growing from fewer rounded capacity past max_capacity (10112 -> 10240)
                dim=dim, max_capacity=n, init_capacity=n, initializer_args=init,
                score_strategy=DynamicEmbScoreStrategy[strategy], safe_check_mode=DynamicEmbCheckMode.IGNORE,
                **extra))
        self.tables = BatchedDynamicEmbeddingTables(opts, table_names=[f"t_{f}" for f in names],
                                                    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR,
                                                    eps=EPS, seed=seed)

    def forward(self, kjt) -> torch.Tensor:
        return self.tables(kjt.values(), kjt.offsets())

    @torch.no_grad()
    def held(self, kjt) -> torch.Tensor:
        """Per id of `kjt`: whether its table holds a row for it."""
        tids = torch.repeat_interleave(torch.arange(len(kjt.keys())), torch.tensor(kjt.length_per_key()))
        return self.tables.storage.find(kjt.values(), tids) >= 0

    def stats(self) -> Dict[str, int]:
        s = self.tables.table_stats().values()
        return {"rows_held": sum(t["size"] for t in s), "evicted": sum(t["evicted"] for t in s),
                "failed": sum(t["failed"] for t in s), "admission_rejected": sum(t["admission_rejected"] for t in s)}


def large_tables(setup: str, rows: Sequence[int], dim: int, seed: int) -> nn.Module:
    """The setup's module for the LARGE features (rows[t]: table t's row budget; for
    `unlimited`, a capacity that holds every id the run sees)."""
    if setup == "fold":
        return Folded(rows, dim, seed)
    if setup == "mch":
        return Managed(rows, dim, seed, LARGE)
    strategy, admit = {"lru": ("TIMESTAMP", None), "lfu": ("LFU", None), "lfu_admit2": ("LFU", 2),
                       "unlimited": ("TIMESTAMP", None)}[setup]
    return Dynamic(rows, dim, seed, LARGE, strategy, admit)


class Embeddings(nn.Module):
    """KeyedJaggedTensor (keys FEATURES) -> KeyedTensor of pooled rows, the
    interface of TorchRec's EmbeddingBagCollection that DLRM uses."""

    def __init__(self, setup: str, rows: Sequence[int], dim: int, seed: int):
        super().__init__()
        from torchrec import EmbeddingBagConfig
        self.setup, self.dim = setup, dim
        self.large = large_tables(setup, rows, dim, seed)
        self.small = _tbe([NATIVE_ROWS] * len(SMALL), dim, seed + 2)
        self._configs = [EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=dim,
                                            num_embeddings=n)
                         for f, n in zip(FEATURES, list(rows) + [NATIVE_ROWS] * len(SMALL))]

    def embedding_bag_configs(self) -> List:
        return self._configs

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import KeyedTensor
        large, small = kjt.split([len(LARGE), len(SMALL)])
        out = torch.cat([self.large(large), self.small(small.values(), small.offsets())], dim=1)
        return KeyedTensor(keys=FEATURES, length_per_key=[self.dim] * len(FEATURES), values=out)

    def held(self, kjt) -> Optional[torch.Tensor]:
        """Per id of the LARGE features of `kjt`: whether it has a row of its own (None for fold)."""
        return self.large.held(kjt.split([len(LARGE), len(SMALL)])[0])

    def stats(self) -> Dict[str, int]:
        return self.large.stats()


def budget_rows(distinct: Sequence[int], fraction: Optional[float]) -> List[int]:
    """Rows per LARGE table: `fraction` of its distinct ids, in whole buckets
    (at least one); fraction None: room for all of them at load factor <= 0.5
    (the next power of two >= 2x, so that no bucket fills)."""
    if fraction is None:
        return [max(BUCKET, 1 << (2 * max(1, d) - 1).bit_length()) for d in distinct]
    return [max(BUCKET, BUCKET * round(fraction * d / BUCKET)) for d in distinct]
