"""Imports a dump written by NVIDIA dynamicemb (its `DynamicEmbDump`, or
`BatchedDynamicEmbeddingTablesV2.dump`) into our checkpoint format, which then
loads on any world size (`python -m dynamicemb.checkpoint import-nvidia SRC DST`,
API.md "Coming from NVIDIA dynamicemb").

Their layout (the spec the tests write files from is in
tests/checkpoint/test_import_nvidia.py): anywhere under SRC (one directory per
collection), per table T, dump rank r of W ranks, headerless little-endian
arrays of equal row counts:

    T_emb_keys.rank_r.world_size_W             int64 keys
    T_emb_values.rank_r.world_size_W           [n, dim] values
    T_emb_scores.rank_r.world_size_W           int64 scores (absent for LRU tables)
    T_opt_values.rank_r.world_size_W           [n, w] optimizer state (optim=True)
    T_counter_keys.rank_r.world_size_W         int64 admission counter keys
    T_counter_frequencies.rank_r.world_size_W  int64 their counts
    T_opt_args.json                            optimizer arguments (and newer metadata)

Why not reload with NVIDIA's own code on another world size: its load keeps,
on rank r of W', the keys with `key % W' == r`, whatever routing the sharded
model uses; a hash_roundrobin model (ours by default) looks key k up on rank
fmix64(k) % W', so about (W'-1)/W' of the keys land on a rank that never looks
them up and train from fresh rows. The import instead re-partitions every key
by the routing the target model uses (`dist_type`), and our load routes them
again for any other world size."""
import json
import os
import re
import shutil
import time
import uuid
import warnings
from typing import Dict, Optional

import torch

from dynamicemb import rules
from dynamicemb.checkpoint.format import (FORMAT_VERSION, CheckpointError, Syncer, part_name, write_manifest,
                                          write_part)
from dynamicemb.fsync import fsync_dir
from dynamicemb.optimizer import optimizer_code
from dynamicemb.options import DynamicEmbInitializerArgs, DynamicEmbInitializerMode
from dynamicemb.positions import by_group
from dynamicemb.routing import owners
from dynamicemb.types import DynamicEmbScoreStrategy, strategy_code, strategy_label

__all__ = ["NvidiaImportError", "import_nvidia"]

_FILE = re.compile(r"^(?P<table>.+)_(?P<item>emb_keys|emb_values|emb_scores|opt_values|counter_keys|"
                   r"counter_frequencies)\.rank_(?P<rank>\d+)\.world_size_(?P<world>\d+)$")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "half": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_STRATEGIES = ("TIMESTAMP", "STEP", "CUSTOMIZED", "LFU", "NO_EVICTION")
_DEFAULT_CHUNK_ROWS = 1 << 18


class NvidiaImportError(CheckpointError):
    """An NVIDIA dump that is incomplete, inconsistent, or holds what has no
    counterpart here (e.g. an optimizer state layout we do not map)."""


# ---- optimizer state: NVIDIA's layouts -> ours ------------------------------------------------
# NVIDIA stores a row's state after its weights: Adam [m (dim) | v (dim)], Adagrad [sum g^2 (dim)],
# row-wise Adagrad its accumulator in the first of 16 bytes' worth of columns (a dump may keep all
# of them, or the one). Ours (csrc/embedding/optimizer_rules.h): the same per-element planes, the
# row-wise accumulator in one column. NVIDIA name -> (our EmbOptimType value, their width for dim).
_OPTIMIZERS = {
    "sgd": ("exact_sgd", lambda dim, w: w == 0),
    "exact_sgd": ("exact_sgd", lambda dim, w: w == 0),
    "adam": ("adam", lambda dim, w: w == 2 * dim),
    "exact_adagrad": ("exact_adagrad", lambda dim, w: w == dim),
    "exact_row_wise_adagrad": ("exact_row_wise_adagrad", lambda dim, w: w >= 1),
}
_ROWWISE_WIDTHS = (1, 4, 8)  # 16 bytes of float32 / 16-bit states, or the one column


