"""Refused at the door under DMP (issue 35 §2): a KeyedJaggedTensor whose
ids are not integers, or whose weights are not finite or not floating point
(TorchRec's kernels ignore integer weights on one rank and fail on several;
the routing's cast would have weighed the ids by them), is a named error
before the input dist casts or routes anything; nothing is stored. An
EmbeddingCollection ignores integer weights, as TorchRec's ignores any."""
import torch
import torchrec

import models
from dynamicemb.stats import table_stats
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]


def _model(kind, pg):
    configs = models.configs_of(kind, TABLES, dim=8, num_embeddings=64)
    return models.build(kind, configs, pg, models.dynamic_constraints(TABLES), models.SGD)


def _models(kinds):
    """(kind, a model of it over this rank, a batch) for each kind."""
    pg = models.rank_groups()[0]
    return [(kind, _model(kind, pg), models.random_batch(FEATURES, 4, 64, seed=0)) for kind in kinds]


def _message(call, *args):
    """The message of the ValueError call(*args) raises; None if it returns."""
    try:
        call(*args)
    except ValueError as e:
        return str(e)
    return None


def _refused(rank, world):
    got = {}
    for kind, model, batch in _models(("weighted_ebc", "ec")):
        good = models.kjt(batch, weighted=kind == "weighted_ebc")
        bad_ids = torchrec.KeyedJaggedTensor(keys=FEATURES, values=good.values().to(torch.float32),
                                             lengths=good.lengths(), weights=good.weights_or_none())
        cases = {"float ids": bad_ids}
        if kind == "weighted_ebc":
            w = good.weights().clone()
            w[-1] = float("nan")
            cases["nan weight"] = torchrec.KeyedJaggedTensor(keys=FEATURES, values=good.values(),
                                                             lengths=good.lengths(), weights=w)
            cases["int weights"] = torchrec.KeyedJaggedTensor(keys=FEATURES, values=good.values(),
                                                              lengths=good.lengths(), weights=good.values() % 3 + 2)
        for what, features in cases.items():
            try:
                model(features)
                got[f"{kind}/{what}"] = None
            except (TypeError, ValueError) as e:
                got[f"{kind}/{what}"] = f"{type(e).__name__}: {e}"
        got[f"{kind}/stored"] = sum(s["size"] for s in table_stats(model).values())
        models.loss_of(models.resolved(model(good))).backward()  # a good batch still trains
        got[f"{kind}/stored after a good batch"] = sum(s["size"] for s in table_stats(model).values())
        if kind == "ec":  # integer weights ignored: the same output as without them
            plain = models.resolved(model.eval()(good))
            weighed = models.resolved(model(torchrec.KeyedJaggedTensor(
                keys=FEATURES, values=good.values(), lengths=good.lengths(), weights=good.values() % 3 + 2)))
            got["ec/int weights ignored"] = all(torch.equal(plain[f].values(), weighed[f].values()) for f in FEATURES)
            got["ec/rows read"] = float(sum(plain[f].values().abs().sum() for f in FEATURES))
    return got


def test_dmp_refuses_float_ids_and_nan_or_integer_weights():
    got = run_ranks(_refused, 1)[0]
    for kind in ("weighted_ebc", "ec"):
        assert got[f"{kind}/float ids"] == (f"TypeError: dynamicemb (input dist): ids of features {FEATURES} must "
                                            f"be int64 or int32, got torch.float32")
        assert got[f"{kind}/stored"] == 0 and got[f"{kind}/stored after a good batch"] > 0
    assert got["weighted_ebc/int weights"] == (f"TypeError: dynamicemb (input dist): per-sample weights of "
                                               f"features {FEATURES} must be floating point, got torch.int64: cast "
                                               f"them (weights.float()) or leave them out")
    assert got["ec/int weights ignored"] and got["ec/rows read"] > 0
    msg = got["weighted_ebc/nan weight"]
    assert msg.startswith("ValueError: dynamicemb (input dist): per-sample weight ") and \
        "(feature 'b_feature', bag 3) is nan; weights must be finite" in msg, msg


