"""`python -m dynamicemb.checkpoint import-nvidia SRC DST` (dynamicemb/checkpoint/nvidia.py).

The files are written from the spec below, which was written down from
reading NVIDIA's dump/load code; the tests never run or copy that code.

SPEC: the layout of a dump written by NVIDIA dynamicemb's `DynamicEmbDump`
(and `BatchedDynamicEmbeddingTablesV2.dump`), from NVIDIA/recsys-examples,
corelib/dynamicemb (dump_load.py, batched_dynamicemb_tables.py,
key_value_table.py, optimizer.py).

Directory: DynamicEmbDump(path, model) writes one directory per sharded
collection, named by the collection's module path from "model"
(``path/model.ebc/``); `module.dump(save_dir)` writes into save_dir itself.
Per table T and dump rank r of W ranks, in that directory:

| file                                       | content (headerless, little endian)                  |
|--------------------------------------------|------------------------------------------------------|
| ``T_emb_keys.rank_r.world_size_W``         | n int64 keys                                         |
| ``T_emb_values.rank_r.world_size_W``       | n x dim values, embedding dtype (float32 before the  |
|                                            | metadata named a dtype)                              |
| ``T_emb_scores.rank_r.world_size_W``       | n int64 (uint64 bits) scores; absent for LRU tables  |
| ``T_opt_values.rank_r.world_size_W``       | n x w optimizer state (only with optim=True)         |
| ``T_counter_keys.rank_r.world_size_W``     | admission counter: m int64 keys (counter=True)       |
| ``T_counter_frequencies.rank_r.world_size_W`` | their m int64 counts                              |
| ``T_opt_args.json``                        | rank 0: the optimizer's arguments (below)            |

Row i of the keys, values, scores and state files is one entry. The ranks'
keys are disjoint (each rank dumps the keys it owns).

Scores by score strategy: TIMESTAMP the device's ns timer at the last access;
STEP the step of the last access (the first step is 1); CUSTOMIZED the score
the user set; LFU the access count; NO_EVICTION a constant.

Optimizer state, w columns after the dim weights of a row:

| opt_type                 | w          | columns                                  | opt_args.json keys          |
|--------------------------|------------|------------------------------------------|-----------------------------|
| exact_sgd (sgd)          | 0          | (no file, or an empty one)               | lr                          |
| adam                     | 2 dim      | m (dim), then v (dim)                    | lr, iters, beta1, beta2, eps, weight_decay |
| exact_adagrad            | dim        | the sum of squared gradients             | lr, eps, initial_accumulator_value |
| exact_row_wise_adagrad   | 16 / itemsize (4 for float32), or 1 | the row's accumulator in column 0, the rest padding | lr, eps, initial_accumulator_value |

opt_args.json also carries ``opt_type`` (newer dumps), ``embedding_dtype``,
``embedding_dim``, ``optim_state_dtype`` (newer still), and may carry
``current_score`` (the score the next access gets) and ``timestamp`` (the
device timer at the dump).

NVIDIA's reload (DynamicEmbLoad) on W' ranks: with W' == W, rank r reads its
own files; otherwise every rank reads every file and keeps the keys with
``key % W' == r`` (torch's remainder), whatever the model's dist_type.

Why NVIDIA's reload loses keys of a hash_roundrobin model on another world
size: it keeps key k on rank k % W', but the model's input distribution
sends k to rank fmix64(k) % W' (dynamicemb.routing.owners); the keys of the
other ranks sit in a table that never sees them, and training reads fresh
rows for them instead (test_nvidia_reload_rule_misplaces_hash_roundrobin_keys).
The import re-partitions the keys by the model's own routing, and our load
routes them again on any world size (the DMP tests below, 1 and 2 ranks).
"""
import json
import os
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import ckpt_helpers as H
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy, DynamicEmbTableOptions, EmbOptimType
from dynamicemb.checkpoint import CheckpointError, DynamicEmbLoad
from dynamicemb.checkpoint.__main__ import main as checkpoint_main
from dynamicemb.checkpoint.nvidia import NvidiaImportError, import_nvidia
from dynamicemb.incremental_dump import incremental_dump
from dynamicemb.routing import owners

