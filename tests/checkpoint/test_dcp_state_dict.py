"""A TorchRec user's checkpoint keeps the dynamic tables (issue 34):
dcp.save(model.state_dict()) on 1, 2 and 3 ranks, then dcp.load into a
freshly built model and load_state_dict, for SGD, Adam and row-wise Adagrad
(and, in test_dcp_tiers.py, cached tables and a FileStore).

- Same world size: the loaded model holds exactly the original's entries
  (read from the hash tables themselves, not through the export that saves
  use), gives identical eval outputs, and trains on identically.
- Another world size (1 -> 2 -> 3, and 3 -> 1): every key is present exactly
  once, on the rank that routing gives it, with its value, optimizer state,
  score and admission count, and eval outputs equal the original's.
"""
import tempfile

import pytest
import torch.distributed as dist

import ckpt_helpers as H
import dcp_helpers as D

SIZES = (1, 2, 3)
ROWS = [t for t in H.TABLES if t != D.COUNTED]  # tables with rows on every rank (admission keeps few keys)


def _state(model, pg, independent=True):
    return dict(entries=D.gathered(model, pg, independent), out=H.probe(model), ns=H.now_ns())


def _round_trips(rank, world, root, fused, tiers=False):
    """Every world size w in 1..3 (ranks 0..w-1): train, save, load into a
    fresh model, train both on; then the 1-rank save on 2 ranks, that
    model's save on 3, and the 3-rank save on rank 0 alone."""
    own = [dist.new_group([r]) for r in range(world)]
    groups = {1: own[0], 2: dist.new_group([0, 1]), 3: dist.GroupMember.WORLD}
    independent = not tiers
    res = {}

    def fresh(pg, name):
        return D.build(pg, fused, tiers, D.run_root(root, "stores", name, rank))

    for w in SIZES:
        if rank < w:
            pg = groups[w]
            a = fresh(pg, f"a{w}")
            H.train(a, pg, [1, 2, 3])
            res[w] = dict(saved=_state(a, pg, independent))
            D.save(a, D.run_root(root, f"w{w}"), pg)
            b = fresh(pg, f"b{w}")
            H.train(b, pg, [7])  # something to replace
            res[w]["incompatible"] = repr(D.load(b, D.run_root(root, f"w{w}"), pg))
            res[w]["loaded"] = _state(b, pg, independent)
            for m in (a, b):
                H.train(m, pg, [4, 5])
            res[w]["a_on"], res[w]["b_on"] = _state(a, pg, independent), _state(b, pg, independent)
        dist.barrier()
    for direction, (src, w) in {"1->2": ("w1", 2), "2->3": ("c2", 3), "3->1": ("w3", 1)}.items():
        if rank < w:
            pg = groups[w]
            c = fresh(pg, direction)
            D.load(c, D.run_root(root, src), pg)
            res[direction] = _state(c, pg, independent)
            if direction == "1->2":
                D.save(c, D.run_root(root, "c2"), pg)
        dist.barrier()
    return res


@H.once
def results(optimizer: str, tiers: bool = False):
    return H.run_ranks(_round_trips, 3, tempfile.mkdtemp(prefix="dynamicemb-dcp-"), D.OPTIMIZERS[optimizer], tiers,
                       timeout=600)


def check_round_trip(ranks, w):
    r = ranks[0][w]
    assert r["incompatible"] == "<All keys matched successfully>"
    saved, loaded = r["saved"], r["loaded"]
    assert len(saved["entries"]) == w
    assert all(e[t]["keys"].numel() >= 3 for e in saved["entries"] for t in ROWS), "a rank holds too few keys"
    H.assert_same_entries(saved["entries"], loaded["entries"], saved["ns"], loaded["ns"])
    D.assert_same_counters(saved["entries"], loaded["entries"])
    assert [e["_modules"] for e in loaded["entries"]] == [e["_modules"] for e in saved["entries"]]
    H.assert_same_outputs(loaded["out"], saved["out"], exact=True)
    # Trained on alike from there: the same tables and eval outputs.
    D.assert_same_training(r["a_on"]["entries"], r["b_on"]["entries"])
    H.assert_same_outputs(r["b_on"]["out"], r["a_on"]["out"], exact=True)


def check_reshard(ranks, direction):
    src = {"1->2": ranks[0][1]["saved"], "2->3": ranks[0]["1->2"], "3->1": ranks[0][3]["saved"]}[direction]
    loads = [r[direction] for r in ranks if direction in r]
    orig, loaded = src["entries"], loads[0]["entries"]
    assert len(loaded) == int(direction[-1])
    assert all(e[t]["keys"].numel() >= 3 for e in loaded for t in ROWS), "a rank holds too few keys"
    # Every key exactly once, on its owner, with its value, state and score.
    H.assert_same_entries(orig, loaded, src["ns"], max(x["ns"] for x in loads))
    D.assert_same_counters(orig, loaded)
    assert {m[1:] for e in loaded for m in e["_modules"]} == {(3, 3)}  # steps and Adam's step count
    for x in loads:
        H.assert_same_outputs(x["out"], src["out"], exact=False)  # another world sums bags in another order


@pytest.mark.parametrize("w", SIZES)
@pytest.mark.parametrize("optimizer", list(D.OPTIMIZERS))
def test_dcp_round_trip_and_training_goes_on(optimizer, w):
    check_round_trip(results(optimizer), w)


@pytest.mark.parametrize("direction", ["1->2", "2->3", "3->1"])
@pytest.mark.parametrize("optimizer", list(D.OPTIMIZERS))
def test_dcp_reshards_every_key_to_its_owner(optimizer, direction):
    check_reshard(results(optimizer), direction)
