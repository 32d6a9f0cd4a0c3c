"""Small JSON payloads shaped as each benchmark script writes them (the
fields run_all.py and summary_numbers.py read), with chosen numbers, for
tests of the summary without running a benchmark."""

MKEYS = 2.0**20
ENV = {"torch": "2.13.0+cpu", "threads": 2, "cpu": "Test CPU", "cpu_count": 2, "git_commit": "abc1234",
       "date": "2026-01-02T03:04:05+00:00", "loadavg_start": [0.1, 0.1, 0.1]}


def _m(mkeys_per_s):
    return {"n": 1024, "median_s": 1024 / (mkeys_per_s * MKEYS), "keys_per_s": mkeys_per_s * MKEYS,
            "mkeys_per_s": mkeys_per_s}


def table(rates):
    """rates: {load factor: {measurement name: Mkeys/s}}"""
    stages = [{"load_factor": lf, "fill": {"load_factor": lf}, "measurements": {k: _m(v) for k, v in ms.items()}}
              for lf, ms in rates.items()]
    ratios = {f"{lf:g}": ms["lookup_gather"] / ms["index_select"] for lf, ms in rates.items()}
    return {"benchmark": "bench_table",
            "config": {"slots": 1 << 20, "batch": 1 << 16, "dim": 64, "strategy": "TIMESTAMP", **ENV},
            "stages": stages,
            "summary": {"gather_ratio": ratios, "gather_ratio_min": min(ratios.values()),
                        "gather_ratio_target": 0.8, "evict_vs_lookup": 0.5, "evict_vs_lookup_target": 0.5}}


def embedding(times_s):
    """times_s: {optimizer: (ours train, TBE train or None, ours eval, TBE eval or None)}"""
    results = {}
    for opt, (ot, tt, oe, te) in times_s.items():
        r = {"ours_train_s": ot, "ours_eval_s": oe}
        if tt is None:
            r["tbe"] = "the CPU TBE has no Adam"
        else:
            r.update(tbe_train_s=tt, tbe_eval_s=te, train_ratio=ot / tt, eval_ratio=oe / te)
        results[opt] = r
    return {"benchmark": "bench_embedding",
            "config": {"batch": 4096, "pooling": 10, "dim": 64, "layout": "8 tables x 1000 rows", **ENV},
            "results": results}


def torchrec(step_s, failed=(), cpu_s=None, key_pool=0, new_share=0.0, ids=None):
    """step_s: {model: median step seconds}; models in `failed` are n/a;
    cpu_s: {model: median step CPU seconds} (default: half the step);
    with key_pool (existing ids, --key-pool): ids = [(unique, new) or
    (unique, new, evicting) ids of each round's timed steps] of the dynamic
    tables."""
    results = {}
    cpu_s = {n: s / 2 for n, s in step_s.items()} | (cpu_s or {})
    for name, s in step_s.items():
        if name in failed:
            results[name] = {"config": None, "status": "n/a", "reason": "rank 0: RuntimeError: boom"}
        else:
            results[name] = {"status": "ok", "median_step_s": s, "median_step_cpu_s": cpu_s[name],
                             "samples_per_s": 2 * 1024 / s, "steps_per_s": 1 / s}
            if key_pool:
                results[name].update(prefill_s=1.5, prefill_s_rounds=[1.5] * len(ids or [0]))
    if key_pool and "dynamic" in results and "dynamic" not in failed:
        results["dynamic"]["ids"] = [
            {"unique_ids_timed": u, "new_ids_timed": n, "new_share_timed": n / u, "new_ids_warmup": 0,
             "evicted_timed": e[0] if e else 0, "failed_timed": 0, "pool_keys": 8 * key_pool,
             "stored_after_prefill": 8 * key_pool, "evicted_in_prefill": 0, "failed_in_prefill": 0}
            for u, n, *e in ids]
    ratios = {}
    if {"dynamic", "native"} <= set(step_s) - set(failed):  # as bench_torchrec: both ran
        ratios["dynamic_over_native_time"] = step_s["dynamic"] / step_s["native"]
        ratios["dynamic_over_native_cpu"] = cpu_s["dynamic"] / cpu_s["native"]
    return {"benchmark": "bench_torchrec",
            "config": {"tables": 8, "dim": 64, "rows_per_table": 1 << 20, "batch": 1024, "pooling": 10,
                       "world": 2, "key_pool": key_pool, "new_share": new_share, **ENV},
            "common": {"mode": "existing ids (--key-pool)" if key_pool else "mostly new ids (Zipf over 2**40)"},
            "results": results, "ratios": ratios,
            "targets": {"dynamic_over_native_time": "<= 1.3", "dynamic_over_mc_time": "< 1"}}