def _optimizer(table: str, meta: dict, dim: int, width: Optional[int], given: Optional[str]) -> str:
    """NVIDIA's optimizer name of a table: given, recorded (opt_type), or told
    apart by its arguments and state width."""
    name = given or meta.get("opt_type")
    if name is None:
        if width in (None, 0):
            name = "adam" if "iters" in meta else "exact_sgd"
        elif "iters" in meta or "beta1" in meta or width == 2 * dim:
            name = "adam"
        elif width == dim and width in _ROWWISE_WIDTHS:
            raise NvidiaImportError(f"table {table!r}: optimizer state of width {width} next to dim {dim} is "
                                    f"EXACT_ADAGRAD's or EXACT_ROWWISE_ADAGRAD's and the dump does not say "
                                    f"which; pass optimizer= (--optimizer)")
        elif width == dim:
            name = "exact_adagrad"
        elif width in _ROWWISE_WIDTHS:
            name = "exact_row_wise_adagrad"
        else:
            raise NvidiaImportError(f"table {table!r}: cannot tell the optimizer from a state of width {width} "
                                    f"next to dim {dim}; pass optimizer= (--optimizer)")
    name = str(getattr(name, "value", name)).lower()
    if name not in _OPTIMIZERS:
        raise NvidiaImportError(f"table {table!r}: NVIDIA optimizer {name!r} has no mapping to dynamicemb's "
                                f"optimizer state (mapped: {sorted(_OPTIMIZERS)}); import with optim=False "
                                f"(--no-optim) to take the weights and scores alone")
    ours, fits = _OPTIMIZERS[name]
    if width is not None and not fits(dim, width):
        raise NvidiaImportError(f"table {table!r}: {name} keeps optimizer state of another width than the "
                                f"dump's {width} columns next to dim {dim}")
    return ours


def _map_state(ours: str, state: torch.Tensor, width: int) -> torch.Tensor:
    """Their state columns of one chunk as ours (`width`: our state width)."""
    if ours == "exact_row_wise_adagrad":
        return state[:, :1]
    return state[:, :width]


# ---- the source files ---------------------------------------------------------------------------


def _dtype(table: str, meta: dict, key: str, default: torch.dtype) -> torch.dtype:
    v = meta.get(key)
    if v is None:
        return default
    d = _DTYPES.get(str(v).replace("torch.", "").lower())
    if d is None:
        raise NvidiaImportError(f"table {table!r}: {key} {v!r} is not a float dtype dynamicemb stores")
    return d


def _discover(src: str) -> Dict[str, dict]:
    """{table: {"dir", "world", "files": {item: {rank: path}}, "meta"}} of every table under src."""
    if not os.path.isdir(src):
        raise NvidiaImportError(f"no NVIDIA dynamicemb dump at {src}")
    found: Dict[str, dict] = {}
    for d, _, names in sorted(os.walk(src)):
        for n in sorted(names):
            m = _FILE.match(n)
            if not m:
                continue
            t = found.setdefault(m["table"], {"dir": d, "world": int(m["world"]), "files": {}})
            if t["dir"] != d:
                raise NvidiaImportError(f"table {m['table']!r} is in two collections ({t['dir']} and {d}); "
                                        f"dynamicemb checkpoints need unique table names")
            if int(m["world"]) != t["world"]:
                raise NvidiaImportError(f"table {m['table']!r}: files of world sizes {t['world']} and "
                                        f"{m['world']} in {d}")
            t["files"].setdefault(m["item"], {})[int(m["rank"])] = os.path.join(d, n)
    if not found:
        old = sorted(n for _, _, ns in os.walk(src) for n in ns if n.endswith("_keys"))
        hint = (f"; {old[0]} looks like their first layout (TABLE_keys / TABLE_values, before per-rank file "
                f"names): load it with NVIDIA dynamicemb and dump it again") if old else ""
        raise NvidiaImportError(f"{src} holds no NVIDIA dynamicemb dump files (TABLE_emb_keys.rank_R.world_size_W)"
                                + hint)
    for name, t in found.items():
        meta_path = os.path.join(t["dir"], f"{name}_opt_args.json")
        t["meta"] = {}
        if os.path.exists(meta_path):
            try:
                with open(meta_path) as f:
                    t["meta"] = json.load(f)
            except ValueError as e:
                raise NvidiaImportError(f"table {name!r}: {meta_path} is not valid JSON: {e}") from None
        ranks = set(range(t["world"]))
        for item, per_rank in t["files"].items():
            stray = sorted(r for r in per_rank if r not in ranks)
            if stray:
                raise NvidiaImportError(f"table {name!r}: {item} files of ranks {stray} in {t['dir']} are past "
                                        f"world size {t['world']} (files of another dump mixed in?)")
        for item in ("emb_keys", "emb_values"):
            have = set(t["files"].get(item, {}))
            if have != ranks:
                raise NvidiaImportError(f"table {name!r}: {item} files of ranks {sorted(ranks - have)} of "
                                        f"{t['world']} are missing in {t['dir']}")
        for item in ("emb_scores", "opt_values", "counter_keys", "counter_frequencies"):
            have = set(t["files"].get(item, {}))
            if have and have != ranks:
                raise NvidiaImportError(f"table {name!r}: {item} files of ranks {sorted(ranks - have)} of "
                                        f"{t['world']} are missing in {t['dir']}")
        if bool(t["files"].get("counter_keys")) != bool(t["files"].get("counter_frequencies")):
            raise NvidiaImportError(f"table {name!r}: admission counter keys without frequencies (or the "
                                    f"reverse) in {t['dir']}")
    return found


