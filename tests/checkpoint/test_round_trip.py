"""Dump then load into a fresh model of the same world size: every key,
value, optimizer state (Adam, after training) and score comes back, on the
rank routing gives it, and the loaded model's eval outputs equal the
original's. TorchRec DMP on 1 and 2 ranks, and a plain module."""

import pytest
import torch

import ckpt_helpers as H
import scenarios
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad


@pytest.mark.parametrize("run", ["single", "world"])
def test_dmp_round_trip(run):
    ranks = scenarios.two_ranks()
    r = ranks[0][run]
    dumped = min(x[run]["dumped_ns"] for x in ranks if run in x)
    loaded = max(x[run]["loaded_ns"] for x in ranks if run in x)
    H.assert_same_entries(r["orig"], r["loaded"], dumped, loaded)
    assert [e["_modules"] for e in r["loaded"]] == [e["_modules"] for e in r["orig"]]  # step, optimizer_step
    assert all(bool(e[t]["state"].any()) for e in r["orig"] for t in H.TABLES), "Adam state should be non-trivial"
    for x in ranks:
        if run in x:  # every rank probes the whole batch: same outputs
            H.assert_same_outputs(x[run]["loaded_out"], x[run]["orig_out"], exact=True)


def test_plain_module_round_trip(tmp_path):
    m = H.plain_module()
    H.plain_train(m, [1, 2, 3])
    want, want_out = H.entries(m), H.plain_probe(m)
    DynamicEmbDump(str(tmp_path / "ckpt"), m)
    fresh = H.plain_module()
    DynamicEmbLoad(str(tmp_path / "ckpt"), fresh)
    H.assert_same_entries([want], [H.entries(fresh)], dist_types=H.PLAIN_DIST)
    assert (fresh.step, fresh.optimizer_step) == (m.step, m.optimizer_step) == (3, 3)
    assert torch.equal(H.plain_probe(fresh), want_out)
