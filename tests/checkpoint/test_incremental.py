"""incremental_dump returns exactly the keys touched since the threshold
(TIMESTAMP and the (TIMESTAMP, LFU) pair: a time.monotonic_ns() reading;
STEP: a step; LFU: a count), gathered from 2 ranks with pg, and its next
thresholds select the following step's keys. get_score / set_score drive
STEP and CUSTOMIZED scores."""
from collections import Counter

import pytest
import torch

import ckpt_helpers as H
import scenarios
from dynamicemb.incremental_dump import get_score, incremental_dump, set_score


def _touched(table, seeds):
    return {k for s in seeds for bag in H.global_batch(s)[H.feature(table)] for k in bag}


def _counts(table, seeds):
    return Counter(k for s in seeds for bag in H.global_batch(s)[H.feature(table)] for k in bag)


@pytest.mark.parametrize("call", ["first", "second"])
def test_incremental_dump_over_two_ranks(call):
    ranks = scenarios.two_ranks()
    r = ranks[0]["incremental"]
    assert r["score"] == {"t_hash": 2}  # get_score: the STEP table's module step
    step = 3 if call == "first" else 4
    stored = {t: {k: v for e in r[call + "_entries"] for k, v in zip(e[t]["keys"].tolist(), e[t]["values"])}
              for t in H.TABLES}
    for t in H.TABLES:
        keys, values = r[call][t]
        for x in ranks[1:]:  # with pg, every rank receives every rank's rows
            assert torch.equal(x["incremental"][call][t][0], keys) and torch.equal(x["incremental"][call][t][1], values)
        assert len(set(keys.tolist())) == keys.numel(), f"{t}: a key returned twice"
        if t == "t_rr":  # LFU: the keys seen at least twice so far
            want = {k for k, c in _counts(t, range(1, step + 1)).items() if c >= 2}
        else:  # the keys of this step's batch (all ranks' parts)
            want = _touched(t, [step])
        assert set(keys.tolist()) == want, f"{t}: {sorted(set(keys.tolist()) ^ want)[:8]} returned wrongly"
        for k, v in zip(keys.tolist(), values):
            assert torch.equal(v, stored[t][k]), f"{t}: value of key {k} is not the stored one"
    # The next thresholds: the step after the current one, the LFU count unchanged.
    nxt = r["next" if call == "first" else "next2"]
    assert (nxt["t_hash"], nxt["t_rr"]) == (step + 1, 2)


def test_get_and_set_score_step_and_customized():
    S = H.S
    m = H.plain_module(strategies=(S.STEP, S.CUSTOMIZED), names=("s", "c"))
    set_score(m, {"c": 5})
    H.plain_train(m, [1])  # step 1
    assert get_score(m) == {"s": 1, "c": 5}
    set_score(m, {"s": 10, "c": 7})
    assert get_score(m) == {"s": 10, "c": 7}
    H.plain_train(m, [2])  # step 11
    e = H.entries(m)
    for t, (before, after) in (("s", (1, 11)), ("c", (5, 7))):
        fresh = H.plain_keys([2], ["s", "c"].index(t))
        for k, score in zip(e[t]["keys"].tolist(), e[t]["scores"].tolist()):
            assert score == (after if k in fresh else before), f"{t}: key {k} has score {score}"
    got, nxt = incremental_dump(m, {"s": 11, "c": 7})
    assert set(got["s"][0].tolist()) == H.plain_keys([2], 0)
    assert set(got["c"][0].tolist()) == H.plain_keys([2], 1)
    assert nxt == {"s": 12, "c": 7}
    # One int sets every STEP and CUSTOMIZED table.
    set_score(m, 3)
    assert get_score(m) == {"s": 3, "c": 3}
    ts = H.plain_module(strategies=(S.TIMESTAMP, S.STEP), names=("x", "y"))
    with pytest.raises(ValueError, match="'x'.*only STEP and CUSTOMIZED"):
        set_score(ts, {"x": 1})
    lfu = H.plain_module(strategies=(S.LFU,), names=("f",))
    with pytest.warns(RuntimeWarning, match=r"set_score: the model's dynamic tables \['f'\] score by neither"):
        set_score(lfu, 3)
    # A misspelt table name is an error, not a silent no-op.
    with pytest.raises(ValueError, match=r"no dynamic tables named \['typo'\]"):
        set_score(m, {"typo": 1})
    assert get_score(m) == {"s": 3, "c": 3}


