"""HostStore against a dict model: it grows up to a maximum that its start
does not double into exactly, and a reserved table holds its rows in place."""
import pytest
import torch

from dynamicemb.tiers import HostStore
from dynamicemb.tiers.store import RowsAt

WIDTH = 5


def rows_of(keys: torch.Tensor) -> torch.Tensor:
    return keys.to(torch.float32)[:, None] * torch.arange(1, WIDTH + 1, dtype=torch.float32)


def put_all(store: HostStore, keys: torch.Tensor, batch: int = 700) -> int:
    lost = 0
    for s in range(0, keys.numel(), batch):
        k = keys[s:s + batch]
        lost += store.put("t", k, rows_of(k), k % 97)
    return lost


@pytest.mark.parametrize("max_rows", [5000, 10112, 3 * 1024 + 128])
def test_it_grows_to_any_maximum_and_keeps_every_row_it_does_not_evict(max_rows):
    store = HostStore(bucket_capacity=128)
    store.open_table("t", WIDTH, torch.float32, max_rows)
    keys = torch.randint(1, 1 << 40, (int(0.85 * max_rows),), generator=torch.Generator().manual_seed(0)).unique()
    lost = put_all(store, keys)  # used to fail once the doubling overshot a maximum it does not divide
    assert store.size("t") + lost == keys.numel()
    assert lost <= 0.02 * keys.numel()  # at the maximum only an overflowing bucket evicts
    held = {k: (r, s) for ks, rs, ss in store.items("t") for k, r, s in zip(ks.tolist(), rs, ss.tolist())}
    assert len(held) == store.size("t")
    want = rows_of(torch.tensor(list(held)))
    assert torch.equal(torch.stack([r for r, _ in held.values()]), want)
    assert [s for _, s in held.values()] == [k % 97 for k in held]


def test_a_reserved_table_writes_its_rows_in_place():
    store = HostStore(bucket_capacity=128)
    store.open_table("t", WIDTH, torch.float32, 1 << 16)
    store.reserve("t", 4096)
    rows, slots = store._rows["t"].data_ptr(), store._index.ht.capacity()
    assert slots >= 4096
    keys = torch.arange(1, 3001) * 7919
    assert put_all(store, keys) == 0
    assert store._rows["t"].data_ptr() == rows and store._index.ht.capacity() == slots  # nothing grew
    found, got, scores = store.take("t", keys)
    assert bool(found.all()) and torch.equal(got, rows_of(keys)) and torch.equal(scores, keys % 97)
    assert store.size("t") == 0


def test_tables_sharing_the_index_grow_evict_and_clear_on_their_own():
    store = HostStore(bucket_capacity=128)
    store.open_table("small", WIDTH, torch.float32, 1024)
    store.open_table("big", WIDTH, torch.float32, 1 << 15)
    g = torch.Generator().manual_seed(1)
    model = {"small": {}, "big": {}}
    lost = {"small": 0, "big": 0}
    for _ in range(12):  # "small" reaches its maximum and evicts; "big" keeps growing
        parts, names = {}, ["small", "big"]
        for j, name in enumerate(names):
            k = torch.randint(1, 1 << 40, (600,), generator=g).unique()
            k = k[torch.tensor([x not in model[name] for x in k.tolist()], dtype=torch.bool)]
            parts[j] = (k, rows_of(k) + j, k % 89)
            model[name].update({x: j for x in k.tolist()})
        for j, n in store.put_group(names, parts).items():
            lost[names[j]] += n
    assert lost["big"] == 0 and lost["small"] > 0
    for j, name in enumerate(["small", "big"]):
        held = {k: (r, s) for ks, rs, ss in store.items(name) for k, r, s in zip(ks.tolist(), rs, ss.tolist())}
        assert len(held) == store.size(name) == len(model[name]) - lost[name]
        assert set(held) <= set(model[name])
        assert torch.equal(torch.stack([r for r, _ in held.values()]), rows_of(torch.tensor(list(held))) + j)
    # one call takes keys of both tables, of each only its own
    big = torch.cat([ks for ks, _, _ in store.items("big")]).sort().values[:50]
    keys = torch.cat([big, big])
    tids = torch.cat([torch.ones(50, dtype=torch.int64), torch.zeros(50, dtype=torch.int64)])
    got = store.take_group(["small", "big"], keys, tids)
    assert list(got) == [1] and torch.equal(got[1][0], torch.arange(50))  # "small" holds none of "big"'s keys
    assert torch.equal(got[1][1], rows_of(big) + 1)
    assert store.size("big") == len(model["big"]) - 50
    store.clear("small")
    assert store.size("small") == 0 and store.size("big") == len(model["big"]) - 50


