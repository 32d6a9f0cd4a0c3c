"""ScoredHashTable throughput: lookup, insert, insert with eviction and erase
at several load factors, plus lookup + gather of embedding rows against a plain
``torch.index_select`` from a static table of the same size.

    scripts/dev.sh bench table                      # 16M slots, 1M-key batches
    scripts/dev.sh bench table --slots 1048576 --batch 65536 --repeats 3   # smoke

Prints fixed-width tables and writes JSON (benchmark/results/bench_table.json
unless --out). Rates are in Mkeys/s = 2^20 keys/s (Gkeys/s = 2^30 on CUDA).

Definitions (per load factor LF; every batch holds --batch keys):
  lookup hit      lookup of stored keys (a random sample, no repeats in a batch)
  lookup miss     lookup of keys never inserted
  lookup+refresh  lookup(update_score=True) of stored keys
  insert assign   insert of stored keys (finds them, refreshes the scores)
  insert new      insert of new keys (LF < 1); erased again after each repeat
                  (untimed), and the few keys they evicted from full buckets
                  inserted again, so that the stored keys stay put
  insert evict    insert of new keys into the full table (LF = 1): each evicts
  erase           erase of stored keys; re-inserted after each repeat (untimed)
  lookup+gather   ScoredHashTable.lookup_gather of stored keys: lookup and
                  copy of their rows from a [slots, dim] float32 values tensor
                  in one op (into a preallocated output). The values tensor is
                  allocated as a dynamic table's storage allocates its rows
                  (dynamicemb.memory: 2 MiB pages where the kernel offers them)
  lookup,gather   the unfused pair: lookup, then index_select of the rows
  gather(slots)   only the index_select, by the slot indices a lookup returned
  index_select    index_select of as many uniformly random rows of a static
                  [slots, dim] table allocated as torch allocates it (the
                  baseline; 4 KiB pages unless transparent huge pages are
                  "always")
  same pages      index_select of random rows of the values tensor itself:
                  the baseline on the dynamic table's pages, so that the
                  summary shows how much of the ratio is the page size (with
                  4 KiB pages every random row costs a page walk)
Per load factor, the operations whose rates the summary compares take turns,
one call of each per round, so that both sides of a ratio are measured under
the same load: the lookups with the insert of new keys, then the gathers with
index_select; refresh, assign and erase follow, each alone.
Keys are distinct pseudo-random int64s: an odd multiple of a counter plus a
random offset (mod 2^64), a bijection, so new keys never collide with stored
ones. LF 1.0 is reached by inserting full batches until size() == capacity()
(random keys overfill some buckets long before the last one fills).
"""
import argparse
import math
import os
import random
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    Measurement,
    IdleGate,
    Op,
    bench,
    bench_round_robin,
    busy_warning,
    default_out,
    env_info,
    fmt_rate,
    format_table,
    huge_page_share,
    loadavg,
    sync,
    timed,
    write_json,
)

from dynamicemb import DynamicEmbScoreStrategy, InsertResult, ScoredHashTable, memory  # noqa: E402

STRATEGIES = {
    "TIMESTAMP": DynamicEmbScoreStrategy.TIMESTAMP,
    "STEP": DynamicEmbScoreStrategy.STEP,
    "CUSTOMIZED": DynamicEmbScoreStrategy.CUSTOMIZED,
    "LFU": DynamicEmbScoreStrategy.LFU,
    "NO_EVICTION": DynamicEmbScoreStrategy.NO_EVICTION,
    "TIMESTAMP_LFU": (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU),
}

RATIO_GATHER_TARGET = 0.8  # (lookup + gather) / index_select
RATIO_EVICT_TARGET = 0.5  # insert evict / lookup hit, at LF 1.0

_MUL = 0x9E3779B97F4A7C15 - 2**64  # odd: multiplying by it is a bijection mod 2^64


