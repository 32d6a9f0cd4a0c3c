"""What the torch.distributed.checkpoint (DCP) tests share: the TorchRec model
of ckpt_helpers (an EBC and an EC, a dynamic table of every dist_type, STEP,
LFU, TIMESTAMP and (TIMESTAMP, LFU) scores) with admission counters on one
table and, for the tier tests, a cached table and a table over a FileStore;
saving it with dcp.save(model.state_dict()) and loading it as a TorchRec user
does (dcp.load into a fresh model's state_dict(), then load_state_dict); and
reading every table back (rows, optimizer state, scores, admission counts)."""
import os
from typing import Dict, List

import torch
import torch.distributed as dist

import ckpt_helpers as H
from dynamicemb import EmbOptimType, FrequencyAdmissionStrategy, KVCounter, get_table_value_bytes, table_stats
from dynamicemb.checkpoint.tables import model_tables

OPTIMIZERS = {
    "sgd": dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1),
    "adam": dict(optimizer=EmbOptimType.ADAM, learning_rate=0.05),
    "rowwise_adagrad": dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3),
}
COUNTED = "t_seq"  # the table with frequency admission (a key is stored once seen twice)
CACHED, FILED = "t_hash", "t_rr"  # tier runs: a cache over a host store; a cache over a FileStore
BUCKET = 16
CACHE_ROWS = 96  # per table and rank: fewer than the keys a rank trains in TIER_STEPS, so rows live in both tiers
TIER_STEPS = 30


def options(fused, tiers: bool, store_dir: str = None, world: int = 1) -> Dict[str, dict]:
    """Per-table option overrides: admission counters on COUNTED; with
    `tiers`, CACHED and FILED cached (FILED's backing store a FileStore in
    `store_dir`, which must be fresh for each model)."""
    out = {COUNTED: dict(admit_strategy=FrequencyAdmissionStrategy(2), admission_counter=KVCounter(4096, 128))}
    if tiers:
        for name in (CACHED, FILED):
            dim = H.TABLES[name][0]
            out[name] = dict(caching=True, bucket_capacity=BUCKET,
                             global_hbm_for_values=get_table_value_bytes(CACHE_ROWS * world, dim, torch.float32,
                                                                         fused["optimizer"]))
        out[FILED]["storage_path"] = store_dir
    return out


def build(pg, fused, tiers: bool = False, store_dir: str = None, **kw):
    return H.build(pg, fused, **options(fused, tiers, store_dir, pg.size()), **kw)


def save(model, path: str, pg) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.save(model.state_dict(), checkpoint_id=path, process_group=pg)


def load(model, path: str, pg):
    """What a TorchRec user does: DCP fills the fresh model's state dict, load_state_dict applies it."""
    import torch.distributed.checkpoint as dcp
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path, process_group=pg)
    return model.load_state_dict(sd)


def entries(model) -> dict:
    """ckpt_helpers.entries' form, read through the storage protocol's
    export (every tier of a cached table), plus "_counters": {table: {key:
    count}} of the tables with admission."""
    out = {}
    for name, ref in model_tables(model).items():
        cols = {"keys": [], "values": [], "state": [], "scores": [], "ts": []}
        for b in ref.storage.export_rows(ref.index):
            cols["keys"].append(b.keys)
            cols["values"].append(b.values)
            cols["state"].append(b.optimizer_state)
            cols["scores"].append(b.scores)
            if b.timestamps is not None:
                cols["ts"].append(b.timestamps)
        if not cols["keys"]:  # an empty table exports no batch
            dim = ref.options.dim
            width = ref.storage.weights()[ref.index].shape[1] - dim
            cols = {"keys": [torch.zeros(0, dtype=torch.int64)], "values": [torch.zeros(0, dim)],
                    "state": [torch.zeros(0, width)], "scores": [torch.zeros(0, dtype=torch.int64)],
                    "ts": [torch.zeros(0, dtype=torch.int64)]}
        keys = torch.cat(cols["keys"])
        order = keys.argsort()
        e = {c: torch.cat(v)[order] if v else None for c, v in cols.items()}
        if name not in H.CLOCK_TIMESTAMPS:
            e["ts"] = None
        out[name] = e
    out["_counters"] = {}
    for name, ref in model_tables(model).items():
        adm = ref.storage.admission_counter(ref.index)
        if adm is not None:
            out["_counters"][name] = {k: c for b in adm.counts.export()
                                      for k, c in zip(b.keys.tolist(), b.scores.tolist())}
    out["_modules"] = sorted((tuple(m.table_names), m.step, m.optimizer_step) for m in H.dynamic_modules(model))
    return out


def gathered(model, pg, independent: bool) -> List[dict]:
    """Every rank's tables, in rank order: read by ckpt_helpers.entries (the
    hash table itself: independent of the export that saves use) when
    `independent`, else through export (cached tables), with the counters."""
    mine = entries(model)
    if independent:
        mine.update({k: v for k, v in H.entries(model).items() if k != "_modules"})
    if pg.size() == 1:
        return [mine]
    out = [None] * pg.size()
    dist.all_gather_object(out, mine, group=pg)
    return out


def assert_same_counters(orig: List[dict], loaded: List[dict]) -> None:
    """Every counted key of the original ranks is counted on exactly one
    loaded rank, the one its table's routing gives it, with the same count."""
    world = len(loaded)
    for name in orig[0]["_counters"]:
        want = {}
        for r in orig:
            for k, c in r["_counters"][name].items():
                assert k not in want, f"{name}: key {k} counted on two original ranks"
                want[k] = c
        got = {}
        for rank, r in enumerate(loaded):
            keys = torch.tensor(sorted(r["_counters"][name]), dtype=torch.int64)
            assert bool((H.owners(keys, H.TABLES[name][1], world, H.NUM_EMB) == rank).all()), \
                f"{name}: rank {rank} counts keys routed elsewhere"
            for k, c in r["_counters"][name].items():
                assert k not in got, f"{name}: key {k} counted twice"
                got[k] = c
        assert want and got == want, f"{name}: admission counts differ"


