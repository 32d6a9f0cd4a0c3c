"""DynamicEmbDump(blocking=False): training goes on after the call, and
handle.wait() publishes a dump of the tables as they were at the call
(compared with the rows read at the call, not with later ones), on 2 ranks
and, with the writer held back deterministically, in one process."""
import threading

import torch

import ckpt_helpers as H
import dynamicemb.checkpoint.dump as D
import scenarios
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.incremental_dump import get_score, set_score


def test_non_blocking_dump_holds_the_state_at_the_call():
    ranks = scenarios.two_ranks()
    r = ranks[0]["non_blocking"]
    assert all(x["non_blocking"]["done"] for x in ranks)
    # Training really changed the tables before wait() ...
    assert not any(torch.equal(a[t]["keys"], b[t]["keys"]) and torch.equal(a[t]["values"], b[t]["values"])
                   for a, b in zip(r["at_call"], r["after"]) for t in H.TABLES)
    assert [m[1:] for m in r["after"][0]["_modules"]] == [(5, 5), (5, 5)]
    # ... yet the dump holds the rows, Adam state, scores and steps of the call.
    H.assert_same_entries(r["at_call"], r["loaded"], min(x["non_blocking"]["dumped_ns"] for x in ranks),
                          max(x["non_blocking"]["loaded_ns"] for x in ranks))
    assert [e["_modules"] for e in r["loaded"]] == [e["_modules"] for e in r["at_call"]]
    for x in ranks:
        H.assert_same_outputs(x["non_blocking"]["loaded_out"], x["non_blocking"]["out_at_call"], exact=True)


def test_non_blocking_dump_written_after_training_went_on(tmp_path, monkeypatch):
    """Deterministic interleaving: the background writer is held until two
    more steps (and a new CUSTOMIZED score) have happened; the dump still
    holds the rows, scores, steps and Adam step count of the call."""
    go = threading.Event()
    real = D.write_part

    def held_write_part(*args, **kwargs):
        assert go.wait(60), "the test never released the writer"
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "write_part", held_write_part)
    strategies = (H.S.STEP, H.S.CUSTOMIZED)
    m = H.plain_module(strategies=strategies)
    set_score(m, {"b": 5})
    H.plain_train(m, [1, 2, 3])
    want, want_out = H.entries(m), H.plain_probe(m)
    handle = DynamicEmbDump(str(tmp_path / "ckpt"), m, blocking=False)
    set_score(m, {"b": 9})
    H.plain_train(m, [4, 5])
    assert not handle.done()
    go.set()
    handle.wait()
    fresh = H.plain_module(strategies=strategies)
    DynamicEmbLoad(str(tmp_path / "ckpt"), fresh)
    H.assert_same_entries([want], [H.entries(fresh)], dist_types=H.PLAIN_DIST)
    assert (fresh.step, fresh.optimizer_step) == (3, 3) and get_score(fresh)["b"] == 5
    assert torch.equal(H.plain_probe(fresh), want_out)


def test_a_script_that_ends_without_wait_still_publishes_its_dump(tmp_path):
    """The last checkpoint of a script, non-blocking, never waited for: the
    writer (slowed here) finishes before the interpreter exits, and the
    dump loads with the rows of the call (its thread was a daemon: killed at
    exit, nothing published, no word)."""
    import subprocess
    import sys
    code = f"""
import time, torch, warnings
warnings.simplefilter("ignore")
import dynamicemb.checkpoint.dump as D
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions, EmbOptimType
from dynamicemb.checkpoint import DynamicEmbDump
slow = D.write_part
D.write_part = lambda *a, **k: (time.sleep(1.0), slow(*a, **k))[1]
m = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024)], table_names=["t"],
                                  optimizer=EmbOptimType.ADAM, learning_rate=0.1)
m(torch.arange(50), torch.tensor([0, 50])).sum().backward()
torch.save(m.storage.find(torch.arange(50), torch.zeros(50, dtype=torch.int64)), {str(tmp_path / "slots.pt")!r})
torch.save(m.storage.weights()[0].clone(), {str(tmp_path / "rows.pt")!r})
DynamicEmbDump({str(tmp_path / "ckpt")!r}, m, blocking=False)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = H.plain_module(strategies=(H.S.TIMESTAMP,), names=("t",), dims=(4,))
    DynamicEmbLoad(str(tmp_path / "ckpt"), m)
    slots, rows = torch.load(tmp_path / "slots.pt"), torch.load(tmp_path / "rows.pt")
    got = m.storage.find(torch.arange(50), torch.zeros(50, dtype=torch.int64))
    assert bool((got >= 0).all())
    torch.testing.assert_close(m.storage.weights()[0][got][:, :4], rows[slots][:, :4], atol=0, rtol=0)
