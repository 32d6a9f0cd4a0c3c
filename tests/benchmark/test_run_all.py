"""benchmark/run_all.py: merging the benchmarks' JSON into the summary, its
key numbers and picture (from JSON the tests write; no benchmark runs), and
the runner's handling of scripts that succeed, fail or do not exist (tiny
stand-in scripts)."""
import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import bench_json_samples as samples

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmark")
sys.path.insert(0, BENCH)
import run_all  # noqa: E402

MKEYS = 2.0**20
INF_CASES = {"dynamicemb program float32": 0.010, "dynamicemb program int8": 0.008,
             "torchrec quantized EBC int8 (static)": 0.0064, "training module eval (float32)": 0.011}


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def write(results, name, payload):
    with open(os.path.join(results, name), "w") as f:
        json.dump(payload, f)
    return payload


SOAK_RSS = [300.0, 310.0, 320.0, 322.0, 325.0, 321.0, 324.0, 326.0, 323.0, 325.0, 324.0, 326.0, 322.0]


# Issue 39's id modes (bench_torchrec --key-pool, --new-share): (dynamic, native) step s, CPU s, (unique, new) ids
EXISTING = dict(step_s={"dynamic": 0.045, "native": 0.050}, cpu_s={"dynamic": 0.030, "native": 0.025},
                key_pool=1 << 18, ids=[(1000, 0), (1000, 2)])
NEWSHARE = dict(step_s={"dynamic": 0.066, "native": 0.055}, key_pool=1 << 18, new_share=0.5,
                ids=[(3000, 2000), (3000, 2200)])
EVICTING = dict(step_s={"dynamic": 0.080, "native": 0.070}, key_pool=1 << 20, new_share=0.5,
                ids=[(3000, 2000, 1900), (3000, 2100, 2000)])


def all_payloads(results, with_tiers=True, with_checkpoint=True, failed_models=(), with_soak=True,
                 with_quality=False, with_torchrec_modes=True):
    p = {
        "table": write(results, "bench_table.json", samples.table({
            0.5: {"lookup_hit": 60.0, "lookup_miss": 70.0, "insert_new": 30.0, "lookup_gather": 20.0,
                  "index_select": 25.0, "index_select_same_pages": 32.0},
            1.0: {"lookup_hit": 40.0, "lookup_miss": 50.0, "insert_evict": 20.0, "lookup_gather": 16.0,
                  "index_select": 24.0, "index_select_same_pages": 30.0}})),
        "embedding": write(results, "bench_embedding.json", samples.embedding({
            "EXACT_SGD": (0.100, 0.125, 0.010, 0.008), "ADAM": (0.150, None, 0.012, None)})),
        "torchrec": write(results, "bench_torchrec.json", samples.torchrec(
            {"dynamic": 0.060, "native": 0.050, "mc": 0.240}, failed=failed_models)),
        "inference": write(results, "inference.json", samples.inference(INF_CASES)),
    }
    if with_torchrec_modes:
        p["torchrec_existing"] = write(results, "bench_torchrec_existing.json", samples.torchrec(**EXISTING))
        p["torchrec_newshare"] = write(results, "bench_torchrec_newshare.json", samples.torchrec(**NEWSHARE))
        p["torchrec_evicting"] = write(results, "bench_torchrec_evicting.json", samples.torchrec(**EVICTING))
    if with_soak:
        p["soak"] = write(results, "soak.json", samples.soak(SOAK_RSS))
    if with_tiers:
        p["tiers"] = write(results, "bench_tiers.json", samples.tiers(
            [(b, f, pf, 20.0 * (1 + (1 - f) * (2 if b == "file" else 1) * (0.5 if pf else 1)), f ** 0.2)
             for b in ("host", "file") for pf in (False, True) for f in (1.0, 0.5, 0.1)]))
    if with_checkpoint:
        p["checkpoint"] = write(results, "bench_checkpoint.json",
                                samples.checkpoint(10**6, 2.0, 1.0, 0.5, 4 * 10**8, 3 * 10**8))
    if with_quality:
        p["quality"] = write(results, "bench_quality.json", samples.quality(
            {"fold@0.0625": [0.70, 0.72], "lru@0.0625": [0.71, 0.74], "unlimited": [0.75, 0.76]}))
    return p