S = DynamicEmbScoreStrategy

def file_name(table: str, item: str, rank: int, world: int) -> str:
    return f"{table}_{item}.rank_{rank}.world_size_{world}"


def write_dump(directory: str, table: str, ranks: List[Dict[str, Optional[torch.Tensor]]],
               meta: Optional[dict] = None) -> None:
    """Writes table's files for len(ranks) ranks: each rank a dict of keys
    [n] int64, values [n, dim], scores [n] int64 or None, opt [n, w] or None,
    counter_keys / counter_counts [m] int64 or None."""
    os.makedirs(directory, exist_ok=True)
    world = len(ranks)
    items = {"emb_keys": "keys", "emb_values": "values", "emb_scores": "scores", "opt_values": "opt",
             "counter_keys": "counter_keys", "counter_frequencies": "counter_counts"}
    for r, data in enumerate(ranks):
        for item, field in items.items():
            t = data.get(field)
            if t is None:
                continue
            with open(os.path.join(directory, file_name(table, item, r, world)), "wb") as f:
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    if meta is not None:
        with open(os.path.join(directory, f"{table}_opt_args.json"), "w") as f:
            json.dump(meta, f)


def nvidia_reload_rank(keys: torch.Tensor, world: int) -> torch.Tensor:
    """The rank NVIDIA's reload on another world size stores each key on."""
    return keys % world


# ---- source data (written in the spec's layout) ------------------------------------------------

SRC_WORLD = 3  # the NVIDIA job's ranks; the imports load on 1 and 2
DUMP_NS = 5_000_000_000  # their device timer at the dump
# The DMP model's bag tables (ckpt_helpers.TABLES): dim, dist_type, strategy; NVIDIA names the strategy.
SRC_TABLES = {"t_hash": (8, "hash_roundrobin", S.STEP, "STEP"),
              "t_rr": (4, "roundrobin", S.LFU, "LFU"),
              "t_cont": (8, "continuous", S.TIMESTAMP, "TIMESTAMP")}
ADAM_ARGS = {"opt_type": "adam", "lr": 0.05, "iters": 7, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
             "weight_decay": 0.0}


def source_rows(dim: int, strategy, seed: int, n_random: int = 120, opt_width=None) -> dict:
    """Distinct keys (small, negative, and far beyond num_embeddings), their
    values, Adam state (m, v >= 0) and scores of the strategy."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.cat([torch.arange(-20, 60), torch.randint(-2**40, 2**40, (n_random,), generator=g)]).unique()
    keys = keys[torch.randperm(keys.numel(), generator=g)]
    n = keys.numel()
    opt = (torch.cat([torch.randn(n, dim, generator=g), torch.rand(n, dim, generator=g)], 1) if opt_width is None
           else torch.rand(n, opt_width, generator=g))
    if strategy == S.TIMESTAMP:
        scores = DUMP_NS - torch.randint(0, 10**9, (n,), generator=g)
    else:
        scores = torch.randint(1, 9 if strategy == S.STEP else 50, (n,), generator=g)
    return dict(keys=keys, values=torch.randn(n, dim, generator=g), scores=scores, opt=opt)


def split_by_owner(rows: dict, dist_type: str, world: int, num_embeddings=None) -> List[dict]:
    """The ranks' files: each NVIDIA rank dumps the keys it owned."""
    own = owners(rows["keys"], dist_type, world, num_embeddings)
    return [{k: (v[own == r] if v is not None else None) for k, v in rows.items()} for r in range(world)]