class KeyGen:
    """Distinct int64 keys spread over the whole range: counter * odd + offset."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.offset = random.Random(seed).getrandbits(64) - 2**63
        self.next = 0

    def __call__(self, n: int) -> torch.Tensor:
        i = torch.arange(self.next, self.next + n, dtype=torch.int64, device=self.device)
        self.next += n
        return i.mul_(_MUL).add_(self.offset)  # wraps mod 2^64


class Sampler:
    """Batches of stored keys: disjoint windows of a random permutation."""

    def __init__(self, keys: torch.Tensor, batch: int):
        self.keys, self.batch = keys, batch
        self.perm, self.pos = None, 0

    def __call__(self) -> torch.Tensor:
        n = self.keys.numel()
        if self.perm is None or self.pos + self.batch > n:
            self.perm, self.pos = torch.randperm(n, device=self.keys.device), 0
        if self.batch > n:  # tiny tables: sample with repeats
            return self.keys[torch.randint(0, n, (self.batch,), device=self.keys.device)]
        w = self.perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.keys[w]


class Table:
    """The table plus the per-call scores each strategy wants."""

    def __init__(self, args, device):
        self.name = args.strategy
        self.t = ScoredHashTable(args.slots, bucket_capacity=args.bucket_capacity,
                                 score_strategy=STRATEGIES[args.strategy], device=device)
        self.calls = 0

    def _scores(self):
        self.calls += 1
        if self.name == "STEP":
            self.t.step = self.calls
        if self.name == "CUSTOMIZED":
            return self.calls
        return None

    def insert(self, keys):
        return self.t.insert(keys, scores=self._scores())

    def lookup(self, keys):
        return self.t.lookup(keys)

    def lookup_refresh(self, keys):
        return self.t.lookup(keys, update_score=True, scores=self._scores())

    def erase(self, keys):
        return self.t.erase(keys)


# What the JSON records of a call's result (keep) and over the timed repeats
# (extra): the share of each InsertResult of an insert, of found keys of a
# lookup, of erased keys of an erase.
INSERT_SHARES = dict(
    keep=lambda out: torch.bincount(out.results.to(torch.int64), minlength=4).cpu(),
    extra=lambda counts: {"results": {r.name.lower(): int(sum(counts)[r]) / max(1, int(sum(counts).sum()))
                                      for r in InsertResult}})


def _share(name, hits):
    return dict(keep=lambda out: (int(hits(out).sum()), hits(out).numel()),
                extra=lambda kept: {name: sum(k for k, _ in kept) / max(1, sum(n for _, n in kept))})


FOUND_SHARE = _share("found", lambda out: out[1])
ERASED_SHARE = _share("erased", lambda out: out)


def fill(tab: Table, lf: float, gen: KeyGen, batch: int, device) -> dict:
    """Inserts new keys until size() reaches lf * capacity (all of it for 1.0)."""
    cap = tab.t.capacity()
    target = cap if lf >= 1.0 else int(round(lf * cap))
    full = target >= cap
    max_batches = 16 * math.ceil(cap / batch) + 64
    keys = batches = 0
    secs = 0.0
    while tab.t.size() < target and batches < max_batches:
        n = batch if full else min(batch, target - tab.t.size())
        dt, _ = timed(lambda: tab.insert(gen(n)), device)
        secs += dt
        keys += n
        batches += 1
    return {"target_size": target, "size": tab.t.size(), "load_factor": tab.t.load_factor(),
            "keys_inserted": keys, "batches": batches, "seconds": secs}


def run_stage(tab: Table, lf: float, args, gen: KeyGen, device, values, static, out_buf, gate) -> dict:
    B, R = args.batch, args.repeats
    info = fill(tab, lf, gen, B, device)
    full = info["size"] >= tab.t.capacity()
    # The stored keys by slot: an evicting insert's teardown writes its keys
    # over the ones it evicted, so lookups of a sample stay all hits.
    parts = tab.t.export(batch_size=tab.t.capacity())
    pool = torch.full((tab.t.capacity(),), 0, dtype=torch.int64, device=device)
    live = torch.zeros(tab.t.capacity(), dtype=torch.bool, device=device)
    for part in parts:
        pool[part.indices] = part.keys
        live[part.indices] = True
    slots_live = live.nonzero().squeeze(1)
    del parts, live
    sample = Sampler(slots_live, B)
    stored_sample = lambda: pool[sample()]  # noqa: E731

    def evict_teardown(keys, out):
        ok = out.indices >= 0
        pool[out.indices[ok]] = keys[ok]

    # The operations whose rates the summary compares take turns, in two
    # groups: the table's (lookups, inserts of new keys) and the gathers'
    # (kept apart: their random reads all over the values table slowed
    # whatever ran next in a round).
    table_turns = [Op("lookup_hit", tab.lookup, stored_sample, **FOUND_SHARE),
                   Op("lookup_miss", tab.lookup, lambda: gen(B), **FOUND_SHARE)]
    if full:
        table_turns.append(Op("insert_evict", tab.insert, lambda: gen(B), evict_teardown, **INSERT_SHARES))
    else:
        def new_teardown(keys, out):  # erase them; keys that a full bucket evicted come back
            tab.erase(keys)
            if out.evicted.keys.numel():
                tab.insert(out.evicted.keys)

        table_turns.append(Op("insert_new", tab.insert, lambda: gen(B), new_teardown, **INSERT_SHARES))
    m: Dict[str, Measurement] = bench_round_robin(table_turns, B, device, R, warmup=1, gate=gate)
    if values is not None:
        slots = values.shape[0]

        def lookup_then_gather(k):
            idx, _ = tab.lookup(k)
            return torch.index_select(values, 0, idx, out=out_buf)

        m.update(bench_round_robin([
            Op("lookup_gather", lambda k: tab.t.lookup_gather(k, values, out=out_buf), stored_sample),
            Op("lookup_then_gather", lookup_then_gather, stored_sample),
            Op("gather_slots", lambda idx: torch.index_select(values, 0, idx, out=out_buf),
               lambda: tab.lookup(stored_sample())[0]),
            Op("index_select", lambda rows: torch.index_select(static, 0, rows, out=out_buf),
               lambda: torch.randint(0, slots, (B,), device=device)),
            Op("index_select_same_pages", lambda rows: torch.index_select(values, 0, rows, out=out_buf),
               lambda: torch.randint(0, slots, (B,), device=device))], B, device, R, warmup=1, gate=gate))

    def run(name, fn, **kw):
        m[name] = bench(name, fn, B, device, R, warmup=1, gate=gate, **kw)

    run("lookup_refresh", tab.lookup_refresh, setup=stored_sample, **FOUND_SHARE)
    run("insert_assign", tab.insert, setup=stored_sample, **INSERT_SHARES)
    # Last: erased keys come back, but maybe in other slots of their bucket.
    run("erase", tab.erase, setup=stored_sample, teardown=lambda k, _: tab.insert(k), **ERASED_SHARE)
    info["size_after"] = tab.t.size()
    del pool, sample
    return {"lf": lf, "fill": info, "full": full, "m": m}


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=16 * 2**20, help="table capacity (default 16M)")
    p.add_argument("--batch", type=int, default=2**20, help="keys per call (default 1M)")
    p.add_argument("--bucket-capacity", type=int, default=128)
    p.add_argument("--load-factors", type=str, default="0.5,0.75,1.0")
    p.add_argument("--dim", type=int, default=64, help="embedding dim of the gather part")
    p.add_argument("--no-gather", action="store_true", help="skip lookup+gather vs index_select")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="TIMESTAMP")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (after one warm-up); median")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", type=str, default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="on a shared machine: before each timed repeat, wait up to SECONDS for the "
                        "CPUs to be idle (default 0: off)")
    p.add_argument("--out", type=str, default=default_out("bench_table"))
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    lfs = [float(x) for x in args.load_factors.split(",") if x.strip()]

    tab = Table(args, device)
    gen = KeyGen(device, args.seed)
    values = static = out_buf = None
    pages = {}
    if not args.no_gather:
        values = memory.zeros((args.slots, args.dim), torch.float32, device).uniform_()
        static = torch.empty(args.slots, args.dim, dtype=torch.float32, device=device).uniform_()
        out_buf = torch.empty(args.batch, args.dim, dtype=torch.float32, device=device)
        sync(device)
        if device.type == "cpu":
            pages = {"values_huge_page_share": huge_page_share(values),
                     "static_huge_page_share": huge_page_share(static)}

    config = {"slots": args.slots, "batch": args.batch, "bucket_capacity": args.bucket_capacity,
              "load_factors": lfs, "dim": None if args.no_gather else args.dim, "strategy": args.strategy,
              "repeats": args.repeats, "warmup": 1, "seed": args.seed, **pages, **env_info(device)}
    print(f"bench_table: {args.slots} slots ({args.slots / 2**20:g}M), batch {args.batch} "
          f"({args.batch / 2**20:g}M), bucket {args.bucket_capacity}, {args.strategy}, {device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.repeats}",
          flush=True)
    warn = busy_warning(torch.get_num_threads())
    if warn:
        print(warn, flush=True)

    gate = IdleGate(args.wait_idle if device.type == "cpu" else 0.0, torch.get_num_threads())
    stages = []
    for lf in lfs:
        st = run_stage(tab, lf, args, gen, device, values, static, out_buf, gate)
        f = st["fill"]
        print(f"  LF {lf:g}: filled to {f['size']}/{tab.t.capacity()} (LF {f['load_factor']:.4f}) with "
              f"{f['keys_inserted']} new keys in {f['batches']} batches, {f['seconds']:.2f} s", flush=True)
        stages.append(st)

    unit = "Gkeys/s (2^30)" if device.type == "cuda" else "Mkeys/s (2^20 keys/s)"
    rate = lambda st, k: fmt_rate(st["m"].get(k), device)  # noqa: E731
    cols = [("lookup hit", "lookup_hit"), ("lookup miss", "lookup_miss"),
            ("lookup+refresh", "lookup_refresh"), ("insert assign", "insert_assign"),
            ("insert new", "insert_new"), ("insert evict", "insert_evict"), ("erase", "erase")]
    rows = [[f"{st['lf']:g}", f"{st['fill']['load_factor']:.4f}"] + [rate(st, k) for _, k in cols]
            for st in stages]
    print(f"\nScoredHashTable, {unit}")
    print(format_table(["LF", "achieved"] + [c for c, _ in cols], rows))

    summary = {}
    if values is not None:
        grows = []
        ratios, same = [], []
        for st in stages:
            mm = st["m"]
            ratios.append(mm["lookup_gather"].rate / mm["index_select"].rate)
            same.append(mm["lookup_gather"].rate / mm["index_select_same_pages"].rate)
            grows.append([f"{st['lf']:g}", rate(st, "lookup_hit"), rate(st, "lookup_gather"),
                          rate(st, "lookup_then_gather"), rate(st, "gather_slots"), rate(st, "index_select"),
                          f"{ratios[-1]:.3f}", rate(st, "index_select_same_pages"), f"{same[-1]:.3f}"])
        print(f"\nLookup + gather of dim-{args.dim} float32 rows vs index_select, {unit} (rows)")
        if pages:
            print(f"(2 MiB pages: {pages['values_huge_page_share']:.0%} of the values tensor, "
                  f"{pages['static_huge_page_share']:.0%} of the static table)")
        print(format_table(["LF", "lookup", "lookup+gather", "lookup,gather", "gather(slots)",
                            "index_select", "ratio", "same pages", "ratio"], grows))
        worst = min(ratios)
        summary["gather_ratio"] = {f"{st['lf']:g}": r for st, r in zip(stages, ratios)}
        summary["gather_ratio_min"] = worst
        summary["gather_ratio_same_pages"] = {f"{st['lf']:g}": r for st, r in zip(stages, same)}
        summary["gather_ratio_same_pages_min"] = min(same)
        summary["gather_ratio_target"] = RATIO_GATHER_TARGET
        summary["gather_ratio_ok"] = worst >= RATIO_GATHER_TARGET
    full = [st for st in stages if st["full"]]
    print()
    if values is not None:
        print(f"lookup+gather / index_select: min {summary['gather_ratio_min']:.3f} over LFs "
              f"(target >= {RATIO_GATHER_TARGET}): {'OK' if summary['gather_ratio_ok'] else 'BELOW TARGET'}; "
              f"against index_select on the same pages: min {summary['gather_ratio_same_pages_min']:.3f}: "
              f"{'OK' if summary['gather_ratio_same_pages_min'] >= RATIO_GATHER_TARGET else 'BELOW TARGET'}")
    if full:
        st = full[-1]
        r = st["m"]["insert_evict"].rate / st["m"]["lookup_hit"].rate
        summary.update({"evict_vs_lookup": r, "evict_vs_lookup_target": RATIO_EVICT_TARGET,
                        "evict_vs_lookup_ok": r >= RATIO_EVICT_TARGET,
                        "evict_share": st["m"]["insert_evict"].extra["results"]["evicted"]})
        print(f"insert evict / lookup hit at LF {st['fill']['load_factor']:.4f}: {r:.3f} "
              f"(target >= {RATIO_EVICT_TARGET}): {'OK' if r >= RATIO_EVICT_TARGET else 'BELOW TARGET'}"
              f"; {summary['evict_share']:.1%} of the keys evicted")

    payload = {
        "benchmark": "bench_table",
        "config": config,
        "stages": [{"load_factor": st["lf"], "fill": st["fill"],
                    "measurements": {k: v.to_json() for k, v in st["m"].items()}} for st in stages],
        "summary": summary,
    }
    payload["config"]["loadavg_end"] = loadavg()
    payload["config"]["idle_gate"] = gate.to_json()
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