def run_cli(*args):
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run_all.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def test_from_json_merges_all_benchmarks_and_draws_every_panel(tmp_path):
    res = str(tmp_path)
    payloads = all_payloads(res, with_quality=True)
    rc, out = run_cli("--from-json", "--results-dir", res)
    assert rc == 0, out
    with open(tmp_path / "summary.json") as f:
        s = json.load(f)

    # The scripts' JSON, unchanged, and where and when each was measured.
    assert s["benchmarks"] == payloads
    assert set(s["runs"]) == set(run_all.NAMES)
    for name, rec in s["runs"].items():
        assert rec["status"] == "previous", name
    assert s["runs"]["table"]["measured"]["git_commit"] == "abc1234"
    assert s["runs"]["inference"]["measured"]["date"] == samples.ENV["date"]
    # The machine, versions, commit and command.
    assert s["env"]["torch"] == torch.__version__
    assert s["env"]["threads"] == torch.get_num_threads()
    assert s["env"]["cpu_count"] == os.cpu_count()
    assert s["env"]["torchrec"] and s["env"]["matplotlib"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert s["commit"] == head.stdout.strip()
    assert "--from-json" in s["command"] and "run_all.py" in s["command"]
    assert s["date"][:2] == "20"

    k = s["key_numbers"]
    t = k["table"]["per_load_factor"]
    assert [r["load_factor"] for r in t] == [0.5, 1.0]
    assert t[0]["lookup_hit"] == pytest.approx(60.0) and t[1]["lookup_miss"] == pytest.approx(50.0)
    assert t[0]["insert"] == pytest.approx(30.0) and not t[0]["insert_evicts"]
    assert t[1]["insert"] == pytest.approx(20.0) and t[1]["insert_evicts"]
    assert t[0]["gather_ratio"] == pytest.approx(20 / 25) and t[1]["gather_ratio"] == pytest.approx(16 / 24)
    assert k["table"]["gather_ratio_min"] == pytest.approx(16 / 24)

    e = k["embedding"]["optimizers"]
    assert e["EXACT_SGD"]["ours_train_ms"] == pytest.approx(100.0)
    assert e["EXACT_SGD"]["tbe_eval_ms"] == pytest.approx(8.0)
    assert e["EXACT_SGD"]["train_ratio"] == pytest.approx(0.8) and e["EXACT_SGD"]["eval_ratio"] == pytest.approx(1.25)
    assert "train_ratio" not in e["ADAM"] and "no Adam" in e["ADAM"]["no_tbe"]

    m = k["torchrec"]["models"]
    assert {n: m[n]["step_ms"] for n in m} == pytest.approx({"dynamic": 60.0, "native": 50.0, "mc": 240.0})
    assert k["torchrec"]["ratios"]["dynamic_over_native_time"] == pytest.approx(1.2)

    series = k["tiers"]["series"]
    assert set(series) == {"host, prefetch off", "host, prefetch on", "file, prefetch off", "file, prefetch on"}
    file_off = series["file, prefetch off"]
    assert [p["cache_fraction"] for p in file_off] == [1.0, 0.5, 0.1]
    assert [p["vs_in_memory"] for p in file_off] == pytest.approx([1.0, 2.0, 2.8])
    assert file_off[2]["hit_rate"] == pytest.approx(0.1 ** 0.2)
    assert k["tiers"]["file_gather"]["ratio"] == 1.25

    c = k["checkpoint"]
    assert (c["dump_gb_s"], c["save_gb_s"], c["load_gb_s"]) == pytest.approx((0.2, 0.3, 0.8))
    assert c["dump_vs_save"] == pytest.approx(0.2 / 0.3)

    i = k["inference"]["cases"]
    assert i["dynamicemb program int8"]["mkeys_per_s"] == pytest.approx(26 * 512 * 10 / 0.008 / MKEYS)
    assert i["dynamicemb program int8"]["vs_torchrec_int8"] == pytest.approx(0.8)

    # Markdown tables with the same numbers.
    md = (tmp_path / "summary.md").read_text()
    assert "| 1 | 40.0 | 50.0 | 20.0 (evicting) | 16.0 | 24.0 | 0.67 |" in md
    assert "| TorchRec FUSED (FBGEMM TBE) | 50.0 | 40960 | 1.20 |" in md
    assert "| DynamicEmbDump | 2.00 | 0.20 |" in md

    so = k["soak"]
    assert [x["rss_mib"] for x in so["samples"]] == SOAK_RSS and so["warmup"] == 150
    # After warm-up (step >= 150: from the 4th sample, 322) the peak is 326; the thirds' peaks are 325 and 326.
    assert so["growth_after_warmup"]["rss_mib"] == pytest.approx(4.0) and so["rss_drift_mib"] == pytest.approx(1.0)
    assert "| max growth | 4.0 | 0 | 0 |" in md
    q = k["quality"]["groups"]
    assert q["lru@0.0625"]["final_auc"] == pytest.approx(0.725)
    assert q["lru@0.0625"]["auc_gap_vs_fold"] == pytest.approx(0.015)
    assert q["fold@0.0625"]["auc_gap_vs_fold"] is None and q["unlimited"]["budget"] is None
    assert q["unlimited"]["auc_by_window"] == pytest.approx([0.755 * (w + 1) / 4 for w in range(4)])
    assert "| label of lru | 1/16 | 100 / 128 | 0.7250 ± 0.0212 | 0.2750 ± 0.0212 | +0.0150 ± 0.0071 | 50.0% | 20.0 |" in md

    # Eight panels (the six speed panels, soak and model quality), two a row: 16 x (1.2 + 4 x 4.8) inches at 100 dpi.
    assert png_size(tmp_path / "summary.png") == (1600, 2040)
    assert "8 panels" in out


def test_missing_benchmarks_are_left_out_of_the_picture(tmp_path):
    res = str(tmp_path)
    payloads = all_payloads(res, with_tiers=False, with_checkpoint=False, failed_models=("mc",), with_soak=False)
    rc, out = run_cli("--from-json", "--results-dir", res)
    assert rc == 0, out
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["benchmarks"] == payloads
    for name in ("tiers", "checkpoint", "soak"):
        assert s["runs"][name]["status"] == "missing" and name not in s["key_numbers"]
    assert s["key_numbers"]["torchrec"]["models"]["mc"] == {"status": "n/a", "reason": "rank 0: RuntimeError: boom"}
    assert "n/a: rank 0: RuntimeError: boom" in (tmp_path / "summary.md").read_text()
    # Four panels: two rows.
    assert png_size(tmp_path / "summary.png") == (1600, 1080)


GOOD = """
import argparse, json, sys
sys.path.insert(0, {tests!r})
import bench_json_samples as samples
ap = argparse.ArgumentParser(); ap.add_argument("--repeats"); ap.add_argument("--out")
a = ap.parse_args()
print("good bench running")
json.dump(samples.inference({cases!r}), open(a.out, "w"))
"""
FAILING = """
import sys
print("bad bench: something broke")
open(sys.argv[sys.argv.index("--out") + 1], "w").write("{{")  # a partial file, then a failure
sys.exit(3)
"""


def test_runner_reports_failed_and_missing_scripts_and_keeps_running(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    res = tmp_path / "results"
    res.mkdir()
    (scripts / "good.py").write_text(textwrap.dedent(GOOD.format(tests=os.path.dirname(__file__), cases=INF_CASES)))
    (scripts / "bad.py").write_text(FAILING.format())
    stale = write(str(res), "bench_table.json", samples.table({  # an earlier run's: not this run's result
        1.0: {"lookup_hit": 1.0, "lookup_miss": 1.0, "insert_evict": 1.0, "lookup_gather": 1.0, "index_select": 1.0,
              "index_select_same_pages": 1.0}}))
    earlier = write(str(res), "bench_checkpoint.json",
                    samples.checkpoint(10**6, 2.0, 1.0, 0.5, 4 * 10**8, 3 * 10**8))
    benches = [run_all.Bench("table", str(scripts / "bad.py"), [], "bench_table.json"),
               run_all.Bench("tiers", str(scripts / "not_written_yet.py"), ["--quick"], "bench_tiers.json"),
               run_all.Bench("inference", str(scripts / "good.py"), ["--repeats", "2"], "inference.json"),
               run_all.Bench("checkpoint", str(scripts / "bad.py"), [], "bench_checkpoint.json")]
    rc = run_all.main(["--results-dir", str(res), "--only", "table,tiers,inference", "--quiet"], benchmarks=benches)
    assert rc == 1  # one failed

    s = json.loads((res / "summary.json").read_text())
    runs = s["runs"]
    assert runs["table"]["status"] == "failed" and runs["table"]["exit_code"] == 3
    assert "table" not in s["benchmarks"]  # neither the partial file nor the stale one
    assert json.loads((res / "bench_table.json").read_text()) == stale
    assert not (res / "bench_table.json.tmp").exists()
    assert "something broke" in (res / "logs" / "table.log").read_text()
    assert runs["tiers"]["status"] == "skipped" and "does not exist" in runs["tiers"]["note"]
    assert runs["inference"]["status"] == "ok" and runs["inference"]["exit_code"] == 0
    assert runs["inference"]["wall_s"] >= 0 and runs["inference"]["args"] == ["--repeats", "2"]
    assert s["benchmarks"]["inference"] == samples.inference(INF_CASES)
    assert "good bench running" in (res / "logs" / "inference.log").read_text()
    # Not selected: an earlier run's JSON, merged and marked as such.
    assert runs["checkpoint"]["status"] == "previous" and s["benchmarks"]["checkpoint"] == earlier
    assert png_size(res / "summary.png") == (1600, 600)  # inference and checkpoint: one row

    # A redraw keeps the record of the run that wrote each JSON, also over several redraws.
    for _ in range(2):
        assert run_all.main(["--results-dir", str(res), "--from-json"], benchmarks=benches) == 0
        again = json.loads((res / "summary.json").read_text())
        inf = again["runs"]["inference"]
        assert inf["status"] == "previous" and inf["previous_run"]["wall_s"] == runs["inference"]["wall_s"]
        assert inf["previous_run"]["exit_code"] == 0 and inf["previous_run"]["args"] == ["--repeats", "2"]
        assert "--only" in inf["previous_run"]["command"]
        assert "previous_run" not in again["runs"]["checkpoint"]  # no record of the run that wrote it
        assert again["runs"]["table"]["status"] == "previous" and again["benchmarks"]["table"] == stale

    dest = tmp_path / "docs"
    published = run_all.publish(str(res), str(dest))
    assert sorted(os.path.basename(p) for p in published) == [
        "benchmark_summary.json", "benchmark_summary.md", "benchmark_summary.png"]
    assert (dest / "benchmark_summary.png").read_bytes() == (res / "summary.png").read_bytes()


HANGING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # like a spawned rank
open({pid_file!r}, "w").write(str(child.pid))
time.sleep(60)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_a_script_past_the_timeout_is_ended_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(HANGING.format(pid_file=str(pid_file)))
    rec = run_all.run_one(run_all.Bench("table", str(script), [], "bench_table.json"), str(tmp_path), timeout=3.0,
                          echo=False)
    assert rec["status"] == "failed" and "timed out after 3 s" in rec["note"]
    assert 3.0 <= rec["wall_s"] < 30
    assert pid_file.exists(), "the script did not start its child within the timeout"
    child = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    assert not (tmp_path / "bench_table.json").exists()


def test_a_json_without_the_expected_fields_is_reported_and_left_out(tmp_path):
    all_payloads(str(tmp_path), with_tiers=False, with_soak=False)
    write(str(tmp_path), "bench_checkpoint.json", {"benchmark": "bench_checkpoint", "config": {}})
    assert run_all.main(["--results-dir", str(tmp_path), "--from-json"]) == 1
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["key_number_errors"] == {"checkpoint": "KeyError: 'results'"}
    assert "checkpoint" not in s["key_numbers"] and "table" in s["key_numbers"]
    assert png_size(tmp_path / "summary.png") == (1600, 1080)  # the four others


# ---- bench_torchrec's id modes (issue 39): torchrec_existing, torchrec_newshare --------------------


def torchrec_panel(key):
    """The torchrec panel drawn from the key numbers: its bars (center, height), x tick labels (the x axis
    label added), legend and y limit."""
    import matplotlib.pyplot as plt
    import plot_summary

    fig, ax = plt.subplots()
    try:
        plot_summary.draw_panel(ax, "torchrec", key)
        bars = sorted((round(p.get_x() + p.get_width() / 2, 6), p.get_height()) for p in ax.patches)
        ticks = [t.get_text() for t in ax.get_xticklabels()] + ([ax.get_xlabel()] if ax.get_xlabel() else [])
        legend = [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []
        return bars, ticks, legend, ax.get_ylim()[1]
    finally:
        plt.close(fig)


def mode_row(label, mode, ids):
    """The Markdown row of a mode from its sample's inputs."""
    s = mode["step_s"]
    cpu = mode.get("cpu_s") or {n: t / 2 for n, t in s.items()}
    unique = sum(u for u, *_ in ids) if ids else 0
    new = f"{100 * sum(n for _, n, *_ in ids) / unique:.1f}%" if ids else "-"
    evicting = f"{100 * sum(e[0] if e else 0 for _, _, *e in ids) / sum(n for _, n, *_ in ids):.1f}%" if ids else "-"
    return (f"| {label} | {new} | {evicting} | {1e3 * s['dynamic']:.1f} | {1e3 * s['native']:.1f} | "
            f"{s['dynamic'] / s['native']:.2f} | {cpu['dynamic'] / cpu['native']:.2f} |")


def test_torchrec_id_modes_give_key_numbers_markdown_rows_and_grouped_bars(tmp_path):
    payloads = all_payloads(str(tmp_path))
    assert run_all.main(["--results-dir", str(tmp_path), "--from-json", "--quiet"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    for name in ("torchrec_existing", "torchrec_newshare", "torchrec_evicting"):
        assert s["runs"][name]["status"] == "previous" and s["benchmarks"][name] == payloads[name]
        assert s["runs"][name]["json"].endswith(f"bench_{name}.json")
    k = s["key_numbers"]
    for name, mode, label, target in (("torchrec_existing", EXISTING, "existing ids", "<= 1.0"),
                                      ("torchrec_newshare", NEWSHARE, "half the ids new", "<= 1.1"),
                                      ("torchrec_evicting", EVICTING, "half the ids new, evicting",
                                       "<= 1.1")):
        e = k[name]
        step, cpu = mode["step_s"], mode.get("cpu_s") or {n: t / 2 for n, t in mode["step_s"].items()}
        assert {n: e["models"][n]["step_ms"] for n in e["models"]} == pytest.approx(
            {n: 1e3 * t for n, t in step.items()})
        assert e["wall_ratio"] == pytest.approx(step["dynamic"] / step["native"])
        assert e["cpu_ratio"] == pytest.approx(cpu["dynamic"] / cpu["native"])
        new = sum(n for _, n, *_ in mode["ids"])
        assert e["new_ids_share"] == pytest.approx(new / sum(u for u, *_ in mode["ids"]))
        assert e["evicting_share"] == pytest.approx(sum(e[0] if e else 0 for _, _, *e in mode["ids"]) / new)
        assert (e["mode"], e["target"], e["key_pool"]) == (label, target, mode["key_pool"])
    assert k["torchrec_evicting"]["evicting_share"] == pytest.approx(3900 / 4100)
    assert k["torchrec_existing"]["cpu_ratio"] != pytest.approx(k["torchrec_existing"]["wall_ratio"])
    # The default mode: its JSON's target, no id counts (no --key-pool).
    assert k["torchrec"]["target"] == "<= 1.3" and k["torchrec"]["new_ids_share"] is None
    assert k["torchrec"]["mode"] == "mostly new ids"

    md = (tmp_path / "summary.md").read_text()
    assert "**Training step by id mode, dynamicemb / TorchRec FUSED**" in md
    default = {"step_s": {"dynamic": 0.060, "native": 0.050}}
    assert mode_row("mostly new ids (Zipf over 2^40)", default, None) + " <= 1.3 |" in md
    assert mode_row("existing ids (pool of 262144 keys per table)", EXISTING, EXISTING["ids"]) + " <= 1.0 |" in md
    assert mode_row("half the ids new (pool of 262144 keys per table)", NEWSHARE, NEWSHARE["ids"]) + " <= 1.1 |" in md
    assert mode_row("half the ids new, evicting (pool of 1048576 keys per table)", EVICTING,
                    EVICTING["ids"]) + " <= 1.1 |" in md
    assert "| TorchRec FUSED (FBGEMM TBE) | 50.0 | 40960 | 1.20 |" in md  # the default's own table stays

    # One panel for the four modes: a group of bars each (dynamic, native, mc; then dynamic, native thrice).
    bars, ticks, legend, top = torchrec_panel(k)
    heights = [h for _, h in bars]
    cut = 1.6 * 80.0  # the highest bar but MCH's (half new evicting, dynamic), x 1.6
    assert sorted(heights) == pytest.approx(sorted([60.0, 50.0, cut, 45.0, 50.0, 66.0, 55.0, 80.0, 70.0]))
    assert [round(x) for x, _ in bars] == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert top >= cut
    assert len(ticks) == 4 and ticks[0].startswith("mostly new ids") and ticks[1].startswith("existing ids")
    assert ticks[3].startswith("half the ids new, evicting")
    assert "target \u2264 1.0" in ticks[1] and "target \u2264 1.1" in ticks[2] and "target \u2264 1.3" in ticks[0]
    assert f"new ids {100 * 2 / 2000:.1f}%\n" in ticks[1] and "dyn / FUSED 0.90x\n(CPU 1.20x)" in ticks[1]
    assert legend == ["dynamicemb", "TorchRec FUSED (FBGEMM TBE)", "TorchRec managed collision (MCH)"]
    assert png_size(tmp_path / "summary.png") == (1600, 2040)  # seven panels (no quality; no new one): four rows


def test_report_without_the_torchrec_mode_results_as_before(tmp_path):
    """An older results directory (no bench_torchrec_existing/newshare.json): the modes are missing, the
    rest as before; the torchrec panel shows the default's models under their bars."""
    payloads = all_payloads(str(tmp_path), with_torchrec_modes=False)
    assert run_all.main(["--results-dir", str(tmp_path), "--from-json", "--quiet"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["benchmarks"] == payloads
    for name in ("torchrec_existing", "torchrec_newshare"):
        assert s["runs"][name]["status"] == "missing" and name not in s["key_numbers"]
    md = (tmp_path / "summary.md").read_text()
    assert "by id mode" not in md and "| TorchRec FUSED (FBGEMM TBE) | 50.0 | 40960 | 1.20 |" in md
    bars, ticks, legend, _ = torchrec_panel(s["key_numbers"])
    assert [h for _, h in bars][:2] == pytest.approx([60.0, 50.0]) and len(bars) == 3
    assert ticks[:3] == ["dynamicemb", "TorchRec FUSED\n(FBGEMM TBE)", "TorchRec managed collision\n(MCH)"]
    assert ticks[3] == "mostly new ids; Zipf over 2^40; dyn / FUSED 1.20x; (CPU 1.20x); target \u2264 1.3"
    assert legend == []


def test_torchrec_modes_alone_still_get_the_torchrec_panel(tmp_path):
    write(str(tmp_path), "bench_torchrec_existing.json", samples.torchrec(**EXISTING))
    assert run_all.main(["--results-dir", str(tmp_path), "--from-json", "--quiet"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert list(s["key_numbers"]) == ["torchrec_existing"]
    md = (tmp_path / "summary.md").read_text()
    assert "by id mode" in md and "Training step, DMP" not in md
    bars, ticks, _, _ = torchrec_panel(s["key_numbers"])
    assert png_size(tmp_path / "summary.png") == (1600, 600)  # one panel
    assert [h for _, h in bars] == pytest.approx([45.0, 50.0])
    assert ticks[:2] == ["dynamicemb", "TorchRec FUSED\n(FBGEMM TBE)"]
    assert ticks[2].startswith("existing ids; pool 256K keys") and ticks[2].endswith("target \u2264 1.0")

    # A mode whose dynamic model failed: no ratios, no id counts; its FUSED bar still drawn.
    write(str(tmp_path), "bench_torchrec_newshare.json", samples.torchrec(**NEWSHARE, failed=("dynamic",)))
    assert run_all.main(["--results-dir", str(tmp_path), "--from-json", "--quiet"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    n = s["key_numbers"]["torchrec_newshare"]
    assert n["wall_ratio"] is None and n["cpu_ratio"] is None and n["new_ids_share"] is None
    assert n["evicting_share"] is None
    assert n["models"]["dynamic"]["status"] == "n/a"
    md = (tmp_path / "summary.md").read_text()
    assert "| half the ids new (pool of 262144 keys per table) | - | - | - | 55.0 | - | - | <= 1.1 |" in md
    bars, ticks, _, _ = torchrec_panel(s["key_numbers"])
    assert [h for _, h in bars] == pytest.approx([45.0, 50.0, 55.0])
    assert ticks[1].startswith("half the ids new") and "dyn / FUSED" not in ticks[1]
