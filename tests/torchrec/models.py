"""Small TorchRec models with dynamic tables, built the way a user would."""
import torch
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder


def ebc_configs(names, dim=8, num_embeddings=4096, pooling=torchrec.PoolingType.SUM):
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=num_embeddings,
                                        feature_names=[n.replace("table", "feature")], pooling=pooling)
            for n in names]


def ec_configs(names, dim=8, num_embeddings=4096):
    return [torchrec.EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=num_embeddings,
                                     feature_names=[n.replace("table", "feature")]) for n in names]


def dynamic_constraints(names, **options):
    options.setdefault("initializer_args", DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.DEBUG))
    return {n: DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(**options))
            for n in names}


def shard(module, configs, world_size, constraints, fused_params, collective=False):
    """DMP over `module` with our planner and sharders, on CPU."""
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params=fused_params),
                DynamicEmbeddingCollectionSharder(fused_params=fused_params)]
    planner = DynamicEmbeddingShardingPlanner(configs, topology=Topology(world_size=world_size, compute_device="cpu"),
                                              constraints=constraints, optimizer=fused_params["optimizer"])
    plan = planner.collective_plan(module, sharders) if collective else planner.plan(module, sharders)
    return DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders)


SGD = dict(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.1)