@pytest.mark.parametrize("strategy", ["STEP", "TIMESTAMP"])
def test_a_dump_between_a_forward_and_its_backward_keeps_its_update_for_the_next(strategy):
    """The forward scores its keys, the backward changes their rows: a dump
    in between has their old rows, so its next threshold must select them
    again (reference: the rows the live model holds after the backward)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024, bucket_capacity=16,
                                                              score_strategy=getattr(H.S, strategy))],
                                      table_names=["t"], optimizer=EmbOptimType.ADAM, learning_rate=0.1)

    def forward(keys):
        return m(torch.tensor(keys), torch.tensor([0, len(keys)]))
    forward([1, 2, 3]).sum().backward()
    _, nxt = incremental_dump(m, 0)
    out = forward([5, 6])
    mid, nxt_mid = incremental_dump(m, nxt)
    assert sorted(mid["t"][0].tolist()) == [5, 6]
    out.sum().backward()
    after, _ = incremental_dump(m, nxt_mid)
    live, _ = incremental_dump(m, 0)
    rows = dict(zip(live["t"][0].tolist(), live["t"][1]))
    got = dict(zip(after["t"][0].tolist(), after["t"][1]))
    assert set(got) == {5, 6}
    for k in (5, 6):
        torch.testing.assert_close(got[k], rows[k], atol=0, rtol=0)
        assert not torch.equal(got[k], mid["t"][1][mid["t"][0].tolist().index(k)])  # the update is in it
    # With no forward open, the threshold moves past what was dumped.
    _, nxt_after = incremental_dump(m, nxt_mid)
    again, _ = incremental_dump(m, nxt_after)
    assert again["t"][0].numel() == 0


def test_threshold_zero_is_every_row_of_a_clock_table():
    """Rows loaded from another clock older than this one's origin (the
    host's uptime) hold negative readings: 0, "every row", still has them."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
    m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024, score_strategy=H.S.TIMESTAMP)],
                                      table_names=["t"], optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1)
    m(torch.arange(10), torch.tensor([0, 10])).sum().backward()
    ht = m.storage.groups[0][0]
    live = (ht.slot_scores != 0).nonzero().squeeze(1)[:4]
    ht.slot_scores[live] = -(10 ** 15)  # as a load leaves rows aged more than the clock's reading
    got, _ = incremental_dump(m, 0)
    assert sorted(got["t"][0].tolist()) == list(range(10))
    got, _ = incremental_dump(m, 1)
    assert len(got["t"][0]) == 6


@pytest.mark.parametrize("bad", [2**70, 2.7, "5", True])
def test_scores_and_thresholds_must_be_int64s(bad):
    """A float or string score was truncated or parsed, and 2**70 failed in
    the next forward after the step had counted; all are refused by name."""
    m = H.plain_module(strategies=(H.S.STEP, H.S.CUSTOMIZED), names=("s", "c"))
    with pytest.raises(ValueError, match=r"table '(s|c)': a score must be an int in int64's range"):
        set_score(m, bad)
    with pytest.raises(ValueError, match=r"set_score: a score must be an int in int64's range"):
        m.set_score(bad)
    with pytest.raises(ValueError, match=r"table '(s|c)': a score must be an int"):
        incremental_dump(m, bad)
    set_score(m, torch.tensor(7))  # an integer tensor is an int
    assert m.storage.custom_scores[1] == 7 and m.step == 7


