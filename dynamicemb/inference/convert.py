"""to_inference: a trained model, its embedding collections frozen.

Every embedding collection sharded by DistributedModelParallel (dynamic
tables, native tables, or both) and every bare BatchedDynamicEmbeddingTables
is replaced by an InferenceEmbeddingTable holding all of its rows (gathered
from every rank); everything else (the dense part) is copied unchanged. The
result is a plain module that torch.export can export."""
import copy
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
from dynamicemb.inference.sources import module_tables
from dynamicemb.inference.frozen import FrozenTable
from dynamicemb.inference.table import InferenceEmbeddingTable
from dynamicemb.stats import dynamic_modules
from dynamicemb.types import DynamicEmbPoolingMode


def _full_weight(w) -> torch.Tensor:
    """A native table's whole weight from its (sharded) state_dict entry
    (collective for a ShardedTensor: every rank adds its shards)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    if isinstance(w, DTensor):
        return w.full_tensor().detach().cpu()
    if not isinstance(w, ShardedTensor):
        return w.detach().cpu()
    full = torch.zeros(w.size(), dtype=torch.float64)
    for s in w.local_shards():
        (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
        full[r0:r0 + nr, c0:c0 + nc] = s.tensor.detach().cpu().to(torch.float64)
    dist.all_reduce(full, group=w._process_group)
    return full.to(w.dtype)


def _sharded_collection(sm, dtype, pg, device, kwargs) -> InferenceEmbeddingTable:
    """An InferenceEmbeddingTable answering as a sharded EBC / EC does."""
    pooled = hasattr(sm, "_embedding_bag_configs")
    configs = sm._embedding_bag_configs if pooled else sm._embedding_configs
    dynamic: Dict[str, FrozenTable] = {}
    seeds = set()
    for m in dynamic_modules(sm):
        seeds.add(m.seed)
        for t in module_tables(m, pg):
            dynamic[t.name] = t
    if len(seeds) > 1:
        raise ValueError(f"the dynamic tables {sorted(dynamic)} of one collection use different seeds {sorted(seeds)}")
    state = sm.state_dict() if len(dynamic) < len(configs) else {}
    prefix = "embedding_bags" if pooled else "embeddings"
    tables = []
    for c in configs:
        if c.name in dynamic:
            t = dynamic[c.name]
            t.feature_names = list(c.feature_names)
        else:  # a native table: ids 0..N-1 are its rows
            weight = _full_weight(state[f"{prefix}.{c.name}.weight"])
            t = FrozenTable(c.name, torch.arange(weight.shape[0], dtype=torch.int64), weight, list(c.feature_names))
        tables.append(t)
    if pooled:
        pooling = [c.pooling.name for c in configs]
        order = [n.split("@")[0] for n in sm._embedding_names]  # the sharded output's order
        kwargs.setdefault("is_weighted", bool(sm._is_weighted))
    else:
        pooling, order = "NONE", None
    return InferenceEmbeddingTable(tables, pooling=pooling, dtype=dtype, seed=seeds.pop() if seeds else 0,
                                   feature_order=order, device=device, **kwargs)


def _bare_module(m: BatchedDynamicEmbeddingTables, dtype, pg, device, kwargs) -> InferenceEmbeddingTable:
    """Same inputs (indices, offsets in its feature order) and outputs as `m` in eval."""
    tables = module_tables(m, pg)
    names: List[str] = []
    for t in tables:
        t.feature_names = []
    for f, t in enumerate(m.feature_table_map):
        tables[t].feature_names.append(f"{m.table_names[t]}.f{f}")
        names.append(tables[t].feature_names[-1])
    keep = [t for t in tables if t.feature_names]
    kwargs.setdefault("mean_divisor", "length")  # the module's own MEAN
    return InferenceEmbeddingTable(keep, pooling=DynamicEmbPoolingMode(m.pooling), dtype=dtype, seed=m.seed,
                                   output_dtype=m.output_dtype, feature_order=names, device=device, **kwargs)


class FeatureProcessedTable(torch.nn.Module):
    """A FeatureProcessedEmbeddingBagCollection frozen: its feature
    processors (e.g. position weights) applied to the whole batch, then the
    weighted InferenceEmbeddingTable."""

    def __init__(self, processors: torch.nn.Module, is_collection: bool, table: InferenceEmbeddingTable):
        super().__init__()
        self.processors, self.is_collection, self.table = processors, is_collection, table

    def forward(self, features):
        if self.is_collection:
            features = self.processors(features)
        else:
            from torchrec.modules.fp_embedding_modules import apply_feature_processors_to_kjt
            features = apply_feature_processors_to_kjt(features, self.processors)
        return self.table(features)


def to_inference(model: torch.nn.Module, dtype="float32", pg: Optional[dist.ProcessGroup] = None,
                 device=None, **kwargs) -> torch.nn.Module:
    """A copy of `model` (unwrapped from DistributedModelParallel) in which
    each embedding collection is an InferenceEmbeddingTable of precision
    `dtype` (float32, float16, bfloat16, int8). Collective over `pg` (default:
    the world) when the model is sharded: every rank calls it, and every rank
    gets the whole model. `kwargs` go to InferenceEmbeddingTable. The copy
    is in eval mode; the model is unchanged."""
    root = model
    try:
        from torchrec.distributed.model_parallel import DistributedModelParallel
        if isinstance(model, DistributedModelParallel):
            root = model.module
        from torchrec.distributed.embedding import ShardedEmbeddingCollection
        from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
        from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection as Fp
        sharded_types, fp_types = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection), (Fp,)
    except ImportError:
        sharded_types, fp_types = (), ()
    memo = {}
    for _, sub in root.named_modules():
        if id(sub) in memo:
            continue
        if isinstance(sub, fp_types):  # (its feature processors, then its sharded EBC)
            ebc = sub._embedding_bag_collection
            memo[id(ebc)] = _sharded_collection(ebc, dtype, pg, device, dict(kwargs))
            memo[id(sub)] = FeatureProcessedTable(copy.deepcopy(sub._feature_processors), sub._is_collection,
                                                  memo[id(ebc)])
        elif isinstance(sub, sharded_types):
            memo[id(sub)] = _sharded_collection(sub, dtype, pg, device, dict(kwargs))
        elif isinstance(sub, BatchedDynamicEmbeddingTables):
            memo[id(sub)] = _bare_module(sub, dtype, pg, device, dict(kwargs))
    if id(root) in memo:  # the model is one collection
        return memo[id(root)].eval()
    out = copy.deepcopy(root, memo)  # the collections replaced, the rest copied
    return out.eval()
