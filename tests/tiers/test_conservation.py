"""Conservation under any sequence of steps (hypothesis): training steps,
prefetches (some never followed by their batch), eval lookups and flushes,
with a cache a few buckets large: every key that the all-in-memory table
holds is in exactly one tier of the cached one, with the same value and
optimizer state; flush then export equals the all-in-memory table."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicemb import EmbOptimType
from tier_helpers import BATCH, all_rows, make_store, module, step

_ACTIONS = st.lists(st.tuples(st.sampled_from(["train", "prefetch", "eval", "flush"]),
                              st.integers(0, 2**31 - 1)), min_size=1, max_size=25)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 400, (2 * BATCH // 2,), generator=g)
    return ids, torch.arange(0, ids.numel() + 1, 4)


@settings(max_examples=150, deadline=None)
@given(actions=_ACTIONS, adam=st.booleans())
def test_every_key_in_exactly_one_place(actions, adam):
    opt = EmbOptimType.ADAM if adam else EmbOptimType.EXACT_SGD
    ref, cached = module(opt), module(opt, make_store("host"), cache_rows=160)
    for action, seed in actions:
        b = _batch(seed)
        if action == "train":
            ref.train()
            cached.train()
            assert torch.equal(step(cached, b), step(ref, b))
        elif action == "prefetch":
            cached.prefetch(*b)
        elif action == "eval":
            ref.eval()
            cached.eval()
            assert torch.equal(cached(*b), ref(*b))
        else:
            cached.flush()
            assert cached.table_stats()["t0"]["cache_rows"] == 0
        for t in range(2):
            want, got = all_rows(ref, t), all_rows(cached, t)  # all_rows asserts one place per key
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
            s = cached.table_stats()[f"t{t}"]
            assert s["size"] == s["cache_rows"] + s["store_rows"] == len(want)


def test_prefetches_without_their_forward_do_not_pin_forever():
    """Pins last for the two newest prefetched batches: a pipeline that
    prefetches and then drops batches does not fill the cache with pins."""
    ref, cached = module(), module(store=make_store("host"), cache_rows=160)
    for seed in range(12):
        cached.prefetch(*_batch(seed))
    b = _batch(99)
    assert torch.equal(step(cached, b), step(ref, b))
    assert all_rows(cached, 0).keys() == all_rows(ref, 0).keys()
