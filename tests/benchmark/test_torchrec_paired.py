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


def run_paired(tmp_path, *argv):
    out = tmp_path / "paired.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "bench_torchrec_paired.py"), *argv, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(out.read_text()), res.stdout


def test_paired_reports_whether_new_ids_evicted(tmp_path):
    """The dynamic tables' counters over the timed steps: new ids fill free
    slots while the tables have room (as many as the batches' fresh ids),
    and evict once a pool as large as the tables has filled them."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    import bench_torchrec as B

    base = ["--tables", "2", "--dim", "8", "--rows-per-table", "4096", "--batch", "32", "--pooling", "3",
            "--steps", "3", "--warmup", "1", "--rounds", "1", "--new-share", "0.5"]
    # Room: a pool of 1/8 of the rows, and 192 fresh ids per rank and step.
    data, stdout = run_paired(tmp_path, *base, "--key-pool", "512")
    ids = data["results"]["rounds"][0]["ids"]
    args = B.parse_args(base + ["--key-pool", "512"])
    fresh = sum(round(0.5 * args.tables * args.batch * args.pooling) for _ in range(args.steps) for _ in range(2))
    assert ids["new_ids_timed"] == fresh and ids["evicted_timed"] == 0 and ids["failed_timed"] == 0
    lo, hi = ids["load_factor_timed"]
    assert 0 < lo < hi < 0.5
    assert f"{fresh} new ids of" in stdout and "0 evicting" in stdout
    # Full: the pool fills every slot, so new ids evict.
    data, stdout = run_paired(tmp_path, *base, "--key-pool", "4096")
    ids = data["results"]["rounds"][0]["ids"]
    assert ids["new_ids_timed"] >= fresh and 0 < ids["evicted_timed"] <= ids["new_ids_timed"]
    assert ids["load_factor_timed"][1] > 0.9
