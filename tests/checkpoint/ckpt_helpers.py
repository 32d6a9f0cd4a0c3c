"""What the checkpoint tests share: a small TorchRec model (an EBC and an EC
with dynamic tables of every dist_type and several score strategies, Adam),
a plain BatchedDynamicEmbeddingTables, deterministic batches, and reading a
table's entries back *without* the export path that dumps use (hash-table
export for the keys, find + weights for the rows, slot scores by lookup), so
that they are an independent reference for what a load restored."""
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: multiprocess
import io  # noqa: E402

from multiprocess import run_ranks as _run_ranks  # noqa: E402

from dynamicemb import (  # noqa: E402
    BatchedDynamicEmbeddingTables,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EmbOptimType,
)
from dynamicemb.checkpoint.tables import model_tables  # noqa: E402
from dynamicemb.routing import owners  # noqa: E402
from dynamicemb.stats import dynamic_modules  # noqa: E402

S = DynamicEmbScoreStrategy
NUM_EMB = 4096
# table: (dim, dist_type, score strategy). One model covers every dist_type;
# t_cont's TIMESTAMP scores and t_seq's access times are clock readings.
BAG_TABLES = {"t_hash": (8, "hash_roundrobin", S.STEP),
              "t_rr": (4, "roundrobin", S.LFU),
              "t_cont": (8, "continuous", S.TIMESTAMP)}
SEQ_TABLES = {"t_seq": (4, "hash_roundrobin", (S.TIMESTAMP, S.LFU))}
TABLES = {**BAG_TABLES, **SEQ_TABLES}
CLOCK_SCORES = {"t_cont"}  # tables whose score is a clock reading
CLOCK_TIMESTAMPS = {"t_seq"}  # tables with (clock) access times beside the score
ADAM = dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05)
GLOBAL_BATCH = 12


def _as_bytes(rank, world, fn, *args):
    buf = io.BytesIO()
    torch.save(fn(rank, world, *args), buf)
    return buf.getvalue()


def run_ranks(fn, world: int, *args, timeout: float = 300):
    """tests/multiprocess.run_ranks, the results sent back as bytes: a tensor
    put on the queue as is travels as a file descriptor that the rank's exit
    may close before the parent reads it. Raises TimeoutError after `timeout` s."""
    return [torch.load(io.BytesIO(b), weights_only=False)
            for b in _run_ranks(_as_bytes, world, fn, *args, timeout=timeout)]


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A temporary directory for a spawned run's files, removed afterwards:
    a checkpoint round trip writes tens of MiB, which a directory left in
    /tmp by every test run would pile up."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_in_scratch(prefix: str, fn, world: int, *args, **kw):
    """run_ranks(fn, world, <a scratch directory>, *args), the directory
    removed once the ranks are done."""
    with scratch_dir(prefix) as root:
        return run_ranks(fn, world, root, *args, **kw)


