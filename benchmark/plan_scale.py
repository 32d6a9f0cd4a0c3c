"""A plan for hundreds of GPUs, made by our planner offline (no GPU needed).

    python benchmark/plan_scale.py [--docs]      # prints the table, writes benchmark/results/plan_scale.json

The model: 26 dynamic tables (EmbeddingBagCollection, dim 128, float32) with
1B or 10B keys in all, split over the tables like Zipf (table i gets keys in
proportion to 1 / (i + 1)), trained with EXACT_ROWWISE_ADAGRAD or ADAM. The
cluster: 8, 64 or 256 GPUs with 80 GiB of HBM each, 8 GPUs and 2 TiB of host
memory per node (256 GiB per rank). For each case the tier policy below picks
every table's options, and DynamicEmbeddingShardingPlanner.plan() (on a meta
EBC and a CUDA Topology) charges them to HBM and DDR per rank, or refuses.

Tier policy (ours, not the planner's: the planner charges what the options
say). HBM for embeddings is the GPU's HBM less a reserve (15 %) for the dense
model, activations and communication buffers. If every table fits whole
(values, optimizer state and hash table) in that budget, all are all-HBM.
Else the smallest tables stay whole in HBM while they use at most half the
budget, and the others are cached (caching=True over a HostStore: every row in
host memory, the cache in HBM), their caches splitting the rest of the budget
in proportion to their rows. `--docs` rewrites the results table in
docs/scale.md, which gives the formulas.
"""
import argparse
import json
import logging
import os
import re
import sys
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torchrec
from torchrec.distributed.planner import Topology

from _common import default_out, format_table, write_json
from dynamicemb import DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.options import get_sharded_table_capacity, get_table_value_bytes
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder

GiB, TiB = 2**30, 2**40
HBM_PER_GPU = 80 * GiB
HOST_PER_NODE = 2 * TiB
GPUS_PER_NODE = 8
NUM_TABLES, DIM = 26, 128
WORLDS = (8, 64, 256)
KEYS = (10**9, 10**10)
OPTIMIZERS = (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM)
BATCH = 64 * 1024          # global batch (samples per step, all ranks)
POOLING = 1                # ids per sample per feature
HBM_RESERVE = 0.15         # share of HBM kept for the dense model, activations, buffers
WHOLE_SHARE = 0.5          # share of the embedding budget the whole (all-HBM) tables may use
TABLE_BYTES_PER_SLOT = 18  # planner.py: key 8, score 8, digest 1, epoch 1
DUMP_EXTRA_PER_ROW = 16    # a dump's row: key (8) and score (8) besides values and state (784 B at dim 64 Adam)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = os.path.join(ROOT, "docs", "benchmark_summary.json")
DOC = os.path.join(ROOT, "docs", "scale.md")
# TorchRec warns on every Topology built directly (we give it the sizes ourselves).
logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")


def zipf_sizes(total: int, n: int = NUM_TABLES, s: float = 1.0) -> List[int]:
    """Keys per table: in proportion to 1 / (i + 1)^s, summing to `total`."""
    w = [1.0 / (i + 1) ** s for i in range(n)]
    sizes = [max(1, int(total * x / sum(w))) for x in w]
    sizes[0] += total - sum(sizes)
    return sizes


def table_names(n: int = NUM_TABLES) -> List[str]:
    return [f"t{i:02d}" for i in range(n)]


def row_bytes(optimizer, dim: int = DIM) -> int:
    """Bytes of one row's values and optimizer state (float32)."""
    return get_table_value_bytes(1, dim, torch.float32, optimizer)


def hbm_budget(hbm: int = HBM_PER_GPU) -> int:
    return int(hbm * (1 - HBM_RESERVE))


def choose_options(sizes: List[int], world: int, optimizer, hbm: int = HBM_PER_GPU
                   ) -> Dict[str, DynamicEmbTableOptions]:
    """The tier policy (module docstring): each table's options."""
    row, budget = row_bytes(optimizer), hbm_budget(hbm)
    names = table_names(len(sizes))
    caps = {n: get_sharded_table_capacity(k, world) for n, k in zip(names, sizes)}
    whole = {n: c * (row + TABLE_BYTES_PER_SLOT) for n, c in caps.items()}
    if sum(whole.values()) <= budget:
        return {n: DynamicEmbTableOptions() for n in names}
    out, used = {}, 0
    for n in sorted(names, key=lambda n: caps[n]):
        if used + whole[n] > budget * WHOLE_SHARE:
            break
        out[n], used = DynamicEmbTableOptions(), used + whole[n]
    cached = [n for n in names if n not in out]
    left, rows = budget - used, sum(caps[n] for n in cached)
    for n in cached:
        cache_rows = left * caps[n] // rows // (row + TABLE_BYTES_PER_SLOT)
        out[n] = DynamicEmbTableOptions(caching=True, global_hbm_for_values=max(1, cache_rows * row * world))
    return out