def write_source(root: str) -> Dict[str, dict]:
    rows = {}
    for i, (t, (dim, dist_type, strategy, _)) in enumerate(SRC_TABLES.items()):
        rows[t] = source_rows(dim, strategy, seed=10 + i)
        meta = dict(ADAM_ARGS)
        if strategy == S.STEP:
            meta["current_score"] = 9
        if strategy == S.TIMESTAMP:
            meta["timestamp"] = DUMP_NS
        write_dump(os.path.join(root, "model.ebc"), t,
                   split_by_owner(rows[t], dist_type, SRC_WORLD, H.NUM_EMB), meta)
    return rows


# ---- through DMP on 1 and 2 gloo ranks -------------------------------------------------------


def _load(pg, dst):
    model = H.build(pg)
    before = H.now_ns()
    DynamicEmbLoad(dst, model, table_names=list(SRC_TABLES), pg=pg)
    after = H.now_ns()
    return dict(entries=H.gathered_entries(model, pg), before=before, after=after)


def _load_ranks(rank, world, dst):
    """Both ranks load the import, then rank 0 alone (its own group) does."""
    alone = [dist.new_group([r]) for r in range(world)]
    out = {2: _load(dist.group.WORLD, dst)}
    if rank == 0:
        out[1] = _load(alone[0], dst)
    dist.barrier()
    return out


@H.once
def _imported():
    with H.scratch_dir("dynamicemb-nvidia-") as root:
        rows = write_source(os.path.join(root, "nvidia"))
        dst = os.path.join(root, "imported")
        import_nvidia(os.path.join(root, "nvidia"), dst,
                      score_strategy={t: s for t, (_, _, _, s) in SRC_TABLES.items()},
                      dist_type={t: d for t, (_, d, _, _) in SRC_TABLES.items()}, num_embeddings=H.NUM_EMB)
        return rows, H.run_ranks(_load_ranks, 2, dst)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("table", list(SRC_TABLES))
def test_import_loads_whole_through_dmp(world, table):
    """Every key of the 3-rank NVIDIA dump is on the rank the DMP model's
    routing gives it, with its values, Adam state and score (TIMESTAMP: its
    age at the dump), none twice, none missing."""
    rows, by_rank = _imported()
    ranks = [r[world] for r in by_rank if world in r]
    src = rows[table]
    before, after = min(r["before"] for r in ranks), max(r["after"] for r in ranks)
    clock = SRC_TABLES[table][2] == S.TIMESTAMP
    want_scores = before - (DUMP_NS - src["scores"]) if clock else src["scores"]
    orig = [{table: dict(keys=src["keys"], values=src["values"], state=src["opt"], scores=want_scores, ts=None)}]
    loaded = ranks[0]["entries"]
    assert len(loaded) == world
    # (NVIDIA's dump holds no reading of our clock: ages count back from the load.)
    H.assert_same_entries(orig, loaded, before, after, dist_types={table: SRC_TABLES[table][1]}, one_clock=False)
    # Adam's step count comes from the dump's "iters".
    assert {m[2] for e in loaded for m in e["_modules"] if table in m[0]} == {ADAM_ARGS["iters"]}


def test_nvidia_reload_rule_misplaces_hash_roundrobin_keys():
    """NVIDIA's own reload of the 3-rank dump on 2 ranks (the spec's rule)
    puts about half of t_hash's keys on a rank the model never routes them to;
    the import's load (above) puts every one on its owner."""
    keys = source_rows(8, S.STEP, seed=10)["keys"]
    theirs = nvidia_reload_rank(keys, 2)
    misplaced = float((theirs != owners(keys, "hash_roundrobin", 2)).double().mean())
    assert misplaced > 0.3, misplaced


# ---- one process: optimizer layouts, refusals, the command line -------------------------------


def _plain(optimizer, dim=8, strategy=S.STEP, **kw):
    return BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=1024, score_strategy=strategy, **kw)], table_names=["a"],
        optimizer=optimizer, learning_rate=0.05)


