"""Serving speed of exported dynamic tables on the CPU.

    bash scripts/dev.sh bench inference [--rows 100000] [--dim 64] [--repeats 30] [--no-cpp]

Batch: 512 samples x 26 features (one table each) x 10 ids per bag, Zipf(1.05)
ids over each table's rows. Compared, on the same rows:
  - dynamicemb exported program (torch.export of InferenceEmbeddingTable), float32 and int8;
  - TorchRec's quantized CPU inference EmbeddingBagCollection (int8, a static table: ids are row numbers);
  - the training module's eval path (BatchedDynamicEmbeddingTables.eval());
  - the same tables saved and memory-mapped (InferenceEmbeddingTable.load(path,
    mmap=True), float32 and int8; int8 with a hot-row cache of a tenth of
    the file, hbm_cache_bytes): warm (pages in the page cache), and cold
    (the file's pages evicted with posix_fadvise(DONTNEED) before each load:
    the first batch after the load);
  - the int8 tables as an AOTInductor package, loaded by Python
    (torch._inductor.aoti_load_package) and served by the C++ client of
    examples/serve_cpp (no Python; built here, --no-cpp skips both: the
    package takes a minute to compile). The client runs in its own process
    after the others, one request at a time, with the same batches and
    intra-op threads; its latencies are its own per-call clock.
Reports ids/s (Mkeys/s = 2^20 ids/s) at the median batch time and p50 / p99
batch latency; writes benchmark/results/inference.json. Target: the int8
program at >= 1.05x the rate of TorchRec's quantized module (issue 39; the
first target, issue 4's, was 0.8x).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

from _common import MKEYS, default_out, env_info, format_table, timed, write_json

FEATURES, BATCH, POOL = 26, 512, 10


def zipf_ids(rows: int, n: int, g: torch.Generator, s: float = 1.05) -> torch.Tensor:
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    p = ranks.pow(-s)
    return torch.multinomial(p / p.sum(), n, replacement=True, generator=g)


def p99(ts):
    return sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))]


def cold_first_batch(path: str, batch, repeats: int) -> list:
    """Seconds of the first batch of a freshly mapped table whose pages were
    evicted from the page cache (as after a restart on a cold machine)."""
    from dynamicemb.inference import InferenceEmbeddingTable
    times = []
    for _ in range(repeats):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the file was fsynced: no dirty page stays
        os.close(fd)
        m = InferenceEmbeddingTable.load(path, mmap=True)
        dt, _ = timed(lambda: m(*batch), torch.device("cpu"))
        times.append(dt)
        del m
    return times


def cpp_client(module, batches, repeats: int, workdir: str) -> dict:
    """The C++ client serving `module` packaged with AOTInductor: {"python":
    the package loaded by Python, "cpp": the client's JSON line}."""
    from dynamicemb.inference import ops_library, package, save_requests
    from dynamicemb.inference.export import example_inputs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = subprocess.run(["bash", os.path.join(root, "examples", "serve_cpp", "build.sh")], capture_output=True,
                           text=True, env={**os.environ, "PYTHON": sys.executable})
    if build.returncode:
        raise RuntimeError(f"examples/serve_cpp did not build:\n{build.stderr}")
    pkg = package(module, example_inputs(module), os.path.join(workdir, "tables.pt2"))
    reqs = save_requests(os.path.join(workdir, "requests.safetensors"), batches)
    loaded = torch._inductor.aoti_load_package(pkg)
    ts = []
    with torch.inference_mode():
        for r in range(repeats + 2):
            dt, out = timed(lambda: loaded(*batches[r % len(batches)]), torch.device("cpu"))
            ts += [dt] if r >= 2 else []
    assert torch.equal(out, module(*batches[(repeats + 1) % len(batches)])), "the package differs from the module"
    run = subprocess.run([build.stdout.split()[-1], pkg, ops_library(), reqs, "--repeat",
                          str(max(1, repeats // len(batches))), "--warmup", "1", "--intra-op-threads",
                          str(torch.get_num_threads()), "--json", "--print", "0"], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"the C++ client failed:\n{run.stdout}\n{run.stderr}")
    return {"python": ts, "cpp": json.loads(run.stdout.strip().splitlines()[-1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cold-repeats", type=int, default=5)
    ap.add_argument("--tmp", default=None, help="where the mapped tables' files go (default: a temporary folder)")
    ap.add_argument("--out", default=default_out("inference"))
    ap.add_argument("--no-cpp", action="store_true", help="leave out the AOTInductor package and the C++ client")
    args = ap.parse_args()
    import torchrec
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
    from dynamicemb.inference import FrozenTable, InferenceEmbeddingTable
    from dynamicemb.inference.export import export

    g = torch.Generator().manual_seed(0)
    names = [f"t{i}" for i in range(FEATURES)]
    weights = [torch.rand(args.rows, args.dim, generator=g) - 0.5 for _ in names]
    # Keys of the dynamic tables: a permutation of a sparse id space; the static table's id is the row.
    keys = [torch.randperm(args.rows, generator=g) * 1_000_003 + 17 for _ in names]
    batches = []
    for r in range(4):
        rows = [zipf_ids(args.rows, BATCH * POOL, g) for _ in names]
        offsets = torch.arange(0, FEATURES * BATCH * POOL + 1, POOL)
        batches.append(dict(
            dyn=(torch.cat([k[i] for k, i in zip(keys, rows)]), offsets),
            static=torchrec.KeyedJaggedTensor.from_offsets_sync([n + "_f" for n in names], torch.cat(rows),
                                                                offsets)))
    n_ids = FEATURES * BATCH * POOL

    progs, modules, mapped, files, file_bytes = {}, {}, {}, {}, {}
    tmp = tempfile.TemporaryDirectory(dir=args.tmp)
    for dtype in ("float32", "int8"):
        m = modules[dtype] = InferenceEmbeddingTable([FrozenTable(n, k, w, [n + "_f"])
                                                      for n, k, w in zip(names, keys, weights)], dtype=dtype)
        progs[dtype] = (export(m).module(), m.memory_bytes())
        files[dtype] = m.save(os.path.join(tmp.name, f"{dtype}.safetensors"))
        file_bytes[dtype] = os.path.getsize(files[dtype])
        mapped[dtype] = InferenceEmbeddingTable.load(files[dtype], mmap=True)
    # A hot-row cache of a tenth of the int8 rows (in ordinary memory on the
    # CPU: what the cache check costs the lookup; on CUDA it saves bus reads).
    mapped["int8 hot"] = InferenceEmbeddingTable.load(files["int8"], mmap=True,
                                                      hbm_cache_bytes=file_bytes["int8"] // 10)
    ebc = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        name=n, embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[n + "_f"]) for n in names])
    with torch.no_grad():
        for n, w in zip(names, weights):
            ebc.embedding_bags[n].weight.copy_(w)
    ebc.qconfig = torch.ao.quantization.QConfig(
        activation=torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.float),
        weight=torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    qebc = QuantEBC.from_float(ebc)
    train = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=args.dim, max_capacity=args.rows * 2)
                                           for _ in names], table_names=names)
    for t, (k, w) in enumerate(zip(keys, weights)):
        train.storage.insert_rows(t, k, w)
    train.eval()

    cases = {
        "dynamicemb program float32": lambda b: progs["float32"][0](*b["dyn"]),
        "dynamicemb program int8": lambda b: progs["int8"][0](*b["dyn"]),
        "torchrec quantized EBC int8 (static)": lambda b: qebc(b["static"]).values(),
        "training module eval (float32)": lambda b: train(*b["dyn"]),
        "mapped float32 (warm)": lambda b: mapped["float32"](*b["dyn"]),
        "mapped int8 (warm)": lambda b: mapped["int8"](*b["dyn"]),
        "mapped int8 + hot-row cache of 10% (warm)": lambda b: mapped["int8 hot"](*b["dyn"]),
    }
    # Same answers where the rows are the same (float32 program vs the training module).
    assert torch.equal(cases["dynamicemb program float32"](batches[0]), cases["training module eval (float32)"](batches[0]))
    times = {k: [] for k in cases}
    dev = torch.device("cpu")
    with torch.inference_mode():
        for r in range(args.repeats + 2):
            for name, fn in cases.items():  # round robin: the cases see the same machine state
                dt, _ = timed(lambda: fn(batches[r % len(batches)]), dev)
                if r >= 2:
                    times[name].append(dt)
        for dtype in ("float32", "int8"):
            times[f"mapped {dtype} (cold: first batch)"] = cold_first_batch(files[dtype], batches[0]["dyn"],
                                                                           args.cold_repeats)
    tmp.cleanup()
    ref = statistics.median(times["torchrec quantized EBC int8 (static)"])
    rows, results = [], {}

    def add(name, med, p99_s, extra):
        results[name] = dict(median_s=med, p50_ms=med * 1e3, p99_ms=p99_s * 1e3, mkeys_per_s=n_ids / med / MKEYS,
                             vs_torchrec_int8=ref / med, **extra)
        rows.append([name, f"{n_ids / med / MKEYS:.1f}", f"{med * 1e3:.2f}", f"{p99_s * 1e3:.2f}", f"{ref / med:.2f}x"])

    for name, ts in times.items():
        add(name, statistics.median(ts), p99(ts), dict(times=ts))
    cpp_note = "C++ client: not run (--no-cpp)"
    if not args.no_cpp:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            cpp_note = "C++ client: not run (no C++ compiler)"
        else:
            with tempfile.TemporaryDirectory() as d:
                c = cpp_client(modules["int8"], [b["dyn"] for b in batches], args.repeats, d)
            add("AOTI package int8, Python-loaded", statistics.median(c["python"]), p99(c["python"]),
                dict(times=c["python"]))
            j = c["cpp"]
            add("AOTI package int8, C++ client (no Python)", j["p50_ms"] / 1e3, j["p99_ms"] / 1e3, dict(cpp=j))
            cpp_note = (f"C++ client: its own process after the others, {j['calls']} calls, {j['intra_op_threads']} "
                        f"intra-op threads, package loaded in {j['load_s']:.2f} s")
    print(f"batch {BATCH} x {FEATURES} features x {POOL} ids, Zipf(1.05) over {args.rows} rows per table, dim "
          f"{args.dim}, {torch.get_num_threads()} threads")
    print(format_table(["case", "Mids/s", "p50 ms", "p99 ms", "vs torchrec int8"], rows))
    print(cpp_note)
    print(f"memory: program float32 {progs['float32'][1] / 2**20:.0f} MiB, int8 {progs['int8'][1] / 2**20:.0f} MiB "
          f"(raw float32 rows {FEATURES * args.rows * args.dim * 4 / 2**20:.0f} MiB); mapped files float32 "
          f"{file_bytes['float32'] / 2**20:.0f} MiB, int8 {file_bytes['int8'] / 2**20:.0f} MiB (in the page cache)")
    ok = results["dynamicemb program int8"]["vs_torchrec_int8"] >= 1.05
    print(f"target (int8 program >= 1.05x torchrec int8): {'met' if ok else 'NOT met'}")
    path = write_json(args.out, dict(env=env_info(dev), config=vars(args), results=results,
                                     memory_bytes={k: v[1] for k, v in progs.items()}, mapped_file_bytes=file_bytes))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