def tiers(points, in_memory_ms=20.0):
    """points: [(backing, cache fraction, prefetch, step ms, hit rate)]"""
    steps = [{"backing": b, "cache_fraction": f, "prefetch": p, "step_ms": ms, "vs_in_memory": ms / in_memory_ms,
              "hit_rate": h} for b, f, p, ms, h in points]
    return {"steps": steps, "in_memory_step_ms": in_memory_ms,
            "file_gather": {"rows_per_s": 2.0e6, "memmap_rows_per_s": 1.6e6, "ratio": 1.25}, "targets": {}}


def checkpoint(rows, dump_s, save_s, load_s, dump_bytes, plain_bytes):
    return {"benchmark": "bench_checkpoint", "config": {"rows": rows, "dim": 64, "world": 2, **ENV},
            "results": {"rows": rows, "dump_bytes": dump_bytes, "plain_bytes": plain_bytes,
                        "dump_s": dump_s, "save_s": save_s, "load_s": load_s,
                        "dump_gb_s": dump_bytes / dump_s / 1e9, "save_gb_s": plain_bytes / save_s / 1e9,
                        "load_gb_s": dump_bytes / load_s / 1e9,
                        "dump_vs_save": (dump_bytes / dump_s) / (plain_bytes / save_s), "loaded_all": True}}


def inference(median_s):
    """median_s: {case: median batch seconds}; the reference is TorchRec's int8 case."""
    n_ids = 26 * 512 * 10
    ref = median_s["torchrec quantized EBC int8 (static)"]
    results = {k: {"median_s": s, "p50_ms": s * 1e3, "p99_ms": s * 1.5e3, "mkeys_per_s": n_ids / s / MKEYS,
                   "vs_torchrec_int8": ref / s, "times": [s]} for k, s in median_s.items()}
    return {"env": ENV, "config": {"rows": 1000, "dim": 64, "repeats": 3}, "results": results,
            "memory_bytes": {"float32": 2**20, "int8": 2**18}}


def soak(rss_mib, steps=600, warmup=150, every=50):
    """rss_mib: the RSS of each sample (fds and threads flat); growth and
    drift computed as soak.summarize does."""
    samples = [{"step": i * every, "rss_mib": r, "fds": 12, "threads_py": 1, "threads_os": 9}
               for i, r in enumerate(rss_mib)]
    after = [x for x in samples if x["step"] >= warmup]
    growth = {k: max(x[k] for x in after) - after[0][k] for k in ("rss_mib", "fds", "threads_py", "threads_os")}
    third = max(1, len(after) // 3)
    drift = max(x["rss_mib"] for x in after[-third:]) - max(x["rss_mib"] for x in after[:third])
    return {"args": {"steps": steps, "warmup": warmup, "every": every}, "env": ENV,
            "events": {"evals": 85, "flushes": 24, "incremental": 30, "dumps": 6},
            "samples": samples, "baseline": after[0], "growth_after_warmup": growth, "rss_drift_mib": drift,
            "final_vs_baseline": {"rss_mib": -3.5, "fds": -3, "threads_py": 0, "threads_os": 0},
            "all_dumps_loadable": True, "dumps": []}


def quality(final_auc, windows=4):
    """final_auc: {group ("setup@budget" or "unlimited"): [final AUC per seed]}; the
    window AUCs climb to it; log loss 1 - AUC; step ms 10 x the group's index + 10."""
    def ms(xs):
        m = sum(xs) / len(xs)
        return {"mean": m, "std": (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5, "n": len(xs)}

    summary = {}
    for i, (g, aucs) in enumerate(final_auc.items()):
        setup, _, budget = g.partition("@")
        s = {"setup": setup, "budget": float(budget) if budget else None, "label": f"label of {setup}",
             "seeds": list(range(len(aucs))), "final_auc": ms(aucs), "final_log_loss": ms([1 - a for a in aucs]),
             "step_ms": ms([10.0 * i + 10.0] * len(aucs)), "rows_held": ms([100.0] * len(aucs)),
             "rows_budget": ms([128.0] * len(aucs)), "final_held_share": ms([0.5] * len(aucs)),
             "auc_by_window": [ms([a * (w + 1) / windows for a in aucs]) for w in range(windows)],
             "log_loss_by_window": [ms([0.5] * len(aucs)) for _ in range(windows)]}
        fold = final_auc.get(f"fold@{budget}")
        if budget and setup != "fold" and fold:
            s["auc_gap_vs_fold"] = ms([a - f for a, f in zip(aucs, fold)])
        summary[g] = s
    return {"benchmark": "bench_quality",
            "config": {"data": "generated", "windows": windows, "window_batches": 8, "batch_size": 512,
                       "seeds": list(range(len(next(iter(final_auc.values()))))), "budgets": [0.0625],
                       "final_share": 0.25, **ENV},
            "summary": summary, "runs": []}
