"""The key numbers of each benchmark's JSON (as its script writes it), for
the summary (run_all.py), its picture (plot_summary.py) and Markdown tables
that the README's performance section can show.

Each `key_<name>(data)` takes one script's JSON and returns a small dict of
numbers in the units their names say (ms, Mkeys/s = 2^20 keys/s, GB/s =
1e9 bytes/s, ratios as plain floats).
"""
from typing import Any, Callable, Dict, List, Optional

from torchrec_batches import fused_target, mode_label

MKEYS = float(2**20)


def _mkeys(m: Optional[dict]) -> Optional[float]:
    return None if m is None else m["keys_per_s"] / MKEYS


def key_table(d: dict) -> Dict[str, Any]:
    """Per load factor: the table's rates and lookup+gather vs index_select."""
    per_lf = []
    for st in d["stages"]:
        m = st["measurements"]
        row = {"load_factor": st["load_factor"],
               "lookup_hit": _mkeys(m.get("lookup_hit")),
               "lookup_miss": _mkeys(m.get("lookup_miss")),
               # LF < 1: new keys into free slots; LF 1: every new key evicts one
               "insert": _mkeys(m.get("insert_new") or m.get("insert_evict")),
               "insert_evicts": "insert_evict" in m,
               "lookup_gather": _mkeys(m.get("lookup_gather")),
               "index_select": _mkeys(m.get("index_select")),
               "index_select_same_pages": _mkeys(m.get("index_select_same_pages"))}
        if row["lookup_gather"] and row["index_select"]:
            row["gather_ratio"] = row["lookup_gather"] / row["index_select"]
        per_lf.append(row)
    s = d.get("summary", {})
    c = d["config"]
    return {"slots": c["slots"], "batch": c["batch"], "dim": c.get("dim"), "strategy": c.get("strategy"),
            "per_load_factor": per_lf,
            "gather_ratio_min": s.get("gather_ratio_min"), "gather_ratio_target": s.get("gather_ratio_target"),
            "evict_vs_lookup": s.get("evict_vs_lookup"), "evict_vs_lookup_target": s.get("evict_vs_lookup_target")}


def key_embedding(d: dict) -> Dict[str, Any]:
    """Per optimizer: training step and eval forward, ours vs FBGEMM's TBE."""
    out = {}
    for opt, r in d["results"].items():
        row = {k[:-2] + "_ms": v * 1e3 for k, v in r.items() if k.endswith("_s")}
        row.update({k: r[k] for k in ("train_ratio", "eval_ratio", "optimizer_bytes_per_row") if k in r})
        if "tbe" in r:
            row["no_tbe"] = r["tbe"]
        out[opt] = row
    c = d["config"]
    return {"layout": c.get("layout"), "batch": c.get("batch"), "pooling": c.get("pooling"),
            "dim": c.get("dim"), "optimizers": out}


# bench_torchrec's runs in run_all, one per id mode (their labels and targets: torchrec_batches).
TORCHREC_MODES = ("torchrec", "torchrec_existing", "torchrec_newshare", "torchrec_evicting")


def _new_share(r: dict) -> Optional[float]:
    """The share of the timed steps' unique ids that were new to the dynamic
    tables (inserted), over all rounds (results.dynamic.ids; absent without --key-pool)."""
    ids = r.get("ids") or []
    unique = sum(c["unique_ids_timed"] for c in ids)
    return sum(c["new_ids_timed"] for c in ids) / unique if unique else None


def _evicting_share(r: dict) -> Optional[float]:
    """The share of the timed steps' new ids that evicted a key (over all rounds)."""
    ids = r.get("ids") or []
    new = sum(c["new_ids_timed"] for c in ids)
    return sum(c["evicted_timed"] for c in ids) / new if new else None