def _width(table: str, path: str, rows: int, itemsize: int, what: str) -> Optional[int]:
    """Columns of a [rows, w] file (None: no rows to tell)."""
    size = os.path.getsize(path)
    if rows == 0:
        if size:
            raise NvidiaImportError(f"table {table!r}: {path} holds {size} bytes of {what} for no keys")
        return None
    if size % (rows * itemsize):
        raise NvidiaImportError(f"table {table!r}: {path} holds {size} bytes, not a whole number of {what} "
                                f"rows for its {rows} keys")
    return size // (rows * itemsize)


def _read(path: str, start: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    with open(path, "rb") as f:
        f.seek(start * width * itemsize)
        buf = bytearray(f.read(rows * width * itemsize))
    if len(buf) != rows * width * itemsize:
        raise NvidiaImportError(f"{path} is truncated")
    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.zeros(0, dtype=dtype)
    return t.view(rows, width) if width != 1 or dtype != torch.int64 else t


# ---- the import ----------------------------------------------------------------------------------


def _of(value, table: str, default=None):
    """A per-table argument: one value for every table, or {table: value}."""
    return value.get(table, default) if isinstance(value, dict) else (default if value is None else value)


def import_nvidia(src: str, dst: str, score_strategy=None, dist_type="hash_roundrobin", num_embeddings=None,
                  world_size: Optional[int] = None, optimizer=None, optim: bool = True, dtype=None, dim=None,
                  chunk_rows: int = _DEFAULT_CHUNK_ROWS) -> dict:
    """Writes the NVIDIA dump at `src` as a dynamicemb checkpoint at `dst`
    (which must not exist); returns its manifest. `score_strategy` (NVIDIA's
    dump does not record it; default the one its metadata names, else
    TIMESTAMP, NVIDIA's default), `dist_type` / `num_embeddings` and `dtype`
    (default: the dump's) must be the target model's; `world_size` (default:
    the dump's) only sets how the files are split; `optimizer` names NVIDIA's
    optimizer where the dump does not; optim=False drops optimizer state.
    score_strategy, dist_type, num_embeddings, optimizer, dtype and dim take
    one value for every table or a {table: value} dict."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; import into a new path")
    tables = _discover(src)
    world_out = world_size or max(t["world"] for t in tables.values())
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    try:
        syncer, metas = Syncer(), {}
        try:
            for name, t in sorted(tables.items()):
                metas[name] = _import_table(tmp, name, t, _of(score_strategy, name),
                                            _of(dist_type, name, "hash_roundrobin"), _of(num_embeddings, name),
                                            world_out, _of(optimizer, name), optim, _of(dtype, name),
                                            _of(dim, name), chunk_rows, syncer)
        finally:
            syncer.wait()
        manifest = {"format": "dynamicemb", "format_version": FORMAT_VERSION, "world_size": world_out,
                    "created_unix": time.time(), "score_ages": "clock scores are stored as ns ages at dump time",
                    "imported_from": {"format": "nvidia-dynamicemb", "path": src}, "tables": metas}
        write_manifest(tmp, manifest)
        for name in metas:
            if os.path.isdir(os.path.join(tmp, name)):
                fsync_dir(os.path.join(tmp, name))
        fsync_dir(tmp)
        os.rename(tmp, dst)
        fsync_dir(os.path.dirname(dst))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _by_owner(part: Dict[str, torch.Tensor], own: torch.Tensor, world: int):
    """(rank, its rows of part) per rank owning some: one grouping of the
    positions and one gather per tensor, then contiguous slices."""
    if world == 1:
        yield 0, part
        return
    order, counts = by_group(own, world)
    part = {k: v.index_select(0, order) for k, v in part.items()}
    start = 0
    for d, c in enumerate(counts):
        if c:
            yield d, {k: v[start:start + c] for k, v in part.items()}
        start += c


def _strategy(table: str, meta: dict, given) -> int:
    s = given if given is not None else meta.get("score_strategy", "TIMESTAMP")
    if isinstance(s, str):
        if s.upper() not in _STRATEGIES:
            raise NvidiaImportError(f"table {table!r}: score strategy {s!r} is not one of NVIDIA's {_STRATEGIES}")
        s = DynamicEmbScoreStrategy[s.upper()]
    code = strategy_code(s)
    if code == rules.TIMESTAMP_LFU:
        raise NvidiaImportError(f"table {table!r}: the (TIMESTAMP, LFU) pair keeps two scores a key; NVIDIA's "
                                f"dump files hold one")
    return code


def _import_table(root, name, t, score_strategy, dist_type, num_embeddings, world_out, optimizer, optim, dtype,
                  dim, chunk_rows, syncer) -> dict:
    meta, files, world = t["meta"], t["files"], t["world"]
    vdt = _dtype(name, meta, "embedding_dtype", torch.float32)
    sdt = _dtype(name, meta, "optim_state_dtype", vdt)
    out_dt = _dtype(name, {"dtype": dtype}, "dtype", vdt) if dtype is not None else vdt
    strategy = _strategy(name, meta, score_strategy)
    rows = []
    for r in range(world):
        n, rem = divmod(os.path.getsize(files["emb_keys"][r]), 8)
        if rem:
            raise NvidiaImportError(f"table {name!r}: {files['emb_keys'][r]} is not a whole number of int64 keys")
        rows.append(n)
    isz, ssz = vdt.itemsize, sdt.itemsize
    dims = {w for r in range(world)
            if (w := _width(name, files["emb_values"][r], rows[r], isz, "value")) is not None}
    dim = meta.get("embedding_dim", dim)
    if dim is not None:
        dims.add(int(dim))
    if len(dims) != 1:
        raise NvidiaImportError(f"table {name!r}: " + (f"value rows of widths {sorted(dims)} across ranks" if dims
                                else "no rows to tell the dim from; pass dim= (--dim)"))
    dim = dims.pop()
    has_opt = optim and bool(files.get("opt_values"))
    widths = {w for r in range(world) if has_opt
              and (w := _width(name, files["opt_values"][r], rows[r], ssz, "optimizer state")) is not None}
    if len(widths) > 1:
        raise NvidiaImportError(f"table {name!r}: optimizer state rows of widths {sorted(widths)} across ranks")
    their_width = widths.pop() if widths else None  # None: no state, or no rows to tell its width
    known = optimizer or meta.get("opt_type")
    if optim:
        ours = _optimizer(name, meta, dim, their_width, optimizer)
    else:
        # Informational only (a load with optim=False does not compare it): ours where we map theirs.
        ours = _OPTIMIZERS.get(str(getattr(known, "value", known)).lower(), ("exact_sgd",))[0]
    try:
        code = optimizer_code(ours)
    except ValueError as e:
        raise NvidiaImportError(f"table {name!r}: {e}") from None
    width = rules.optimizer(code).state_width(dim)
    # A state-less optimizer (SGD) has its state whenever the dump says which optimizer it was.
    has_state = has_opt or (optim and width == 0 and (known is not None or bool(meta)))
    # Scores: clock readings (TIMESTAMP's device time) become ages against the dump's time when its
    # metadata records it, else against the newest reading of the table.
    have_scores = bool(files.get("emb_scores"))
    for r in range(world):
        if have_scores and os.path.getsize(files["emb_scores"][r]) != 8 * rows[r]:
            raise NvidiaImportError(f"table {name!r}: {files['emb_scores'][r]} does not hold one int64 score "
                                    f"per key ({rows[r]})")
    clock = rules.score_is_clock(strategy)
    if not have_scores and not clock:
        warnings.warn(f"import_nvidia: table {name!r} has no score files (NVIDIA leaves them out for LRU tables "
                      f"only): every key imports with score 0 under {strategy_label(strategy)}", RuntimeWarning,
                      stacklevel=3)
    current = meta.get("current_score")
    # The newest score: the reference of clock ages without the dump's time, the step or score without
    # the dump's current one (one pass over the score files, 8 bytes a row).
    need_top = clock and "timestamp" not in meta or not clock and current is None and (
        rules.scored_by_step(strategy) or rules.scored_by_caller(strategy))
    top = 0
    if have_scores and need_top:
        for r in range(world):
            for s in range(0, rows[r], chunk_rows):
                top = max(top, int(_read(files["emb_scores"][r], s, min(chunk_rows, rows[r] - s), 1,
                                         torch.int64).max()))
    ref = int(meta.get("timestamp", top)) if clock else 0
    parts = [0] * world_out
    files_out, rows_out = [], [0] * world_out

    def emit(rank, kind, tensors):
        files_out.append(dict(write_part(root, part_name(name, rank, kind, parts[rank]), tensors, syncer),
                              rank=rank, kind=kind))
        parts[rank] += 1

    for r in range(world):
        for s in range(0, rows[r], chunk_rows):
            c = min(chunk_rows, rows[r] - s)
            keys = _read(files["emb_keys"][r], s, c, 1, torch.int64)
            part = {"keys": keys, "values": _read(files["emb_values"][r], s, c, dim, vdt).to(out_dt)}
            if have_scores:
                sc = _read(files["emb_scores"][r], s, c, 1, torch.int64)
                part["scores"] = (ref - sc).clamp_(min=0) if clock else sc
            else:  # no scores (an LRU table's dump): every row counts as touched at the dump, age 0
                part["scores"] = torch.zeros(c, dtype=torch.int64)
            if has_state:
                st = _read(files["opt_values"][r], s, c, their_width, sdt) if has_opt else torch.zeros(c, 0)
                part["optimizer_state"] = _map_state(ours, st, width).to(out_dt).contiguous()
            for d, rows_d in _by_owner(part, owners(keys, dist_type, world_out, num_embeddings), world_out):
                emit(d, "part", rows_d)
                rows_out[d] += rows_d["keys"].numel()
    counter = bool(files.get("counter_keys"))
    for r in range(world) if counter else ():
        n, rem = divmod(os.path.getsize(files["counter_keys"][r]), 8)
        if rem or os.path.getsize(files["counter_frequencies"][r]) != 8 * n:
            raise NvidiaImportError(f"table {name!r}: {files['counter_keys'][r]} and its frequencies do not hold "
                                    f"one int64 each per counted key")
        for s in range(0, n, chunk_rows):
            c = min(chunk_rows, n - s)
            keys = _read(files["counter_keys"][r], s, c, 1, torch.int64)
            counts = _read(files["counter_frequencies"][r], s, c, 1, torch.int64)
            for d, rows_d in _by_owner({"keys": keys, "counts": counts},
                                       owners(keys, dist_type, world_out, num_embeddings), world_out):
                emit(d, "counter", rows_d)
    step = custom = 0
    if rules.scored_by_step(strategy):  # their current score is the next step's; ours the last step
        step = int(current) - 1 if current is not None else top
    elif rules.scored_by_caller(strategy):
        custom = int(current) if current is not None else top
    defaults = {"learning_rate": meta.get("lr", 0.01), "eps": meta.get("eps", 1.0e-8),
                "beta1": meta.get("beta1", 0.9), "beta2": meta.get("beta2", 0.999),
                "weight_decay": meta.get("weight_decay", 0.0), "weight_decay_mode": 0}
    return {
        "dim": dim, "dtype": str(out_dt).replace("torch.", ""), "optimizer": code, "optimizer_state_width": width,
        "hyper_parameters": {h: defaults.get(h, 0) for h in rules.HYPER_PARAMETERS},
        "optimizer_step": int(meta.get("iters", 0)), "step": step, "score_strategy": strategy,
        "custom_score": custom, "dist_type": dist_type, "num_embeddings": num_embeddings, "bucket_capacity": 128,
        "admission_counter": counter, "feature_names": [], "pooling": "SUM",
        "eval_initializer": DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT).packed(None, 0),
        "seed": 0, "rows_per_rank": rows_out, "files": files_out, "has_optimizer_state": has_state,
        "has_counter": counter, "source_world_size": world,
    }
