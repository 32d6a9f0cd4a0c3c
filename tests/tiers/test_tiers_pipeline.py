"""TorchRec's prefetch pipeline over cached dynamic tables
(dynamicemb.shard.PrefetchTrainPipelineSparseDist: TorchRec's, with a
prefetch stage that also runs on CPU). The pipeline prefetches batch i+1
between the forward and the backward of batch i; our lookups pass that to
the kernel, which moves the batch's rows from the backing store into the
cache. Step by step the pipeline gives what a plain loop over all-in-memory
tables gives (logits, dense parameters, rows and optimizer state), EBC on 1
and 2 ranks, EC on 2, SGD and Adam; and every forward lookup of a key stored
before was a cache hit: the only misses are new keys."""
import pytest
import torch
from torchrec.datasets.utils import Batch

import dynamicemb
import tiered_dmp as td
from dynamicemb.shard import PrefetchTrainPipelineSparseDist
from tiered_dmp import models, run_ranks


def _batches(pg):
    out = []
    for step, batch in enumerate(td.zipf_batches()):
        labels = torch.tensor([float((step + i) % 3 == 0) for i in range(td.BATCH)])
        mine = models.local_samples(td.BATCH, pg)
        out.append(Batch(dense_features=torch.zeros(td.BATCH // pg.size(), 1),
                         sparse_features=td.local_kjt(batch, pg), labels=labels[mine]))
    return out


def _lookups():
    """Per table, the forward lookups summed over ranks: each step, the
    distinct keys of the global batch (each key is looked up by its owner)."""
    batches = td.zipf_batches()
    return {t: sum(len({k for bag in b[f] for k in bag}) for b in batches) for t, f in zip(td.TABLES, td.FEATURES)}


def _build(kind, pg, fused, **cache):
    model = td.build(kind, pg, fused, wrap=td.SparseDenseModel, **cache)
    dense = [p for n, p in model.named_parameters() if "dense" in n]
    assert len(dense) == 2, [n for n, _ in model.named_parameters()]
    return model, torch.optim.SGD(dense, lr=0.05)


def _pipeline_equals_plain_loop(rank, world, optimizer):
    fused = td.OPTIMIZERS[optimizer]
    lookups = _lookups()
    checked = []
    for pg in td.process_groups():
        batches = _batches(pg)
        for kind in ("ebc", "ec") if pg.size() > 1 else ("ebc",):  # EC: the same kernel path
            what = f"{kind}/{optimizer}/{pg.size()} ranks"
            ref, opt = _build(kind, pg, fused)
            ref_logits = models.train_steps(ref, opt, batches)

            cached, opt = _build(kind, pg, fused, cache_rows=td.CACHE_ROWS)
            pipeline = PrefetchTrainPipelineSparseDist(cached, opt, torch.device("cpu"))
            it = iter(batches)
            logits = [pipeline.progress(it) for _ in batches]
            with pytest.raises(StopIteration):
                pipeline.progress(it)

            for step, (a, b) in enumerate(zip(logits, ref_logits)):
                assert torch.equal(a, b), f"{what}: step {step} logits differ"
            for (n, p), (_, q) in zip(cached.named_parameters(), ref.named_parameters()):
                assert torch.equal(p, q), f"{what}: {n} differs"
            td.assert_same_rows(cached, ref, pg, what)
            stats = dynamicemb.table_stats(cached, pg)
            for t in td.TABLES:
                s = stats[t]
                assert s["write_backs"] > 0 and s["store_rows"] > 0 and s["evicted"] == 0, f"{what} {t}: {s}"
                assert s["hits"] + s["misses"] == lookups[t], f"{what} {t}: {s}, {lookups[t]} lookups"
                # Every key stored before its batch was prefetched into the cache.
                assert s["misses"] == s["inserted"] == s["size"] < lookups[t], f"{what} {t}: {s}"
            checked.append(what)
    return checked


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_prefetch_pipeline_trains_as_all_in_memory(optimizer):
    checked = run_ranks(_pipeline_equals_plain_loop, 2, optimizer)
    assert len(checked[0]) == 3 and checked[1] == checked[0][:2]  # rank 0 also ran the 1-rank models
