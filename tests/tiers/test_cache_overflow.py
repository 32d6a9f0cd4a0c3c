"""A cache far smaller than a step's distinct keys degrades (safe_check_mode
WARNING or IGNORE): the keys that find no cache slot are served from, and
written back to, the backing store around their step, so training matches
an all-in-memory module bit for bit, with and without prefetch; the
overflow is counted (`bypassed`) and WARNING says once how big the cache
must be."""
import warnings

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, EmbOptimType
from tier_helpers import BUCKET, all_rows, batches, make_store, module

CACHE = 2 * BUCKET  # rows per table: far fewer than a step's ~50 distinct keys per table


def _loss(y):
    return (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y) / 100).sum()


def _train(m, data, prefetch: bool):
    """Steps over data as the train pipeline orders them (batch i+1 is
    prefetched between batch i's forward and backward); the outputs."""
    outs = []
    if prefetch:
        m.prefetch(*data[0])
    for i, b in enumerate(data):
        y = m(*b)
        if prefetch and i + 1 < len(data):
            m.prefetch(*data[i + 1])
        _loss(y).backward()
        outs.append(y.detach())
    return outs


def _small(kind, tmp_path, optimizer, mode=DynamicEmbCheckMode.IGNORE):
    return module(optimizer, store=make_store(kind, tmp_path), cache_rows=CACHE, safe_check_mode=mode)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("kind", ["host", "file", "dict"])
