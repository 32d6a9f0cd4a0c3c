"""Small TorchRec models with dynamic tables, built the way a user would, and
what the multi-rank tests share: batches, per-rank process groups, reading
rows back from every rank."""
import random
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.types import LazyAwaitable, ShardingEnv

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder
from dynamicemb.stats import dynamic_modules


def ebc_configs(names, dim=8, num_embeddings=4096, pooling=torchrec.PoolingType.SUM):
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=num_embeddings,
                                        feature_names=[n.replace("table", "feature")], pooling=pooling)
            for n in names]


def ec_configs(names, dim=8, num_embeddings=4096):
    return [torchrec.EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=num_embeddings,
                                     feature_names=[n.replace("table", "feature")]) for n in names]


def configs_of(kind: str, names, **kw):
    """ec_configs for kind "ec", else ebc_configs (an EBC, weighted or not)."""
    return (ec_configs if kind == "ec" else ebc_configs)(names, **kw)


def dynamic_constraints(names, **options):
    options.setdefault("initializer_args", DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.DEBUG))
    return {n: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(**options))
            for n in names}


def shard(module, configs, world_size, constraints, fused_params, collective=False, env=None, ec_sharder=None):
    """DMP over `module` with our planner and sharders (ec_sharder: the
    EmbeddingCollection's, if not the default), on CPU (over `env`'s
    process group when given, else the world)."""
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params=fused_params),
                ec_sharder or DynamicEmbeddingCollectionSharder(fused_params=fused_params)]
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=world_size, compute_device="cpu"),
                                              constraints=constraints)
    plan = (planner.collective_plan(module, sharders, env.process_group if env else None) if collective
            else planner.plan(module, sharders))
    return DistributedModelParallel(module, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders)


SGD = dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1)


# ---- inside spawned ranks --------------------------------------------------------------


def rank_groups() -> List[dist.ProcessGroup]:
    """[world group, a 1-rank group of this rank]: a multi-rank run also
    builds the 1-rank reference model, saving a spawn. Collective: every rank
    creates every 1-rank group."""
    world = dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)]
    return [dist.GroupMember.WORLD, own[dist.get_rank()]]


def build(kind: str, configs, pg: dist.ProcessGroup, constraints, fused_params, wrap=None, collective=False):
    """A collection (kind "ebc", "weighted_ebc" or "ec") on meta, wrapped by
    `wrap` (or not), sharded over `pg` with our planner (its collective_plan
    when `collective`) and sharders."""
    if kind == "ec":
        module = torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta"))
    else:
        module = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"),
                                                 is_weighted=kind == "weighted_ebc")
    if wrap is not None:
        module = wrap(module)
    return shard(module, configs, pg.size(), constraints, fused_params, collective=collective,
                 env=ShardingEnv.from_process_group(pg))


def random_batch(features: Sequence[str], batch_size: int, num_keys: int, seed: int, max_len: int = 3,
                 key_offset: int = 0) -> Dict[str, List[List[int]]]:
    """{feature: one bag (list of keys) per sample}; keys repeat across and
    within bags; some bags are empty."""
    rng = random.Random(seed)
    return {f: [[key_offset + rng.randrange(num_keys) for _ in range(rng.randrange(max_len + 1))]
                for _ in range(batch_size)] for f in features}


def kjt(batch: Dict[str, List[List[int]]], samples: Optional[slice] = None,
        weighted: bool = False) -> torchrec.KeyedJaggedTensor:
    """The KJT of `samples` of a batch (all by default); `weighted`: each key
    weighs 1 + (key mod 5) / 10, wherever it is fed."""
    samples = samples or slice(None)
    keys = list(batch)
    bags = [b for f in keys for b in batch[f][samples]]
    values = torch.tensor([k for b in bags for k in b], dtype=torch.int64)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=torch.tensor([len(b) for b in bags], dtype=torch.int64),
        weights=1 + (values % 5).to(torch.float32) / 10 if weighted else None)