def key_torchrec(d: dict) -> Dict[str, Any]:
    """Per model (dynamic, native, mc): the median step time; the ratios;
    dynamic / FUSED by wall and CPU time against the id mode's target, and
    the share of new ids in the timed steps (with --key-pool)."""
    models = {}
    for name, r in d["results"].items():
        if r.get("status") == "ok":
            models[name] = {"step_ms": r["median_step_s"] * 1e3, "cpu_ms": r["median_step_cpu_s"] * 1e3,
                            "samples_per_s": r["samples_per_s"]}
        else:
            models[name] = {"status": r.get("status", "n/a"), "reason": r.get("reason")}
    c = d["config"]
    ratios, targets = d.get("ratios", {}), d.get("targets", {})
    key_pool, new_share = c.get("key_pool") or 0, c.get("new_share") or 0.0
    dyn = d["results"].get("dynamic", {})
    return {"models": models, "ratios": ratios, "targets": targets,
            "tables": c.get("tables"), "dim": c.get("dim"), "rows_per_table": c.get("rows_per_table"),
            "batch": c.get("batch"), "pooling": c.get("pooling"), "world": c.get("world"),
            "mode": mode_label(key_pool, new_share, c.get("rows_per_table") or 0), "key_pool": key_pool or None, "new_share_asked": new_share or None,
            "wall_ratio": ratios.get("dynamic_over_native_time"), "cpu_ratio": ratios.get("dynamic_over_native_cpu"),
            # from the run's mode (a JSON written before the per-mode targets carries issue 4's for every mode)
            "target": fused_target(key_pool, new_share),
            "new_ids_share": _new_share(dyn) if dyn.get("status") == "ok" else None,
            "evicting_share": _evicting_share(dyn) if dyn.get("status") == "ok" else None}


def key_tiers(d: dict) -> Dict[str, Any]:
    """Per (backing, prefetch) series: step time relative to the all-in-memory
    table and hit rate by cache fraction; the file store's gather rate
    (file_gather["ratio"]: its time over numpy.memmap's)."""
    series: Dict[str, List[dict]] = {}
    for s in d["steps"]:
        name = f"{s['backing']}, prefetch {'on' if s['prefetch'] else 'off'}"
        series.setdefault(name, []).append({k: s[k] for k in ("cache_fraction", "step_ms", "vs_in_memory",
                                                              "hit_rate")})
    for pts in series.values():
        pts.sort(key=lambda p: -p["cache_fraction"])
    c = d.get("config", {})
    ws = c.get("working_set_rows")
    new = [s["new_share"] for s in d["steps"] if "new_share" in s]
    return {"in_memory_step_ms": d.get("in_memory_step_ms"), "series": series,
            "file_gather": d.get("file_gather"), "targets": d.get("targets", {}),
            "tables": c.get("tables"), "dim": c.get("dim"), "batch": c.get("batch"), "pooling": c.get("pooling"),
            "optimizer": c.get("optimizer"),
            "working_set_rows": sum(ws) / len(ws) if isinstance(ws, list) and ws else ws,
            "new_share": max(new) if new else None}


def key_checkpoint(d: dict) -> Dict[str, Any]:
    r = d["results"]
    return {"rows": r["rows"], "dim": d["config"].get("dim"), "world": d["config"].get("world"),
            "dump_gb_s": r["dump_gb_s"], "save_gb_s": r["save_gb_s"], "load_gb_s": r["load_gb_s"],
            "dump_s": r["dump_s"], "save_s": r["save_s"], "load_s": r["load_s"],
            "dump_vs_save": r["dump_vs_save"], "loaded_all": r["loaded_all"],
            # The same rows in a TorchRec model: DynamicEmbDump / Load against DCP (absent with --no-dcp).
            **{k: r[k] for k in ("model_dump_s", "model_load_s", "model_dump_bytes", "dcp_save_s", "dcp_load_s",
                                 "dcp_bytes", "dcp_loaded_all") if k in r}}


def key_inference(d: dict) -> Dict[str, Any]:
    cases = {name: {k: r[k] for k in ("mkeys_per_s", "p50_ms", "p99_ms", "vs_torchrec_int8")}
             for name, r in d["results"].items()}
    return {"rows": d["config"].get("rows"), "dim": d["config"].get("dim"), "cases": cases,
            "memory_mib": {k: v / 2**20 for k, v in d.get("memory_bytes", {}).items()}}


def key_soak(d: dict) -> Dict[str, Any]:
    a = d["args"]
    return {"steps": a["steps"], "warmup": a["warmup"], "events": d["events"],
            "growth_after_warmup": d["growth_after_warmup"], "rss_drift_mib": d["rss_drift_mib"],
            "final_vs_baseline": d["final_vs_baseline"], "all_dumps_loadable": d["all_dumps_loadable"],
            "samples": [{k: s[k] for k in ("step", "rss_mib", "fds", "threads_os")} for s in d["samples"]]}