def once(fn):
    """Caches a spawned run's result *or its failure* for the session: the
    tests sharing a run should not each spawn it again after it failed."""
    memo = {}

    def wrapper(*args):
        if args not in memo:
            try:
                memo[args] = (True, fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised to every caller
                memo[args] = (False, e)
        ok, value = memo[args]
        if not ok:
            raise value
        return value
    return wrapper


def feature(table: str) -> str:
    return "f" + table[1:]


# ---- TorchRec model (inside spawned ranks) ----------------------------------------------


class TwoCollections(torch.nn.Module):
    def __init__(self, num_embeddings: int = NUM_EMB, dims: Dict[str, int] = None):
        import torchrec
        super().__init__()
        meta = torch.device("meta")
        dims = dims or {}
        self.ebc = torchrec.EmbeddingBagCollection(device=meta, tables=[
            torchrec.EmbeddingBagConfig(name=n, embedding_dim=dims.get(n, d), num_embeddings=num_embeddings,
                                        feature_names=[feature(n)]) for n, (d, _, _) in BAG_TABLES.items()])
        self.ec = torchrec.EmbeddingCollection(device=meta, tables=[
            torchrec.EmbeddingConfig(name=n, embedding_dim=dims.get(n, d), num_embeddings=num_embeddings,
                                     feature_names=[feature(n)]) for n, (d, _, _) in SEQ_TABLES.items()])

    def configs(self):
        return list(self.ebc.embedding_bag_configs()) + list(self.ec.embedding_configs())

    def forward(self, bag_kjt, seq_kjt):
        return self.ebc(bag_kjt), self.ec(seq_kjt)


def build(pg: dist.ProcessGroup, fused_params=ADAM, num_embeddings: int = NUM_EMB, dims: Dict[str, int] = None,
          **option_overrides):
    """TwoCollections sharded row-wise over `pg` with our planner and sharders
    (`dims`: other embedding dims for some tables)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.types import ShardingEnv

    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
    from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

    import logging
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # keys beyond num_embeddings are the point here
    module = TwoCollections(num_embeddings, dims)
    constraints = {}
    for n, (_, dist_type, strategy) in TABLES.items():
        opts = dict(dist_type=dist_type, score_strategy=strategy)
        opts.update(option_overrides.get(n, {}))
        constraints[n] = DynamicEmbParameterConstraints(use_dynamicemb=True,
                                                        dynamicemb_options=DynamicEmbTableOptions(**opts))
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params=fused_params),
                DynamicEmbeddingCollectionSharder(fused_params=fused_params)]
    planner = DynamicEmbeddingShardingPlanner(module.configs(), topology=Topology(world_size=pg.size(),
                                                                                  compute_device="cpu"),
                                              constraints=constraints, optimizer=fused_params["optimizer"])
    plan = planner.plan(module, sharders)
    # ShardingEnv(pg) builds a device mesh, a collective over the *world*:
    # subgroups that only some ranks use need the env without it.
    env = ShardingEnv.__new__(ShardingEnv)
    env.world_size, env.rank, env.process_group = pg.size(), dist.get_rank(pg), pg
    env.device_mesh, env.output_dtensor = None, False
    return DistributedModelParallel(module, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders)


def global_batch(seed: int) -> Dict[str, List[List[int]]]:
    """{feature: GLOBAL_BATCH bags}: keys repeat within and across bags, some
    bags are empty, a few keys are negative or far beyond num_embeddings."""
    rng = random.Random(seed)

    def key():
        r = rng.random()
        return rng.randrange(-2**40, 2**40) if r < 0.3 else rng.randrange(-20, 200)
    return {feature(t): [[key() for _ in range(rng.randrange(4))] for _ in range(GLOBAL_BATCH)] for t in TABLES}


def kjts(batch, pg=None, whole=False):
    """(bag KJT, sequence KJT) of this rank's contiguous part of a global
    batch (all of it with whole=True: every rank sees the same probe)."""
    import torchrec
    n = len(next(iter(batch.values())))
    if whole or pg is None:
        sl = slice(None)
    else:
        per = n // pg.size()
        sl = slice(dist.get_rank(pg) * per, (dist.get_rank(pg) + 1) * per)

    def make(tables):
        feats = [feature(t) for t in tables]
        bags = [b for f in feats for b in batch[f][sl]]
        return torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=feats, values=torch.tensor([k for b in bags for k in b], dtype=torch.int64),
            lengths=torch.tensor([len(b) for b in bags], dtype=torch.int64))
    return make(BAG_TABLES), make(SEQ_TABLES)


def outputs(model, batch_kjts) -> Dict[str, torch.Tensor]:
    pooled, seq = model(*batch_kjts)
    out = dict(pooled.to_dict())
    out.update({f: jt.values() for f, jt in seq.items()})
    return out


def train(model, pg, seeds: Sequence[int]) -> None:
    """One training step per seed; the loss (sum of squares of every output)
    gives every touched row a non-trivial gradient."""
    model.train()
    for s in seeds:
        loss = sum((v * v).sum() for v in outputs(model, kjts(global_batch(s), pg)).values())
        loss.backward()


@torch.no_grad()
def probe(model, seed: int = 999) -> Dict[str, torch.Tensor]:
    """Eval outputs of a fixed probe batch (every rank feeds all of it), with
    keys the training batches held and keys they did not."""
    model.eval()
    out = {k: v.detach().clone() for k, v in outputs(model, kjts(global_batch(seed), whole=True)).items()}
    model.train()
    return out


# ---- reading entries back ---------------------------------------------------------------


def entries(model) -> dict:
    """{table: {keys, values, state, scores, ts}} of this rank's storage, and
    "_modules": [(table names, step, optimizer_step)], read without export_rows."""
    out = {}
    for name, ref in model_tables(model).items():
        st, t = ref.storage, ref.index
        g, lt = st.group_of[t]
        ht = st.groups[g][0]
        keys = [b.keys for b in ht.export(table_id=lt)]
        keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
        keys = keys.sort().values
        slots, found = ht.lookup(keys, torch.full_like(keys, lt))
        assert bool(found.all())
        rows = st.find(keys, torch.full_like(keys, t))
        rows_of = getattr(st, "rows_of", None)  # both parts of a hybrid table
        w = rows_of(t).index_select(0, rows) if rows_of is not None else st.weights()[t][rows].clone()
        dim = ref.options.dim
        out[name] = dict(keys=keys, values=w[:, :dim], state=w[:, dim:], scores=ht.slot_scores[slots].clone(),
                         ts=ht.slot_timestamps[slots].clone() if ht.slot_timestamps.numel() else None,
                         slots=slots - sum(ht.capacities()[:lt]))  # in the logical table
    out["_modules"] = sorted((tuple(m.table_names), m.step, m.optimizer_step) for m in dynamic_modules(model))
    return out


def gathered_entries(model, pg) -> List[dict]:
    """entries() of every rank of pg, in rank order."""
    mine = entries(model)
    if pg.size() == 1:
        return [mine]
    out = [None] * pg.size()
    dist.all_gather_object(out, mine, group=pg)
    return out


def assert_same_entries(orig: List[dict], loaded: List[dict], dumped_ns: int = 0, loaded_ns: int = 0,
                        optim: bool = True, dist_types: Dict[str, str] = None, num_embeddings: int = NUM_EMB,
                        one_clock: bool = True) -> None:
    """Every key of the original ranks is on exactly one loaded rank, the one
    routing gives it, with equal value, optimizer state (zero when
    optim=False) and score. Clock readings (stored as ages) come back as
    saved where the save and the load share one clock (one host: every test
    run here); with one_clock=False (a load on another clock) they may move
    forward by at most the time between the dump (dumped_ns, taken before
    it) and the load (loaded_ns, taken after it). dist_types: {table:
    dist_type} to check (default: the TorchRec model's tables)."""
    world = len(loaded)
    dist_types = dist_types or {n: d for n, (_, d, _) in TABLES.items()}
    for name, dist_type in dist_types.items():
        ref = {}
        for r in orig:
            e = r[name]
            for i, k in enumerate(e["keys"].tolist()):
                assert k not in ref, f"{name}: key {k} on two original ranks"
                ref[k] = (e, i)
        seen = set()
        for rank, r in enumerate(loaded):
            e = r[name]
            ks = e["keys"]
            assert bool((owners(ks, dist_type, world, num_embeddings) == rank).all()), \
                f"{name}: rank {rank} of {world} holds keys routing gives to another rank"
            for i, k in enumerate(ks.tolist()):
                assert k not in seen, f"{name}: key {k} loaded twice"
                assert k in ref, f"{name}: key {k} was not in the dump"
                seen.add(k)
                o, j = ref[k]
                assert torch.equal(e["values"][i], o["values"][j]), f"{name}: value of key {k} differs"
                want_state = o["state"][j] if optim else torch.zeros_like(o["state"][j])
                if e["state"].shape[1] == want_state.numel():
                    assert torch.equal(e["state"][i], want_state), f"{name}: optimizer state of key {k} differs"
                else:
                    assert not optim and not bool(e["state"][i].any()), f"{name}: state of key {k} is not zero"
                _same_score(name, k, int(e["scores"][i]), int(o["scores"][j]),
                            name in CLOCK_SCORES and not one_clock, dumped_ns, loaded_ns)
                if o["ts"] is not None:
                    _same_score(name, k, int(e["ts"][i]), int(o["ts"][j]), name in CLOCK_TIMESTAMPS and not one_clock,
                                dumped_ns, loaded_ns)
        assert seen == set(ref), f"{name}: {len(set(ref) - seen)} dumped keys were not loaded"


def _same_score(name, key, got, want, moved_clock, dumped_ns, loaded_ns):
    if not moved_clock:
        assert got == want, f"{name}: score of key {key} is {got}, was {want}"
        return
    # An age counted from the load on another clock: the loaded reading is the
    # original plus (load time - dump time), positive and at most loaded_ns - dumped_ns.
    assert 0 < got - want <= loaded_ns - dumped_ns, \
        f"{name}: clock score of key {key} moved by {got - want} ns (bound {loaded_ns - dumped_ns})"


def assert_same_outputs(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], exact: bool) -> None:
    assert set(got) == set(want)
    for f in want:
        if exact:
            assert torch.equal(got[f], want[f]), f"output {f} differs"
        else:  # another world size sums a bag's rows in another order
            torch.testing.assert_close(got[f], want[f], rtol=1e-6, atol=1e-6, msg=f"output {f} differs")


def now_ns() -> int:
    return time.monotonic_ns()


# ---- a plain module (single process) -------------------------------------------------


PLAIN_DIST = {"a": "hash_roundrobin", "b": "hash_roundrobin"}  # plain_module's tables (one process: no routing)


def plain_module(optimizer=EmbOptimType.ADAM, dims=(8, 4), strategies=(S.STEP, S.LFU), names=("a", "b"),
                 **option_kwargs) -> BatchedDynamicEmbeddingTables:
    opts = [DynamicEmbTableOptions(dim=d, max_capacity=512, bucket_capacity=16, score_strategy=s,
                                   **option_kwargs) for d, s in zip(dims, strategies)]
    return BatchedDynamicEmbeddingTables(opts, table_names=list(names), optimizer=optimizer, learning_rate=0.05)


def plain_batch(seed: int, num_tables: int = 2, batch: int = 6, num_keys: int = 60):
    """TBE input (indices, offsets) over num_tables features."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (num_tables * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(-5, num_keys, (int(lengths.sum()),), generator=g)
    return indices, offsets


def plain_train(module, seeds) -> None:
    module.train()
    for s in seeds:
        out = module(*plain_batch(s, module.num_tables))
        (out * out).sum().backward()


@torch.no_grad()
def plain_probe(module, seed: int = 999) -> torch.Tensor:
    module.eval()
    out = module(*plain_batch(seed, module.num_tables, num_keys=80)).clone()
    module.train()
    return out


def plain_keys(seeds, table: int, num_tables: int = 2, batch: int = 6) -> set:
    """The keys a plain module's table saw in the batches of `seeds`."""
    out = set()
    for s in seeds:
        indices, offsets = plain_batch(s, num_tables, batch)
        out |= set(indices[offsets[table * batch]:offsets[(table + 1) * batch]].tolist())
    return out
