"""Serving from C++ with no Python: the ops library has no Python dependency;
examples/serve_cpp, built against the installed torch, loads an AOTInductor
package (float32 from the Python API, int8 with per-id weights from a dump
through the CLI) and the ops library, and serves batches of 1 and more ids
bit for bit as the eager InferenceEmbeddingTable does (the reference), from
one thread and from 4 threads sharing the loaded package, also under
ThreadSanitizer."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbTableOptions
from dynamicemb.inference import FrozenTable, InferenceEmbeddingTable, ops_library, package
from dynamicemb.inference.export import example_inputs
from dynamicemb.inference.request_files import load_outputs, load_requests, sample_requests, save_requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "examples", "serve_cpp", "build.sh")
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _build(tsan: bool) -> str:
    """The client's path, built (incrementally) by the example's build script."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:  # cmake is optional (build.sh falls back to one compiler line)
        pytest.skip(f"no C++ compiler to build examples/serve_cpp: {cxx} not found")
    r = subprocess.run(["bash", BUILD], env={**ENV, "PYTHON": sys.executable, "SERVE_CPP_TSAN": str(int(tsan))},
                       capture_output=True, text=True)
    assert r.returncode == 0, f"examples/serve_cpp did not build:\n{r.stdout}\n{r.stderr}"
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def client():
    return _build(tsan=False)


@pytest.fixture(scope="module")
def float32(tmp_path_factory):
    """(eager module, package, requests of batch 1, 64 and 5) from FrozenTables."""
    d = tmp_path_factory.mktemp("float32")
    g = torch.Generator().manual_seed(0)
    tables = [FrozenTable(n, torch.randint(0, 1000, (300,), generator=g).unique(), None, [n + "_f", n + "_g"][:k])
              for n, k in (("a", 2), ("b", 1))]
    for t, dim in zip(tables, (8, 4)):
        t.values = torch.randn(t.keys.numel(), dim, generator=g)
    m = InferenceEmbeddingTable(tables, pooling=["SUM", "MEAN"])
    path = package(m, example_inputs(m), str(d / "lookup.pt2"))
    reqs = [r for b in (1, 64, 5) for r in sample_requests(m, 1, b, seed=b)]
    return m, path, save_requests(str(d / "requests.safetensors"), reqs)


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """The same from a dump of a trained module, packaged (int8, weighted) by the CLI."""
    d = tmp_path_factory.mktemp("int8")
    module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=16, max_capacity=1024),
                                            DynamicEmbTableOptions(dim=4, max_capacity=1024)],
                                           table_names=["u", "v"], feature_names=[["uf"], ["vf"]])
    module(torch.arange(400), torch.arange(0, 401, 10)).sum().backward()  # store 400 keys, one SGD step
    dump, path = str(d / "dump"), str(d / "lookup.pt2")
    DynamicEmbDump(dump, module)
    cli = [sys.executable, "-m", "dynamicemb.inference"]
    subprocess.run(cli + ["package", dump, path, "--dtype", "int8", "--weighted"], check=True, env=ENV,
                   capture_output=True)
    one = str(d / "batch1.safetensors")
    subprocess.run(cli + ["requests", dump, one, "--dtype", "int8", "--weighted", "--count", "2", "--batch", "1"],
                   check=True, env=ENV, capture_output=True)
    m = InferenceEmbeddingTable.from_dump(dump, dtype="int8", is_weighted=True)
    reqs = load_requests(one) + sample_requests(m, 2, 64, ids_per_bag=8, seed=1)
    return m, path, save_requests(str(d / "requests.safetensors"), reqs)


def _serve(client, case, tmp_path, *args, env=None):
    m, pkg, req = case
    out = str(tmp_path / "out.safetensors")
    r = subprocess.run([client, pkg, ops_library(), req, "--out", out, *args], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, f"serve_cpp failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    expected = [m(*x) for x in load_requests(req)]
    return r, load_outputs(out), expected


def _needed(path):
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    ldd = subprocess.run(["ldd", path], capture_output=True, text=True, check=True,
                         env={**os.environ, "LD_LIBRARY_PATH": torch_lib}).stdout
    return [line.split()[0] for line in ldd.strip().split("\n")]


def test_ops_library_has_no_python_dependency():
    lib = ops_library()
    tools = [t for t in ("ldd", "nm") if shutil.which(t) is None]
    if tools:
        pytest.skip(f"{' and '.join(tools)} not found")
    needed = _needed(lib)
    assert "libtorch_cpu.so" in needed and not [n for n in needed if "python" in n], needed
    symbols = subprocess.run(["nm", "-D", lib], capture_output=True, text=True, check=True).stdout.split("\n")
    py = [s for s in symbols if s.split(" ")[-1].lstrip("_").startswith(("Py", "PyInit"))]
    assert not py, f"Python symbols in {lib}: {py[:5]}"


def test_client_links_no_python(client):
    if shutil.which("ldd") is None:
        pytest.skip("ldd not found")
    needed = _needed(client)
    assert "libtorch_cpu.so" in needed and not [n for n in needed if "python" in n], needed


@pytest.mark.parametrize("case", ["float32", "int8"])
def test_serves_the_eager_outputs(client, case, request, tmp_path):
    c = request.getfixturevalue(case)
    r, got, expected = _serve(client, c, tmp_path)
    assert [x.shape[0] for x in expected][:1] == [1] and max(x.shape[0] for x in expected) == 64
    assert len(got[0]) == len(expected)
    for i, (g, e) in enumerate(zip(got[0], expected)):
        assert torch.equal(g, e), f"request {i}: max diff {(g - e).abs().max()}"
    assert "latency ms: p50" in r.stdout
    if case == "int8":  # the CLI's package says what it holds (its metadata)
        assert '"features": ["uf", "vf"]' in r.stdout


def test_four_threads_share_one_package(client, int8, tmp_path):
    r, got, expected = _serve(client, int8, tmp_path, "--threads", "4", "--repeat", "5")
    assert sorted(got) == [0, 1, 2, 3] and "threads agree: yes" in r.stdout
    for t, outs in got.items():
        assert all(torch.equal(g, e) for g, e in zip(outs, expected)), f"thread {t}"


def test_four_threads_under_thread_sanitizer(float32, tmp_path):
    """The client built with -fsanitize=thread (torch, the ops library and the
    package's .so are not instrumented: their own accesses are not checked,
    their locks and allocations are). One intra-op thread: libgomp's
    barriers are invisible to TSan and would be reported as races."""
    tsan = _build(tsan=True)
    env = {**os.environ, "TSAN_OPTIONS": "exitcode=66 halt_on_error=0 report_signal_unsafe=0"}
    r, got, expected = _serve(tsan, float32, tmp_path, "--threads", "4", "--repeat", "3", "--intra-op-threads", "1",
                              env=env)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    assert all(torch.equal(g, e) for outs in got.values() for g, e in zip(outs, expected))