def _dump_a(tmp, rows, meta, world=2, opt=True, dist_type="hash_roundrobin"):
    if not opt:
        rows = dict(rows, opt=None)
    write_dump(str(tmp / "src"), "a", split_by_owner(rows, dist_type, world), meta)
    return str(tmp / "src")


@pytest.mark.parametrize("nv, width, ours, state", [
    ("exact_row_wise_adagrad", 4, EmbOptimType.EXACT_ROWWISE_ADAGRAD, lambda o: o[:, :1]),
    ("exact_row_wise_adagrad", 1, EmbOptimType.EXACT_ROWWISE_ADAGRAD, lambda o: o[:, :1]),
    ("exact_adagrad", 8, EmbOptimType.EXACT_ADAGRAD, lambda o: o),
    ("exact_sgd", 0, EmbOptimType.EXACT_SGD, lambda o: o[:, :0]),
], ids=["rowwise-16-bytes", "rowwise-1-column", "adagrad", "sgd"])
def test_optimizer_state_layouts_map_to_ours(tmp_path, nv, width, ours, state):
    rows = source_rows(8, S.STEP, seed=3, opt_width=width)
    src = _dump_a(tmp_path, rows, {"opt_type": nv, "lr": 0.05, "eps": 1e-8, "initial_accumulator_value": 0.0},
                  opt=width > 0)
    import_nvidia(src, str(tmp_path / "dst"), score_strategy="STEP", world_size=1)  # loads in its layout
    m = _plain(ours)
    DynamicEmbLoad(str(tmp_path / "dst"), m)
    got = H.entries(m)["a"]
    order = torch.argsort(rows["keys"])
    assert torch.equal(got["keys"], rows["keys"][order])
    assert torch.equal(got["values"], rows["values"][order])
    assert torch.equal(got["state"], state(rows["opt"])[order])
    assert torch.equal(got["scores"], rows["scores"][order])


def test_optimizer_inferred_from_arguments_and_width(tmp_path):
    """An older dump without opt_type: Adam by its "iters", and the hyper-
    parameters and step count travel into the manifest."""
    rows = source_rows(4, S.LFU, seed=4)
    meta = {k: v for k, v in ADAM_ARGS.items() if k != "opt_type"}
    m = import_nvidia(_dump_a(tmp_path, rows, meta), str(tmp_path / "dst"), score_strategy="LFU")
    t = m["tables"]["a"]
    assert t["optimizer_step"] == 7 and t["hyper_parameters"]["learning_rate"] == 0.05
    assert t["optimizer_state_width"] == 8 and sum(t["rows_per_rank"]) == rows["keys"].numel()


def test_unmappable_optimizer_is_refused_by_name(tmp_path):
    rows = source_rows(4, S.STEP, seed=5, opt_width=8)
    src = _dump_a(tmp_path, rows, {"opt_type": "partial_row_wise_lamb", "lr": 0.05})
    with pytest.raises(NvidiaImportError, match="partial_row_wise_lamb.*--no-optim"):
        import_nvidia(src, str(tmp_path / "dst"), score_strategy="STEP")
    assert not os.path.exists(tmp_path / "dst")
    # Without optimizer state, the weights come in (and load with optim=False).
    import_nvidia(src, str(tmp_path / "dst"), score_strategy="STEP", optim=False)
    m = _plain(EmbOptimType.ADAM, dim=4)
    DynamicEmbLoad(str(tmp_path / "dst"), m, optim=False)
    assert torch.equal(H.entries(m)["a"]["values"], rows["values"][torch.argsort(rows["keys"])])


def test_ambiguous_state_width_asks_for_the_optimizer(tmp_path):
    rows = source_rows(4, S.STEP, seed=6, opt_width=4)  # dim 4: Adagrad's width and row-wise Adagrad's
    src = _dump_a(tmp_path, rows, {"lr": 0.05, "eps": 1e-8, "initial_accumulator_value": 0.0})
    with pytest.raises(NvidiaImportError, match="--optimizer"):
        import_nvidia(src, str(tmp_path / "dst"))
    import_nvidia(src, str(tmp_path / "dst"), optimizer="exact_row_wise_adagrad", score_strategy="STEP")