def assert_same_training(a: List[dict], b: List[dict]) -> None:
    """Two models trained alike from equal states: equal keys, values,
    optimizer state, counters and steps on every rank; equal scores but for
    clock readings (which depend on when each trained)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra["_modules"] == rb["_modules"] and ra["_counters"] == rb["_counters"]
        for name in H.TABLES:
            ea, eb = ra[name], rb[name]
            for c in ("keys", "values", "state") + (() if name in H.CLOCK_SCORES else ("scores",)):
                assert torch.equal(ea[c], eb[c]), f"{name}: {c} differ after the same training"


def run_root(root: str, *parts) -> str:
    return os.path.join(root, *map(str, parts))


# ---- the spawned runs and their checks ---------------------------------------------------

SIZES = (1, 2, 3)
ROWS = [t for t in H.TABLES if t != COUNTED]  # tables with rows on every rank (admission keeps few keys)


def _state(model, pg, independent=True):
    return dict(entries=gathered(model, pg, independent), out=H.probe(model), ns=H.now_ns(), stats=table_stats(model))


def _round_trips(rank, world, root, fused, tiers=False):
    """Every world size w in 1..3 (ranks 0..w-1): train, save, load into a
    fresh model, train both on; then the 1-rank save on 2 ranks, that
    model's save on 3, and the 3-rank save on rank 0 alone."""
    own = [dist.new_group([r]) for r in range(world)]
    groups = {1: own[0], 2: dist.new_group([0, 1]), 3: dist.GroupMember.WORLD}
    independent = not tiers
    res = {}

    def fresh(pg, name):
        return build(pg, fused, tiers, run_root(root, "stores", name, rank))

    for w in SIZES:
        if rank < w:
            pg = groups[w]
            a = fresh(pg, f"a{w}")
            H.train(a, pg, range(1, 1 + (TIER_STEPS if tiers else 3)))
            res[w] = dict(saved=_state(a, pg, independent))
            save(a, run_root(root, f"w{w}"), pg)
            b = fresh(pg, f"b{w}")
            H.train(b, pg, [7])  # something to replace
            res[w]["incompatible"] = repr(load(b, run_root(root, f"w{w}"), pg))
            res[w]["loaded"] = _state(b, pg, independent)
            for m in (a, b):
                H.train(m, pg, [4, 5])
            res[w]["a_on"], res[w]["b_on"] = _state(a, pg, independent), _state(b, pg, independent)
        dist.barrier()
    for direction, (src, w) in {"1->2": ("w1", 2), "2->3": ("c2", 3), "3->1": ("w3", 1)}.items():
        if rank < w:
            pg = groups[w]
            c = fresh(pg, direction)
            load(c, run_root(root, src), pg)
            res[direction] = _state(c, pg, independent)
            if direction == "1->2":
                save(c, run_root(root, "c2"), pg)
        dist.barrier()
    return res


@H.once
def results(optimizer: str, tiers: bool = False):
    return H.run_in_scratch("dynamicemb-dcp-", _round_trips, 3, OPTIMIZERS[optimizer], tiers, timeout=600)


def check_round_trip(ranks, w):
    r = ranks[0][w]
    assert r["incompatible"] == "<All keys matched successfully>"
    saved, loaded = r["saved"], r["loaded"]
    assert len(saved["entries"]) == w
    assert all(e[t]["keys"].numel() >= 3 for e in saved["entries"] for t in ROWS), "a rank holds too few keys"
    H.assert_same_entries(saved["entries"], loaded["entries"], saved["ns"], loaded["ns"])
    if "slots" in saved["entries"][0][ROWS[0]]:
        # Each key in its slot again, so that eviction breaks ties as it would have (the
        # lowest slot of equal scores): the slots load in slot order, not DCP's order of them.
        for a, b in zip(saved["entries"], loaded["entries"]):
            for t in ROWS:
                assert torch.equal(a[t]["slots"], b[t]["slots"]), f"{t}: keys in other slots after the load"
    assert_same_counters(saved["entries"], loaded["entries"])
    assert [e["_modules"] for e in loaded["entries"]] == [e["_modules"] for e in saved["entries"]]
    H.assert_same_outputs(loaded["out"], saved["out"], exact=True)
    # Trained on alike from there: the same tables and eval outputs.
    assert_same_training(r["a_on"]["entries"], r["b_on"]["entries"])
    H.assert_same_outputs(r["b_on"]["out"], r["a_on"]["out"], exact=True)


def check_reshard(ranks, direction):
    src = {"1->2": ranks[0][1]["saved"], "2->3": ranks[0]["1->2"], "3->1": ranks[0][3]["saved"]}[direction]
    loads = [r[direction] for r in ranks if direction in r]
    orig, loaded = src["entries"], loads[0]["entries"]
    assert len(loaded) == int(direction[-1])
    assert all(e[t]["keys"].numel() >= 3 for e in loaded for t in ROWS), "a rank holds too few keys"
    # Every key exactly once, on its owner, with its value, state and score.
    H.assert_same_entries(orig, loaded, src["ns"], max(x["ns"] for x in loads))
    assert_same_counters(orig, loaded)
    assert {m[1:] for e in loaded for m in e["_modules"]} == {m[1:] for e in orig for m in e["_modules"]}  # steps
    for x in loads:
        H.assert_same_outputs(x["out"], src["out"], exact=False)  # another world sums bags in another order


