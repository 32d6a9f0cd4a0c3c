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
