"""InferenceEmbeddingTable.save / load(mmap=True): the mapped table answers
exactly as the in-memory one (every precision, pooling, weights, missing
keys, the exported program), and a fresh process serves a table 4x larger
than the memory it may use: under a cgroup v2 memory.max where the machine
delegates one, and in any case with its anonymous memory (RssAnon) growing
by less than a quarter of the table's bytes while its lookups touch every
row. The reference is the in-memory table the file was saved from."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from dynamicemb.inference import FrozenTable, InferenceEmbeddingTable
from dynamicemb.inference.export import export
from frozen_tables import random_tables, tbe_batch

HERE = os.path.dirname(os.path.abspath(__file__))


def _tables(seed=0):
    return random_tables(seed)


_batch = tbe_batch



@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("pooling,weighted", [("SUM", True), (["MEAN", "SUM"], False), ("NONE", False)])
def test_round_trip(tmp_path, dtype, pooling, weighted):
    tables = _tables()
    if pooling == "NONE":
        tables[1] = FrozenTable("b", tables[1].keys, torch.randn(1000, 16), ["fc"])
    m = InferenceEmbeddingTable(tables, pooling=pooling, dtype=dtype, is_weighted=weighted, seed=7,
                                feature_order=["fc", "fa", "fb"])
    path = m.save(str(tmp_path / "t.safetensors"))
    mapped, read = InferenceEmbeddingTable.load(path), InferenceEmbeddingTable.load(path, mmap=False)
    for s in range(3):
        batch = _batch(tables, 3, 5, 3, s, weighted)
        want = m(*batch)
        assert torch.equal(mapped(*batch), want) and torch.equal(read(*batch), want)
    assert mapped.extra_repr() == m.extra_repr() and mapped.num_keys() == m.num_keys()
    # A standard safetensors file: the rows as the module holds them.
    with safe_open(path, framework="pt") as f:
        for k, v in m.named_buffers():
            assert torch.equal(f.get_tensor(k), v), k
    # The exported program of the mapped table runs on the mapped buffers, not a copy.
    program = export(mapped).module()
    assert all(b.data_ptr() == mapped.get_buffer(k).data_ptr() for k, b in program.named_buffers())
    assert torch.equal(program(*batch), m(*batch))


def test_not_a_table_file(tmp_path):
    path = str(tmp_path / "x.safetensors")
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2, 2)}, path)
    with pytest.raises(ValueError, match="not an InferenceEmbeddingTable file"):
        InferenceEmbeddingTable.load(path)
    m = InferenceEmbeddingTable(_tables())
    m.save(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="truncated"):
        InferenceEmbeddingTable.load(path)


def _rewrite_header(path, edit):
    """The file at path with its safetensors header (JSON) replaced by edit(header)."""
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(n)), f.read()
    raw = edit(header)
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _config_edit(fn):
    def edit(h):
        cfg = json.loads(h["__metadata__"]["config"])
        fn(cfg)
        h["__metadata__"]["config"] = json.dumps(cfg)
        return h
    return edit


@pytest.mark.parametrize("edit, message", [
    (lambda h: b"{\x8b" + json.dumps(h).encode()[1:], r"its header is not valid JSON"),
    (_config_edit(lambda c: c.pop("table_names")), r"its config lacks \['table_names'\]"),
    (lambda h: {**h, "weight_0": {**h["weight_0"], "shape": [h["weight_0"]["shape"][0] - 1,
                                                             h["weight_0"]["shape"][1]]}},
     r"tensor 'weight_0' of shape .* does not fill its \d+ bytes"),
])
def test_a_damaged_header_is_refused_naming_the_file(tmp_path, edit, message):
    # They raised bare UnicodeDecodeError, KeyError or a reshape error naming no file.
    path = InferenceEmbeddingTable(_tables()).save(str(tmp_path / "x.safetensors"))
    _rewrite_header(path, edit)
    for mmap in (True, False):
        with pytest.raises(ValueError, match=re.escape(path) + ": " + message):
            InferenceEmbeddingTable.load(path, mmap=mmap)


def test_damaged_table_buckets_are_refused_naming_the_file(tmp_path):
    # A garbage layout reached the kernel: "hash table 0 must hold -2314885530818453568 slots".
    import struct
    path = InferenceEmbeddingTable(_tables()).save(str(tmp_path / "x.safetensors"))
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin, _ = json.loads(f.read(n))["table_buckets"]["data_offsets"]
        f.seek(8 + n + begin)
        f.write(b"\x7f" * 16)
    with pytest.raises(ValueError, match=re.escape(path) + r": its table_buckets .* do not lay out"):
        InferenceEmbeddingTable.load(path)


def _cgroup_v2(limit: int):
    """A child cgroup v2 of this process's own with memory.max = limit, where
    the machine delegates the memory controller to it; else None."""
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))
        parent = os.path.join("/sys/fs/cgroup", own.lstrip("/"))
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            if "memory" not in f.read().split():
                return None
        child = os.path.join(parent, f"dynamicemb-test-{os.getpid()}")
        os.mkdir(child)
        with open(os.path.join(child, "memory.max"), "w") as f:
            f.write(str(limit))
        return child
    except (OSError, StopIteration):
        return None


def _serve(path, requests, out, cgroup):
    def enter():  # in the child, before it imports anything
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    cmd = [sys.executable, os.path.join(HERE, "serve_mapped.py"), path, requests, out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=enter if cgroup else None)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype,dim", [("float32", 64), ("int8", 248)])
def test_serves_a_table_4x_its_memory(tmp_path, dtype, dim):
    # ~70 MiB: 256 bytes a row either way, at up to 3 keys in 4 slots, and the index.
    n = 160 * 1024
    g = torch.Generator().manual_seed(1)
    keys = torch.randperm(8 * n, generator=g)[:n] * 5 + 3
    m = InferenceEmbeddingTable([FrozenTable("big", keys, torch.randn(n, dim, generator=g), ["f"])], dtype=dtype)
    path = m.save(str(tmp_path / "big.safetensors"))
    table_bytes = os.path.getsize(path)
    # Every key once (bags of 16, in random order), and some missing keys; small
    # outputs (batches of 1024 bags), so that the allocator keeps little.
    ids = torch.cat([keys[torch.randperm(n, generator=g)], torch.arange(4096) * 5 + 4])
    batches = [(c, torch.arange(0, c.numel() + 1, 16)) for c in ids.split(16384)]
    torch.save(batches, str(tmp_path / "requests.pt"))
    want = torch.cat([m(v, o).reshape(-1) for v, o in batches])
    del m
    cgroup = _cgroup_v2(300 * 2**20 + table_bytes // 4)  # the interpreter and torch (~300 MiB), a quarter of the table
    try:
        rep = _serve(path, str(tmp_path / "requests.pt"), str(tmp_path / "out.bin"), cgroup)
    finally:
        if cgroup:
            os.rmdir(cgroup)
    got = torch.frombuffer(bytearray(open(tmp_path / "out.bin", "rb").read()), dtype=torch.float32)
    assert torch.equal(got, want)
    grown = rep["most"]["RssAnon"] - rep["before"]["RssAnon"]
    print(f"\n{dtype}: table {table_bytes / 2**20:.1f} MiB, RssAnon grew {grown / 2**20:.1f} MiB (before {rep['before']['RssAnon'] / 2**20:.0f} MiB); RssFile {rep['most']['RssFile'] / 2**20:.0f} MiB")
    assert grown < table_bytes // 4, (grown, table_bytes, rep)


def test_cli_save_and_serve(tmp_path, capsys):
    """A dump -> `save` -> `serve` (mapped, and read), against from_dump's module."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbTableOptions
    from dynamicemb.inference.__main__ import main
    module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024)] * 2,
                                           table_names=["u", "v"], feature_names=[["uf"], ["vf"]])
    module(torch.arange(40), torch.arange(0, 41, 10)).sum().backward()
    dump, table = str(tmp_path / "dump"), str(tmp_path / "t.safetensors")
    DynamicEmbDump(dump, module)
    batch = {"values": [1, 2, 3, 50, 7], "offsets": [0, 2, 3, 3, 5]}
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    main(["save", dump, table, "--dtype", "int8"])
    assert "saved 40 keys" in capsys.readouterr().out
    want = InferenceEmbeddingTable.from_dump(dump, dtype="int8")(torch.tensor(batch["values"]),
                                                                  torch.tensor(batch["offsets"]))
    for extra in ([], ["--no-mmap"]):
        main(["serve", table, "--input", str(tmp_path / "batch.json"), "--output", str(tmp_path / "out.pt")] + extra)
        assert torch.equal(torch.load(tmp_path / "out.pt"), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cuda_mapped_rows(tmp_path, dtype):
    """On CUDA: the index in device memory, the rows read from the registered
    host mapping; the same answers as the table held in device memory."""
    tables = _tables()
    m = InferenceEmbeddingTable(tables, pooling=["MEAN", "SUM"], dtype=dtype, device="cuda")
    path = m.save(str(tmp_path / "t.safetensors"))
    mapped = InferenceEmbeddingTable.load(path, device="cuda")
    assert mapped.slot_keys.is_cuda and mapped.weight_0.is_cuda
    for s in range(3):
        batch = tuple(x.cuda() for x in _batch(tables, 3, 5, 3, s, False))
        assert torch.equal(mapped(*batch), m(*batch))


def test_save_over_a_served_file(tmp_path):
    """Saving over the file a mapped table serves replaces it (rename): the
    served table keeps answering from the old rows, a new load reads the new."""
    old, new = InferenceEmbeddingTable(_tables(0)), InferenceEmbeddingTable(_tables(1))
    path = old.save(str(tmp_path / "t.safetensors"))
    served = InferenceEmbeddingTable.load(path)
    new.save(path)
    batch = _batch(_tables(0), 3, 4, 2, 0, False)
    assert torch.equal(served(*batch), old(*batch))
    assert torch.equal(InferenceEmbeddingTable.load(path)(*batch), new(*batch))
    assert os.listdir(tmp_path) == ["t.safetensors"]
