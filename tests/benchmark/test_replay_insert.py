"""replay_evicting_insert: two identical full tables, the same calls into
each; nearly every new key evicts, in both variants, and each is timed."""
import importlib.util
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_replay_evicts_and_times_both_variants(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    spec = importlib.util.spec_from_file_location("replay_evicting_insert",
                                                  os.path.join(ROOT, "benchmark", "replay_evicting_insert.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "replay.json"
    threads = torch.get_num_threads()  # main sets its own: the later tests run with this process's
    try:
        mod.main(["--slots", "4096", "--tables", "2", "--stored", "300", "--new", "700", "--calls", "3",
                  "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    for v in ("hold_stored=0", "hold_stored=1"):
        assert len(res["ms_per_call"][v]) == 3 and min(res["ms_per_call"][v]) > 0
        # Tables at load >= 0.995: a new key rarely finds a free slot (700 new keys a call; "stored"
        # keys evicted by earlier calls are new again, and without hold_stored a stored key a new one
        # evicted comes back as new in the same call).
        assert 600 <= res["evicting_per_call"][v] <= 1000
