"""bench_embedding --hbm-share: the hybrid tables it times beside ours hold
that share of their rows in their first part (the rest in host memory), and
it reports their step against ours (issue 32's hybrid target, on a GPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_embedding_times_hybrid_tables(tmp_path):
    out = tmp_path / "bench_embedding.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "bench_embedding.py"), "--tables", "2", "--dim", "16",
           "--key-range", "20000", "--capacity", "16384", "--batch", "64", "--steps", "1", "--warmup", "1",
           "--hbm-share", "0.25", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "ADAM", "PARTIAL_ROWWISE_ADAM"}
    for name, r in results.items():
        assert r["hybrid_device_share"] == 0.25, name
        assert r["hybrid_train_ratio"] == r["hybrid_train_s"] / r["ours_train_s"] > 0, name
        assert r["hybrid_eval_ratio"] == r["hybrid_eval_s"] / r["ours_eval_s"] > 0, name
    assert "hybrid / ours" in res.stdout
