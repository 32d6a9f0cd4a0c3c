"""bench_torchrec_paired: both models train in the same ranks, step by step,
and the ratios it reports are those of the step times it records."""
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_paired_ratios_come_from_the_recorded_steps(tmp_path):
    out = tmp_path / "paired.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "bench_torchrec_paired.py"), "--tables", "2",
           "--dim", "8", "--rows-per-table", "4096", "--batch", "32", "--pooling", "3", "--key-pool", "512",
           "--steps", "3", "--warmup", "1", "--rounds", "2", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    r = data["results"]
    assert len(r["rounds"]) == 2
    steps = {m: [t for rd in r["rounds"] for t in rd["step_s"][m]] for m in ("dynamic", "native")}
    assert all(len(v) == 6 and min(v) > 0 for v in steps.values())
    ratios = [a / b for a, b in zip(steps["dynamic"], steps["native"])]
    assert r["per_step_ratio"]["median"] == statistics.median(ratios)
    assert r["per_step_ratio"]["q1"] <= r["per_step_ratio"]["median"] <= r["per_step_ratio"]["q3"]
    assert r["ratio_of_medians"] == statistics.median(steps["dynamic"]) / statistics.median(steps["native"])
    assert data["common"]["mode"] == "existing ids"
    assert "per-step ratio" in res.stdout
