"""bench_embedding --torch-bags: issue 32's step baseline,
torch.nn.EmbeddingBag(sparse=True) with a torch sparse optimizer, computes
the same pooled output as our module on the same ids, and its step is the
optimizer's update."""
import importlib.util
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    spec = importlib.util.spec_from_file_location("bench_embedding", os.path.join(ROOT, "benchmark", "bench_embedding.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(weights, idx, features, pooling):
    ids = idx.view(features, -1, pooling)
    return torch.cat([weights[f % len(weights)][ids[f]].sum(1) for f in range(features)], dim=1)


def test_torch_bags_pool_like_ours_and_step_with_sgd():
    bench = _bench()
    tables, rows, dim, features, batch, pooling, lr = 2, 50, 4, 3, 5, 3, 0.5
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, rows, (features * batch * pooling,), generator=g)
    offsets = torch.arange(0, idx.numel() + 1, pooling)
    bags = bench.TorchBags(tables, rows, dim, features, pooling, "EXACT_SGD", lr, torch.device("cpu"))
    before = [b.weight.detach().clone() for b in bags.bags]
    torch.testing.assert_close(bags(idx, offsets), _reference(before, idx, features, pooling))

    # Our module on the same ids and layout, its rows set to the bags' rows.
    ours = bench.ours(tables, 64, dim, bench.EmbOptimType.EXACT_SGD, lr, features, torch.device("cpu"))
    for t in range(tables):
        ours.storage.insert_rows(t, torch.arange(rows), before[t])
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx, offsets), bags(idx, offsets))

    grad = torch.randn(batch, features * dim, generator=g)
    bags.train_step(idx, offsets, grad)
    ref = [w.clone().requires_grad_() for w in before]
    _reference(ref, idx, features, pooling).backward(grad)
    for b, w in zip(bags.bags, ref):
        torch.testing.assert_close(b.weight.detach(), w.detach() - lr * w.grad)


def test_bench_embedding_times_torch_bags(tmp_path):
    out = tmp_path / "bench_embedding.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "bench_embedding.py"), "--tables", "2", "--dim", "16",
           "--key-range", "20000", "--capacity", "16384", "--batch", "64", "--steps", "1", "--warmup", "1",
           "--torch-bags", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    results = json.loads(out.read_text())["results"]
    for name, torch_opt in (("EXACT_SGD", "torch.optim.SGD"), ("ADAM", "torch.optim.SparseAdam")):
        r = results[name]
        assert r["bag_optimizer"] == torch_opt
        assert r["bag_train_ratio"] == r["ours_train_s"] / r["bag_train_s"] > 0, name
        assert r["bag_eval_ratio"] == r["ours_eval_s"] / r["bag_eval_s"] > 0, name
    assert "bag_train_s" not in results["EXACT_ROWWISE_ADAGRAD"]
    assert "ours / bag" in res.stdout
