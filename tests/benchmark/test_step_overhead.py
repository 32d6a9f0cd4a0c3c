"""bench_step_overhead counts the torch ops of one training step at the top
level: the module's own ops once each, none counted twice through the ops
they call."""
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    spec = importlib.util.spec_from_file_location("bench_step_overhead",
                                                  os.path.join(ROOT, "benchmark", "bench_step_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_step_calls_each_embedding_op_once(tmp_path):
    out = tmp_path / "overhead.json"
    assert _bench().main(["--tables", "2", "--ids", "16", "--capacity", "256", "--steps", "3", "--repeats", "2",
                          "--warmup", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ops = res["ops_per_step"]
    for op in ("dynamicemb::emb_unique", "dynamicemb::table_insert", "dynamicemb::emb_row_order_init",
               "dynamicemb::emb_forward", "dynamicemb::emb_backward_update"):
        assert ops.get(op) == 1, (op, ops)
    # Top level only: emb_forward's and the insert's inner aten ops (empty, zeros) are theirs, not the step's.
    assert res["ops_per_step_total"] == sum(ops.values()) < 40
    assert len(res["us_per_step_repeats"]) == 2 and res["us_per_step"] > 0