@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM])
def test_a_too_small_cache_trains_as_all_in_memory(kind, prefetch, optimizer, tmp_path):
    data = batches(6, seed=1)
    small, ref = _small(kind, tmp_path, optimizer), module(optimizer)
    assert small.table_stats()["t0"]["cache_capacity"] == CACHE
    for got, want in zip(_train(small, data, prefetch), _train(ref, data, prefetch=False)):
        assert torch.equal(got, want)
    stats = small.table_stats()
    assert all(stats[t]["bypassed"] > 0 for t in ("t0", "t1"))
    for t in range(2):
        got, want = all_rows(small, t), all_rows(ref, t)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        # the rows the module finds (cache then store) after a flush: the same
        keys = torch.tensor(sorted(want))
        small.flush()
        assert small.storage.tables.find(keys, torch.full_like(keys, t)).max() < 0  # all in the store now
    # and training goes on alike from the store
    more = batches(2, seed=5)
    for got, want in zip(_train(small, more, prefetch), _train(ref, more, prefetch=False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("strategy", ["LFU", "STEP", "CUSTOMIZED"])
def test_scores_are_those_of_an_in_memory_table(strategy, tmp_path):
    from dynamicemb import DynamicEmbScoreStrategy
    data = batches(5, seed=2)
    s = DynamicEmbScoreStrategy[strategy]
    small = module(store=make_store("host"), cache_rows=CACHE, strategy=s)
    ref = module(strategy=s)
    if strategy == "CUSTOMIZED":
        for m in (small, ref):
            m.set_score(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(small, data, False)
    _train(ref, data, False)
    for t in range(2):
        want = {k: s for b in ref.storage.export(t) for k, s in zip(b[0].tolist(), b[2].tolist())}
        got = {k: s for b in small.storage.export(t) for k, s in zip(b[0].tolist(), b[2].tolist())}
        assert got == want


def test_bypassed_counts_the_keys_left_without_a_cache_slot(tmp_path):
    small = _small("host", tmp_path, EmbOptimType.EXACT_SGD)
    want = torch.zeros(2, dtype=torch.int64)
    seen = [set(), set()]
    for ids, offsets in batches(5, seed=3):
        y = small(ids, offsets)
        for t in range(2):
            seen[t].update(ids.view(2, -1)[t].tolist())
        # independently: the step's distinct keys that the cache's table does not hold
        per_table = ids.view(2, -1)
        for t in range(2):
            keys = torch.unique(per_table[t])
            want[t] += int((small.storage.tables.find(keys, torch.full_like(keys, t)) < 0).sum())
        _loss(y).backward()
    stats = small.table_stats()
    assert [stats["t0"]["bypassed"], stats["t1"]["bypassed"]] == want.tolist()
    assert want.min() > 0
    # A bypassed key is stored (in the store): not a failure (it was counted as one).
    for t in range(2):
        s = stats[f"t{t}"]
        assert s["failed"] == 0 and s["evicted"] == 0 and s["size"] == s["inserted"] == len(seen[t]), s


def test_warning_mode_warns_once_per_table_with_the_size_needed(tmp_path):
    small = _small("host", tmp_path, EmbOptimType.EXACT_SGD, mode=DynamicEmbCheckMode.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(small, batches(4, seed=4), prefetch=False)
    said = [str(w.message) for w in caught if "cannot hold" in str(w.message)]
    assert len(said) <= 2 and all("global_hbm_for_values >=" in s and "bypassed" in s for s in said)
    assert sum(f"table {t!r}" in s for s in said for t in ("t0", "t1")) == 2  # each table named once


def test_ignore_mode_says_nothing(tmp_path):
    small = _small("host", tmp_path, EmbOptimType.EXACT_SGD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(small, batches(2, seed=4), prefetch=False)
    assert not [w for w in caught if "cannot hold" in str(w.message)]


def _dmp_overflow(rank, world):
    import torch.distributed as dist

    import tiered_dmp as td
    from tiered_dmp import models
    pg = dist.group.WORLD
    data = td.zipf_batches(steps=4, batch_size=64)  # far more distinct keys per rank than one bucket
    small = td.build("ebc", pg, models.SGD, cache_rows=2 * td.BUCKET, safe_check_mode=DynamicEmbCheckMode.IGNORE)
    ref = td.build("ebc", pg, models.SGD)
    for got, want in zip(td.train(small, data, pg), td.train(ref, data, pg)):
        assert torch.equal(got, want)
    td.assert_same_rows(small, ref, pg, "overflowing cache")
    import dynamicemb
    return [s["bypassed"] for s in dynamicemb.table_stats(small, pg).values()]


def test_two_ranks_train_as_all_in_memory():
    from tiered_dmp import run_ranks
    assert all(min(b) > 0 for b in run_ranks(_dmp_overflow, 2))


def test_two_forwards_before_their_backwards_keep_every_key_in_one_place(tmp_path):
    """A second forward before the first's backward: the first's overflow
    rows go back to the store first (that backward then finds them gone, as
    any key moved meanwhile: no update), so no key is in two places and the
    keys stored are those of an all-in-memory module."""
    small, ref = _small("host", tmp_path, EmbOptimType.EXACT_SGD), module()
    a, b = batches(2, seed=6)
    for m in (small, ref):
        ya, yb = m(*a), m(*b)
        _loss(ya).backward()
        _loss(yb).backward()
    assert small.table_stats()["t0"]["bypassed"] > 0
    for t in range(2):
        assert all_rows(small, t).keys() == all_rows(ref, t).keys()  # all_rows: no key in two places


@pytest.mark.parametrize("read", ["dump", "incremental"])
@pytest.mark.parametrize("kind", ["host", "file"])
def test_a_checkpoint_between_forward_and_backward_keeps_the_overflow_rows_update(read, kind, tmp_path):
    """A checkpoint between a forward whose keys overflowed the cache and its
    backward: the dump holds every key as it is at the call (the overflow
    rows too), and the backward still updates them (before, the export
    sent them back to the store, and their update was lost)."""
    from dynamicemb import DynamicEmbDump, DynamicEmbLoad
    from dynamicemb.incremental_dump import incremental_dump
    data = batches(6, seed=3)
    small, ref = _small(kind, tmp_path, EmbOptimType.ADAM), module(EmbOptimType.ADAM)
    for i, b in enumerate(data):
        y, want = small(*b), ref(*b)
        if i == 3:
            snapshot = [all_rows(ref, t) for t in range(2)]
            if read == "dump":
                DynamicEmbDump(str(tmp_path / "ckpt"), small)
            else:
                got, _ = incremental_dump(small, 0)
                for t, name in enumerate(("t0", "t1")):
                    keys, values = got[name]
                    assert sorted(keys.tolist()) == sorted(snapshot[t])
                    for k, v in zip(keys.tolist(), values):
                        assert torch.equal(v, snapshot[t][k][:v.numel()])
        _loss(y).backward()
        _loss(want).backward()
    assert small.table_stats()["t0"]["bypassed"] > 0
    for t in range(2):
        got, want = all_rows(small, t), all_rows(ref, t)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if read == "dump":
        fresh = module(EmbOptimType.ADAM)
        DynamicEmbLoad(str(tmp_path / "ckpt"), fresh)
        for t in range(2):
            got = all_rows(fresh, t)
            assert got.keys() == snapshot[t].keys() and all(torch.equal(got[k], snapshot[t][k]) for k in got)
