"""benchmark/soak.py, short: 200 steps with growth, eviction, flushes, evals,
incremental dumps and a non-blocking dump every 20 steps; nothing leaks."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import soak  # noqa: E402

# RSS bound after warm-up. One leaked dump snapshot is >= 2 MiB (8192 + >2048
# rows x (16 values + 32 Adam floats) x 4 B, plus keys and scores); the 7
# dumps from step 80 on would leak >= 14 MiB, and one leaked step's keys, rows
# and gradients (>= 100 KiB) over 120 steps >= 12 MiB. Allocator noise
# measured here: 1-3 MiB after warm-up.
RSS_BOUND_MIB = 8.0


def test_soak_short_is_flat(tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    res = soak.main(["--steps", "200", "--warmup", "80", "--every", "20", "--dump-every", "20",
                     "--dir", str(tmp_path), "--out", str(out), "--png", str(png)])
    ev = res["events"]
    assert ev["dumps"] == 10 and ev["flushes"] == 8 and ev["incremental"] == 10 and ev["evals"] == 28
    # The growing table reached its capacity (then evicted); the cached table's store grew past the cache.
    last = res["dumps"][-1]["rows"]
    assert last["grow"] == 8192 and last["cached"] > 2048
    assert res["table_stats"]["grow"]["evicted"] > 0 and res["table_stats"]["cached"]["write_backs"] > 0
    base = res["baseline"]
    after = [s for s in res["samples"] if s["step"] >= 80]
    for k in ("fds", "threads_py", "threads_os"):  # exactly their post-warm-up values at every sample
        assert [s[k] for s in after] == [base[k]] * len(after), k
    assert res["growth_after_warmup"]["rss_mib"] < RSS_BOUND_MIB
    # Closing the module releases its file store's descriptors and starts no thread.
    assert res["final_after_close"]["fds"] <= base["fds"]
    assert res["final_after_close"]["threads_os"] == base["threads_os"]
    assert res["all_dumps_loadable"] and len(res["dumps"]) == 10
    assert json.loads(out.read_text())["growth_after_warmup"] == res["growth_after_warmup"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The temporary directory (store and dumps) is removed.
    assert not [p for p in os.listdir(tmp_path) if p.startswith("dynamicemb-soak-")]