def test_missing_rank_file_is_refused(tmp_path):
    rows = source_rows(4, S.STEP, seed=7)
    src = _dump_a(tmp_path, rows, ADAM_ARGS, world=3)
    os.remove(os.path.join(src, file_name("a", "emb_values", 1, 3)))
    with pytest.raises(NvidiaImportError, match=r"table 'a': emb_values files of ranks \[1\] of 3"):
        import_nvidia(src, str(tmp_path / "dst"))


def test_not_a_dump_is_refused(tmp_path):
    os.makedirs(tmp_path / "v1")
    (tmp_path / "v1" / "a_keys").write_bytes(b"\0" * 8)
    with pytest.raises(NvidiaImportError, match="a_keys looks like their first layout"):
        import_nvidia(str(tmp_path / "v1"), str(tmp_path / "dst"))
    with pytest.raises(NvidiaImportError, match="no NVIDIA dynamicemb dump at"):
        import_nvidia(str(tmp_path / "none"), str(tmp_path / "dst2"))


def test_timestamp_ages_without_dump_time_count_from_the_newest(tmp_path):
    """Without the dump's timer reading, TIMESTAMP ages count from the
    table's newest score: the newest key loads as the most recent."""
    rows = source_rows(4, S.TIMESTAMP, seed=8)
    import_nvidia(_dump_a(tmp_path, rows, {"opt_type": "adam", "lr": 0.05, "iters": 1}), str(tmp_path / "dst"))
    m = _plain(EmbOptimType.ADAM, dim=4, strategy=S.TIMESTAMP)
    before = H.now_ns()
    DynamicEmbLoad(str(tmp_path / "dst"), m)
    got = H.entries(m)["a"]
    want_age = rows["scores"].max() - rows["scores"][torch.argsort(rows["keys"])]
    assert bool(((before - got["scores"]) <= want_age).all())  # loaded after `before`: ages at least as large
    assert bool(((H.now_ns() - got["scores"]) >= want_age).all())


def test_admission_counters_are_imported(tmp_path):
    rows = source_rows(4, S.STEP, seed=9)
    rows["counter_keys"] = torch.tensor([5, -3, 2**40, 77], dtype=torch.int64)
    rows["counter_counts"] = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    write_dump(str(tmp_path / "src"), "a", [rows], ADAM_ARGS)
    m = import_nvidia(str(tmp_path / "src"), str(tmp_path / "dst"), score_strategy="STEP", world_size=2)
    t = m["tables"]["a"]
    assert t["has_counter"] and t["admission_counter"]
    from dynamicemb.checkpoint.format import read_tensors
    got = {}
    for e in t["files"]:
        if e["kind"] == "counter":
            part = read_tensors(str(tmp_path / "dst"), e, ["keys", "counts"])
            assert bool((owners(part["keys"], "hash_roundrobin", 2) == e["rank"]).all())
            got.update(zip(part["keys"].tolist(), part["counts"].tolist()))
    assert got == {5: 1, -3: 2, 2**40: 3, 77: 4}


def test_command_line(tmp_path, capsys):
    rows = source_rows(8, S.STEP, seed=11)
    src = _dump_a(tmp_path, rows, ADAM_ARGS)
    dst = str(tmp_path / "dst")
    assert checkpoint_main(["import-nvidia", src, dst, "--score-strategy", "a=STEP", "--dist-type",
                            "hash_roundrobin"]) == 0
    assert "imported 1 table(s)" in capsys.readouterr().out
    assert checkpoint_main([dst]) == 0  # our inspector: every file's size and checksum
    assert "checksums ok" in capsys.readouterr().out
    assert checkpoint_main(["import-nvidia", src, dst]) == 1  # never over an existing path
    assert "exists" in capsys.readouterr().err