def topology(world: int, hbm: int = HBM_PER_GPU, host_per_node: int = HOST_PER_NODE) -> Topology:
    local = min(world, GPUS_PER_NODE)
    return Topology(world_size=world, local_world_size=local, compute_device="cuda", hbm_cap=hbm,
                    ddr_cap=host_per_node // local)


def plan_case(sizes: List[int], world: int, optimizer, options: Optional[Dict[str, DynamicEmbTableOptions]] = None,
              hbm: int = HBM_PER_GPU, host_per_node: int = HOST_PER_NODE):
    """(planner, plan) of the model on `world` GPUs; raises the planner's
    ValueError when it does not fit."""
    names = table_names(len(sizes))
    options = options if options is not None else choose_options(sizes, world, optimizer, hbm)
    configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=k, feature_names=[f"f{n}"])
               for n, k in zip(names, sizes)]
    constraints = {n: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=options[n])
                   for n in names}
    topo = topology(world, hbm, host_per_node)
    planner = DynamicEmbeddingShardingPlanner(configs, topology=topo, constraints=constraints)
    module = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params=dict(optimizer=optimizer, learning_rate=0.01))]
    return planner, planner.plan(module, sharders)


def all_to_all_bytes(world: int, features: int = NUM_TABLES, batch: int = BATCH, pooling: int = POOLING,
                     dim: int = DIM, itemsize: int = 4) -> Dict[str, int]:
    """Bytes one rank sends to the other ranks per step (row-wise sharding,
    pooled): docs/scale.md gives the formulas."""
    b = batch // world                                   # samples per rank
    ids = b * features * pooling * 8 * (world - 1) // world
    lengths = b * features * 4 * (world - 1)             # one length per (sample, feature) to every other rank
    pooled = batch * features * dim * itemsize * (world - 1) // world
    return {"fwd_ids": ids + lengths, "fwd_pooled": pooled, "bwd_grads": pooled, "bwd_ids": 0,
            "total": ids + lengths + 2 * pooled}


def measured_dump_rate(path: str = SUMMARY) -> Tuple[float, str]:
    """Bytes per second one rank dumps, from bench_checkpoint in the
    benchmark summary (every rank writing in parallel)."""
    with open(path) as f:
        summary = json.load(f)
    ck = summary["benchmarks"]["checkpoint"]
    world, res = ck["config"]["world"], ck["results"]
    rate = res["dump_bytes"] / world / res["dump_s"]
    return rate, (f"bench_checkpoint in docs/benchmark_summary.json ({summary.get('date', '?')[:10]}, "
                  f"{ck['config']['rows']} rows x dim {ck['config']['dim']} Adam over {world} ranks, "
                  f"{ck['config'].get('cpu_count', '?')} CPUs)")


def choice(o: DynamicEmbTableOptions, row: int) -> Tuple[str, float]:
    """(tier, share of the table's rows per rank in HBM)."""
    if o.caching:
        return "cached", o.cache_rows(row, 1) / o.max_capacity
    head = o.hbm_rows(row)
    if head is None or head >= o.max_capacity:
        return "hbm", 1.0
    return ("host", 0.0) if head == 0 else ("hybrid", head / o.max_capacity)


