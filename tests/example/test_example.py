"""example.py end to end with short settings, in its own processes (2 gloo
ranks), on each data source: it must exit 0 after its own checks (the
checkpoint reloaded on 1 rank predicts as the 2-rank model did; the exported
program served in a fresh process predicts as eval did), learn the
generated log (AUC well above chance), and leave what its summary names."""
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from example_data import NUM_DENSE, SPARSE_FEATURES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHORT = ["--steps", "40", "--batch-size", "256", "--log-every", "20", "--delta-steps", "10", "--eval-batches", "4"]


def _criteo_file(path, n=4000):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            dense = [str(rng.randrange(100)) if rng.random() > 0.1 else "" for _ in range(NUM_DENSE)]
            cats = [f"{rng.randrange(2**32) % 997:08x}" if rng.random() > 0.1 else "" for _ in SPARSE_FEATURES]
            f.write("\t".join([str(rng.randrange(2))] + dense + cats) + "\n")


def _movielens_file(path, n=4000):
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            f.write(f"{rng.randrange(1, 200)}::{rng.randrange(1, 300)}::{rng.randrange(1, 6)}::{978300000 + 60 * i}\n")


def _number(pattern, text):
    m = re.search(pattern, text)
    assert m, f"no {pattern!r} in the output:\n{text}"
    return float(m.group(1).replace(",", ""))


@pytest.mark.parametrize("kind", ["generated", "criteo", "movielens"])
def test_example_runs_end_to_end(tmp_path, kind):
    args = list(SHORT)
    if kind == "criteo":
        _criteo_file(tmp_path / "day_0")
        args += ["--data", "criteo", str(tmp_path / "day_0"), "--batch-size", "64", "--eval-batches", "2"]
    elif kind == "movielens":
        _movielens_file(tmp_path / "ratings.dat")
        args += ["--data", "movielens", str(tmp_path), "--batch-size", "64", "--eval-batches", "2"]
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), *args, "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    assert "leaked semaphore" not in text, text[-2000:]  # the ranks end by os._exit: they leave nothing registered

    assert _number(r"\[reload\] on 1 rank\(s\): same predictions \(max \|logit difference\| (\S+)\)", text) <= 1e-4
    assert _number(r"served in a fresh process: max \|logit difference\| (\S+)\)", text) <= 1e-4
    assert re.search(r"\[serve\] .*model\.pt2: served \d+ \+ 1 samples .* in a fresh process", text)
    auc = _number(r"eval AUC\s+(\S+)", text)
    if kind == "generated":
        assert auc > 0.6, text  # the hidden model's signal was learnt
    assert _number(r"failed (\S+)", text) == 0

    # What the summary names is there: the dump's rows are the rows it reports.
    rows = _number(r"rows\s+([\d,]+) in 22 dynamic tables", text)
    manifest = json.loads((out / "checkpoint" / "dynamic" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["tables"]) == 22
    assert sum(sum(t["rows_per_rank"]) for t in manifest["tables"].values()) == rows
    delta = torch.load(out / "delta.pt")
    assert sum(k.numel() for k, _ in delta.values()) == _number(r"delta\s+\S+ \(([\d,]+) rows\)", text) > 0
    assert (out / "model.pt2").exists() and (out / "checkpoint" / "dense" / ".metadata").exists()


def test_example_with_a_cache_trains_through_both_tiers(tmp_path):
    """--cache: half of each table's rows in a cache in front of host
    memory, the prefetch pipeline; rows reach the store (written back), and
    the checkpoint reload and the served program still predict as eval did."""
    out = tmp_path / "out"
    args = [*SHORT, "--capacity", "8192", "--cache", "0.5", "--out", str(out)]
    res = subprocess.run([sys.executable, os.path.join(ROOT, "example.py"), *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    assert "in a cache in front of host memory, prefetch pipeline" in text
    rows = _number(r"rows\s+([\d,]+) in 22 dynamic tables", text)
    summary = text[text.index("[summary]"):]
    cached, stored = _number(r"cache ([\d,]+) rows, store", summary), _number(r"rows, store ([\d,]+)", summary)
    assert cached + stored == rows and stored > 0 and _number(r"written back ([\d,]+)", summary) >= stored
    assert _number(r"\[reload\] on 1 rank\(s\): same predictions \(max \|logit difference\| (\S+)\)", text) <= 1e-4
    assert _number(r"served in a fresh process: max \|logit difference\| (\S+)\)", text) <= 1e-4
    assert _number(r"eval AUC\s+(\S+)", text) > 0.6 and _number(r"failed (\S+)", text) == 0
    manifest = json.loads((out / "checkpoint" / "dynamic" / "manifest.json").read_text())
    assert sum(sum(t["rows_per_rank"]) for t in manifest["tables"].values()) == rows  # the dump saw both tiers
