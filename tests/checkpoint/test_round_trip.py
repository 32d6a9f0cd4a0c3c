"""Dump then load into a fresh model of the same world size: every key,
value, optimizer state (Adam, after training) and score comes back, on the
rank routing gives it, and the loaded model's eval outputs equal the
original's. TorchRec DMP on 1 and 2 ranks, and a plain module."""

import pytest
import torch

import ckpt_helpers as H
import scenarios
from dynamicemb import EmbOptimType, get_table_value_bytes
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


@pytest.mark.parametrize("direction", ["hybrid_to_whole", "whole_to_hybrid"])
def test_hybrid_round_trip(tmp_path, direction):
    """A hybrid table (its rows past 128 in a second part) dumps what the same
    table whole dumps, and each loads the other's dump."""
    hybrid = dict(global_hbm_for_values=get_table_value_bytes(128, 8, optimizer=EmbOptimType.ADAM))  # 128 rows of a, 256 of b
    src_kw, dst_kw = (hybrid, {}) if direction == "hybrid_to_whole" else ({}, hybrid)
    m = H.plain_module(**src_kw)
    H.plain_train(m, list(range(1, 12)))
    assert m.storage.rows_of(0).tail is not None or not src_kw
    want, want_out = H.entries(m), H.plain_probe(m)
    DynamicEmbDump(str(tmp_path / "ckpt"), m)
    fresh = H.plain_module(**dst_kw)
    DynamicEmbLoad(str(tmp_path / "ckpt"), fresh)
    H.assert_same_entries([want], [H.entries(fresh)], dist_types=H.PLAIN_DIST)
    assert torch.equal(H.plain_probe(fresh), want_out)
    stats = (m if src_kw else fresh).table_stats()["a"]
    assert stats["device_capacity"] == 128 and stats["host_rows"] > 0 and stats["device_rows"] > 0
