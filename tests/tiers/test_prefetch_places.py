"""A prefetch places every key of its batch in the cache (the stored ones
taken from the store, the new ones with their initial rows), so the batch's
forward and backward move nothing between the tiers. The new keys stay
provisional until that forward: nothing that reads the tiers sees them, and
a prefetch whose forward never comes stores nothing."""
import torch

from tier_helpers import all_rows, batches, make_store, module, step


def test_a_prefetched_step_makes_no_store_call_and_no_cache_lookup_or_insert(monkeypatch):
    ref = module()
    store = make_store("host")
    cached = module(store=store, cache_rows=512)
    calls = []
    for name in ("take_group", "put_group", "put", "take_found"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    cache_ht = cached.storage.groups[0][0]
    for name in ("insert", "lookup"):  # nor does it look its keys up: the prefetch found their slots
        real = getattr(cache_ht, name)
        monkeypatch.setattr(cache_ht, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    data = batches(20)
    cached.prefetch(*data[0])
    moved = 0
    for i, b in enumerate(data):
        if i + 1 < len(data):
            calls.clear()
            cached.prefetch(*data[i + 1])
            moved += len(calls)
        calls.clear()
        assert torch.equal(step(cached, b), step(ref, b)), f"step {i}"
        assert calls == [], f"step {i}: the forward and backward called {calls}"
    assert moved > 0  # the prefetches did the moving
    for name, s in cached.table_stats().items():
        assert s["write_backs"] > 0, f"{name}: {s}"  # the cache did evict
        assert s["misses"] == s["inserted"] == s["size"] == ref.table_stats()[name]["size"], f"{name}: {s}"


def _new_keys(batch, ref, t):
    """The keys of table t in `batch` that the reference does not hold."""
    ids, _ = batch
    per_table = ids.numel() // 2
    keys = ids[t * per_table:(t + 1) * per_table].unique()
    held = torch.tensor(sorted(all_rows(ref, t)), dtype=torch.int64)
    return keys[~torch.isin(keys, held)]


def test_provisional_keys_are_invisible_until_their_forward():
    ref, cached = module(), module(store=make_store("host"), cache_rows=256)
    data = batches(12, seed=1)
    for b in data[:6]:
        assert torch.equal(step(cached, b), step(ref, b))
    b = data[6]
    assert all(_new_keys(b, ref, t).numel() for t in range(2))  # the test needs new keys
    cached.prefetch(*b)
    # Counters and eval lookups see the stored keys only.
    for name, s in cached.table_stats().items():
        assert s["size"] == ref.table_stats()[name]["size"], f"{name}: {s}"
    cached.eval(), ref.eval()
    assert torch.equal(cached(*b), ref(*b))
    for t in range(2):  # in the cache, but not found
        keys = _new_keys(b, ref, t)
        _, there = cached.storage.groups[0][0].lookup(keys, torch.full_like(keys, t))
        assert bool(there.all()) and bool((cached.storage.find(keys, torch.full_like(keys, t)) == -1).all())
    cached.train(), ref.train()
    # The prefetched batch's forward stores them (after a stats call and an eval in between).
    assert torch.equal(step(cached, b), step(ref, b))
    # An export between a prefetch and its forward holds the stored keys only;
    # that forward stores the new ones again, with the same initial rows.
    cached.prefetch(*data[7])
    for t in range(2):
        assert all_rows(cached, t).keys() == all_rows(ref, t).keys()
    for b in data[7:]:
        assert torch.equal(step(cached, b), step(ref, b))
    for t in range(2):
        want, got = all_rows(ref, t), all_rows(cached, t)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_abandoned_prefetch_stores_nothing():
    """A prefetch whose forward never comes: its new keys leave the cache as
    any row does once no longer pinned, but they are dropped, not written
    back; the tiers then hold what the reference holds."""
    ref, cached = module(), module(store=make_store("host"), cache_rows=256)
    data = batches(30, seed=2)
    for b in data[:4]:
        assert torch.equal(step(cached, b), step(ref, b))
    stray = data[4]
    new = [_new_keys(stray, ref, t) for t in range(2)]
    assert all(k.numel() for k in new)
    cached.prefetch(*stray)  # never trained
    for b in data[5:]:
        assert torch.equal(step(cached, b), step(ref, b))
    cache_ht = cached.storage.groups[0][0]
    for t in range(2):
        never = new[t][~torch.isin(new[t], torch.tensor(sorted(all_rows(ref, t)), dtype=torch.int64))]
        assert never.numel()
        # Evicted from the cache (while unpinned, with the later batches' keys) and not in the store.
        _, in_cache = cache_ht.lookup(never, torch.full_like(never, t))
        in_store, _, _ = cached.storage.store.read(f"t{t}", never)
        assert not bool(in_cache.any()) and not bool(in_store.any()), t
    for name, s in cached.table_stats().items():
        r = ref.table_stats()[name]
        assert s["size"] == s["inserted"] == r["size"] and s["cache_rows"] + s["store_rows"] == s["size"], name
    for t in range(2):
        want, got = all_rows(ref, t), all_rows(cached, t)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
