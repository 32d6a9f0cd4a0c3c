"""A cache holding about 10% of the keys in front of a backing store (host,
file, or a user's dict) trains exactly as one all-in-memory table: the same
outputs at every step and the same rows and optimizer state at the end
(SGD, Adam, row-wise Adagrad; prefetch on and off; several score
strategies), and evaluates the same over both tiers."""
import pytest
import torch

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import EmbOptimType
from tier_helpers import all_rows, batches, make_store, module, step

OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM, EmbOptimType.EXACT_ROWWISE_ADAGRAD]


@pytest.mark.parametrize("store_kind", ["host", "file", "dict"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("prefetch", [False, True])
def test_cached_training_equals_all_in_memory(tmp_path, store_kind, optimizer, prefetch, device):
    ref = module(optimizer, device=device)
    cached = module(optimizer, make_store(store_kind, tmp_path), device=device)
    data = [tuple(x.to(device) for x in b) for b in batches(60)]
    side = torch.cuda.Stream() if device == "cuda" else None
    main = torch.cuda.current_stream() if device == "cuda" else None
    for i, b in enumerate(data):
        if prefetch and side is not None:  # as TorchRec's prefetch pipeline: on a side stream
            with torch.cuda.stream(side):
                cached.prefetch(*b, forward_stream=main)
        elif prefetch:
            cached.prefetch(*b)
        assert torch.equal(step(cached, b), step(ref, b)), f"step {i}"
    stats = cached.table_stats()["t0"]
    assert stats["write_backs"] > 0 and stats["cache_rows"] <= 0.12 * stats["size"]  # about 10% cached
    assert stats["size"] == ref.table_stats()["t0"]["size"] == stats["inserted"]
    for t in range(2):
        want, got = all_rows(ref, t), all_rows(cached, t)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # Eval over both tiers (nothing moves), unseen keys included.
    ref.eval()
    cached.eval()
    ids = torch.cat([data[0][0][:40], torch.arange(5000, 5008, device=device)])
    offsets = torch.arange(0, 49, 6, device=device)
    before = cached.table_stats()["t0"]["cache_rows"]
    assert torch.equal(cached(ids, offsets), ref(ids, offsets))
    assert cached.table_stats()["t0"]["cache_rows"] == before
    # A flush leaves every row in the store, the same rows.
    cached.flush()
    assert cached.table_stats()["t0"]["cache_rows"] == 0
    assert all_rows(cached, 0).keys() == all_rows(ref, 0).keys()


@pytest.mark.parametrize("strategy", [S.LFU, S.STEP, S.CUSTOMIZED])
def test_scores_follow_keys_across_tiers(strategy):
    """A key's score is the same whichever tier it went through (LFU counts
    add up across trips to the store)."""
    ref, cached = module(strategy=strategy), module(store=make_store("host"), strategy=strategy)
    if strategy == S.CUSTOMIZED:
        for m in (ref, cached):
            m.set_score(7)
    for b in batches(10, seed=1):
        assert torch.equal(step(cached, b), step(ref, b))
    for t in range(2):
        want = {int(k): int(s) for b in ref.storage.export_rows(t) for k, s in zip(b.keys, b.scores)}
        got = {int(k): int(s) for b in cached.storage.export_rows(t) for k, s in zip(b.keys, b.scores)}
        assert got == want


def test_flush_between_forward_and_backward_warns():
    """A flush empties the cache, so a pending backward's updates would be
    lost: the flush says so; between steps it is silent."""
    import warnings

    cached = module(store=make_store("host"))
    b = batches(2, seed=4)
    step(cached, b[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached.flush()  # between steps: nothing pending
    y = cached(*b[1])
    with pytest.warns(RuntimeWarning, match=r"\['t0', 't1'\] between a training forward and its backward"):
        cached.flush()
    y.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached.flush()


def test_training_forward_under_no_grad_pins_nothing():
    """A training-mode forward under no_grad gets no backward: it leaves no
    pin behind (a flush after it is silent) and trains on as the reference."""
    import warnings

    ref, cached = module(), module(store=make_store("host"))
    data = batches(4, seed=6)
    for m in (ref, cached):
        step(m, data[0])
        with torch.no_grad():
            m(*data[1])
    assert not cached.storage._forward_pins
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached.flush()
    for b in data[2:]:
        assert torch.equal(step(cached, b), step(ref, b))
    assert all_rows(cached, 0).keys() == all_rows(ref, 0).keys()


def test_eval_of_a_hybrid_table_beside_a_cached_one_reads_its_host_rows():
    """A hybrid table (rows past its global_hbm_for_values share in host
    memory) in the same module as a cached table: eval reads its host rows
    too, as the module without budgets does (it indexed past its head and
    raised IndexError)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions

    def build(budgets):
        hyb = dict(global_hbm_for_values=100 * 8 * 4) if budgets else {}
        cac = dict(caching=True, global_hbm_for_values=256 * 8 * 4) if budgets else {}
        return BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=8, max_capacity=4096, **hyb),
                                              DynamicEmbTableOptions(dim=8, max_capacity=4096, **cac)],
                                             table_names=["hyb", "cached"], optimizer=EmbOptimType.EXACT_SGD,
                                             learning_rate=0.05)
    a, b = build(True), build(False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = (torch.rand(400, generator=g) * 1000).long()
        ya, yb = a(ids, torch.arange(0, 401, 4)), b(ids, torch.arange(0, 401, 4))
        assert torch.equal(ya, yb)
        ya.pow(2).sum().backward()
        yb.pow(2).sum().backward()
    assert a.table_stats()["hyb"]["host_rows"] > 0 and a.table_stats()["cached"]["store_rows"] > 0
    a.eval()
    b.eval()
    ids = torch.arange(1000)
    assert torch.equal(a(ids, torch.arange(0, 1001, 5)), b(ids, torch.arange(0, 1001, 5)))
