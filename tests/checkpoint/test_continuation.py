"""Training continues across a checkpoint: 3 Adam steps, dump, load into a
fresh model, 2 more steps gives exactly the model of 5 straight steps
(values, Adam moments, its step count, STEP/LFU scores, outputs)."""
import pytest
import torch

import ckpt_helpers as H
import scenarios


def _same_training_state(got, want):
    for name in H.TABLES:
        g, w = got[name], want[name]
        assert torch.equal(g["keys"], w["keys"]), f"{name}: keys differ"
        assert torch.equal(g["values"], w["values"]), f"{name}: values differ"
        assert torch.equal(g["state"], w["state"]), f"{name}: Adam state differs"
        if name not in H.CLOCK_SCORES:  # clock readings differ between two runs
            assert torch.equal(g["scores"], w["scores"]), f"{name}: scores differ"
    assert got["_modules"] == want["_modules"]  # step and optimizer_step: 5 and 5


@pytest.mark.parametrize("run", ["single", "world"])
def test_three_steps_load_two_steps_equals_five(run):
    for x in scenarios.two_ranks():
        if run not in x:
            continue
        r = x[run]
        assert all(m[1:] == (5, 5) for m in r["straight"][0]["_modules"])
        for got, want in zip(r["continued"], r["straight"]):
            _same_training_state(got, want)
        H.assert_same_outputs(r["continued_out"], r["straight_out"], exact=True)
