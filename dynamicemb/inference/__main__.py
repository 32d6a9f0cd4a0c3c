"""Command line: export a dump for serving, and serve a batch from it.

    python -m dynamicemb.inference export DUMP_DIR OUT.pt2 [--dtype int8] [--tables a b] [--pooling SUM]
    python -m dynamicemb.inference serve OUT.pt2 --input BATCH [--output OUT.pt]

export writes a torch.export program of the dump's tables (TBE-layout
inputs: values, offsets [F * B + 1] with features in the order printed;
dynamic batch size and id count). serve loads it (importing only torch and
dynamicemb) and runs one batch: BATCH is a JSON file {"values": [...],
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
    torch.export.save(export(m), args.out, extra_files={META: json.dumps(meta)})
    print(f"exported {sum(meta['keys'].values())} keys of tables {m.table_names} ({args.dtype}, "
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
    extra = {META: ""}
    program = torch.export.load(args.program, extra_files=extra)
    meta = json.loads(extra[META] or "{}")
    out = program.module()(*_read_batch(args.input))
    if args.output:
        torch.save(out, args.output)
    torch.set_printoptions(precision=4, threshold=64, edgeitems=3)
    print(f"output {tuple(out.shape)} ({', '.join(f'{f}: {d}' for f, d in zip(meta.get('features', []), meta.get('dims', [])))})")
    print(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynamicemb.inference", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="export a dump's tables as a torch.export program")
    e.add_argument("dump")
    e.add_argument("out")
    e.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
    e.add_argument("--tables", nargs="+", default=None, help="tables to export (default: all), in this order")
    e.add_argument("--pooling", default=None, choices=["SUM", "MEAN", "NONE"],
                   help="pooling of every table (default: the dump's)")
    e.add_argument("--weighted", action="store_true", help="the program takes per-id weights")
    s = sub.add_parser("serve", help="run one batch through an exported program")
    s.add_argument("program")
    s.add_argument("--input", required=True)
    s.add_argument("--output", default=None, help="torch.save the output here")
    args = p.parse_args(argv)
    (_export if args.cmd == "export" else _serve)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
