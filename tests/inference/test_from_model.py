"""An InferenceEmbeddingTable built from a trained sharded model (to_inference)
or from its dump (any world size) answers as the model does in eval: a
weighted or plain EBC mixing dynamic and native tables, SUM and MEAN, and an
EC; missing keys, empty bags. The reference is the TorchRec model itself."""

import pytest
import torch
import torchrec

import models
from ckpt_helpers import run_ranks
from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.inference import InferenceEmbeddingTable
from dynamicemb.inference.convert import to_inference

DYNAMIC = ["a_table", "b_table"]
FEATURES = ["a_feature", "b_feature", "n_feature"]
DIMS = {"a_table": 8, "b_table": 4, "n_table": 8}
B = 6  # samples per rank
# kind: (collection, pooling of b_table, native table n_table in it). TorchRec
# 1.8's own sharded EBC would divide n_table's SUM outputs by their bag lengths
# beside a MEAN table; ours does not ("native_mean").
KINDS = {"weighted_mean": ("weighted_ebc", torchrec.PoolingType.MEAN, False),
         "mean": ("ebc", torchrec.PoolingType.MEAN, False),
         "native": ("weighted_ebc", torchrec.PoolingType.SUM, True),
         "native_mean": ("ebc", torchrec.PoolingType.MEAN, True),
         "ec": ("ec", None, True)}


def _tables(kind):
    return DYNAMIC + ["n_table"] if KINDS[kind][2] else DYNAMIC


def _configs(kind):
    collection, b_pooling, _ = KINDS[kind]
    if collection == "ec":
        return models.ec_configs(_tables(kind), dim=8, num_embeddings=512)
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIMS[n], num_embeddings=512,
                                        feature_names=[n.replace("table", "feature")],
                                        pooling=b_pooling if n == "b_table" else torchrec.PoolingType.SUM)
            for n in _tables(kind)]


def _eval_batch(rank, world, kind):
    """This rank's samples of an eval batch: trained and never-seen keys (the
    dynamic tables' missing keys read zeros), empty bags."""
    features = [t.replace("table", "feature") for t in _tables(kind)]
    batch = models.random_batch(features, B * world, 400, seed=99, max_len=4)
    return models.kjt(batch, slice(rank * B, (rank + 1) * B), weighted=KINDS[kind][0] == "weighted_ebc")


def _values(out):
    out = models.resolved(out)
    if isinstance(out, torchrec.KeyedTensor):
        return out.keys(), out.values()
    return sorted(out), torch.cat([out[f].values() for f in sorted(out)]), \
        torch.cat([out[f].lengths() for f in sorted(out)])


def _train(rank, world, kind, dump_dir):
    pg = models.rank_groups()[0]
    model = models.build(KINDS[kind][0], _configs(kind), pg, models.dynamic_constraints(DYNAMIC), models.SGD)
    features = [t.replace("table", "feature") for t in _tables(kind)]
    for step in range(3):
        batch = models.random_batch(features, B * world, 300, seed=step)
        models.loss_of(model(models.kjt(batch, models.local_samples(B * world, pg),
                                        weighted=KINDS[kind][0] == "weighted_ebc"))).backward()
    model.eval()
    kjt = _eval_batch(rank, world, kind)
    expected = _values(model(kjt))
    inference = to_inference(model)
    got = _values(inference(kjt))
    DynamicEmbDump(dump_dir, model, pg=pg)
    return expected, got


def _reload(rank, world, kind, src, dst):
    """The dump loaded into a model on `world` ranks, and dumped again."""
    pg = models.rank_groups()[0]
    model = models.build(KINDS[kind][0], _configs(kind), pg, models.dynamic_constraints(DYNAMIC), models.SGD)
    DynamicEmbLoad(src, model, pg=pg)
    DynamicEmbDump(dst, model, pg=pg)


def _assert_same(a, b, exact):
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
def test_to_inference_and_dumps_match_eval(tmp_path, kind):
    dump2 = str(tmp_path / "dump2")
    ranks = run_ranks(_train, 2, kind, dump2)
    for expected, got in ranks:
        # RW sums partial bags per rank before the reduce: equal to float rounding.
        _assert_same(expected, got, exact=False)
    # From the 2-rank dump, and from the same tables dumped by 1 rank: the
    # dynamic tables only (native tables are not in dumps).
    dump1 = str(tmp_path / "dump1")
    run_ranks(_reload, 1, kind, dump2, dump1)
    weighted = KINDS[kind][0] == "weighted_ebc"
    # Whether ids are weighted comes from the dump (the collection the tables were trained in).
    mods = [InferenceEmbeddingTable.from_dump(d, table_names=DYNAMIC) for d in (dump2, dump1)]
    assert [m.is_weighted for m in mods] == [weighted, weighted]
    for rank, (expected, _) in enumerate(ranks):
        kjt = _eval_batch(rank, 2, kind)
        outs = [_values(m(kjt)) for m in mods]
        _assert_same(outs[0], outs[1], exact=True)
        # The dump's tables answer as the model's for their features.
        if kind != "ec":
            keys, vals = expected
            cols, c = {}, 0
            for k in keys:
                d = DIMS[k.replace("feature", "table")]
                cols[k] = vals[:, c:c + d]
                c += d
            got = torch.cat([cols[f] for f in outs[0][0]], 1)
            torch.testing.assert_close(outs[0][1], got, rtol=1e-6, atol=1e-6)
