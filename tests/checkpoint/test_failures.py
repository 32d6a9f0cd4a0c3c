"""A failure on one rank raises on every rank (no rank is left waiting in a
collective) and leaves what it can unchanged, on 2 ranks:

- a load whose keys exceed a table's capacity, or with a corrupted file in
  rank 1's share, is refused on both ranks before the model changes;
- a failure on rank 1 while rows are loaded raises on both ranks, naming the
  table and the file;
- a write error on rank 1 (blocking and non-blocking) or a publish error on
  rank 0 fails the dump on both ranks, publishes nothing, keeps the previous
  dump at PATH byte for byte and removes PATH.tmp-*;
- a load replaces a table's content: keys trained after the dump are gone;
- admission counters dumped on 2 ranks load on 1 with every count exact, and
  are refused (with the count) where they do not fit the counter.
The spawned run has a deadline (run_ranks' timeout): a hang fails the test."""
import errno
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ckpt_helpers as H
import dynamicemb.checkpoint.dump as D
from dynamicemb import FrequencyAdmissionStrategy, KVCounter
from dynamicemb.checkpoint import CheckpointError, DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint.format import stale_siblings
from dynamicemb.checkpoint.tables import model_tables
from dynamicemb.storage import HashTableStorage

COUNTED = ("t_hash", "t_rr")  # the tables with frequency admission in the counter runs


def _outcome(fn):
    """None, or (exception type name, message) of what fn raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return type(e).__name__, str(e)
    return None


def _files(path):
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return out


def _admission(capacity, bucket_capacity=128):
    return {t: dict(admit_strategy=FrequencyAdmissionStrategy(threshold=3),
                    admission_counter=KVCounter(capacity=capacity, bucket_capacity=bucket_capacity))
            for t in COUNTED}


def _counts(model):
    """{table: {key: count}} of this rank's admission counters."""
    out = {}
    for name in COUNTED:
        counts = model_tables(model)[name].storage.admission[model_tables(model)[name].index].counts
        out[name] = {k: c for b in counts.export() for k, c in zip(b.keys.tolist(), b.scores.tolist())}
    return out


