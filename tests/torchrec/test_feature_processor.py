"""Position-weighted features (TorchRec's FeatureProcessedEmbeddingBagCollection
with a PositionWeightedModuleCollection) over dynamic tables on 2 ranks,
against the unsharded TorchRec module on the global batch in one process:
the outputs and the position weights' gradients every step (they come
through our kernel's per-id weights), then the rows the tables' fused SGD
trained, and the same outputs after a torch.distributed.checkpoint or a
dump, loaded into a fresh model, and from to_inference's frozen copy. TorchRec applies the position weights after the input dist, on the
rank that owns each id; on the CPU their gradients are left different on
each rank (DDP does not reduce them: native tables alike), so the test
averages them itself, as a synchronised DDP would, and keeps the weights
fixed."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

import models
from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.inference import to_inference
from dynamicemb.planner import DynamicEmbeddingShardingPlanner
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicFeatureProcessedEmbeddingBagCollectionSharder
from multiprocess import run_ranks

TABLES = ["a_table", "b_table"]
FEATURES = [t.replace("table", "feature") for t in TABLES]
KEYS, BATCH, STEPS, MAX_LEN = 40, 8, 4, 3
LR_TABLES = 0.1
POSITIONS = [1.0, 0.5, 0.25]


def _fpebc(configs, device):
    fp = PositionWeightedModuleCollection({f: MAX_LEN for f in FEATURES}, device=device)
    return FeatureProcessedEmbeddingBagCollection(
        torchrec.EmbeddingBagCollection(tables=configs, is_weighted=True, device=device), fp)


def _sharded(configs, pg):
    fused = dict(optimizer=models.EmbOptimType.EXACT_SGD, learning_rate=LR_TABLES)
    ebc_sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused)
    sharders = [DynamicFeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder), ebc_sharder]
    module = _fpebc(configs, torch.device("meta"))
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=pg.size(), compute_device="cpu"),
                                              constraints=models.dynamic_constraints(TABLES))
    return DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                    plan=planner.plan(module, sharders), sharders=sharders)


def _reloaded_alike(model, configs, pg, path):
    """The trained model through torch.distributed.checkpoint and through a
    dump, each into a fresh model: the same outputs in eval."""
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(path, "dcp"))
    DynamicEmbDump(os.path.join(path, "dump"), model)
    from_dcp, from_dump = _sharded(configs, pg), _sharded(configs, pg)
    state = {"model": from_dcp.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    from_dcp.load_state_dict(state["model"])
    DynamicEmbLoad(os.path.join(path, "dump"), from_dump)
    with torch.no_grad():  # a dump holds the dynamic tables only: the position weights are dense
        for (_, p), (_, q) in zip(in_backward_optimizer_filter(from_dump.named_parameters()),
                                  in_backward_optimizer_filter(model.named_parameters())):
            p.copy_(q)
    batch = models.kjt(models.random_batch(FEATURES, BATCH, KEYS, seed=900, max_len=MAX_LEN),
                       models.local_samples(BATCH, pg))
    outs = []
    for m in (model, from_dcp, from_dump):
        m.eval()
        outs.append(models.resolved(m(batch)).values())
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    # Frozen for serving: the position weights, then the weighted tables.
    served = to_inference(model, pg=pg)
    assert torch.equal(served(batch).values(), outs[0])


def _ranks(rank, world, path):
    pg = models.rank_groups()[0]
    configs = models.ebc_configs(TABLES, dim=4, num_embeddings=KEYS)
    start = models.initial_weights(configs, seed=7)
    model = _sharded(configs, pg)
    for c in configs:
        models.set_dynamic_rows(model, c.name, start[c.name], pg)
    positions = dict(in_backward_optimizer_filter(model.named_parameters()))
    assert len(positions) == len(FEATURES)
    ref = _fpebc(configs, torch.device("cpu"))
    with torch.no_grad():
        for c in configs:
            ref._embedding_bag_collection.embedding_bags[c.name].weight.copy_(start[c.name])
        for p in list(positions.values()) + list(ref._feature_processors.parameters()):
            p.copy_(torch.tensor(POSITIONS))
    ref_opt = torch.optim.SGD(ref._embedding_bag_collection.parameters(), lr=LR_TABLES)
    for step in range(STEPS):
        batch = models.random_batch(FEATURES, BATCH, KEYS, seed=500 + step, max_len=MAX_LEN)
        out = models.resolved(model(models.kjt(batch, models.local_samples(BATCH, pg))))
        ref_opt.zero_grad()
        ref._feature_processors.zero_grad()
        want = ref(models.kjt(batch))
        torch.testing.assert_close(out.values(), want.values()[models.local_samples(BATCH, pg)], rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"step {step}: {m}")
        (models.loss_of(out) * pg.size()).backward()  # (the tables' gradient: see test_native_parity)
        models.loss_of(want).backward()
        ref_opt.step()
        for f in FEATURES:
            (p,) = [p for n, p in positions.items() if n.endswith(f)]
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad, group=pg)
            torch.testing.assert_close(grad / pg.size(), ref._feature_processors.position_weights[f].grad,
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} {f} positions: {m}")
            p.grad = None
    for c in configs:
        rows, held = models.stored_rows(model, c.name, torch.arange(KEYS), pg)
        assert bool((held >= 0).all())
        trained = ref._embedding_bag_collection.embedding_bags[c.name].weight.detach()
        assert not torch.allclose(trained, start[c.name])
        torch.testing.assert_close(rows.float(), trained, rtol=1e-5, atol=1e-6, msg=lambda m: f"{c.name}: {m}")
    _reloaded_alike(model, configs, pg, path)
    return True


def test_position_weighted_features_match_torchrecs_unsharded_module(tmp_path):
    assert run_ranks(_ranks, 2, str(tmp_path)) == [True, True]


def test_sharder_takes_only_our_ebc_sharder():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    with pytest.raises(TypeError, match="ebc_sharder must be a DynamicEmbeddingBagCollectionSharder"):
        DynamicFeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=EmbeddingBagCollectionSharder())
    ours = DynamicEmbeddingBagCollectionSharder(fused_params=models.SGD)
    with pytest.raises(ValueError, match="give fused_params to the ebc_sharder"):
        DynamicFeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ours, fused_params=models.SGD)
    built = DynamicFeatureProcessedEmbeddingBagCollectionSharder(fused_params=models.SGD)
    assert built.fused_params == models.SGD
