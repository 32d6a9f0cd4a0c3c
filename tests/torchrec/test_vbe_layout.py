"""The VBE layout of dynamicemb.shard.vbe, where features carry batches of
different sizes: the padding and unpadding of lengths against loops, and a
dynamic kernel's VBE output (rank by rank, feature by feature) against each
bag pooled alone through the uniform path, alone and written into a
pre-allocated output shared with another kernel (TorchRec's merge)."""
import torch
import torchrec
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.modules.embedding_configs import DataType, PoolingType

import dynamicemb.shard.kernel as kernel
from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbTableOptions
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.shard import vbe
from dynamicemb.shard.parameter_sharding import OPTIONS_KEY, OptionsRef

DIMS = {"a": 4, "b": 8}


def test_lengths_padded_and_unpadded_as_loops_do():
    counts = [2, 0, 3]
    lengths = torch.tensor([5, 6, 7, 8, 9])  # feature 0: 5, 6; feature 2: 7, 8, 9
    padded = vbe.padded_lengths(lengths, counts)
    assert padded.tolist() == [5, 6, 0, 0, 0, 0, 7, 8, 9]
    world = 2
    routed = torch.arange(world * len(counts) * 3)  # [rank][feature][padded bag]
    want = [int(routed[(r * len(counts) + f) * 3 + b]) for r in range(world) for f, c in enumerate(counts)
            for b in range(c)]
    assert vbe.unpadded_routed_lengths(routed, counts, world).tolist() == want
    assert vbe.padded_offsets(lengths, counts).tolist() == [0, 5, 11, 11, 11, 11, 11, 18, 26, 35]


def _kernel():
    tables, opts = [], {}
    for name, d in DIMS.items():
        o = DynamicEmbTableOptions(dim=d, max_capacity=256, num_embeddings=1000,
                                   initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.DEBUG))
        opts[name] = o
        tables.append(ShardedEmbeddingTable(name=f"{name}_table", num_embeddings=1000, embedding_dim=d,
                                            data_type=DataType.FP32, feature_names=[f"{name}_feature"],
                                            local_rows=1000, local_cols=d,
                                            compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL,
                                            fused_params={OPTIONS_KEY: OptionsRef(o)}))
    config = GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=False,
                                    has_feature_processor=False,
                                    compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL, embedding_tables=tables,
                                    fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    return kernel.BatchedDynamicEmbeddingBag(config)


def _pooled_alone(k, feature, ids):
    """One bag pooled through the uniform path (one bag per feature, the other empty)."""
    keys = list(DIMS)
    lengths = torch.tensor([len(ids) if f == feature else 0 for f in keys])
    out = k(torchrec.KeyedJaggedTensor(keys=[f"{f}_feature" for f in keys], values=torch.tensor(ids,
                                       dtype=torch.int64), lengths=lengths, stride=1))
    col = sum(DIMS[f] for f in keys[:keys.index(feature)])
    return out[0, col:col + DIMS[feature]]


def test_kernel_vbe_output_is_each_bag_pooled_in_torchrecs_layout():
    k = _kernel()
    # After the all-to-all of 2 ranks: feature a has 2 bags from rank 0 and 1
    # from rank 1, feature b none from rank 0 and 3 from rank 1.
    spkr = [[2, 1], [0, 3]]
    bags = {"a": [[1, 2], [3], [4, 5, 6]], "b": [[7], [], [8, 9]]}
    lengths = torch.tensor([len(b) for f in DIMS for b in bags[f]])
    values = torch.tensor([i for f in DIMS for b in bags[f] for i in b])
    kjt = torchrec.KeyedJaggedTensor(keys=["a_feature", "b_feature"], values=values, lengths=lengths,
                                     stride_per_key_per_rank=spkr)
    k(kjt)  # stores every key (training mode)
    k.eval()
    got = k(kjt)
    # rank 0: a's bags 0, 1; b: none. rank 1: a's bag 2; b's bags 0, 1, 2.
    order = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    want = torch.cat([_pooled_alone(k, f, bags[f][j]) for f, j in order])
    torch.testing.assert_close(got, want)
    # Several kernels share one output (TorchRec's merge): blocks at the given offsets.
    out = torch.full((got.numel() + 10,), -7.0)
    offsets = torch.tensor([[10, 18], [18, 22]])  # [rank][feature] element offsets
    merged = k(kjt, vbe_output_offsets=offsets, vbe_output=out)
    assert torch.equal(merged[:10], out[:10]) and bool((out == -7.0).all())  # the given output unchanged
    torch.testing.assert_close(merged[10:], want)