def _failures(rank, world, root):
    pg = dist.GroupMember.WORLD
    own = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    res = {}
    older, latest = os.path.join(root, "older"), os.path.join(root, "latest")
    model = H.build(pg)
    H.train(model, pg, [1, 2])
    res["older"] = H.gathered_entries(model, pg)
    res["dumped_ns"] = H.now_ns()
    DynamicEmbDump(older, model, pg=pg)
    H.train(model, pg, [3, 4, 5, 6])
    res["trained"] = H.gathered_entries(model, pg)
    DynamicEmbDump(latest, model, pg=pg)

    # More keys than a table's capacity: refused up front on both ranks.
    small = H.build(pg, t_hash=dict(max_capacity=16, bucket_capacity=16))
    H.train(small, pg, [7])
    res["small_before"] = H.entries(small)
    res["capacity"] = _outcome(lambda: DynamicEmbLoad(latest, small, pg=pg))
    res["small_after"] = H.entries(small)

    # A corrupted file in rank 1's share: refused on both ranks.
    bad = os.path.join(root, "bad")
    if rank == 0:
        shutil.copytree(latest, bad)
        victim = os.path.join(bad, "t_rr", "rank00001.part00000.safetensors")
        with open(victim, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    fresh = H.build(pg)
    res["corrupted"] = _outcome(lambda: DynamicEmbLoad(bad, fresh, pg=pg))
    res["corrupted_sizes"] = {n: r.storage.size(r.index) for n, r in model_tables(fresh).items()}

    # A failure while loading rows on rank 1: raises on both ranks.
    real_load_rows = HashTableStorage.load_rows
    if rank == 1:
        def failing_load_rows(self, table_id, batch):
            raise RuntimeError("injected load failure")
        HashTableStorage.load_rows = failing_load_rows
    try:
        res["injected_load"] = _outcome(lambda: DynamicEmbLoad(latest, fresh, pg=pg))
    finally:
        HashTableStorage.load_rows = real_load_rows

    # The older dump into the model trained further: its keys are the dump's, exactly.
    DynamicEmbLoad(older, model, pg=pg)
    res["loaded_ns"] = H.now_ns()
    res["reloaded"] = H.gathered_entries(model, pg)

    # Dump failures: previous dump at `latest` intact, nothing left beside it.
    snapshot = _files(latest)
    real_write_part = D.write_part
    calls = [0]

    def failing_write_part(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # after a complete first file
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_write_part(*args, **kwargs)

    for mode in ("blocking", "non_blocking"):
        calls[0] = 0
        if rank == 1:
            D.write_part = failing_write_part
        try:
            if mode == "blocking":
                res[f"dump_{mode}"] = _outcome(lambda: DynamicEmbDump(latest, model, pg=pg, allow_overwrite=True))
            else:
                handle = DynamicEmbDump(latest, model, pg=pg, allow_overwrite=True, blocking=False)
                res[f"dump_{mode}"] = _outcome(handle.wait)
        finally:
            D.write_part = real_write_part
        dist.barrier()
        res[f"dump_{mode}_intact"] = _files(latest) == snapshot
        res[f"dump_{mode}_siblings"] = stale_siblings(latest)
        dist.barrier()
    real_publish = D._publish
    if rank == 0:
        def failing_publish(tmp, path, allow_overwrite):
            raise OSError(errno.EIO, "Input/output error (injected)")
        D._publish = failing_publish
    try:
        res["publish"] = _outcome(lambda: DynamicEmbDump(latest, model, pg=pg, allow_overwrite=True))
    finally:
        D._publish = real_publish
    dist.barrier()
    res["publish_intact"] = _files(latest) == snapshot
    res["publish_siblings"] = stale_siblings(latest)
    dist.barrier()

    # Admission counters, 2 ranks -> 1.
    counted = os.path.join(root, "counted")
    cm = H.build(pg, **_admission(1024))
    H.train(cm, pg, [1, 2, 3])
    res["counts"] = _counts(cm)
    DynamicEmbDump(counted, cm, pg=pg, counter=True)
    dist.barrier()
    if rank == 0:
        one = H.build(own[0], **_admission(1024))
        DynamicEmbLoad(counted, one, pg=own[0], counter=True)
        res["counts_one"] = _counts(one)
        tiny = H.build(own[0], **_admission(16, 16))
        res["counts_tiny"] = _outcome(lambda: DynamicEmbLoad(counted, tiny, pg=own[0], counter=True))
        res["no_counter"] = _outcome(lambda: DynamicEmbLoad(counted, H.build(own[0]), pg=own[0], counter=True))
    dist.barrier()

    # A group other than the one sharding the model: a load would route keys
    # by its ranks (each rank taking every key, or half of them), a dump would
    # name its shards by them. Refused, the model unchanged.
    def keys_of(m):
        return {t: e["keys"].tolist() for t, e in H.entries(m).items() if t != "_modules"}
    before = keys_of(model)
    res["load_own_group"] = _outcome(lambda: DynamicEmbLoad(latest, model, pg=own[rank]))
    res["load_own_group_unchanged"] = keys_of(model) == before
    res["dump_own_group"] = _outcome(lambda: DynamicEmbDump(os.path.join(root, f"own{rank}"), model, pg=own[rank]))
    res["dump_own_group_written"] = os.path.exists(os.path.join(root, f"own{rank}"))
    replica = H.build(own[rank])  # sharded over this rank alone
    res["load_world_into_replica"] = _outcome(lambda: DynamicEmbLoad(latest, replica))
    dist.barrier()
    return res


@H.once
def _results():
    return H.run_in_scratch("dynamicemb-failures-", _failures, 2, timeout=240)  # a hang fails, it does not block


def test_keys_over_capacity_refused_on_every_rank_model_unchanged():
    for r in _results():
        assert r["capacity"] is not None and r["capacity"][0] == "CheckpointError", r["capacity"]
        assert r["capacity"][1].startswith("table 't_hash': ") and "maximum capacity" in r["capacity"][1]
        before, after = r["small_before"], r["small_after"]
        assert before["_modules"] == after["_modules"]
        for t in H.TABLES:
            for k, v in before[t].items():
                assert v is None and after[t][k] is None or torch.equal(v, after[t][k]), f"{t}.{k} changed"


def test_corrupted_file_of_rank_1_refused_on_every_rank():
    r0, r1 = (r["corrupted"] for r in _results())
    assert r1[0] == "CheckpointError" and "rank00001.part00000" in r1[1] and "checksum" in r1[1]
    assert r0[0] == "CheckpointError" and r0[1].startswith(r1[1]) and "found by rank 1" in r0[1]
    for r in _results():
        assert all(n == 0 for n in r["corrupted_sizes"].values())


def test_failure_while_loading_on_rank_1_raises_on_every_rank():
    r0, r1 = (r["injected_load"] for r in _results())
    assert r1[0] == "CheckpointError" and "injected load failure" in r1[1]
    assert r1[1].startswith("table '") and "rank00001.part" in r1[1] and "partly loaded" in r1[1]
    assert r0[0] == "CheckpointError" and "found by rank 1" in r0[1] and "injected load failure" in r0[1]


def test_load_replaces_the_tables_content():
    ranks = _results()
    older = [r["older"] for r in ranks][0]
    trained = [r["trained"] for r in ranks][0]
    reloaded = [r["reloaded"] for r in ranks][0]
    for t in H.TABLES:  # training after the dump added keys that the load must remove
        before = {k for e in older for k in e[t]["keys"].tolist()}
        assert {k for e in trained for k in e[t]["keys"].tolist()} - before, t
    H.assert_same_entries(older, reloaded, ranks[0]["dumped_ns"], max(r["loaded_ns"] for r in ranks))


@pytest.mark.parametrize("mode", ["blocking", "non_blocking"])
def test_write_failure_on_rank_1_fails_the_dump_on_every_rank(mode):
    r0, r1 = (r[f"dump_{mode}"] for r in _results())
    assert r1 is not None and r1[0] == "OSError" and "injected" in r1[1], r1
    assert r0 is not None and r0[0] == "RuntimeError" and "writing failed on rank 1" in r0[1], r0
    for r in _results():
        assert r[f"dump_{mode}_intact"] and r[f"dump_{mode}_siblings"] == []


def test_publish_failure_on_rank_0_fails_the_dump_on_every_rank():
    r0, r1 = (r["publish"] for r in _results())
    assert r0 is not None and r0[0] == "OSError" and "injected" in r0[1], r0
    assert r1 is not None and r1[0] == "RuntimeError" and "publishing failed on rank 0" in r1[1], r1
    for r in _results():
        assert r["publish_intact"] and r["publish_siblings"] == []


def test_counters_reshard_2_to_1():
    r0, r1 = _results()
    for t in COUNTED:
        want = {**r0["counts"][t], **r1["counts"][t]}
        assert len(want) == len(r0["counts"][t]) + len(r1["counts"][t]) and len(want) > 20
        assert r0["counts_one"][t] == want, t


def test_counters_that_do_not_fit_are_refused():
    kind, msg = _results()[0]["counts_tiny"]
    assert kind == "CheckpointError" and msg.startswith("table 't_hash': ") and "admission counts" in msg
    assert "capacity" in msg and "counter=False" in msg


def test_counter_load_into_a_model_without_counters():
    kind, msg = _results()[0]["no_counter"]
    assert kind == "CheckpointError" and msg.startswith("table 't_hash': ") and "no admission counter" in msg


def test_single_process_load_replaces_content(tmp_path):
    m = H.plain_module()
    H.plain_train(m, [1, 2])
    want = H.entries(m)
    DynamicEmbDump(str(tmp_path / "ckpt"), m)
    H.plain_train(m, [3, 4, 5])
    assert H.entries(m)["a"]["keys"].numel() > want["a"]["keys"].numel()
    DynamicEmbLoad(str(tmp_path / "ckpt"), m)
    H.assert_same_entries([want], [H.entries(m)], dist_types=H.PLAIN_DIST)
    with pytest.raises(CheckpointError):  # (nothing to load: no mistake is silent)
        DynamicEmbLoad(str(tmp_path / "nothing"), m)


def test_a_group_other_than_the_models_is_refused():
    for rank, r in enumerate(_results()):
        for key, theirs, given in (("load_own_group", [0, 1], [rank]), ("dump_own_group", [0, 1], [rank]),
                                   ("load_world_into_replica", [rank], [0, 1])):
            kind, msg = r[key]
            assert kind == "ValueError" and f"sharded over ranks {theirs}" in msg and f"has ranks {given}" in msg, \
                (key, r[key])
        assert r["load_own_group_unchanged"] and not r["dump_own_group_written"]
