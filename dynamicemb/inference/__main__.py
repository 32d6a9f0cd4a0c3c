"""Command line: export a dump for serving, and serve a batch from it.

    python -m dynamicemb.inference export DUMP_DIR OUT.pt2 [--dtype int8] [--tables a b] [--pooling SUM]
    python -m dynamicemb.inference save DUMP_DIR OUT.safetensors [same options as export]
    python -m dynamicemb.inference serve OUT.pt2|OUT.safetensors --input BATCH [--output OUT.pt] [--no-mmap]

export writes a torch.export program of the dump's tables (TBE-layout
inputs: values, offsets [F * B + 1] with features in the order printed;
dynamic batch size and id count); save writes the tables as one file that
serve memory-maps (InferenceEmbeddingTable.load: rows read in place through
the page cache, for tables larger than memory). serve loads either (importing
only torch and dynamicemb) and runs one batch: BATCH is a JSON file {"values": [...],
"offsets": [...], "weights": [...] (optional)} or a torch.save'd tuple.
"""
import argparse
import json
import sys

import torch

META = "dynamicemb.json"


def _export(args) -> None:
    from dynamicemb.inference.export import export
    from dynamicemb.inference.table import InferenceEmbeddingTable
    m = InferenceEmbeddingTable.from_dump(args.dump, table_names=args.tables, dtype=args.dtype,
                                          pooling=args.pooling, is_weighted=args.weighted)
    meta = {"features": m.feature_names, "dims": m.feature_dims, "tables": m.table_names, "dtype": args.dtype,
            "keys": m.num_keys(), "weighted": m.is_weighted}
    if args.cmd == "save":
        m.save(args.out)
    else:
        torch.export.save(export(m), args.out, extra_files={META: json.dumps(meta)})
    done = "saved" if args.cmd == "save" else "exported"
    print(f"{done} {sum(meta['keys'].values())} keys of tables {m.table_names} ({args.dtype}, "
          f"{m.memory_bytes() / 2**20:.1f} MiB) to {args.out}")
    print(f"inputs: values, offsets [F * B + 1] with features {m.feature_names} (dims {m.feature_dims})"
          + (", per-id weights" if m.is_weighted else ""))


def _read_batch(path: str) -> tuple:
    if path.endswith(".json"):
        with open(path) as f:
            raw = json.load(f)
        batch = (torch.tensor(raw["values"], dtype=torch.int64), torch.tensor(raw["offsets"], dtype=torch.int64))
        return batch + ((torch.tensor(raw["weights"], dtype=torch.float32),) if "weights" in raw else ())
    return tuple(torch.load(path))


def _serve(args) -> None:
    import dynamicemb  # noqa: F401  (registers the lookup op)
    if args.program.endswith(".safetensors"):
        from dynamicemb.inference.table import InferenceEmbeddingTable
        module = InferenceEmbeddingTable.load(args.program, mmap=not args.no_mmap)
        meta = {"features": module.feature_names, "dims": module.feature_dims}
    else:
        extra = {META: ""}
        module = torch.export.load(args.program, extra_files=extra).module()
        meta = json.loads(extra[META] or "{}")
    out = module(*_read_batch(args.input))
    if args.output:
        torch.save(out, args.output)
    torch.set_printoptions(precision=4, threshold=64, edgeitems=3)
    print(f"output {tuple(out.shape)} ({', '.join(f'{f}: {d}' for f, d in zip(meta.get('features', []), meta.get('dims', [])))})")
    print(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynamicemb.inference", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd, what in (("export", "export a dump's tables as a torch.export program"),
                      ("save", "save a dump's tables as one file that serve memory-maps")):
        e = sub.add_parser(cmd, help=what)
        e.add_argument("dump")
        e.add_argument("out")
        e.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
        e.add_argument("--tables", nargs="+", default=None, help="tables to export (default: all), in this order")
        e.add_argument("--pooling", default=None, choices=["SUM", "MEAN", "NONE"],
                       help="pooling of every table (default: the dump's)")
        e.add_argument("--weighted", action="store_true", help="the program takes per-id weights")
    s = sub.add_parser("serve", help="run one batch through an exported program or a saved table")
    s.add_argument("program", help="OUT.pt2 (export) or OUT.safetensors (save)")
    s.add_argument("--input", required=True)
    s.add_argument("--output", default=None, help="torch.save the output here")
    s.add_argument("--no-mmap", action="store_true", help="read a saved table into memory instead of mapping it")
    args = p.parse_args(argv)
    (_serve if args.cmd == "serve" else _export)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
