"""InferenceEmbeddingTable: frozen dynamic tables for serving (API.md §5).

The keys of every table sit in one read-only scored hash table (the training
table's bucketed layout, so the lookup is the same op, emb_lookup_forward, as
the training module's eval forward); each table's rows sit at their keys'
slots in one tensor of the chosen precision. Nothing is inserted and no
score changes: a missing key reads its table's eval initial value.
"""
import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from dynamicemb import memory
from dynamicemb._ops import ops
from dynamicemb.batched_dynamicemb_tables import pooling_code
from dynamicemb.inference.frozen import FrozenTable
from dynamicemb.inference.quantize import storage_width, to_storage, value_dtype
from dynamicemb.inference.sources import dump_tables
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import (DynamicEmbPoolingMode, DynamicEmbScoreStrategy, InsertResult, canonical_device,
                              check_finite_weights)

def _capacity(n: int, bucket_capacity: int, load_factor: float) -> int:
    return bucket_capacity * max(1, math.ceil(n / (bucket_capacity * load_factor)))


def pack_keys(tables: Sequence[FrozenTable], bucket_capacity: int, load_factor: float, device) -> ScoredHashTable:
    """A hash table holding every table's keys (logical table t: tables[t]),
    sized near `load_factor`; a table one of whose buckets overflows gets
    25% more buckets and the packing is redone (no key is ever dropped)."""
    keys = torch.cat([t.keys.to(torch.int64) for t in tables]).to(device)
    tids = torch.cat([torch.full((t.keys.numel(),), i, dtype=torch.int64) for i, t in enumerate(tables)]).to(device)
    caps = [_capacity(t.keys.numel(), bucket_capacity, load_factor) for t in tables]
    while True:
        ht = ScoredHashTable(caps, bucket_capacity=bucket_capacity, score_strategy=DynamicEmbScoreStrategy.STEP,
                             num_tables=len(tables), device=device, table_names=[t.name for t in tables])
        res = ht.insert(keys, tids, scores=0, evict=False).results
        dup = res == InsertResult.ASSIGNED
        if bool(dup.any()):
            i = int(dup.nonzero()[0])
            raise ValueError(f"table {tables[int(tids[i])].name!r}: key {int(keys[i])} is given twice")
        failed = torch.bincount(tids[res == InsertResult.FAILED].cpu(), minlength=len(tables)).tolist()
        if not any(failed):
            return ht
        caps = [c + bucket_capacity * max(1, c // bucket_capacity // 4) if f else c for c, f in zip(caps, failed)]


class InferenceEmbeddingTable(nn.Module):
    """Frozen embedding tables that answer as the training model does in eval.

    Args:
        tables: the tables' contents (FrozenTable), in the collection's order.
        pooling: SUM, MEAN (pooled, as an EmbeddingBagCollection) or NONE (one
            row per id, as an EmbeddingCollection; one dim for all tables);
            one mode, or one per table (SUM and MEAN may mix).
        dtype: the rows' precision: "float32", "float16", "bfloat16" or
            "int8" (FBGEMM's fused 8-bit rowwise rows, dequantized on read).
        is_weighted: whether a KeyedJaggedTensor's weights scale the ids
            (a weighted EmbeddingBagCollection).
        output_dtype: the output's dtype (accumulation is float32).
        seed: the random seed of the eval initializers (a non-constant eval
            initializer is a pure function of (seed, table stream, key)).
        mean_divisor: how a MEAN bag is divided: "torchrec_rw" (default) as
            TorchRec's row-wise sharded collections do (sum / (length +
            1e-6), or / (sum of the bag's weights + 1e-6) when weighted), or
            "length" as an unsharded TBE / BatchedDynamicEmbeddingTables does
            (sum * (1 / length), an empty bag 0).
        feature_order: the features' order in the input and output (default:
            the tables' order, then each table's features).
        bucket_capacity, load_factor: the read-only hash table's layout
            (slots per bucket; target keys per slot). 64 slots: a lookup
            reads one line of digests; against 128, 15-25% faster lookups
            for about 25% more slots (a bucket that would overflow grows its
            table, which lowers the load from 0.75 to about 0.6).
        device: where keys and rows live (CPU or CUDA).

    ``forward(features)`` takes a KeyedJaggedTensor holding (at least) the
    module's features and returns a KeyedTensor (pooled) or a dict of
    JaggedTensors (NONE), as TorchRec's collections; ``forward(values,
    offsets)`` takes ids in TBE layout (offsets [F * B + 1], features in
    ``feature_names`` order) and returns the tensor: [B, sum of the features'
    dims] pooled, [ids, dim] with NONE.
    """

    def __init__(self, tables: Sequence[FrozenTable], pooling=DynamicEmbPoolingMode.SUM, dtype="float32",
                 is_weighted: bool = False, output_dtype: torch.dtype = torch.float32, seed: int = 0,
                 mean_divisor: str = "torchrec_rw", feature_order: Optional[Sequence[str]] = None,
                 bucket_capacity: int = 64,
                 load_factor: float = 0.75, device=None):
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("InferenceEmbeddingTable needs at least one table")
        if not 0 < load_factor <= 1:
            raise ValueError(f"load_factor must be in (0, 1], got {load_factor}")
        device = canonical_device(device)
        self.table_names = [t.name for t in tables]
        if len(set(self.table_names)) != len(tables):
            raise ValueError(f"table names must be distinct, got {self.table_names}")
        self.dims = [t.dim for t in tables]
        self.feature_names = [f for t in tables for f in t.feature_names]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"a feature may feed one table only, got {self.feature_names}")
        self.feature_table_map = [i for i, t in enumerate(tables) for _ in t.feature_names]
        if feature_order is not None:
            if sorted(feature_order) != sorted(self.feature_names):
                raise ValueError(f"feature_order {list(feature_order)} is not an order of the tables' features "
                                 f"{self.feature_names}")
            table_of = dict(zip(self.feature_names, self.feature_table_map))
            self.feature_names = list(feature_order)
            self.feature_table_map = [table_of[f] for f in self.feature_names]
        self.feature_dims = [self.dims[t] for t in self.feature_table_map]
        per_table = list(pooling) if isinstance(pooling, (list, tuple)) else [pooling] * len(tables)
        if len(per_table) != len(tables):
            raise ValueError(f"{len(per_table)} pooling modes for {len(tables)} tables")
        self.table_poolings = [pooling_code(p) for p in per_table]
        kinds = set(self.table_poolings)
        if DynamicEmbPoolingMode.NONE in kinds and len(kinds) > 1:
            raise ValueError(f"pooling NONE cannot mix with pooled tables: {dict(zip(self.table_names, per_table))}")
        if mean_divisor not in ("torchrec_rw", "length"):
            raise ValueError(f"mean_divisor must be 'torchrec_rw' or 'length', got {mean_divisor!r}")
        self.mean_divisor = mean_divisor
        # One op call pools every feature: the op's MEAN when every table is
        # MEAN by length, else SUM with the MEAN features divided afterwards.
        self.pooling = kinds.pop() if len(kinds) == 1 else int(DynamicEmbPoolingMode.SUM)
        if self.pooling == DynamicEmbPoolingMode.MEAN and mean_divisor == "torchrec_rw":
            self.pooling = int(DynamicEmbPoolingMode.SUM)
        self._mean_features = [f for f, t in enumerate(self.feature_table_map)
                               if self.table_poolings[t] == DynamicEmbPoolingMode.MEAN
                               and self.pooling != DynamicEmbPoolingMode.MEAN]
        if self.pooling == DynamicEmbPoolingMode.NONE and len(set(self.feature_dims)) > 1:
            raise ValueError(f"pooling NONE needs one dim for all tables, got {dict(zip(self.table_names, self.dims))}")
        self.is_weighted = bool(is_weighted)
        self.value_dtype = value_dtype(dtype)
        self.output_dtype = output_dtype
        self.seed = int(seed)
        self.bucket_capacity = bucket_capacity
        for t in tables:
            if t.keys.dim() != 1 or t.values.dim() != 2 or t.values.shape[0] != t.keys.numel():
                raise ValueError(f"table {t.name!r}: keys must be [n] and values [n, dim], got "
                                 f"{tuple(t.keys.shape)} and {tuple(t.values.shape)}")
            if t.keys.dtype not in (torch.int64, torch.int32) or not t.values.is_floating_point():
                raise TypeError(f"table {t.name!r}: keys must be int64 (got {t.keys.dtype}) and values floating "
                                f"(got {t.values.dtype})")
        ht = pack_keys(tables, bucket_capacity, load_factor, device)
        # Read at random by every lookup, never resized: each in a mapping of its own (memory.full).
        self.register_buffer("slot_keys", memory.in_own_mapping(ht.slot_keys))
        self.register_buffer("slot_digests", memory.in_own_mapping(ht.slot_digests))
        self.register_buffer("table_buckets", ht.table_buckets)
        self.register_buffer("eval_init_params", torch.tensor([t.eval_init for t in tables], dtype=torch.float64))
        for i, t in enumerate(tables):
            self.register_buffer(f"weight_{i}", self._rows_at_slots(ht, i, t, device))

    def _rows_at_slots(self, ht: ScoredHashTable, i: int, t: FrozenTable, device) -> torch.Tensor:
        begin, end = ht.table_slot_range(i)
        slots, _ = ht.lookup(t.keys.to(device=device, dtype=torch.int64), torch.full_like(t.keys, i, device=device,
                                                                                          dtype=torch.int64))
        # Rows read at random: on 2 MiB pages where the kernel offers them, in a mapping of their own.
        rows = memory.zeros((end - begin, storage_width(t.dim, self.value_dtype)), self.value_dtype, device,
                            own_mapping=True)
        rows[slots - begin] = to_storage(t.values.to(device), self.value_dtype)
        return rows

    @classmethod
    def from_dump(cls, path: str, table_names: Optional[Sequence[str]] = None, dtype="float32",
                  feature_names: Optional[Dict[str, List[str]]] = None, pooling=None, **kwargs
                  ) -> "InferenceEmbeddingTable":
        """The tables of the dump at `path` (all, or `table_names`, in that
        order), from any number of ranks, or the dynamic tables of the
        torch.distributed.checkpoint of model.state_dict() at `path`.
        Features, pooling, the eval initializer and its seed come from the
        dump's manifest (the checkpoint's entries), and whether the ids are
        weighted (is_weighted) from the collection the tables were trained in;
        `pooling`, `feature_names` ({table: [features]}) and `is_weighted`
        override them."""
        found = dump_tables(path, table_names, feature_names)
        tables = [v["table"] for v in found.values()]
        seeds = {v["seed"] for v in found.values()}
        if len(seeds) > 1:
            raise ValueError(f"the tables of {path} were trained with different seeds {sorted(seeds)}: build one "
                             f"InferenceEmbeddingTable per seed (table_names=...)")
        kwargs.setdefault("seed", seeds.pop())
        if pooling is None:
            pooling = [v["pooling"] for v in found.values()]
        if "is_weighted" not in kwargs:  # as the collection the tables were trained in (dumps record it)
            weighted = {v["is_weighted"] for v in found.values()} - {None}
            if len(weighted) > 1:
                raise ValueError(f"the tables {sorted(found)} of {path} come from weighted and unweighted "
                                 f"collections: build one InferenceEmbeddingTable per collection (table_names=...), "
                                 f"or pass is_weighted")
            kwargs["is_weighted"] = weighted.pop() if weighted else False
        return cls(tables, pooling=pooling, dtype=dtype, **kwargs)

    def save(self, path: str) -> str:
        """Writes the table to one safetensors file `path` (its hash index,
        rows and configuration) that load() maps; returns `path`."""
        from dynamicemb.inference.mapped import save
        return save(self, path)

    @classmethod
    def load(cls, path: str, mmap: bool = True, device=None, hbm_cache_bytes: int = 0,
             hot_keys: Optional[Dict[str, torch.Tensor]] = None) -> "InferenceEmbeddingTable":
        """The table saved at `path`. With mmap (the default) its buffers are
        views of a memory map of the file: served through the page cache
        with no copy in the process's memory, so a table larger than the
        memory the process may use is served; on CUDA the hash index is
        copied to the device and the rows are read from the mapped host
        pages (registered with CUDA). mmap=False reads it into memory.
        hbm_cache_bytes > 0 copies up to that many bytes of rows to the
        device (a hot-row cache the lookup reads instead of the mapped rows;
        the same answers): those of `hot_keys` ({table: keys, hottest
        first}) where given, else each table's stored rows in slot order
        (inference/hot_cache.py)."""
        from dynamicemb.inference.mapped import load
        return load(cls, path, mmap=mmap, device=device, hbm_cache_bytes=hbm_cache_bytes, hot_keys=hot_keys)

    # ---- what it holds -----------------------------------------------------------------

    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight_{i}") for i in range(len(self.table_names))]

    hot_cache = False  # load(hbm_cache_bytes=...) sets it with hot_weight_<i> / hot_pos_<i>

    def hot_rows(self):
        """(hot_weights, hot_pos) of the hot-row cache, or (None, None)."""
        if not self.hot_cache:
            return None, None
        T = range(len(self.table_names))
        return [getattr(self, f"hot_weight_{i}") for i in T], [getattr(self, f"hot_pos_{i}") for i in T]

    def num_keys(self) -> Dict[str, int]:
        """Keys stored per table."""
        ht_buckets = self.table_buckets.tolist()
        live = self.slot_digests.ne(0)
        return {n: int(live[ht_buckets[i] * self.bucket_capacity:ht_buckets[i + 1] * self.bucket_capacity].sum())
                for i, n in enumerate(self.table_names)}

    def memory_bytes(self) -> int:
        """Bytes of keys, digests and rows."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"tables={self.table_names}, dims={self.dims}, pooling={DynamicEmbPoolingMode(self.pooling).name}, "
                f"dtype={self.value_dtype}, slots={self.slot_keys.numel()}")

    # ---- lookups -----------------------------------------------------------------------

    def lookup(self, values: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Ids in TBE layout -> the pooled [B, sum dims] (or [ids, dim] with NONE) tensor."""
        if values.dtype not in (torch.int64, torch.int32) or offsets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"InferenceEmbeddingTable {self.table_names}: ids and offsets must be int64 or int32, "
                            f"got {values.dtype} and {offsets.dtype} (features {self.feature_names})")
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(torch.float32)
            if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
                check_finite_weights(per_sample_weights, offsets, self.feature_names, f"InferenceEmbeddingTable "
                                     f"{self.table_names}")
            else:  # data-dependent: a runtime assertion of the program (eager names the weight and its bag)
                torch._assert_async(torch.isfinite(per_sample_weights).all(),
                                    f"InferenceEmbeddingTable {self.table_names}: per-sample weights must be finite "
                                    f"(features {self.feature_names})")
        out = ops.emb_lookup_forward([self.slot_keys], [self.slot_digests], [self.table_buckets],
                                      [self.bucket_capacity], [0] * len(self.dims), list(range(len(self.dims))),
                                      self.weights(), values.to(torch.int64), offsets.to(torch.int64),
                                      self.feature_table_map, self.dims, per_sample_weights, self.pooling,
                                      self.eval_init_params, self.seed, self.output_dtype, *self.hot_rows())
        return self._divide_means(out, offsets, per_sample_weights) if self._mean_features else out

    def _divide_means(self, out: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor]) -> torch.Tensor:
        """MEAN features of a SUM-pooled output, divided per bag (mean_divisor)."""
        offsets = offsets.to(torch.int64)
        lengths = offsets.diff()
        if self.mean_divisor == "length":  # as the kernel: acc * (1 / L); an empty bag stays 0
            L = lengths.to(torch.float32)
            per_bag = torch.where(L > 0, 1.0 / L.clamp(min=1), torch.ones_like(L))
        elif psw is None:  # TorchRec's row-wise MEAN: / (length + 1e-6)
            per_bag = lengths + 1e-6
        else:  # weighted: / (sum of the bag's weights + 1e-6)
            bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=out.device), lengths,
                                          output_size=psw.numel())
            per_bag = torch.zeros(lengths.numel(), dtype=torch.float32, device=out.device).index_add_(0, bag, psw)
            per_bag = per_bag + 1e-6
        # The [B, sum dims] factors: element (b, c) of a MEAN feature f's
        # column c divides by per_bag[f * B + b]; built by flat indexing, not
        # views or slices of per_bag, so export puts no divisibility guard on
        # the offsets' length (a free dim: AOTInductor would derive the batch
        # from F * batch + 1 in floating point and be off by one) and does
        # not specialise a batch of one (no broadcasting).
        B, D = out.shape[0], out.shape[1]
        col_feature = torch.tensor([f for f, d in enumerate(self.feature_dims) for _ in range(d)], device=out.device)
        col_mean = torch.tensor([f in self._mean_features for f, d in enumerate(self.feature_dims) for _ in range(d)],
                                device=out.device)
        i = torch.arange(B * D, device=out.device)
        col = i % D
        per_bag = per_bag.to(out.dtype)
        factor = torch.where(col_mean[col], per_bag[col_feature[col] * B + i // D], 1.0).view(B, D)
        return out * factor if self.mean_divisor == "length" else out / factor

    def forward(self, features, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None):
        if offsets is not None or isinstance(features, torch.Tensor):
            if offsets is None:
                raise ValueError("InferenceEmbeddingTable: ids given as a tensor need offsets [F * B + 1]")
            return self.lookup(features, offsets, per_sample_weights)
        from dynamicemb.inference.jagged import jagged_output, select_features
        values, offsets, weights, lengths = select_features(features, self.feature_names, self.table_names)
        out = self.lookup(values, offsets, weights if self.is_weighted else None)
        return jagged_output(out, self.feature_names, self.feature_dims, lengths, self.pooling)
