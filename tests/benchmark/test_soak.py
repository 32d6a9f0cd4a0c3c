"""benchmark/soak.py, short: 400 steps with growth, eviction, flushes, evals,
incremental dumps and a non-blocking dump every 20 steps; nothing leaks."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import soak  # noqa: E402

# RSS bounds after warm-up (step 100). RSS saw-tooths with the dump cycle:
# measured here, the max growth over the first post-warm-up sample was 3-7
# MiB and the drift (peak of the last third - peak of the first) within
# +-3.1 MiB. A leak of one dump snapshot per dump (>= 3 MiB: 8192 + 8192
# rows x (16 values + 32 Adam floats) x 4 B, 15 dumps after warm-up) measured
# +51 MiB growth and +38 MiB drift (injected by keeping every snapshot_of result);
# one leaked step's keys, rows and gradients (>= 100 KiB) over 300 steps is >= 30 MiB.
RSS_GROWTH_BOUND_MIB = 16.0
RSS_DRIFT_BOUND_MIB = 8.0


def test_soak_short_is_flat(tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    res = soak.main(["--steps", "400", "--warmup", "100", "--every", "20", "--dump-every", "20",
                     "--dir", str(tmp_path), "--out", str(out), "--png", str(png)])
    ev = res["events"]
    assert ev["dumps"] == 20 and ev["flushes"] == 16 and ev["incremental"] == 20 and ev["evals"] == 57
    # The growing table reached its capacity (then evicted); the cached table's store grew past the cache.
    last = res["dumps"][-1]["rows"]
    assert last["grow"] == 8192 and last["cached"] > 2048
    assert res["table_stats"]["grow"]["evicted"] > 0 and res["table_stats"]["cached"]["write_backs"] > 0
    base = res["baseline"]
    after = [s for s in res["samples"] if s["step"] >= 100]
    for k in ("fds", "threads_py", "threads_os"):  # exactly their post-warm-up values at every sample
        assert [s[k] for s in after] == [base[k]] * len(after), k
    assert res["growth_after_warmup"]["rss_mib"] < RSS_GROWTH_BOUND_MIB
    assert res["rss_drift_mib"] < RSS_DRIFT_BOUND_MIB
    # Closing the module releases its file store's descriptors and starts no thread.
    assert res["final_after_close"]["fds"] <= base["fds"]
    assert res["final_after_close"]["threads_os"] == base["threads_os"]
    assert res["all_dumps_loadable"] and len(res["dumps"]) == 20
    assert json.loads(out.read_text())["growth_after_warmup"] == res["growth_after_warmup"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The temporary directory (store and dumps) is removed.
    assert not [p for p in os.listdir(tmp_path) if p.startswith("dynamicemb-soak-")]
