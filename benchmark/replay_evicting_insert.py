"""The evicting insert of one rank's DMP step, replayed alone and paired:
two identical tables (8 logical tables of --slots slots each, filled to
>= 0.995 by random inserts), each call's keys (--stored of them already
stored, --new never seen) inserted into both, alternating which goes first,
one variant per table (issue 39; docs/dmp_step_new_ids.md, tenth session).
The variants are the insert's options: `hold_stored=0` (keys in input order,
API §6) against `hold_stored=1` (a step's stored keys held first, what the
module does). Prints each variant's median ms per call and writes JSON.

    bash scripts/dev.sh python benchmark/replay_evicting_insert.py [--calls 14] [--threads 1]
"""
import argparse
import statistics
import time

import torch

from _common import default_out, env_info, format_table, write_json
from dynamicemb import DynamicEmbScoreStrategy, ScoredHashTable


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=1 << 19, help="slots per logical table")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--stored", type=int, default=32000, help="stored keys a call")
    ap.add_argument("--new", type=int, default=82000, help="new keys a call")
    ap.add_argument("--calls", type=int, default=14)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default_out("replay_evicting_insert"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    variants = {"hold_stored=0": False, "hold_stored=1": True}
    tables = {v: ScoredHashTable(args.slots, 128, DynamicEmbScoreStrategy.STEP, num_tables=args.tables)
              for v in variants}
    step, fill = 1, 1 << 19
    first = next(iter(tables.values()))
    while first.load_factor() < 0.995:  # the same inserts into both
        keys = torch.randint(0, 1 << 40, (fill,), generator=g)
        tids = torch.randint(0, args.tables, (fill,), generator=g)
        for t in tables.values():
            t.insert(keys, tids, scores=step, list_evicted=False)
        step += 1
    batches = list(first.export())
    stored_keys = torch.cat([b.keys for b in batches])
    stored_tids = torch.cat([b.table_ids for b in batches])
    ms = {v: [] for v in variants}
    evicting = {v: 0 for v in variants}
    for c in range(args.calls):
        pick = torch.randint(0, stored_keys.numel(), (args.stored,), generator=g)
        keys = torch.cat([stored_keys[pick], torch.randint(0, 1 << 40, (args.new,), generator=g)])
        tids = torch.cat([stored_tids[pick], torch.randint(0, args.tables, (args.new,), generator=g)])
        perm = torch.randperm(keys.numel(), generator=g)
        keys, tids = keys[perm], tids[perm]
        order = list(variants) if c % 2 == 0 else list(reversed(variants))
        for v in order:
            s = time.perf_counter()
            out = tables[v].insert(keys, tids, scores=step, list_evicted=False, hold_stored=variants[v])
            ms[v].append((time.perf_counter() - s) * 1e3)
            evicting[v] += int((out.results == 2).sum())
        step += 1
    rows = [[v, f"{statistics.median(ms[v]):.2f}", f"{min(ms[v]):.2f}", evicting[v] // args.calls] for v in variants]
    print(f"[replay_evicting_insert] {args.tables} tables x {args.slots} slots at load "
          f"{first.load_factor():.3f}, {args.stored} stored + {args.new} new keys a call, {args.threads} thread(s)")
    print(format_table(["variant", "median ms", "min ms", "evicting keys a call"], rows))
    return write_json(args.out, {"benchmark": "replay_evicting_insert", "config": vars(args),
                                 "env": env_info(torch.device("cpu")), "ms_per_call": ms,
                                 "evicting_per_call": {v: evicting[v] / args.calls for v in variants}})


if __name__ == "__main__":
    main()