def _reordered(rank, world):
    got = {}
    for kind, model, batch in _models(("ebc", "ec")):
        models.loss_of(models.resolved(model(models.kjt(batch)))).backward()
        swapped = models.kjt({f: batch[f] for f in reversed(FEATURES)})
        before = table_stats(model)
        got[kind] = _message(model, swapped)
        got[f"{kind}/missing"] = _message(model, models.kjt({FEATURES[1]: batch[FEATURES[1]]}))
        got[f"{kind}/unchanged"] = table_stats(model) == before
        extra = models.kjt(dict(batch, c_feature=[[1]] * 4))  # a feature appended: ignored, as TorchRec does
        models.loss_of(models.resolved(model(extra))).backward()
    return got


def test_a_batch_with_its_features_in_another_order_is_refused():
    """TorchRec reads features by position from the first batch on: swapped,
    a's ids went to b_table and b's to a_table, without a word."""
    got = run_ranks(_reordered, 1)[0]
    for kind in ("ebc", "ec"):
        how = (f"TorchRec reads a KJT's features by position from the first batch on, so its ids would feed "
               f"other tables or none: build every batch's KeyedJaggedTensor with the same keys in the same order "
               f"(an empty feature: lengths of 0)")
        assert got[kind] == (f"dynamicemb (input dist): the batch has the first batch's features in another "
                             f"order: its features are {FEATURES[::-1]}, the first batch's {FEATURES}; {how}"), got[kind]
        assert got[f"{kind}/missing"] == (f"dynamicemb (input dist): the batch lacks the features {FEATURES[:1]} "
                                          f"of the first batch: its features are {FEATURES[1:]}, the first batch's "
                                          f"{FEATURES}; {how}"), got[f"{kind}/missing"]
        assert got[f"{kind}/unchanged"]


def _bad_lengths(rank, world):
    model = _model("weighted_ebc", models.rank_groups()[0])
    good = models.kjt(models.random_batch(FEATURES, 4, 64, seed=1, max_len=2), weighted=True)
    lengths = good.lengths().clone()
    lengths[5], lengths[6] = lengths[5] + 1, -1  # bag 2 of b_feature (4 bags a feature)
    cases = {"negative length": torchrec.KeyedJaggedTensor(keys=FEATURES, values=good.values(), lengths=lengths,
                                                           weights=good.weights()),
             "short weights": torchrec.KeyedJaggedTensor(keys=FEATURES, values=good.values(), lengths=good.lengths(),
                                                         weights=good.weights()[:-1])}
    return {what: _message(model, kjt) for what, kjt in cases.items()}


def test_bad_lengths_and_weights_name_the_feature():
    got = run_ranks(_bad_lengths, 1)[0]
    assert got["negative length"] == "dynamicemb (input dist): feature 'b_feature' has a negative length in bag 2"
    assert got["short weights"].startswith(f"dynamicemb (input dist): features {FEATURES}: ") and \
        got["short weights"].endswith("give one weight per id"), got["short weights"]


def _index_dedup(rank, world):
    import warnings
    from torchrec.distributed.types import ShardingEnv
    from dynamicemb.shard import DynamicEmbeddingCollectionSharder
    pg = models.rank_groups()[0]
    configs = models.ec_configs(TABLES, dim=8, num_embeddings=64)
    module = torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = models.shard(module, configs, 1, models.dynamic_constraints(TABLES), models.SGD,
                             env=ShardingEnv.from_process_group(pg),
                             ec_sharder=DynamicEmbeddingCollectionSharder(fused_params=models.SGD, use_index_dedup=True))
    models.loss_of(models.resolved(model(models.kjt(models.random_batch(FEATURES, 4, 64, seed=0))))).backward()
    return [str(w.message) for w in caught if "use_index_dedup" in str(w.message)]


def test_index_dedup_is_ignored_on_the_cpu():
    """NVIDIA's example shards with use_index_dedup=True: on the CPU the
    first forward failed in a CUDA-only fbgemm op (jagged_unique_indices)."""
    assert run_ranks(_index_dedup, 1)[0] == [
        "DynamicEmbeddingCollectionSharder: use_index_dedup=True is ignored on the CPU (TorchRec's index dedup runs "
        "a CUDA-only fbgemm op; dynamic tables deduplicate their ids anyway)"]
