"""Command line: export a dump for serving, and serve a batch from it.

    python -m dynamicemb.inference export DUMP_DIR OUT.pt2 [--dtype int8] [--tables a b] [--pooling SUM]
    python -m dynamicemb.inference save DUMP_DIR OUT.safetensors [same options as export]
    python -m dynamicemb.inference serve OUT.pt2|OUT.safetensors --input BATCH [--output OUT.pt] [--no-mmap]
    python -m dynamicemb.inference package DUMP_DIR OUT.pt2 [--dtype int8] [--tables a b] [--pooling SUM]
    python -m dynamicemb.inference requests DUMP_DIR OUT.safetensors [--count 64] [--batch 32]

export writes a torch.export program of the dump's tables (TBE-layout
inputs: values, offsets [F * B + 1] with features in the order printed;
dynamic batch size and id count); save writes the tables as one file that
serve memory-maps (InferenceEmbeddingTable.load: rows read in place through
the page cache, for tables larger than memory). serve loads either (importing
only torch and dynamicemb) and runs one batch: BATCH is a JSON file {"values": [...],
"offsets": [...], "weights": [...] (optional)} or a torch.save'd tuple.
package compiles the same program with AOTInductor into a package that a
C++ program serves with libtorch and dynamicemb's ops library, no Python
(examples/serve_cpp). requests writes sample batches of the dump's keys
for it (a safetensors file, dynamicemb.inference.request_files).
DUMP_DIR may also be a torch.distributed.checkpoint directory of
model.state_dict() (its dynamic tables, read in this one process).
"""
import argparse
import json
import sys

import torch

META = "dynamicemb.json"


def _from_dump(args):
    from dynamicemb.inference.table import InferenceEmbeddingTable
    given = {} if args.weighted is None else {"is_weighted": args.weighted}  # (default: the dump's)
    m = InferenceEmbeddingTable.from_dump(args.dump, table_names=args.tables, dtype=args.dtype,
                                          pooling=args.pooling, **given)
    meta = {"features": m.feature_names, "dims": m.feature_dims, "tables": m.table_names, "dtype": args.dtype,
            "keys": m.num_keys(), "weighted": m.is_weighted}
    return m, meta


def _describe(m, meta, what: str, out: str) -> None:
    print(f"{what} {sum(meta['keys'].values())} keys of tables {m.table_names} ({meta['dtype']}, "
          f"{m.memory_bytes() / 2**20:.1f} MiB) to {out}")
    print(f"inputs: values, offsets [F * B + 1] with features {m.feature_names} (dims {m.feature_dims})"
          + (", per-id weights" if m.is_weighted else ""))


def _export(args) -> None:
    from dynamicemb.inference.export import export
    m, meta = _from_dump(args)
    torch.export.save(export(m), args.out, extra_files={META: json.dumps(meta)})
    _describe(m, meta, "exported", args.out)


def _save(args) -> None:
    m, meta = _from_dump(args)
    m.save(args.out)
    _describe(m, meta, "saved", args.out)


def _package(args) -> None:
    from dynamicemb.inference.export import example_inputs, package
    m, meta = _from_dump(args)
    package(m, example_inputs(m), args.out, metadata={META: json.dumps(meta)})
    _describe(m, meta, "packaged (AOTInductor)", args.out)


def _requests(args) -> None:
    from dynamicemb.inference.request_files import sample_requests, save_requests
    m, _ = _from_dump(args)
    batches = sample_requests(m, args.count, args.batch, args.ids_per_bag, args.miss, seed=args.seed)
    save_requests(args.out, batches)
    print(f"wrote {args.count} requests of batch {args.batch} (features {m.feature_names}"
          + (", per-id weights" if m.is_weighted else "") + f") to {args.out}")


def _integers(path: str, raw: dict, field: str) -> torch.Tensor:
    """raw[field] as int64, refusing what is not a list of integers (a float id
    would be truncated into another key, as the Python API refuses it)."""
    items = raw[field]
    bad = next((v for v in items if not isinstance(v, int) or isinstance(v, bool)), None) \
        if isinstance(items, list) else items
    if bad is not None:
        raise SystemExit(f"{path}: {field!r} must be a list of integers, got {bad!r}")
    return torch.tensor(items, dtype=torch.int64)


def _read_batch(path: str) -> tuple:
    if path.endswith(".json"):
        with open(path) as f:
            raw = json.load(f)
        batch = tuple(_integers(path, raw, field) for field in ("values", "offsets"))
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

    def from_dump(name, help):
        e = sub.add_parser(name, help=help)
        e.add_argument("dump", help="a DynamicEmbDump directory, or a torch.distributed.checkpoint one")
        e.add_argument("out")
        e.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
        e.add_argument("--tables", nargs="+", default=None, help="tables to export (default: all), in this order")
        e.add_argument("--pooling", default=None, choices=["SUM", "MEAN", "NONE"],
                       help="pooling of every table (default: the dump's)")
        e.add_argument("--weighted", action=argparse.BooleanOptionalAction, default=None,
                       help="whether the program takes per-id weights (default: as the dump's collection)")
        return e

    from_dump("export", "export a dump's tables as a torch.export program")
    from_dump("save", "save a dump's tables as one file that serve memory-maps")
    from_dump("package", "compile a dump's tables into an AOTInductor package (served from C++: examples/serve_cpp)")
    r = from_dump("requests", "write sample requests of a dump's keys for the C++ client (safetensors)")
    r.add_argument("--count", type=int, default=64, help="requests")
    r.add_argument("--batch", type=int, default=32, help="samples per request")
    r.add_argument("--ids-per-bag", type=int, default=4, help="mean ids per bag (0 to twice this)")
    r.add_argument("--miss", type=float, default=0.1, help="fraction of random (mostly missing) keys")
    r.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("serve", help="run one batch through an exported program or a saved table")
    s.add_argument("program", help="OUT.pt2 (export) or OUT.safetensors (save)")
    s.add_argument("--input", required=True)
    s.add_argument("--output", default=None, help="torch.save the output here")
    s.add_argument("--no-mmap", action="store_true", help="read a saved table into memory instead of mapping it")
    args = p.parse_args(argv)
    {"export": _export, "save": _save, "package": _package, "requests": _requests, "serve": _serve}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
