"""Writes OUTDIR/summary.json for scripts/gpu_check.sh from its work folder:
steps.tsv (one line per step: name, status, exit code, seconds, reason), the
steps' logs, the pytest JUnit XML files and the probe's JSON. Run after every
step, so a run cut short still leaves a summary. Standard library only.

    python3 scripts/gpu_summary.py WORK OUTDIR MODE
"""
import glob
import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET

TEST_STEPS = ("gpu_tests", "tier_inference_checkpoint_tests")


def junit(path):
    """Counts and the names of failed/errored tests of a JUnit XML file, by top folder too."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    by_dir, failed = {}, []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        name = f"{cls.replace('.', '/')}.py::{case.get('name')}" if cls else case.get("name")
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "errors"
                msg = (child.get("message") or child.text or "").strip().splitlines()
                failed.append({"test": name, "kind": child.tag, "message": (msg[0] if msg else "")[:300]})
                break
            if child.tag == "skipped":
                kind = "skipped"
        counts[kind] += 1
        top = "/".join(cls.split(".")[:2]) if cls else "?"
        by_dir.setdefault(top, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})[kind] += 1
    return counts, by_dir, failed


def pytest_tail(log):
    """pytest's closing line ('N passed, M failed ... in S s'), when it printed one."""
    lines = [ln for ln in open(log, errors="replace").read().splitlines() if re.search(r"\b(passed|failed|error|no tests ran)\b", ln)
             and re.search(r" in [\d.]+s", ln)]
    return lines[-1].strip("= ") if lines else None


def tail(path, n=15):
    try:
        return open(path, errors="replace").read().splitlines()[-n:]
    except OSError:
        return []


def main():
    work, out, mode = sys.argv[1:4]
    s = {"mode": mode, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}, "not_run": []}
    env_path = os.path.join(work, "env.json")
    if os.path.exists(env_path):
        s["env"] = json.load(open(env_path))
        s["gpu"] = s["env"].get("gpu")
    notes_path = os.path.join(work, "notes.txt")
    s["notes"] = [ln for ln in open(notes_path).read().splitlines() if ln] if os.path.exists(notes_path) else []
    tsv = os.path.join(work, "steps.tsv")
    rows = [ln.split("\t") for ln in open(tsv).read().splitlines() if ln] if os.path.exists(tsv) else []
    for name, status, rc, seconds, reason in rows:
        st = {"status": status, "exit_code": int(rc) if rc.lstrip("-").isdigit() else None,
              "seconds": float(seconds) if seconds else None}
        if reason:
            st["reason"] = reason
        log = os.path.join(work, "logs", f"{name}.log")
        if name == "example" and os.path.exists(log):  # its own checks and closing summary
            st["example_says"] = [ln.rstrip() for ln in open(log, errors="replace")
                                  if re.match(r"(\[(reload|serve|delta|summary)\]|  (eval AUC|rows|checkpoint|program) )", ln)]
        if name.startswith("bench_") and status == "ok" and os.path.exists(log):
            st["bench_says"] = tail(log, 14)
        if status in ("failed", "timeout") and name not in TEST_STEPS and os.path.exists(log):
            st["log_tail"] = tail(log, 25)
        if name in TEST_STEPS:
            xml = os.path.join(work, f"{name}.xml")
            if os.path.exists(xml):
                try:
                    st["counts"], st["by_dir"], st["failed_tests"] = junit(xml)
                except ET.ParseError as e:
                    st["junit_error"] = str(e)
            if os.path.exists(log):
                st["pytest_says"] = pytest_tail(log)
        if name == "build":
            cu = os.path.join(work, "cuda_ops.json")
            if os.path.exists(cu) and os.path.getsize(cu):
                st.update(json.load(open(cu)))
        if name == "probe":
            pj = os.path.join(out, "probe.json")
            if os.path.exists(pj):
                checks = json.load(open(pj)).get("checks", {})
                st["checks"] = {k: ("ok" if v["ok"] else v["error"]) for k, v in checks.items()}
                st["ok"] = sum(v["ok"] for v in checks.values())
                st["of"] = len(checks)
        s["steps"][name] = st
        why = reason or (f"timed out after {seconds} s" if status == "timeout" else f"exit code {rc}")
        if status == "skipped":
            s["not_run"].append({"part": name, "why": why})
        elif status in ("failed", "timeout"):
            s.setdefault("failed", []).append({"part": name, "why": why})
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for name in TEST_STEPS:
        for k, v in s["steps"].get(name, {}).get("counts", {}).items():
            totals[k] += v
    s["test_totals"] = totals
    starts = glob.glob(os.path.join(work, "started"))
    if starts:
        s["wall_s"] = round(time.time() - os.path.getmtime(starts[0]), 1)
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(s, f, indent=1)
    os.replace(tmp, os.path.join(out, "summary.json"))


if __name__ == "__main__":
    main()
