"""A bare BatchedDynamicEmbeddingTables (no TorchRec) frozen two ways, from
its dump and by to_inference: the same outputs as the module in eval, bit for
bit in float32, missing keys reading the eval initializer (a random one too:
a pure function of seed, table and key)."""
import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbInitializerArgs,
                        DynamicEmbInitializerMode, DynamicEmbTableOptions, EmbOptimType)
from dynamicemb.checkpoint import CheckpointError
from dynamicemb.inference import InferenceEmbeddingTable
from dynamicemb.inference.convert import to_inference

M = DynamicEmbInitializerMode


def _module(pooling):
    opts = [DynamicEmbTableOptions(dim=d, max_capacity=4096, eval_initializer_args=init)
            for d, init in ((8, DynamicEmbInitializerArgs(mode=M.NORMAL, std_dev=0.1)),
                            (8 if pooling == "NONE" else 5, DynamicEmbInitializerArgs(mode=M.CONSTANT, value=0.25)))]
    m = BatchedDynamicEmbeddingTables(opts, table_names=["x", "y"], feature_table_map=[0, 1, 0], pooling_mode=pooling,
                                      optimizer=EmbOptimType.ADAM, learning_rate=0.05, seed=7)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # training: keys inserted, rows updated
        idx = torch.randint(0, 500, (60,), generator=g)
        m(idx, torch.arange(0, 61, 5)).sum().backward()
    return m.eval()


@pytest.mark.parametrize("pooling", ["SUM", "MEAN", "NONE"])
def test_dump_and_to_inference_equal_eval(tmp_path, pooling):
    m = _module(pooling)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 1000, (45,), generator=g)  # half the keys never seen: eval initial values
    offsets = torch.tensor([0, 3, 3, 10, 15, 20, 22, 30, 33, 45])  # 3 features x 3 bags, an empty one
    want = m(idx, offsets)
    frozen = to_inference(m)
    assert isinstance(frozen, InferenceEmbeddingTable)
    assert torch.equal(frozen(idx, offsets), want)
    DynamicEmbDump(str(tmp_path / "d"), m)
    # The dump knows tables, not the module's feature map: one feature per table here.
    loaded = InferenceEmbeddingTable.from_dump(str(tmp_path / "d"), mean_divisor="length")
    for t, name in enumerate(["x", "y"]):
        sel = [f for f, tt in enumerate([0, 1, 0]) if tt == t]
        parts = [idx[offsets[f * 3]:offsets[(f + 1) * 3]] for f in sel]
        sub_off = torch.cat([torch.zeros(1, dtype=torch.int64)] +
                            [offsets[f * 3 + 1:(f + 1) * 3 + 1] - offsets[f * 3] for f in sel])
        for j in range(1, len(sel)):  # chain the features' bags
            lo = 1 + 3 * j
            sub_off[lo:lo + 3] += sub_off[lo - 1]
        alone = InferenceEmbeddingTable.from_dump(str(tmp_path / "d"), table_names=[name], mean_divisor="length",
                                                  feature_names={name: [f"{name}{j}" for j in range(len(sel))]})
        got = alone(torch.cat(parts), sub_off)
        if pooling == "NONE":  # the rows of this table's ids
            expected = torch.cat([want[offsets[f * 3]:offsets[(f + 1) * 3]] for f in sel])
        else:  # this table's features' columns
            cols = torch.split(want, frozen.feature_dims, 1)
            expected = torch.cat([cols[f] for f in sel], 1)
        assert got.numel() > 0 and torch.equal(got, expected)
    assert loaded.table_names == ["x", "y"]


def test_from_dump_keeps_the_models_table_order(tmp_path):
    """Tables named out of alphabetical order: the dump serves them in the
    model's order, so its TBE layout input reads as the model's does."""
    opts = [DynamicEmbTableOptions(dim=4, max_capacity=1024), DynamicEmbTableOptions(dim=4, max_capacity=1024)]
    m = BatchedDynamicEmbeddingTables(opts, table_names=["user", "item"], optimizer=EmbOptimType.EXACT_SGD,
                                      learning_rate=0.5)
    idx, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 4])  # user [1, 2], item [3, 4]
    m(idx, offsets).sum().backward()
    DynamicEmbDump(str(tmp_path / "d"), m.eval())
    loaded = InferenceEmbeddingTable.from_dump(str(tmp_path / "d"))
    assert loaded.table_names == ["user", "item"]
    assert torch.equal(loaded(idx, offsets), m(idx, offsets))


def test_from_dump_refuses_a_table_it_does_not_hold(tmp_path):
    m = _module("SUM")
    DynamicEmbDump(str(tmp_path / "d"), m)
    with pytest.raises(CheckpointError, match="table 'z'.*has no such table"):
        InferenceEmbeddingTable.from_dump(str(tmp_path / "d"), table_names=["z"])
    with pytest.raises(CheckpointError, match="no checkpoint"):
        InferenceEmbeddingTable.from_dump(str(tmp_path / "missing"))
    # Names given wrong are refused, not read otherwise: a string (letter by
    # letter), none, one twice, features for a table not served, no features.
    for kwargs, error, match in (
            (dict(table_names="x"), TypeError, r"table_names must be a list of table names, got the string 'x'"),
            (dict(table_names=[]), ValueError, r"\(tables \['x', 'y'\]\): table_names is empty"),
            (dict(table_names=["x", "x"]), ValueError, r"table_names names \['x'\] more than once"),
            (dict(feature_names={"z": ["q"]}), ValueError, r"feature_names names table 'z', which is not among"),
            (dict(table_names=["x"], feature_names={"y": ["q"]}), ValueError, r"feature_names names table 'y'"),
            (dict(feature_names={"x": []}), ValueError, r"feature_names\['x'\] must be a non-empty list")):
        with pytest.raises(error, match=match):
            InferenceEmbeddingTable.from_dump(str(tmp_path / "d"), **kwargs)