def run_case(world: int, keys: int, optimizer, dump_rate: float) -> dict:
    sizes = zipf_sizes(keys)
    row = row_bytes(optimizer)
    case = {"world": world, "keys": keys, "optimizer": optimizer.name, "row_bytes": row,
            "hbm_per_rank": HBM_PER_GPU, "ddr_per_rank": HOST_PER_NODE // min(world, GPUS_PER_NODE),
            "hbm_budget": hbm_budget(), "table_keys": dict(zip(table_names(), sizes)),
            "all_to_all": all_to_all_bytes(world)}
    try:
        planner, plan = plan_case(sizes, world, optimizer)
    except ValueError as e:
        case.update(fits=False, refusal=str(e))
        return case
    topo = planner._topology.devices[0].storage
    case.update(fits=True, hbm_used=HBM_PER_GPU - topo.hbm, ddr_used=case["ddr_per_rank"] - topo.ddr)
    tables = {}
    for name, ps in plan.plan[""].items():
        o = ps.dynamicemb_options
        tier, share = choice(o, row)
        tables[name] = {"tier": tier, "hbm_share": share, "max_capacity": o.max_capacity, "caching": o.caching,
                        "global_hbm_for_values": o.global_hbm_for_values}
    case["tables"] = tables
    dump = sum(-(-k // world) for k in sizes) * (row + DUMP_EXTRA_PER_ROW)
    case.update(dump_bytes_per_rank=dump, checkpoint_s=dump / dump_rate)
    return case


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def summary_rows(cases: List[dict]) -> List[list]:
    rows = []
    for c in cases:
        head = [c["world"], f"{c['keys'] // 10**9}B", c["optimizer"].replace("EXACT_", "").lower()]
        a2a = _gb(c["all_to_all"]["total"])
        if not c["fits"]:
            name = re.search(r"table '(\w+)'", c["refusal"])
            kind = re.search(r"fit in (\w+)", c["refusal"])
            rows.append(head + ["-", "-", f"refused: {name and name[1]} ({kind and kind[1]})", a2a, "-", "-"])
            continue
        tiers = [t for t in c["tables"].values()]
        whole = sum(t["tier"] == "hbm" for t in tiers)
        cached = [t["hbm_share"] for t in tiers if t["tier"] == "cached"]
        share = f"{min(cached):.0%}" if cached and f"{min(cached):.0%}" == f"{max(cached):.0%}" else \
            f"{min(cached or [0]):.0%}-{max(cached or [0]):.0%}"
        plan = "all-HBM" if not cached else f"{whole} all-HBM + {len(cached)} cached ({share} of rows in HBM)"
        rows.append(head + [_gb(c["hbm_used"]), _gb(c["ddr_used"]), plan, a2a, _gb(c["dump_bytes_per_rank"]),
                            f"{c['checkpoint_s']:.0f}"])
    return rows


HEADERS = ["GPUs", "keys", "optimizer", "HBM GB/rank", "host GB/rank", "plan", "a2a GB/rank/step",
           "dump GB/rank", "checkpoint s"]


def markdown(cases: List[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join(["--:"] * 2 + ["---"] + ["--:"] * 2 + ["---"]
                                                                  + ["--:"] * 3) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in summary_rows(cases)]
    return "\n".join(lines)


def write_docs(cases: List[dict], source: str, rate: float, path: str = DOC) -> None:
    with open(path) as f:
        text = f.read()
    block = (f"<!-- plan_scale:begin (generated by benchmark/plan_scale.py --docs) -->\n{markdown(cases)}\n\n"
             f"Dump rate: {rate / 1e9:.2f} GB/s per rank, measured by {source}.\n<!-- plan_scale:end -->")
    text = re.sub(r"<!-- plan_scale:begin.*?<!-- plan_scale:end -->", lambda _: block, text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out("plan_scale"))
    ap.add_argument("--dump-rate", type=float, default=None, help="bytes/s per rank (default: measured)")
    ap.add_argument("--docs", action="store_true", help="rewrite the results table in docs/scale.md")
    args = ap.parse_args(argv)
    if args.dump_rate:
        rate, source = args.dump_rate, "--dump-rate"
    else:
        rate, source = measured_dump_rate()
    cases = [run_case(w, k, o, rate) for k in KEYS for o in OPTIMIZERS for w in WORLDS]
    print(format_table(HEADERS, summary_rows(cases)))
    for c in cases:
        if not c["fits"]:
            print(f"\n{c['world']} GPUs, {c['keys']} keys, {c['optimizer']}: {c['refusal'][:400]}")
    print(f"\ndump rate {rate / 1e9:.3f} GB/s per rank ({source})")
    write_json(args.out, {"command": " ".join(["python"] + sys.argv), "dump_rate": rate, "dump_rate_source": source,
                          "batch": BATCH, "pooling": POOLING, "hbm_reserve": HBM_RESERVE, "cases": cases})
    if args.docs:
        write_docs(cases, source, rate)
    return cases


if __name__ == "__main__":
    main()