def local_samples(batch_size: int, pg: dist.ProcessGroup) -> slice:
    """This rank's contiguous part of a global batch."""
    n = batch_size // pg.size()
    r = dist.get_rank(pg)
    return slice(r * n, (r + 1) * n)


def stored_rows(model, table: str, keys: torch.Tensor, pg: dist.ProcessGroup):
    """(rows [n, dim + optimizer state], owner rank [n], -1 where no rank holds
    the key) of a dynamic table, read from the storage of every rank of `pg`.
    Asserts that no key is held by two ranks."""
    keys = keys.to(torch.int64)
    mods = [(m, m.table_names.index(table)) for m in dynamic_modules(model) if table in m.table_names]
    assert len(mods) == 1, f"table {table!r} found in {len(mods)} dynamic modules"
    m, t = mods[0]
    rows_of = getattr(m.storage, "rows_of", None)  # both parts of a hybrid table
    w = rows_of(t) if rows_of is not None else m.storage.weights()[t]
    rows = m.storage.find(keys, torch.full_like(keys, t))
    found = rows >= 0
    values = torch.zeros(keys.numel(), w.shape[1], dtype=torch.float64)
    values[found] = w.index_select(0, rows[found]).to(torch.float64)
    holders = found.to(torch.int64)
    owner = torch.where(found, dist.get_rank(pg), 0)
    for t_ in (values, holders, owner):
        dist.all_reduce(t_, group=pg)
    assert bool((holders <= 1).all()), f"table {table!r}: keys held by several ranks"
    return values, torch.where(holders == 1, owner, -1)


def every_row(model, tables, pg: dist.ProcessGroup) -> Dict[str, Dict[int, list]]:
    """{table: {key: value row}} of dynamic tables, from every tier (a cache
    and its store) of every rank of `pg`."""
    local: Dict[str, Dict[int, list]] = {}
    for m in dynamic_modules(model):
        for t, name in enumerate(m.table_names):
            for b in m.storage.export_rows(t):
                local.setdefault(name, {}).update(zip(b.keys.tolist(), b.values.tolist()))
    gathered = [None] * pg.size()
    dist.all_gather_object(gathered, local, group=pg)
    return {t: {k: v for g in gathered for k, v in g.get(t, {}).items()} for t in tables}


def local_scores(model, table: str) -> Dict[int, int]:
    """{key: score} of the keys this rank's storage holds for a dynamic table,
    read from the kernel's storage."""
    mods = [(m, m.table_names.index(table)) for m in dynamic_modules(model) if table in m.table_names]
    assert len(mods) == 1, f"table {table!r} found in {len(mods)} dynamic modules"
    m, t = mods[0]
    out = {}
    for keys, _, scores in m.storage.export(t):
        out.update(zip(keys.tolist(), scores.tolist()))
    return out


