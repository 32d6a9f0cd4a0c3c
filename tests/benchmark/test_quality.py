"""benchmark/bench_quality.py: the progressive-validation bookkeeping (each
window scored before it is trained on; AUC and log loss as torchmetrics and
torch compute them on a known sequence) and every setup getting the same
batches (a tiny run of all six setups)."""
import json
import os
import statistics
import sys

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import bench_quality as bq  # noqa: E402
from quality_setups import BUDGETED, LARGE, SETUPS  # noqa: E402


def test_auc_matches_torchmetrics_with_and_without_ties():
    gen = torch.Generator().manual_seed(3)
    for n, levels in ((1000, None), (1000, 7), (37, 3), (2, None)):
        labels = torch.zeros(n)
        labels[torch.randperm(n, generator=gen)[: max(1, n // 3)]] = 1.0
        scores = torch.randn(n, generator=gen) + labels  # some signal
        if levels is not None:  # ties: few distinct scores
            scores = torch.round(scores * levels / 4) / levels
        assert bq.auc(scores, labels) == pytest.approx(float(binary_auroc(scores, labels.long())), abs=1e-6)
    assert torch.isnan(torch.tensor(bq.auc(torch.tensor([0.3, 0.1]), torch.ones(2))))


def test_each_window_is_scored_before_it_is_trained_on():
    """A model that is a counter of trained batches: a window's scores must see
    every earlier window trained and none of its own batches."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 1, 4, 2]  # batches per window
    windows = [[(None, None, (torch.rand(16, generator=gen) < 0.4).float()) for _ in range(k)] for k in sizes]
    known = [[torch.randn(16, generator=gen) for _ in win] for win in windows]  # the logits score() returns
    events, trained = [], [0]

    def score(batch):
        w, b = next((w, b) for w, win in enumerate(windows) for b, x in enumerate(win) if x is batch)
        events.append(("score", w, b, trained[0]))
        return known[w][b]

    def train(batch):
        w, b = next((w, b) for w, win in enumerate(windows) for b, x in enumerate(win) if x is batch)
        events.append(("train", w, b, trained[0]))
        trained[0] += 1
        return 0.001 * (b + 1)

    recs = bq.progressive_validation(windows, score, train, after_window=lambda: {"rows_held": trained[0]})
    expected = []
    done = 0
    for w, k in enumerate(sizes):
        expected += [("score", w, b, done) for b in range(k)]  # scored with exactly the earlier windows trained
        expected += [("train", w, b, done + b) for b in range(k)]
        done += k
    assert events == expected
    for w, rec in enumerate(recs):
        logits = torch.cat(known[w])
        labels = torch.cat([x[2] for x in windows[w]])
        assert rec["window"] == w and rec["samples"] == 16 * sizes[w]
        assert rec["auc"] == pytest.approx(float(binary_auroc(logits, labels.long())), abs=1e-6)
        assert rec["log_loss"] == pytest.approx(
            float(torch.nn.functional.binary_cross_entropy(torch.sigmoid(logits.double()), labels.double())))
        assert rec["step_ms"] == pytest.approx(statistics.median(b + 1.0 for b in range(sizes[w])))
        assert rec["rows_held"] == sum(sizes[: w + 1])  # after_window runs after the window's training


def test_every_setup_gets_the_same_batches(tmp_path):
    out = tmp_path / "quality.json"
    bq.main(["--windows", "2", "--window-batches", "2", "--batch-size", "64", "--seeds", "0,1", "--budgets", "1/4",
             "--out", str(out)])
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert sorted({r["setup"] for r in runs}) == sorted(SETUPS)
    for seed in (0, 1):
        # The stream, made again independently, and what every setup saw of it.
        again = bq.make_stream("generated", None, seed, 2, 2, 64)
        assert res["streams"][str(seed)]["digest"] == again.digest
        mine = [r for r in runs if r["seed"] == seed]
        assert len(mine) == len(SETUPS)
        assert {r["digest"] for r in mine} == {again.digest}
        # The same row budget for every budgeted setup; the ceiling holds every id.
        budgets = {tuple(r["rows_per_table"]) for r in mine if r["setup"] in BUDGETED}
        assert len(budgets) == 1
        ceiling = next(r for r in mine if r["setup"] == "unlimited")
        assert ceiling["rows_held"] == sum(again.distinct) and ceiling["evicted"] == 0
        for r in mine:
            assert r["rows_held"] <= r["rows_budget"]
        # Ids with a row when scored: for the ceiling (nothing evicted), those its earlier windows held.
        seen = [set() for _ in LARGE]
        for w, win in enumerate(again.windows):
            held = total = 0
            for _, kjt, _ in win:
                for t, part in enumerate(kjt.values().split(kjt.length_per_key())[: len(LARGE)]):
                    held += sum(k in seen[t] for k in part.tolist())
                    total += part.numel()
            assert ceiling["windows"][w]["held_share"] == pytest.approx(held / total)
            for _, kjt, _ in win:
                for t, part in enumerate(kjt.values().split(kjt.length_per_key())[: len(LARGE)]):
                    seen[t].update(part.tolist())
        assert all(r["windows"][0]["held_share"] == 0.0 for r in mine if r["setup"] != "fold")
    assert res["streams"]["0"]["digest"] != res["streams"]["1"]["digest"]
    # One summary group per (setup, budget); a paired gap to fold for the other budgeted setups.
    s = res["summary"]
    assert set(s) == {f"{x}@0.25" for x in BUDGETED} | {"unlimited"}
    assert "auc_gap_vs_fold" in s["lru@0.25"] and "auc_gap_vs_fold" not in s["fold@0.25"]
    assert s["lru@0.25"]["final_auc"]["n"] == 2
