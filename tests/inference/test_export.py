"""The exported lookup: torch.export with dynamic batch size (1 included) and
id count, saved, then loaded and run in a fresh process that imports only
torch and dynamicemb; AOTInductor's package gives the same outputs. The
reference is the eager module."""
import os
import subprocess
import sys

import pytest
import torch

from dynamicemb.inference import FrozenTable, InferenceEmbeddingTable
from dynamicemb.inference.export import export, package

_SERVE = r"""
import sys, torch
import dynamicemb  # registers the lookup op
program = torch.export.load(sys.argv[1])
inputs = torch.load(sys.argv[2])
torch.save([program.module()(*x) for x in inputs], sys.argv[3])
assert "torchrec" not in sys.modules, "serving imported torchrec"
"""


def _module(dtype="float32", weighted=False):
    g = torch.Generator().manual_seed(0)
    tables = [FrozenTable(n, torch.randint(0, 1000, (200,), generator=g).unique(), None, [n + "_f"])
              for n in ("a", "b")]
    for t, dim in zip(tables, (8, 4)):
        t.values = torch.randn(t.keys.numel(), dim, generator=g)
    return InferenceEmbeddingTable(tables, pooling=["SUM", "MEAN"], dtype=dtype, is_weighted=weighted)


def _inputs(weighted):
    out = []
    for B, seed in ((1, 0), (3, 1), (7, 2)):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 4, (2 * B,), generator=g)
        values = torch.randint(0, 1200, (int(lengths.sum()),), generator=g)
        x = (values, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        out.append(x + ((torch.rand(values.numel(), generator=g),) if weighted else ()))
    return out


@pytest.mark.parametrize("dtype,weighted", [("float32", False), ("int8", True)])
def test_exported_program_serves_in_a_fresh_process(tmp_path, dtype, weighted):
    m = _module(dtype, weighted)
    path = str(tmp_path / "lookup.pt2")
    torch.export.save(export(m), path)
    inputs = _inputs(weighted)
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", _SERVE, path, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    for x, got in zip(inputs, torch.load(tmp_path / "out.pt")):
        assert torch.equal(got, m(*x))


def test_aot_inductor_package(tmp_path):
    m = _module()
    inputs = _inputs(False)
    loaded = torch._inductor.aoti_load_package(package(m, inputs[1], str(tmp_path / "lookup.pt2")))
    for x in inputs:
        assert torch.equal(loaded(*x), m(*x))


def test_cli_export_and_serve(tmp_path):
    """A dump -> `export` -> `serve` from a shell, against from_dump's module."""
    import json

    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbTableOptions
    module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024)] * 2,
                                           table_names=["u", "v"], feature_names=[["uf"], ["vf"]])
    module(torch.arange(40), torch.arange(0, 41, 10)).sum().backward()  # store 40 keys, one SGD step
    dump = str(tmp_path / "dump")
    DynamicEmbDump(dump, module)
    batch = {"values": [1, 2, 3, 50, 7], "offsets": [0, 2, 3, 3, 5]}
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cli = [sys.executable, "-m", "dynamicemb.inference"]
    out = subprocess.run(cli + ["export", dump, str(tmp_path / "p.pt2"), "--dtype", "int8"], check=True, env=env,
                         capture_output=True, text=True).stdout
    assert "features ['uf', 'vf']" in out
    subprocess.run(cli + ["serve", str(tmp_path / "p.pt2"), "--input", str(tmp_path / "batch.json"), "--output",
                          str(tmp_path / "out.pt")], check=True, env=env, capture_output=True)
    ref = InferenceEmbeddingTable.from_dump(dump, dtype="int8")
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got, ref(torch.tensor(batch["values"]), torch.tensor(batch["offsets"])))
    # The module in eval: equal within int8 rounding.
    torch.testing.assert_close(got, module.eval()(torch.tensor(batch["values"]), torch.tensor(batch["offsets"])),
                               rtol=0, atol=0.02)
    # Float ids are refused by name (they were truncated into other keys: 1.7 served as key 1).
    (tmp_path / "floats.json").write_text(json.dumps({"values": [1.7, 2], "offsets": [0, 1, 1, 1, 2]}))
    bad = subprocess.run(cli + ["serve", str(tmp_path / "p.pt2"), "--input", str(tmp_path / "floats.json")],
                         env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "floats.json: 'values' must be a list of integers, got 1.7" in bad.stderr, bad


def test_exported_program_and_package_refuse_non_finite_weights(tmp_path):
    """The eager module refuses a NaN / inf weight (naming it); the program and
    the package did not (data-dependent): they served NaN rows. A runtime
    assertion of the program refuses them now."""
    m = _module(weighted=True)
    x = _inputs(True)[2]
    loaded = torch._inductor.aoti_load_package(package(m, x, str(tmp_path / "lookup.pt2")))
    for serve in (export(m).module(), loaded):
        assert torch.equal(serve(*x), m(*x))
        for bad in (float("nan"), float("inf")):
            w = x[2].clone()
            w[1] = bad
            with pytest.raises(RuntimeError, match=r"InferenceEmbeddingTable \['a', 'b'\]: per-sample weights "
                                                   r"must be finite \(features \['a_f', 'b_f'\]\)"):
                serve(x[0], x[1], w)


def test_a_kjt_example_that_went_through_a_model_serves_kjts_built_from_lengths(tmp_path):
    """A program's input structure records which fields of an example KJT are
    set. An example that went through a model has its offsets cached, and its
    program refused every request built from lengths (from_lengths_sync), with
    errors that named nothing; the example is now taken as a request builds it."""
    import torchrec

    from dynamicemb.inference.export import export_model
    m = _module()
    features = m.feature_names

    def kjt(lengths, seed):
        g = torch.Generator().manual_seed(seed)
        values = torch.randint(0, 1200, (int(sum(lengths)),), generator=g)
        return torchrec.KeyedJaggedTensor.from_lengths_sync(features, values, torch.tensor(lengths))

    example = kjt([2, 0, 1, 3], seed=0)
    m(example)
    example.offsets()  # cached, as any TorchRec model call leaves it
    requests = [kjt([1, 2, 0, 0, 3, 1], seed=1), kjt([2, 1], seed=2)]  # batch 3, batch 1
    loaded = torch._inductor.aoti_load_package(package(m, (example,), str(tmp_path / "kjt.pt2")))
    for serve in (export_model(m, (example,)).module(), loaded):
        for r in requests:
            got = serve(r)
            assert torch.equal(got.values() if hasattr(got, "values") else got, m(r).values())


def test_cli_export_takes_the_dumps_weighting(tmp_path):
    """A dump of a weighted collection's tables (the sharder records it):
    `export` without --weighted makes a program that takes per-id weights
    (it made an unweighted one, which ignored them)."""
    from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbTableOptions
    module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=1024)],
                                           table_names=["u"], feature_names=[["uf"]])
    module(torch.arange(10), torch.tensor([0, 10])).sum().backward()
    module.is_weighted = True  # as DynamicEmbeddingBagCollectionSharder sets it for a weighted EBC
    dump = str(tmp_path / "dump")
    DynamicEmbDump(dump, module)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "dynamicemb.inference", "export", dump, str(tmp_path / "p.pt2")],
                         check=True, env=env, capture_output=True, text=True).stdout
    assert "features ['uf'] (dims [4]), per-id weights" in out, out