def test_a_key_given_twice_is_refused_before_any_row_loads(tmp_path):
    """A dump holding a key twice (here two rank files of theirs, both with
    it): a load would keep one of its rows and drop the other unsaid, so it
    refuses, naming the table and the key, and the model keeps its rows."""
    rows = source_rows(4, S.STEP, seed=8)
    twice = int(rows["keys"][0])
    parts = split_by_owner(rows, "hash_roundrobin", 2)
    other = next(p for p in parts if twice not in p["keys"].tolist())
    for col in ("keys", "values", "scores", "opt"):
        other[col] = torch.cat([other[col], rows[col][:1]])
    write_dump(str(tmp_path / "src"), "a", parts, ADAM_ARGS)
    import_nvidia(str(tmp_path / "src"), str(tmp_path / "dst"), score_strategy="STEP")
    m = _plain(EmbOptimType.ADAM, dim=4)
    m(torch.tensor([1, 2]), torch.tensor([0, 2])).sum().backward()
    before = H.entries(m)["a"]
    n = rows["keys"].numel() + 1
    with pytest.raises(CheckpointError, match=rf"table 'a': 1 of the {n} keys .* \(key {twice}, 2 times\)"):
        DynamicEmbLoad(str(tmp_path / "dst"), m)
    after = H.entries(m)["a"]
    assert all(torch.equal(before[c], after[c]) for c in ("keys", "values", "state", "scores"))


def test_an_lru_dump_without_scores_loads_its_rows_as_just_touched(tmp_path):
    """No score files (NVIDIA's LRU tables): every row counts as touched at
    the dump, with or without the dump's timer reading (with one, the rows
    loaded about 54 years old and threshold 0 returned none)."""
    rows = dict(source_rows(4, S.TIMESTAMP, seed=10), scores=None)
    import_nvidia(_dump_a(tmp_path, rows, {"opt_type": "adam", "lr": 0.05, "iters": 1, "timestamp": DUMP_NS}),
                  str(tmp_path / "dst"), score_strategy="TIMESTAMP")
    m = _plain(EmbOptimType.ADAM, dim=4, strategy=S.TIMESTAMP)
    before = H.now_ns()
    DynamicEmbLoad(str(tmp_path / "dst"), m)
    got = H.entries(m)["a"]
    assert got["keys"].numel() == rows["keys"].numel()
    assert bool((got["scores"] >= before).all())  # age 0 at the load
    assert incremental_dump(m, 0)[0]["a"][0].numel() == rows["keys"].numel()


def test_damaged_metadata_and_stray_rank_files_are_named(tmp_path):
    rows = source_rows(4, S.STEP, seed=11)
    src = _dump_a(tmp_path, rows, ADAM_ARGS, world=2)
    with open(os.path.join(src, "a_opt_args.json"), "a") as f:
        f.write("{")
    with pytest.raises(NvidiaImportError, match=r"table 'a': .*a_opt_args.json is not valid JSON"):
        import_nvidia(src, str(tmp_path / "dst"))
    src = _dump_a(tmp_path / "b", rows, ADAM_ARGS, world=2)
    with open(os.path.join(src, file_name("a", "emb_keys", 2, 2)), "wb") as f:
        f.write(b"\0" * 8)
    with pytest.raises(NvidiaImportError, match=r"table 'a': emb_keys files of ranks \[2\] .* past world size 2"):
        import_nvidia(src, str(tmp_path / "dst2"))


def test_a_step_dump_without_scores_warns(tmp_path):
    rows = dict(source_rows(4, S.STEP, seed=12), scores=None)
    with pytest.warns(RuntimeWarning, match=r"table 'a' has no score files .* score 0 under STEP"):
        import_nvidia(_dump_a(tmp_path, rows, ADAM_ARGS), str(tmp_path / "dst"), score_strategy="STEP")