def key_quality(d: dict) -> Dict[str, Any]:
    """Per group (setup@budget, or `unlimited`): final AUC / log loss (mean, std
    over seeds), the paired AUC gap to `fold`, step ms, rows held, and the
    mean AUC of every window."""
    groups = {}
    for g, s in d["summary"].items():
        groups[g] = {"setup": s["setup"], "budget": s["budget"], "label": s["label"],
                     "final_auc": s["final_auc"]["mean"], "final_auc_std": s["final_auc"]["std"],
                     "final_log_loss": s["final_log_loss"]["mean"], "final_log_loss_std": s["final_log_loss"]["std"],
                     "auc_gap_vs_fold": (s.get("auc_gap_vs_fold") or {}).get("mean"),
                     "auc_gap_vs_fold_std": (s.get("auc_gap_vs_fold") or {}).get("std"),
                     "held_share": (s.get("final_held_share") or {}).get("mean"),
                     "step_ms": s["step_ms"]["mean"], "rows_held": s["rows_held"]["mean"],
                     "rows_budget": s["rows_budget"]["mean"], "seeds": len(s["seeds"]),
                     "auc_by_window": [w["mean"] for w in s["auc_by_window"]]}
    c = d["config"]
    return {"data": c.get("data"), "windows": c.get("windows"), "window_batches": c.get("window_batches"),
            "batch_size": c.get("batch_size"), "seeds": c.get("seeds"), "budgets": c.get("budgets"),
            "final_share": c.get("final_share"), "groups": groups}


KEY_NUMBERS: Dict[str, Callable[[dict], Dict[str, Any]]] = {
    "table": key_table, "embedding": key_embedding, "tiers": key_tiers,
    "checkpoint": key_checkpoint, "inference": key_inference, "soak": key_soak, "quality": key_quality,
    **{n: key_torchrec for n in TORCHREC_MODES},
}


