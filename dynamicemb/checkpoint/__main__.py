"""Inspect a checkpoint: python -m dynamicemb.checkpoint PATH [--no-verify]

Prints the manifest summary (tables, rows per rank, dims, optimizer, sizes)
and verifies every file's size and checksum (exit status 1 if one fails).
Also lists PATH.tmp-* / PATH.old-* siblings: left by dumps that died (or still
being written); delete them when no dump to PATH is running.

Import a dump of NVIDIA dynamicemb: python -m dynamicemb.checkpoint
import-nvidia SRC DST [options] (see import-nvidia --help)."""
import argparse
import os
import sys
import time

from dynamicemb import rules
from dynamicemb.checkpoint.format import MANIFEST, CheckpointError, read_manifest, stale_siblings, verify_files
from dynamicemb.types import strategy_label

_OPTIMIZERS = {o.code: o.name for o in rules.OPTIMIZERS}
_STRATEGIES = {code: strategy_label(code) for code in rules.STRATEGIES}


def _list_stale(path: str) -> None:
    for d in stale_siblings(path):
        try:
            size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(d) for n in ns)
            age = (time.time() - os.path.getmtime(d)) / 3600
        except OSError:  # removed meanwhile
            continue
        what = "a complete dump" if os.path.exists(os.path.join(d, MANIFEST)) else "a partial dump"
        print(f"stale: {d} ({what}, {size / 2**20:.1f} MiB, modified {age:.1f} h ago; "
              f"delete it if no dump to this path is running)")


def import_main(argv) -> int:
    """python -m dynamicemb.checkpoint import-nvidia SRC DST [options]"""
    from dynamicemb.checkpoint.nvidia import import_nvidia

    ap = argparse.ArgumentParser(prog="python -m dynamicemb.checkpoint import-nvidia",
                                 description="Writes the dump NVIDIA dynamicemb's DynamicEmbDump wrote at SRC as a "
                                             "dynamicemb checkpoint at DST (loads on any world size). A "
                                             "per-table option takes VALUE or TABLE=VALUE,TABLE=VALUE.")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--score-strategy", default=None,
                    help="the tables' score strategy (TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION); default: "
                         "the dump's metadata, else TIMESTAMP")
    ap.add_argument("--dist-type", default="hash_roundrobin", help="the target model's dist_type")
    ap.add_argument("--num-embeddings", default=None, help="the tables' num_embeddings (continuous)")
    ap.add_argument("--world-size", type=int, default=None, help="ranks to split the files for (default: the dump's)")
    ap.add_argument("--optimizer", default=None, help="NVIDIA's optimizer (EmbOptimType value) where the dump "
                                                      "does not record it")
    ap.add_argument("--no-optim", action="store_true", help="drop the optimizer state")
    ap.add_argument("--dtype", default=None, help="the target model's embedding dtype (default: the dump's)")
    ap.add_argument("--dim", default=None, help="the dim, for a dump without rows")
    args = ap.parse_args(argv)

    def per_table(v, kind=str):  # "VALUE" or "TABLE=VALUE,TABLE=VALUE"
        if v is None or "=" not in str(v):
            return None if v is None else kind(v)
        return {t: kind(x) for t, x in (p.split("=", 1) for p in str(v).split(","))}
    try:
        m = import_nvidia(args.src, args.dst, score_strategy=per_table(args.score_strategy),
                          dist_type=per_table(args.dist_type), num_embeddings=per_table(args.num_embeddings, int),
                          world_size=args.world_size, optimizer=per_table(args.optimizer), optim=not args.no_optim,
                          dtype=per_table(args.dtype), dim=per_table(args.dim, int))
    except (CheckpointError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = {n: sum(t["rows_per_rank"]) for n, t in m["tables"].items()}
    print(f"{args.dst}: imported {len(rows)} table(s) from {args.src}: "
          + ", ".join(f"{n} ({r} rows)" for n, r in sorted(rows.items())))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "import-nvidia":
        return import_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m dynamicemb.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--no-verify", action="store_true", help="skip the checksums")
    args = ap.parse_args(argv)
    _list_stale(args.path)
    try:
        m = read_manifest(args.path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.path}: dynamicemb checkpoint v{m['format_version']}, dumped by {m['world_size']} rank(s)")
    head = f"{'table':<24}{'rows':>12}  {'rows per rank':<24}{'dim':>5} {'dtype':<9}{'optimizer':<23}{'score':<18}{'dist':<16}{'MiB':>9}"
    print(head)
    for name, t in sorted(m["tables"].items()):
        mib = sum(f["bytes"] for f in t["files"]) / 2**20
        per_rank = ",".join(map(str, t["rows_per_rank"]))
        opt = _OPTIMIZERS.get(t["optimizer"], t["optimizer"]) + ("" if t["has_optimizer_state"] else " (no state)")
        print(f"{name:<24}{sum(t['rows_per_rank']):>12}  {per_rank:<24}{t['dim']:>5} {t['dtype']:<9}{opt:<23}"
              f"{_STRATEGIES.get(t['score_strategy'], t['score_strategy']):<18}{t['dist_type']:<16}{mib:>9.1f}")
    if args.no_verify:
        return 0
    try:
        total = verify_files(args.path, m)
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"verified: {sum(len(t['files']) for t in m['tables'].values())} files, {total / 2**20:.1f} MiB, checksums ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
