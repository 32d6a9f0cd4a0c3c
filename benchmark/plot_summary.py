"""The picture of the benchmark summary (run_all.py): one panel per benchmark
whose results are in the summary, two panels a row, a title naming the
machine and the commit.

    bash scripts/dev.sh python benchmark/plot_summary.py [summary.json] [out.png]
"""
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

COLS = 2
WIDTH_IN, ROW_IN, HEAD_IN, DPI = 16.0, 4.8, 1.2, 100
OURS, THEIRS, OTHER = "tab:blue", "tab:orange", "tab:gray"


def figure_size_px(n_panels: int) -> Tuple[int, int]:
    """(width, height) in pixels of the picture with n_panels panels."""
    rows = max(1, math.ceil(n_panels / COLS))
    return round(WIDTH_IN * DPI), round((HEAD_IN + ROW_IN * rows) * DPI)


def _label_bars(ax, bars, texts):
    """Each text above its bar (bars of zero height get none)."""
    for b, t in zip(bars, texts):
        if b.get_width() > 0 and b.get_height() > 0 and t:
            ax.annotate(t, (b.get_x() + b.get_width() / 2, b.get_height()), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8)


# ---- panels: each takes (ax, key numbers of its benchmark) -------------------------------------


def panel_table(ax, k: Dict[str, Any]) -> None:
    rows = k["per_load_factor"]
    lf = [r["load_factor"] for r in rows]
    lines = [("lookup (hit)", "lookup_hit", OURS, "-", "o"),
             ("lookup (miss)", "lookup_miss", OURS, ":", "o"),
             ("insert new keys (evicting at LF 1)", "insert", "tab:green", "-", "s"),
             (f"lookup + gather of dim-{k['dim']} rows", "lookup_gather", "tab:purple", "-", "D"),
             ("index_select, static table", "index_select", THEIRS, "--", "^"),
             ("index_select, same pages as ours", "index_select_same_pages", THEIRS, ":", "^")]
    top = 0.0
    for label, key, color, ls, marker in lines:
        ys = [r.get(key) for r in rows]
        top = max([top] + [y for y in ys if y is not None])
        if any(y is not None for y in ys):
            ax.plot(lf, [float("nan") if y is None else y for y in ys], ls, color=color, marker=marker,
                    label=label)
    for r in rows:
        if r.get("gather_ratio") is not None:
            ax.annotate(f"{r['gather_ratio']:.2f}x", (r["load_factor"], r["lookup_gather"]), xytext=(0, -13),
                        textcoords="offset points", ha="center", fontsize=8, color="tab:purple")
    ax.set_xticks(lf)
    ax.set_xticklabels([f"{x:g}" for x in lf])
    ax.set_xlabel("load factor")
    ax.set_ylabel("Mkeys/s (2^20 keys/s)")
    ax.set_ylim(0, 1.45 * top or 1.0)  # room for the legend at the top
    ax.set_title(f"Hash table: {k['slots'] / 2**20:g}M slots, {k['batch'] / 2**20:g}M-key batches\n"
                 "(purple labels: lookup+gather / index_select)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=2)


TORCHREC_LABELS = {"dynamic": "dynamicemb", "native": "TorchRec FUSED (FBGEMM TBE)",
                   "mc": "TorchRec managed collision (MCH)"}


def _mode_label(k: Dict[str, Any]) -> str:
    """An id mode's group label: the ids, the new ids' share, dynamic / FUSED and the target."""
    lines = [k.get("mode") or "mostly new ids",
             f"pool {k['key_pool'] / 1024:g}K keys" if k.get("key_pool") else "Zipf over 2^40"]
    if k.get("new_ids_share") is not None:
        lines.append(f"new ids {100 * k['new_ids_share']:.1f}%")
    if k.get("wall_ratio") is not None:
        lines.append(f"dyn / FUSED {k['wall_ratio']:.2f}x")
        if k.get("cpu_ratio") is not None:
            lines.append(f"(CPU {k['cpu_ratio']:.2f}x)")
    if k.get("target"):
        lines.append("target " + k["target"].replace("<=", "\u2264").replace(">=", "\u2265"))
    return "\n".join(lines)


def panel_torchrec(ax, k: Optional[Dict[str, Any]], more: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    """The DMP step per model, one group of bars per id mode: the default
    (k) and those in `more` (existing ids, half new, half new evicting; from
    their own runs).
    A bar far above the others (MCH) is cut at the top, its value written."""
    groups = ([k] if k else []) + list((more or {}).values())
    models = [m for m in TORCHREC_LABELS if any(m in g["models"] for g in groups)]
    models += [m for g in groups for m in g["models"] if m not in models]
    ok = [m.get("step_ms", 0.0) for g in groups for n, m in g["models"].items() if n != "mc"]
    cut = 1.6 * max(ok) if ok and max(ok) > 0 else None
    width = 0.8 / max(len(g["models"]) for g in groups)
    shown, ticks = set(), []
    for x, g in enumerate(groups):
        names = [n for n in models if n in g["models"]]
        dyn = g["models"].get("dynamic", {}).get("step_ms")
        for i, n in enumerate(names):
            pos = x + (i - (len(names) - 1) / 2) * width
            ticks.append((pos, TORCHREC_LABELS.get(n, n).replace(" (", "\n(")))
            m = g["models"][n].get("step_ms")
            if not m:
                ax.annotate("n/a", (pos, 0), ha="center", va="bottom", fontsize=8)
                continue
            clipped = cut is not None and m > cut
            color = OURS if n == "dynamic" else THEIRS
            ax.bar(pos, min(m, cut) if clipped else m, width, color=color, hatch="//" if n == "mc" else None,
                   edgecolor="white" if n == "mc" else None, label=None if n in shown else TORCHREC_LABELS.get(n, n))
            shown.add(n)
            text = f"{m:.1f}" + (f"\n(dyn {dyn / m:.2f}x)" if n == "mc" and dyn else "")
            if clipped:
                ax.annotate(text + "\n(bar cut)", (pos, cut), xytext=(0, -3), textcoords="offset points",
                            ha="center", va="top", fontsize=7, bbox=dict(boxstyle="square,pad=0.15", fc="white",
                                                                         ec="none", alpha=0.85))
            else:
                ax.annotate(text, (pos, m), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                            fontsize=7)
    if len(groups) > 1:  # a group per mode, a legend for the models
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([_mode_label(g) for g in groups], fontsize=8 if len(groups) < 4 else 7)
        ax.legend(fontsize=7, loc="upper right")
    else:  # one mode: the models under their bars
        ax.set_xticks([t[0] for t in ticks])
        ax.set_xticklabels([t[1] for t in ticks], fontsize=9)
        ax.set_xlabel(_mode_label(groups[0]).replace("\n", "; "), fontsize=9)
    ax.set_ylabel("median training step, ms (lower is better)")
    if cut is not None:
        ax.set_ylim(0, 1.15 * cut)
    g = groups[0]
    ids = "Zipf ids over 2^40" if len(groups) == 1 and not g.get("key_pool") else "ids by mode below"
    ax.set_title(f"Training step, DMP on {g['world']} CPU ranks: {g['tables']} tables x dim {g['dim']}, "
                 f"{g['rows_per_table'] / 2**20:g}M rows/table,\nbatch {g['batch']}/rank x {g['pooling']} ids, "
                 f"{ids}, EXACT_SGD (bar labels: ms)", fontsize=10)


def panel_tiers(ax, k: Dict[str, Any]) -> None:
    colors = {"host": "tab:green", "file": "tab:brown"}
    series = k["series"]
    top = 1.0
    for name, pts in series.items():
        backing = name.split(",")[0]
        x = [p["cache_fraction"] for p in pts]
        y = [p["vs_in_memory"] for p in pts]
        top = max(top, *y)
        ax.plot(x, y, "-" if name.endswith("on") else "--", marker="o", color=colors.get(backing, OTHER),
                label=f"step time, {name}")
    # Hit rates: one line per group of series with the same ones (e.g. both backings: same cache policy and keys).
    hit = ax.twinx()
    groups: Dict[tuple, List[str]] = {}
    for name, pts in series.items():
        groups.setdefault(tuple(round(p["hit_rate"], 3) for p in pts), []).append(name)
    for names in groups.values():
        pts = series[names[0]]
        backings = {n.split(",")[0] for n in names}
        prefetch = {n.endswith("on") for n in names}
        label = "hit rate" + (f", {next(iter(backings))}" if len(backings) == 1 else "") + (
            f", prefetch {'on' if next(iter(prefetch)) else 'off'}" if len(prefetch) == 1 else "")
        hit.plot([p["cache_fraction"] for p in pts], [100 * p["hit_rate"] for p in pts],
                 linestyle=":" if prefetch == {True} else (0, (1, 4)), marker="x" if prefetch == {True} else "+",
                 color=colors.get(next(iter(backings)), OTHER) if len(backings) == 1 else "black", label=label)
    ax.axhline(1.0, color=OTHER, lw=0.8)
    ax.set_xscale("log")
    fr = sorted({p["cache_fraction"] for pts in series.values() for p in pts})
    ax.set_xticks(fr)
    ax.set_xticklabels([f"{x:g}" for x in fr])
    ax.minorticks_off()
    ax.set_xlabel("cache size / rows the run touches per table (log scale)")
    ax.set_ylabel("step time / all-in-memory step time\n(lower is better)")
    ax.set_ylim(0, 1.5 * top)  # room for the legend at the top
    hit.set_ylabel("cache hit rate, % (dotted)")
    hit.set_ylim(0, 150)
    hit.set_yticks(range(0, 101, 20))
    lines = ["Storage tiers: a cache in memory over a host or file store"]
    setup = []
    if k.get("tables"):
        setup.append(f"{k['tables']} tables x dim {k['dim']}, batch {k['batch']} x {k['pooling']} ids")
    if k.get("in_memory_step_ms"):
        setup.append(f"all in memory: {k['in_memory_step_ms']:.1f} ms/step")
    notes = []
    if k.get("new_share") is not None:
        notes.append(f"new keys ({100 * k['new_share']:.0f}% of lookups) count as misses")
    fg = k.get("file_gather")
    if fg and fg.get("rows_per_s"):
        notes.append(f"file store gather {fg['rows_per_s'] / 1e6:.1f} M rows/s, numpy.memmap "
                     f"{fg['memmap_rows_per_s'] / 1e6:.1f}")
    lines += ["; ".join(x) for x in (setup, notes) if x]
    ax.set_title("\n".join(lines), fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = hit.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center", ncol=2)


def panel_inference(ax, k: Dict[str, Any]) -> None:
    short = {"dynamicemb program float32": "dynamicemb program\nfloat32",
             "dynamicemb program int8": "dynamicemb program\nint8",
             "torchrec quantized EBC int8 (static)": "TorchRec quantized\nEBC int8 (static)",
             "training module eval (float32)": "dynamicemb training\nmodule eval, float32",
             "AOTI package int8, Python-loaded": "AOTI package int8\n(Python-loaded)",
             "AOTI package int8, C++ client (no Python)": "AOTI package int8\n(C++ client, no Python)"}
    names = list(k["cases"])
    rates = [k["cases"][n]["mkeys_per_s"] for n in names]
    bars = ax.barh([short.get(n, n) for n in names], rates,
                   color=[THEIRS if n.startswith("torchrec") else OURS for n in names])
    for b, n in zip(bars, names):
        c = k["cases"][n]
        ax.annotate(f" {c['mkeys_per_s']:.1f} Mids/s, p99 {c['p99_ms']:.1f} ms, {c['vs_torchrec_int8']:.2f}x",
                    (b.get_width(), b.get_y() + b.get_height() / 2), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ids looked up and pooled per second, Mids/s (2^20 ids/s)")
    ax.margins(x=0.45)
    ax.set_title(f"Inference: 26 tables x {k['rows'] / 1e3:g}K rows x dim {k['dim']}, batch 512 x 10 ids\n"
                 "(x: rate relative to TorchRec's int8 module)", fontsize=10)


def panel_embedding(ax, k: Dict[str, Any]) -> None:
    opts = list(k["optimizers"])
    width = 0.38
    for i, (phase, color) in enumerate((("train", OURS), ("eval", "tab:cyan"))):
        xs, ys, texts = [], [], []
        for j, o in enumerate(opts):
            r = k["optimizers"][o]
            if f"{phase}_ratio" in r:
                xs.append(j + (i - 0.5) * width)
                ys.append(r[f"{phase}_ratio"])
                texts.append(f"{r[f'{phase}_ratio']:.2f}x\n{r[f'ours_{phase}_ms']:.0f} vs "
                             f"{r[f'tbe_{phase}_ms']:.0f} ms")
        bars = ax.bar(xs, ys, width, color=color, label=f"{'training step' if phase == 'train' else 'eval forward'}")
        _label_bars(ax, bars, texts)
    for j, o in enumerate(opts):
        r = k["optimizers"][o]
        if "train_ratio" not in r and "ours_train_ms" in r:
            state = (f",\nstate {r['optimizer_bytes_per_row']:.0f} B/row" if "optimizer_bytes_per_row" in r else "")
            ax.annotate(f"no CPU TBE to compare\nours: train {r['ours_train_ms']:.0f} ms,\n"
                        f"eval {r['ours_eval_ms']:.0f} ms{state}", (j, 0.05), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color=OTHER, lw=0.8)
    ax.set_xticks(range(len(opts)))
    ax.set_xticklabels(opts, fontsize=9)
    ax.set_ylabel("ours time / FBGEMM TBE time (lower is better)")
    ax.margins(y=0.25)
    ax.set_title(f"Embedding module vs FBGEMM's CPU TBE: {k['layout']},\nbatch {k['batch']} x pooling "
                 f"{k['pooling']}, dim {k['dim']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


def panel_checkpoint(ax, k: Dict[str, Any]) -> None:
    names = ["DynamicEmbDump", "torch.save + fsync\n(same bytes)", "DynamicEmbLoad"]
    gbs = [k["dump_gb_s"], k["save_gb_s"], k["load_gb_s"]]
    secs = [k["dump_s"], k["save_s"], k["load_s"]]
    bars = ax.bar(names, gbs, color=[OURS, THEIRS, OURS])
    _label_bars(ax, bars, [f"{g:.2f} GB/s\n({s:.1f} s)" for g, s in zip(gbs, secs)])
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.margins(y=0.25)
    ax.set_title(f"Checkpoint: {k['rows'] / 1e6:g}M rows x dim {k['dim']} + Adam state, {k['world']} ranks "
                 f"in parallel\n(dump / torch.save rate: {k['dump_vs_save']:.2f})", fontsize=10)


def panel_soak(ax, k: Dict[str, Any]) -> None:
    steps = [s["step"] for s in k["samples"]]
    ax.plot(steps, [s["rss_mib"] for s in k["samples"]], "-", color=OURS, marker=".", label="RSS (MiB)")
    ax.axvline(k["warmup"], color=OTHER, ls="--", lw=0.8, label="end of warm-up")
    ax.set_xlabel("training step")
    ax.set_ylabel("RSS MiB")
    ax.margins(y=0.4)
    right = ax.twinx()
    right.plot(steps, [s["fds"] for s in k["samples"]], ":", color="tab:green", label="open fds")
    right.plot(steps, [s["threads_os"] for s in k["samples"]], "-.", color="tab:purple", label="OS threads")
    right.set_ylabel("count")
    right.margins(y=0.4)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right", ncol=2)
    g = k["growth_after_warmup"]
    ax.set_title(f"Soak: {k['steps']} steps (growth, eviction, flushes, evals, dumps)\nafter warm-up: RSS "
                 f"max growth {g['rss_mib']:+.1f} MiB, drift {k['rss_drift_mib']:+.1f} MiB; fds {g['fds']:+d}, "
                 f"threads {g['threads_os']:+d}", fontsize=10)


QUALITY_COLORS = {"fold": THEIRS, "mch": "tab:red", "lru": OURS, "lfu": "tab:green", "lfu_admit2": "tab:purple",
                  "unlimited": "black"}


def panel_quality(ax, k: Dict[str, Any]) -> None:
    budgets = sorted({g["budget"] for g in k["groups"].values() if g["budget"] is not None})
    styles = ["-", "--", ":", "-."]
    shown = []
    for name, g in k["groups"].items():
        ys = g["auc_by_window"]
        style = "-" if g["budget"] is None else styles[budgets.index(g["budget"]) % len(styles)]
        budget = "" if g["budget"] is None else f", 1/{round(1 / g['budget'])}"
        gap = "" if g["auc_gap_vs_fold"] is None else f" ({g['auc_gap_vs_fold']:+.4f})"
        ax.plot(range(1, len(ys) + 1), ys, style, color=QUALITY_COLORS.get(g["setup"], OTHER), lw=1.2,
                label=f"{g['label']}{budget}: {g['final_auc']:.4f}{gap}")
        shown += ys[len(ys) // 5:]  # the first windows (the model still learning) fall below the view
    if shown:
        lo, hi = min(shown), max(shown)
        ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.9 * (hi - lo))  # room for the legend at the top
    ax.set_xlabel(f"window ({k['window_batches']} batches x {k['batch_size']} samples), scored before trained on")
    ax.set_ylabel(f"AUC of the window (mean of {len(k['seeds'] or [])} seeds)")
    ax.set_title(f"Model quality at equal rows per table: DLRM, progressive validation, {k['data']} log\n"
                 f"(legend: final AUC, last {k['final_share']:.0%} of windows; in brackets: minus id % rows at that "
                 "budget, paired)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=2)


PANELS: List[Tuple[str, Callable]] = [
    ("table", panel_table), ("torchrec", panel_torchrec), ("tiers", panel_tiers),
    ("inference", panel_inference), ("embedding", panel_embedding), ("checkpoint", panel_checkpoint),
    ("soak", panel_soak), ("quality", panel_quality),
]
# Benchmarks drawn in another's panel (passed to it as `more`; the panel is drawn if any of them has results).
PANEL_MORE = {"torchrec": ("torchrec_existing", "torchrec_newshare", "torchrec_evicting")}


def draw_panel(ax, name: str, key: Dict[str, Any]) -> None:
    """Benchmark `name`'s panel on `ax`, from the summary's key numbers."""
    fn = dict(PANELS)[name]
    if name in PANEL_MORE:
        fn(ax, key.get(name), more={m: key[m] for m in PANEL_MORE[name] if m in key})
    else:
        fn(ax, key[name])
    ax.grid(True, alpha=0.3)


def _title(summary: Dict[str, Any]) -> str:
    e = summary.get("env", {})
    measured = [r.get("measured", {}) for r in summary.get("runs", {}).values() if r.get("measured")]
    commits = sorted({m["git_commit"] for m in measured if m.get("git_commit")}) or [summary.get("commit")]
    dates = sorted({(m.get("date") or "")[:10] for m in measured if m.get("date")}) or [summary.get("date", "")[:10]]
    ran_now = any(r.get("status") == "ok" for r in summary.get("runs", {}).values())
    dirty = " (with uncommitted changes)" if summary.get("git_dirty") and ran_now else ""
    line1 = (f"dynamicemb benchmarks (short settings): {e.get('cpu', '?')}, {e.get('cpu_count', '?')} CPUs, "
             f"{e.get('threads', '?')} threads")
    fbgemm = e.get("fbgemm-gpu-cpu", e.get("fbgemm-gpu", "?"))
    when = " to ".join([dates[0], dates[-1]] if len(dates) > 1 else dates)
    line2 = (f"torch {e.get('torch', '?')}, torchrec {e.get('torchrec', '?')}, fbgemm-gpu-cpu {fbgemm}; "
             f"commit {', '.join(map(str, commits))}{dirty}; {when}")
    loads = [m["loadavg_start"][0] for m in measured if m.get("loadavg_start")]
    if loads and max(loads) > 0.5:
        line2 += (f"\nload average before the runs up to {max(loads):.1f}: other processes were running, "
                  "timings are noisy")
    return line1 + "\n" + line2


def draw(summary: Dict[str, Any], path: str) -> List[str]:
    """Writes the picture to `path`; returns the names of the panels drawn."""
    key = summary.get("key_numbers", {})
    panels = [(n, fn) for n, fn in PANELS if n in key or any(m in key for m in PANEL_MORE.get(n, ()))]
    w, h = figure_size_px(len(panels))
    rows = max(1, math.ceil(len(panels) / COLS))
    # Constrained layout fits the labels in and keeps the figure's size.
    fig = plt.figure(figsize=(w / DPI, h / DPI), dpi=DPI, layout="constrained")
    fig.get_layout_engine().set(h_pad=0.15, w_pad=0.15, hspace=0.06, wspace=0.06)
    grid = fig.add_gridspec(rows, COLS)
    for i, (name, fn) in enumerate(panels):
        ax = fig.add_subplot(grid[i // COLS, i % COLS])
        draw_panel(ax, name, key)
    if not panels:
        fig.text(0.5, 0.5, "no benchmark results", ha="center", va="center")
    title = _title(summary)
    missing = [n for n, r in summary.get("runs", {}).items() if n not in key]
    if missing:
        bad = summary.get("key_number_errors", {})
        title += "\nnot shown (no results): " + ", ".join(
            f"{n} ({'unexpected JSON' if n in bad else summary['runs'][n].get('status', '?')})" for n in missing)
    title += ("\nblue: dynamicemb;  orange: the baseline it is compared with "
              "(torch.index_select, TorchRec, FBGEMM, torch.save)")
    fig.suptitle(title, fontsize=11)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return [n for n, _ in panels]


if __name__ == "__main__":
    import json

    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "summary.json")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(src)[0] + ".png"
    with open(src) as f:
        print(f"{dst}: {', '.join(draw(json.load(f), dst))}")