def native_rows(model, fqn: str, pg: dist.ProcessGroup) -> torch.Tensor:
    """The full weight of a native sharded table (state_dict key `fqn`),
    assembled from the shards of every rank of `pg`."""
    st = model.state_dict()[fqn]
    full = torch.zeros(st.size(), dtype=torch.float64)
    for s in st.local_shards():
        (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
        full[r0:r0 + nr, c0:c0 + nc] = s.tensor.to(torch.float64)
    dist.all_reduce(full, group=pg)
    return full


def set_native_rows(model, fqn: str, weight: torch.Tensor) -> None:
    """Writes a full weight into this rank's shards of a native table."""
    st = model.state_dict()[fqn]
    with torch.no_grad():
        for s in st.local_shards():
            (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
            s.tensor.copy_(weight[r0:r0 + nr, c0:c0 + nc])


def set_dynamic_rows(model, table: str, weight: torch.Tensor, pg: dist.ProcessGroup) -> None:
    """Stores keys 0..N-1 with the rows of `weight` in a dynamic table, each on
    the rank that routing gives it (the keys this rank's storage may hold)."""
    from dynamicemb.routing import owners
    m = [m for m in dynamic_modules(model) if table in m.table_names][0]
    t = m.table_names.index(table)
    o = m.table_options[t]
    keys = torch.arange(weight.shape[0], dtype=torch.int64)
    mine = owners(keys, o.dist_type, pg.size(), o.num_embeddings) == dist.get_rank(pg)
    rows = m.storage.insert_rows(t, keys[mine], weight[mine])
    assert bool((rows >= 0).all()), f"table {table!r}: rows could not be stored"



def resolved(out):
    """A sharded collection's output (a LazyAwaitable), awaited."""
    return out.wait() if isinstance(out, LazyAwaitable) else out


def output_values(out) -> torch.Tensor:
    """One tensor of a collection's output: the KeyedTensor's [B, sum dims]
    (EBC), or every feature's id rows concatenated (EC)."""
    out = resolved(out)
    if isinstance(out, torchrec.KeyedTensor):
        return out.values()
    return torch.cat([out[f].values() for f in sorted(out)])


def sample_rows(out, samples: slice) -> torch.Tensor:
    """The rows of output_values that belong to `samples` (EC: per feature,
    the ids of those samples)."""
    out = resolved(out)
    if isinstance(out, torchrec.KeyedTensor):
        return out.values()[samples]
    parts = []
    for f in sorted(out):
        offsets = out[f].offsets()
        b, e = range(offsets.numel() - 1)[samples][0], range(offsets.numel() - 1)[samples][-1] + 1
        parts.append(out[f].values()[offsets[b]:offsets[e]])
    return torch.cat(parts)


def loss_of(out) -> torch.Tensor:
    """A loss whose gradient depends on the output (so a wrong forward also
    shows in the updated rows)."""
    return ((output_values(out).to(torch.float64) - 0.5) ** 2).sum()


def native_model(configs, pg: dist.ProcessGroup, fused_params, kind: str = "ebc", sharding_type="table_wise",
                 **constraint_settings):
    """The pure-TorchRec reference: a collection of native FUSED tables,
    planned and sharded by TorchRec's own planner and sharder (each table's
    ParameterConstraints also given `constraint_settings`)."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    if kind != "ec":
        module = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"),
                                                 is_weighted=kind == "weighted_ebc")
        sharders = [EmbeddingBagCollectionSharder(fused_params=fused_params)]
    else:
        module = torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta"))
        sharders = [EmbeddingCollectionSharder(fused_params=fused_params)]
    constraints = {c.name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=["fused"],
                                                **constraint_settings) for c in configs}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=pg.size(), compute_device="cpu"),
                                       constraints=constraints)
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                    plan=planner.plan(module, sharders), sharders=sharders)


def native_and_dynamic(kind: str, configs, pg: dist.ProcessGroup, fused_params, start: Dict[str, torch.Tensor]):
    """The native reference (native_model) and the same collection of dynamic
    tables (our planner and sharders), both holding `start`'s rows."""
    native = native_model(configs, pg, fused_params, kind)
    dynamic = build(kind, configs, pg, dynamic_constraints([c.name for c in configs]), fused_params)
    for c in configs:
        set_native_rows(native, weight_fqn(kind, c.name), start[c.name])
        set_dynamic_rows(dynamic, c.name, start[c.name], pg)
    return native, dynamic


def weight_fqn(kind: str, table: str) -> str:
    """state_dict key of a native table of a bare collection under DMP."""
    return f"{'embeddings' if kind == 'ec' else 'embedding_bags'}.{table}.weight"


def initial_weights(configs, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Per table, a full [num_embeddings, dim] weight to start both models from."""
    g = torch.Generator().manual_seed(seed)
    return {c.name: torch.rand(c.num_embeddings, c.embedding_dim, generator=g) - 0.5 for c in configs}


def train_steps(model, optimizer, batches) -> List[torch.Tensor]:
    """A plain training loop (what a train pipeline must match) over a model
    returning (loss, logits); returns each step's logits."""
    logits = []
    for b in batches:
        optimizer.zero_grad()
        loss, out = model(b)
        loss.backward()
        optimizer.step()
        logits.append(out)
    return logits
