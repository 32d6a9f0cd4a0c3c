"""NVIDIA dynamicemb's names (dynamicemb/aliases.py, API.md "Coming from
NVIDIA dynamicemb"): each is accepted with a DeprecationWarning that names
ours, and behaves exactly as our name does (the reference: the same module
built and trained with our name). The porting idiom
incremental_dump(m, get_score(m)) works, or says what to pass instead."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint"))
import ckpt_helpers as H  # noqa: E402

from dynamicemb import rules  # noqa: E402
from dynamicemb import (  # noqa: E402
    BatchedDynamicEmbeddingTables,
    BatchedDynamicEmbeddingTablesV2,
    DynamicEmbDump,
    DynamicEmbEvictStrategy,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbLoad,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EmbOptimType,
)
from dynamicemb.checkpoint.format import read_manifest  # noqa: E402
from dynamicemb.incremental_dump import get_score, incremental_dump, set_score  # noqa: E402
from dynamicemb.tiers import NvidiaStorageStore  # noqa: E402
from dynamicemb.tiers.nvidia_store import CopyMode  # noqa: E402

S = DynamicEmbScoreStrategy
SMALL = dict(max_capacity=256, bucket_capacity=16)


def _module(opts, cls=BatchedDynamicEmbeddingTables, names=("a", "b"), optimizer=EmbOptimType.ADAM):
    return cls(opts, table_names=list(names), optimizer=optimizer, learning_rate=0.05)


def _same_training(m1, m2, steps=4):
    """Trains both on the same batches; their outputs, eval outputs and rows agree exactly."""
    for s in range(steps):
        idx, off = H.plain_batch(s, m1.num_tables, num_keys=300)
        o1, o2 = m1(idx, off), m2(idx, off)
        assert torch.equal(o1, o2)
        (o1 * o1).sum().backward()
        (o2 * o2).sum().backward()
    assert torch.equal(H.plain_probe(m1), H.plain_probe(m2))
    e1, e2 = H.entries(m1), H.entries(m2)
    for i, t in enumerate(m1.table_names):
        clock = rules.score_is_clock(m1.storage.strategy(i))  # readings of each module's own clock
        for k in ("keys", "values", "state") + (() if clock else ("scores",)):
            assert torch.equal(e1[t][k], e2[t][k]), (t, k)


# ---- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("evict, ours", [(DynamicEmbEvictStrategy.LFU, S.LFU), ("lru", S.TIMESTAMP),
                                         (DynamicEmbEvictStrategy.CUSTOMIZED, S.CUSTOMIZED)])
def test_evict_strategy_is_score_strategy(evict, ours):
    with pytest.warns(DeprecationWarning, match=f"score_strategy=DynamicEmbScoreStrategy.{ours.name}"):
        o = DynamicEmbTableOptions(dim=4, evict_strategy=evict, **SMALL)
    assert o.score_strategy == ours and o.evict_strategy is None
    ref = DynamicEmbTableOptions(dim=4, score_strategy=ours, **SMALL)
    assert o == ref
    if ours != S.CUSTOMIZED:
        _same_training(_module([o, o]), _module([ref, ref]))


def test_evict_strategy_yields_to_a_given_score_strategy_and_epoch_is_refused():
    # NVIDIA's STEP tables evict CUSTOMIZED: the score strategy decides, and the warning says so.
    with pytest.warns(DeprecationWarning, match=r"the score_strategy given \(STEP\) decides here, so this table "
                                                r"evicts by STEP, not by evict_strategy"):
        o = DynamicEmbTableOptions(dim=4, score_strategy=S.STEP, evict_strategy=DynamicEmbEvictStrategy.CUSTOMIZED)
    assert o.score_strategy == S.STEP
    with pytest.raises(ValueError, match="EPOCH_LRU.*no dynamicemb counterpart"):
        DynamicEmbTableOptions(dim=4, evict_strategy=DynamicEmbEvictStrategy.EPOCH_LRU)


@pytest.mark.parametrize("value", ["uniform", "normal", "truncated_normal", "constant", "debug"])
def test_initializer_mode_strings(value):
    with pytest.warns(DeprecationWarning, match=f"DynamicEmbInitializerMode.{value.upper()}"):
        mode = DynamicEmbInitializerMode(value)
    assert mode is DynamicEmbInitializerMode[value.upper()]
    with pytest.warns(DeprecationWarning):
        theirs = DynamicEmbInitializerArgs(mode=value, value=0.5)
    assert theirs == DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode[value.upper()], value=0.5)
    with pytest.raises(ValueError, match="unknown initializer"):
        DynamicEmbInitializerArgs(mode="gaussian")


def test_batched_v2_is_our_module():
    opts = [DynamicEmbTableOptions(dim=4, score_strategy=S.STEP, **SMALL)] * 2
    with pytest.warns(DeprecationWarning, match="dynamicemb's is BatchedDynamicEmbeddingTables"):
        theirs = _module(opts, BatchedDynamicEmbeddingTablesV2)
    assert isinstance(theirs, BatchedDynamicEmbeddingTables)
    _same_training(theirs, _module(opts))


# ---- external_storage: an NVIDIA-style Storage behind the cache -------------------------------------


class DictStorage:
    """A minimal storage of NVIDIA's interface (find / insert / export_keys_values
    and the dims), a dict per table; `erase` only when asked."""

    def __init__(self, dims, state_widths, with_erase=False):
        self.dims, self.states = list(dims), list(state_widths)
        self.rows = [dict() for _ in dims]
        if with_erase:
            self.erase = self._erase

    def embedding_dim(self, t):
        return self.dims[t]

    def value_dim(self, t):
        return self.dims[t] + self.states[t]

    def max_embedding_dim(self):
        return max(self.dims)

    def max_value_dim(self):
        return max(self.dims) + max(self.states)

    def find(self, keys, table_ids, copy_mode, lfu_accumulated_frequency=None):
        assert copy_mode is CopyMode.VALUE
        n = keys.numel()
        founds = torch.zeros(n, dtype=torch.bool)
        scores = torch.zeros(n, dtype=torch.int64)
        values = torch.zeros(n, self.max_value_dim())
        for i, (k, t) in enumerate(zip(keys.tolist(), table_ids.tolist())):
            if k in self.rows[t]:
                founds[i] = True
                values[i], scores[i] = self.rows[t][k]
        missing = (~founds).nonzero().flatten()
        return missing.numel(), keys[missing], missing, scores[missing], founds, scores, values

    def insert(self, keys, table_ids, values, scores=None, preserve_existing=False):
        for i, (k, t) in enumerate(zip(keys.tolist(), table_ids.tolist())):
            self.rows[t][k] = (values[i].clone(), int(scores[i]) if scores is not None else 0)

    def _erase(self, keys, table_ids):
        for k, t in zip(keys.tolist(), table_ids.tolist()):
            self.rows[t].pop(k, None)

    def export_keys_values(self, device, batch_size=65536, table_id=0):
        items = sorted(self.rows[table_id].items())
        if items:
            keys = torch.tensor([k for k, _ in items], dtype=torch.int64)
            v = torch.stack([r for _, (r, _) in items])
            maxe = self.max_embedding_dim()
            yield (keys, v[:, :self.dims[table_id]], v[:, maxe:maxe + self.states[table_id]],
                   torch.tensor([s for _, (_, s) in items], dtype=torch.int64))


@pytest.mark.parametrize("with_erase", [False, True], ids=["no-erase", "erase"])
def test_external_storage_is_a_backing_store(with_erase, tmp_path):
    """A cached table in front of an NVIDIA-style storage trains, dumps and
    loads exactly as the same table in front of our HostStore (its default
    backing store): the cache holds 32 rows, the batches touch ~300 keys."""
    cache = dict(caching=True, global_hbm_for_values=32 * 12 * 4, **SMALL)
    storage = DictStorage([4], [8], with_erase=with_erase)
    with pytest.warns(DeprecationWarning, match="backing_store"):
        theirs = DynamicEmbTableOptions(dim=4, score_strategy=S.STEP, external_storage=storage, **cache)
    assert theirs.caching
    m1 = _module([theirs], names=["a"])
    m2 = _module([DynamicEmbTableOptions(dim=4, score_strategy=S.STEP, **cache)], names=["a"])
    assert isinstance(m1.storage.store, NvidiaStorageStore)
    _same_training(m1, m2)
    assert any(storage.rows[0].values())  # evicted rows went to the storage
    DynamicEmbDump(str(tmp_path / "d1"), m1)
    DynamicEmbDump(str(tmp_path / "d2"), m2)
    fresh = _module([DynamicEmbTableOptions(dim=4, score_strategy=S.STEP, **cache)], names=["a"])
    DynamicEmbLoad(str(tmp_path / "d1"), fresh)
    assert torch.equal(H.plain_probe(fresh), H.plain_probe(m2))


def test_external_storage_needs_a_cache_budget():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="external_storage puts a cache"):
        o = DynamicEmbTableOptions(dim=4, external_storage=DictStorage([4], [0]), **SMALL)
        o.validate("a")


# ---- NVIDIA's {collection: {table: ...}} dicts, and the porting idiom ------------------------------


def _trained(strategies=(S.STEP, S.CUSTOMIZED)):
    m = _module([DynamicEmbTableOptions(dim=4, score_strategy=s, **SMALL) for s in strategies])
    set_score(m, {n: 3 for n, s in zip(m.table_names, strategies) if s == S.CUSTOMIZED})
    H.plain_train(m, [1, 2, 3])
    return m


def test_nested_collection_dicts(tmp_path):
    m = _trained()
    with pytest.warns(DeprecationWarning, match=r"\{table: threshold\}"):
        theirs = incremental_dump(m, {"model.ebc": {"a": 2, "b": 3}})
    ours = incremental_dump(m, {"a": 2, "b": 3})
    for t in ("a", "b"):
        assert torch.equal(theirs[0][t][0], ours[0][t][0]) and torch.equal(theirs[0][t][1], ours[0][t][1])
    assert theirs[1] == ours[1]
    with pytest.warns(DeprecationWarning, match=r"\{table: score\}"):
        set_score(m, {"model.ebc": {"b": 7}})
    assert get_score(m)["b"] == 7
    with pytest.warns(DeprecationWarning, match="a list of table names"):
        DynamicEmbDump(str(tmp_path / "theirs"), m, table_names={"model.ebc": ["b"]})
    assert list(read_manifest(str(tmp_path / "theirs"))["tables"]) == ["b"]
    fresh = _trained()
    with pytest.warns(DeprecationWarning, match="a list of table names"):
        DynamicEmbLoad(str(tmp_path / "theirs"), fresh, table_names={"model.ebc": ["b"]})
    assert torch.equal(H.entries(fresh)["b"]["values"], H.entries(m)["b"]["values"])
    with pytest.raises(ValueError, match="table 'a' is named in two collections"):
        incremental_dump(m, {"x": {"a": 1}, "y": {"a": 2}})


def test_porting_idiom_works_for_step_and_customized_tables():
    m = _trained()
    rows, nxt = incremental_dump(m, get_score(m))
    assert set(rows) == {"a", "b"} and set(nxt) == {"a", "b"}
    assert torch.equal(rows["a"][0], incremental_dump(m, m.step)[0]["a"][0])


def test_porting_idiom_says_what_to_pass_for_clock_tables():
    m = _trained((S.STEP, S.TIMESTAMP))
    with pytest.raises(ValueError, match=r"table 'b' scores by TIMESTAMP.*get_score.*second result.*0 the first"):
        incremental_dump(m, get_score(m))
    rows, nxt = incremental_dump(m, {"a": 0, "b": 0})  # what the error says works
    assert rows["b"][0].numel() > 0 and set(nxt) == {"a", "b"}