# ---- Markdown ---------------------------------------------------------------------------------


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _md(headers: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "--:" for i in
                                                              range(len(headers))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(key: Dict[str, Dict[str, Any]]) -> str:
    """Markdown tables of the key numbers of the benchmarks present in `key`."""
    parts = []
    if "table" in key:
        k = key["table"]
        parts.append(f"**Hash table** ({k['slots'] / 2**20:g}M slots, {k['batch'] / 2**20:g}M-key batches, "
                     f"dim-{k['dim']} float32 rows; Mkeys/s = 2^20 keys/s)\n\n" + _md(
                         ["load factor", "lookup hit", "lookup miss", "insert", "lookup+gather", "index_select",
                          "gather / index_select"],
                         [[f"{r['load_factor']:g}", _f(r["lookup_hit"]), _f(r["lookup_miss"]),
                           _f(r["insert"]) + (" (evicting)" if r["insert_evicts"] else ""),
                           _f(r["lookup_gather"]), _f(r["index_select"]),
                           _f(r.get("gather_ratio"), "{:.2f}")] for r in k["per_load_factor"]]))
    if "torchrec" in key:
        k = key["torchrec"]
        label = {"dynamic": "dynamicemb", "native": "TorchRec FUSED (FBGEMM TBE)",
                 "mc": "TorchRec managed collision (MCH)"}
        rows = []
        for name, m in k["models"].items():
            rel = (k["models"]["dynamic"]["step_ms"] / m["step_ms"]
                   if "step_ms" in m and "step_ms" in k["models"].get("dynamic", {}) else None)
            rows.append([label.get(name, name), _f(m.get("step_ms")), _f(m.get("samples_per_s"), "{:.0f}"),
                         _f(rel, "{:.2f}") if "step_ms" in m else f"n/a: {m.get('reason')}"])
        parts.append(f"**Training step, DMP on {k['world']} CPU ranks** ({k['tables']} tables x dim {k['dim']}, "
                     f"{k['rows_per_table']} rows per table, batch {k['batch']} per rank x {k['pooling']} ids)\n\n"
                     + _md(["tables", "ms / step", "samples/s", "dynamicemb time / this"], rows))
    modes = [n for n in TORCHREC_MODES if n in key]
    if any(n != "torchrec" for n in modes):
        rows = []
        for n in modes:
            k = key[n]
            ms = {m: k["models"].get(m, {}).get("step_ms") for m in ("dynamic", "native")}
            pool = f" (pool of {k['key_pool']} keys per table)" if k.get("key_pool") else " (Zipf over 2^40)"
            rows.append([k["mode"] + pool, _f(100 * k["new_ids_share"], "{:.1f}%")
                         if k["new_ids_share"] is not None else "-",
                         _f(100 * k["evicting_share"], "{:.1f}%") if k.get("evicting_share") is not None else "-",
                         _f(ms["dynamic"]), _f(ms["native"]),
                         _f(k["wall_ratio"], "{:.2f}"), _f(k["cpu_ratio"], "{:.2f}"), k["target"] or "-"])
        k = key[modes[0]]
        parts.append(f"**Training step by id mode, dynamicemb / TorchRec FUSED** (DMP on {k['world']} CPU ranks, "
                     f"{k['rows_per_table']} rows per table, batch {k['batch']} per rank; new ids: the timed steps' "
                     "unique ids the dynamic tables inserted, and the share of those that evicted a key)\n\n" + _md(
                         ["ids", "new ids", "of them evicting", "dynamicemb ms", "FUSED ms", "wall time ratio", "CPU time ratio",
                          "target"], rows))
    if "embedding" in key:
        k = key["embedding"]
        rows = [[opt, _f(r.get("optimizer_bytes_per_row"), "{:.0f}"), _f(r.get("ours_train_ms")),
                 _f(r.get("tbe_train_ms")), _f(r.get("train_ratio"), "{:.2f}"), _f(r.get("ours_eval_ms")),
                 _f(r.get("tbe_eval_ms")), _f(r.get("eval_ratio"), "{:.2f}")]
                for opt, r in k["optimizers"].items()]
        parts.append(f"**Embedding module vs FBGEMM's CPU TBE** ({k['layout']}, batch {k['batch']} x pooling "
                     f"{k['pooling']}, dim {k['dim']}; optimizer state bytes per row beside each optimizer)\n\n"
                     + _md(["optimizer", "optimizer B / row", "ours train ms", "TBE train ms", "ratio",
                            "ours eval ms", "TBE eval ms", "ratio"], rows))
    if "tiers" in key:
        k = key["tiers"]
        rows = [[name, f"{p['cache_fraction']:g}", _f(p["step_ms"]), _f(p["vs_in_memory"], "{:.2f}"),
                 _f(100 * p["hit_rate"], "{:.1f}%")] for name, pts in k["series"].items() for p in pts]
        fg = k.get("file_gather") or {}
        setup = (f"{k['tables']} tables x dim {k['dim']}, batch {k['batch']} x {k['pooling']} ids, {k['optimizer']}, "
                 f"cache fraction of a working set of {k['working_set_rows']:.0f} rows per table; "
                 if k.get("working_set_rows") else "")
        new = (f"; new keys, {100 * k['new_share']:.0f}% of the lookups, count as misses"
               if k.get("new_share") is not None else "")
        parts.append(f"**Storage tiers** ({setup}all in memory: {_f(k['in_memory_step_ms'])} ms / step{new})\n\n"
                     + _md(
            ["backing store", "cache fraction", "ms / step", "vs all in memory", "hit rate"], rows)
            + (f"\n\nFile store gather of rows by position: {_f(fg.get('rows_per_s', 0) / 1e6, '{:.2f}')} M rows/s; "
               f"numpy.memmap of the same rows: {_f(fg.get('memmap_rows_per_s', 0) / 1e6, '{:.2f}')} M rows/s "
               f"(time ratio {_f(fg.get('ratio'), '{:.2f}')})" if fg else ""))
    if "inference" in key:
        k = key["inference"]
        rows = [[name, _f(c["mkeys_per_s"]), _f(c["p50_ms"], "{:.2f}"), _f(c["p99_ms"], "{:.2f}"),
                 _f(c["vs_torchrec_int8"], "{:.2f}")] for name, c in k["cases"].items()]
        parts.append(f"**Inference** (26 tables x {k['rows']} rows x dim {k['dim']}, batch 512 x 10 ids per "
                     f"feature; Mids/s = 2^20 ids/s)\n\n" + _md(
                         ["program", "Mids/s", "p50 ms", "p99 ms", "vs TorchRec int8"], rows))
    if "checkpoint" in key:
        k = key["checkpoint"]
        parts.append(f"**Checkpoint** ({k['rows'] / 1e6:g}M rows x dim {k['dim']} with Adam state, "
                     f"{k['world']} ranks writing in parallel)\n\n" + _md(
                         ["operation", "seconds", "GB/s"],
                         [["DynamicEmbDump", _f(k["dump_s"], "{:.2f}"), _f(k["dump_gb_s"], "{:.2f}")],
                          ["torch.save + fsync, same bytes", _f(k["save_s"], "{:.2f}"),
                           _f(k["save_gb_s"], "{:.2f}")],
                          ["DynamicEmbLoad", _f(k["load_s"], "{:.2f}"), _f(k["load_gb_s"], "{:.2f}")]]))
        if "dcp_save_s" in k:
            parts.append("**Checkpoint of the same rows in a TorchRec model**, loaded into a fresh one\n\n" + _md(
                ["path", "save s", "load s", "MiB on disk"],
                [["DynamicEmbDump / DynamicEmbLoad", _f(k["model_dump_s"], "{:.2f}"), _f(k["model_load_s"], "{:.2f}"),
                  _f(k["model_dump_bytes"] / 2**20, "{:.0f}")],
                 ["dcp.save / dcp.load + load_state_dict", _f(k["dcp_save_s"], "{:.2f}"),
                  _f(k["dcp_load_s"], "{:.2f}"), _f(k["dcp_bytes"] / 2**20, "{:.0f}")]]))
    if "soak" in key:
        k = key["soak"]
        g, fin = k["growth_after_warmup"], k["final_vs_baseline"]
        ev = k["events"]
        parts.append(f"**Soak** ({k['steps']} training steps with growth, eviction, {ev['flushes']} flushes, "
                     f"{ev['evals']} evals, {ev['incremental']} incremental dumps, {ev['dumps']} non-blocking "
                     f"dumps; every dump loadable: {'yes' if k['all_dumps_loadable'] else 'NO'})\n\n" + _md(
                         ["after warm-up (step >= %d)" % k["warmup"], "RSS MiB", "open fds", "OS threads"],
                         [["max growth", _f(g["rss_mib"]), str(g["fds"]), str(g["threads_os"])],
                          ["drift (last third - first third, peaks)", _f(k["rss_drift_mib"]), "-", "-"],
                          ["after close, vs warm-up", _f(fin["rss_mib"]), str(fin["fds"]),
                           str(fin["threads_os"])]]))
    if "quality" in key:
        k = key["quality"]
        rows = [[g["label"], "all ids" if g["budget"] is None else f"1/{round(1 / g['budget'])}",
                 f"{g['rows_held']:,.0f} / {g['rows_budget']:,.0f}",
                 f"{g['final_auc']:.4f} ± {g['final_auc_std']:.4f}",
                 f"{g['final_log_loss']:.4f} ± {g['final_log_loss_std']:.4f}",
                 "-" if g["auc_gap_vs_fold"] is None
                 else f"{g['auc_gap_vs_fold']:+.4f} ± {g['auc_gap_vs_fold_std']:.4f}",
                 "-" if g.get("held_share") is None else f"{100 * g['held_share']:.1f}%",
                 _f(g["step_ms"])] for g in k["groups"].values()]
        n = len(k["seeds"] or [])
        parts.append(f"**Model quality at equal memory** (progressive validation of the example's DLRM on the "
                     f"{k['data']} click log: {k['windows']} windows x {k['window_batches']} batches x "
                     f"{k['batch_size']}; final = the last {k['final_share']:.0%} of the windows; mean ± std over "
                     f"{n} seeds)\n\n" + _md(
                         ["setup", "row budget", "rows held / budget", "final AUC", "final log loss",
                          "AUC - fold (paired)", "ids with a row", "ms / step"], rows))
    return "\n\n".join(parts) + "\n"