@pytest.mark.parametrize("clock", ["same", "another"])
def test_clock_thresholds_across_a_load(tmp_path, monkeypatch, clock):
    """A dump keeps its clock's reading. Loaded on the same clock (one host,
    as a restarted job), the access times come back as saved, so a
    threshold from before the dump still selects exactly the keys touched
    since; one from after the dump warns (the load rolled back what changed
    since, which a replica fed past the dump keeps). On another clock (modelled: the wall clock an hour off, so the
    clocks' offsets differ) ages count back from the load: a threshold from
    before it warns, 0 gets every row, and the thresholds returned after the
    load select the keys touched after them. A threshold past the clock is
    not a reading of it (another host's): refused."""
    import warnings

    from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
    from dynamicemb.checkpoint import clock as C

    def module():
        return H.plain_module(strategies=(H.S.TIMESTAMP, H.S.STEP))

    def touch(m, keys):
        m(torch.tensor(keys), torch.tensor([0, len(keys), len(keys)])).sum().backward()

    def keys_since(m, threshold):
        return sorted(incremental_dump(m, {"a": threshold, "b": 0})[0]["a"][0].tolist())

    m = module()
    touch(m, [1, 2, 3])
    _, before = incremental_dump(m, 0)
    touch(m, [4])
    DynamicEmbDump(str(tmp_path / "d"), m)
    touch(m, [1, 5])  # after the dump: a replica fed past it holds these
    _, past_dump = incremental_dump(m, before)
    if clock == "another":
        real = C.time.time_ns
        monkeypatch.setattr(C.time, "time_ns", lambda: real() + 3600 * 10**9)
    loaded = module()
    DynamicEmbLoad(str(tmp_path / "d"), loaded)
    touch(loaded, [7])
    if clock == "same":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert keys_since(loaded, before["a"]) == [4, 7]  # (key 1's change after the dump was rolled back)
            assert H.entries(loaded)["a"]["scores"][1:4].tolist() == H.entries(m)["a"]["scores"][1:4].tolist()
        # A threshold from after the dump: the load rolled back key 1 and dropped key 5, which a replica
        # fed up to it keeps, and incremental dumps carry no removals.
        with pytest.warns(RuntimeWarning, match=r"it is later than the checkpoint \(whose clock read \d+\): the "
                                                r"load rolled back what changed after the dump"):
            keys_since(loaded, past_dump["a"])
    else:
        with pytest.warns(RuntimeWarning, match=r"table 'a': threshold \d+ is from before the table's load from a "
                                                r"checkpoint: the checkpoint was saved on another clock"):
            keys_since(loaded, before["a"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert keys_since(loaded, 0) == [1, 2, 3, 4, 7]
            _, after = incremental_dump(loaded, 0)
            assert keys_since(loaded, loaded.storage.now(0)) == []  # any reading taken since the load: no warning
            touch(loaded, [9])
            assert keys_since(loaded, after["a"]) == [9]
    with pytest.raises(ValueError, match=r"table 'a': threshold \d+ is later than the table's clock"):
        incremental_dump(loaded, {"a": loaded.storage.now(0) + 10**15, "b": 0})


def test_an_empty_clock_tables_load_keeps_its_thresholds(tmp_path):
    """A clock table with no rows writes no part file: the dump still keeps
    its clock's reading, so a load on the same clock keeps the thresholds
    from before (it warned as if the dump came from another host)."""
    import warnings

    from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
    m = H.plain_module(strategies=(H.S.TIMESTAMP, H.S.STEP))
    _, before = incremental_dump(m, 0)
    DynamicEmbDump(str(tmp_path / "d"), m)
    loaded = H.plain_module(strategies=(H.S.TIMESTAMP, H.S.STEP))
    DynamicEmbLoad(str(tmp_path / "d"), loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows, _ = incremental_dump(loaded, {"a": before["a"], "b": 0})
    assert rows["a"][0].numel() == 0


def test_a_threshold_refused_on_one_rank_raises_on_every_rank():
    r0, r1 = (r["incremental"]["ahead"] for r in scenarios.two_ranks())
    assert r1 is not None and "table 't_cont': threshold" in r1 and "later than the table's clock" in r1, r1
    assert r0 is not None and r0.startswith("incremental_dump: rank 1 refused its thresholds: ValueError: "), r0