@pytest.mark.parametrize("kind", ["host", "file"])
def test_a_table_not_open_is_a_key_error_naming_it(tmp_path, kind):
    from dynamicemb.tiers import FileStore
    store = HostStore() if kind == "host" else FileStore(str(tmp_path))
    keys = torch.arange(3)
    calls = [lambda: store.read("nope", keys), lambda: store.take("nope", keys), lambda: list(store.items("nope")),
             lambda: store.size("nope"), lambda: store.put("nope", keys, torch.zeros(3, WIDTH), keys),
             lambda: store.clear("nope")]
    for opened in (False, True):  # with no table open, and with another one
        if opened:
            store.open_table("other", WIDTH, torch.float32, 64)
        for call in calls:
            with pytest.raises(KeyError, match="table 'nope' is not open"):
                call()


def test_rows_stay_within_twice_the_keys_held_as_keys_come_and_go():
    """Puts fill fresh rows while the allocated ones last, then reuse freed
    ones: over many takes and puts the rows grow only with the keys held at
    once, and every row read back is its key's (a dict model)."""
    store = HostStore(bucket_capacity=128)
    store.open_table("t", WIDTH, torch.float32, 1 << 16)
    g = torch.Generator().manual_seed(5)
    held, most, next_key = set(), 0, 1
    for _ in range(60):
        new = torch.arange(next_key, next_key + 400) * 7919
        next_key += 400
        assert store.put("t", new, rows_of(new), new % 97) == 0
        held.update(new.tolist())
        most = max(most, len(held))
        out = torch.tensor(sorted(held))[torch.randperm(len(held), generator=g)[:380]]
        found, got, scores = store.take("t", out)
        assert bool(found.all()) and torch.equal(got, rows_of(out)) and torch.equal(scores, out % 97)
        held.difference_update(out.tolist())
    assert store._rows["t"].shape[0] <= 2 * most
    keys = torch.tensor(sorted(held))
    found, got, _ = store.read("t", keys)
    assert bool(found.all()) and torch.equal(got, rows_of(keys)) and store.size("t") == len(held)


def test_rows_handed_as_rows_at_are_stored_as_the_gathered_rows():
    """put_group with RowsAt (a CPU cache's evicted rows, copied once into
    place) stores what the gathered rows would: into fresh positions (one
    block) and, once takes freed some, into freed ones (scattered)."""
    g = torch.Generator().manual_seed(4)
    source = torch.randn(5000, WIDTH, generator=g)
    stores = {kind: HostStore(bucket_capacity=128) for kind in ("rows_at", "tensor")}
    for s in stores.values():
        s.open_table("t", WIDTH, torch.float32, 1 << 14)
        s.reserve("t", 2048)  # room for the first puts only: later ones reuse freed positions
    keys = torch.randperm(1 << 20, generator=g)[:4000] + 1
    for r in range(8):
        k = keys[r * 500:(r + 1) * 500]
        at = torch.randperm(5000, generator=g)[:500]
        for kind, s in stores.items():
            rows = RowsAt(source, at) if kind == "rows_at" else source.index_select(0, at)
            assert s.put_group(["t"], {0: (k, rows, k % 13)}) == {0: 0}
            s.take("t", keys[r * 500:r * 500 + 300])  # frees positions for the next puts
    assert stores["rows_at"]._free["t"].count < 8 * 300  # freed positions were reused
    got = {kind: sorted((kk, rr.tolist(), ss) for ks, rs, ss in s.items("t")
                        for kk, rr, ss in zip(ks.tolist(), rs, ss.tolist())) for kind, s in stores.items()}
    assert got["rows_at"] == got["tensor"] and len(got["tensor"]) == 8 * 200


def test_a_file_store_appends_rows_handed_as_rows_at(tmp_path):
    from dynamicemb.tiers import FileStore
    g = torch.Generator().manual_seed(5)
    source = torch.randn(3000, WIDTH, generator=g)
    store = FileStore(str(tmp_path / "s"))
    store.open_table("t", WIDTH, torch.float32, 1 << 14)
    keys, at = torch.arange(1, 2001) * 31, torch.randperm(3000, generator=g)[:2000]
    for s in range(0, 2000, 400):  # appended block after block
        store.put_group(["t"], {0: (keys[s:s + 400], RowsAt(source, at[s:s + 400]), keys[s:s + 400] % 7)})
    found, rows, scores = store.read("t", keys)
    assert bool(found.all()) and torch.equal(rows, source[at]) and torch.equal(scores, keys % 7)
    store.close()


def test_a_full_stores_rows_stay_near_its_room():
    """Each put into a full store writes its rows before the index evicts as
    many: the rows doubled to twice the room. They now stop at the room plus
    a put (or 1/16 of it)."""
    from dynamicemb.tiers.store import ROOM_MARGIN
    store = HostStore(bucket_capacity=16)
    store.open_table("t", 4, torch.float32, 2048)
    room = store.room("t")
    for step in range(12):
        keys = torch.arange(500) + 500 * step
        store.put("t", keys, torch.full((500, 4), float(step)), torch.full((500,), step, dtype=torch.int64))
    assert store.size("t") > room - 200  # full: it evicted
    assert store._rows["t"].shape[0] <= room + max(room // ROOM_MARGIN, 500)
