"""KeyedJaggedTensor in, KeyedTensor / JaggedTensors out: what TorchRec's
collections take and return, around InferenceEmbeddingTable's TBE-layout
lookup. TorchRec is imported here only, so that a program exported from
TBE-layout inputs serves without it."""
from typing import List, Sequence

import torch

from dynamicemb.types import DynamicEmbPoolingMode


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _check_lengths(lengths: torch.Tensor, n: int, keys: Sequence[str], B: int, owner: str) -> None:
    """Eager checks that name the feature: no negative length, lengths summing to the ids."""
    if _tracing():
        return
    neg = (lengths < 0).nonzero()
    if neg.numel():
        i = int(neg[0])
        raise ValueError(f"{owner}: feature {keys[i // B]!r} has a negative length ({int(lengths[i])}) in bag {i % B}")
    total = int(lengths.sum())
    if total != n:
        raise ValueError(f"{owner}: the lengths add up to {total} ids, the input has {n} values")


def select_features(features, feature_names: List[str], table_names: List[str]):
    """(values, offsets [F * B + 1], weights, lengths [F * B]) of the module's
    features, in its order, from a KeyedJaggedTensor holding them (and
    possibly others, which are left out as TorchRec's collections do)."""
    owner = f"InferenceEmbeddingTable {table_names}"
    keys = list(features.keys())
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise KeyError(f"{owner}: the input has no feature {missing} (it has {keys})")
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    if values.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{owner}: ids of features {keys} must be int64 or int32, got {values.dtype}")
    B = features.stride()
    lengths = lengths.to(torch.int64)
    _check_lengths(lengths, values.numel(), keys, B, owner)
    if keys != feature_names:  # the module's features, in its order, ahead of the rest
        K, F = len(keys), len(feature_names)
        rank = torch.tensor([feature_names.index(k) if k in feature_names else F for k in keys],
                            device=values.device)
        value_rank = torch.repeat_interleave(rank.repeat_interleave(B), lengths, output_size=values.numel())
        pos = torch.tensor([keys.index(f) for f in feature_names], device=values.device)
        lengths = lengths.view(K, B).index_select(0, pos).reshape(-1)
        order = torch.argsort(value_rank, stable=True)[:int(lengths.sum())]
        values = values.index_select(0, order)
        weights = None if weights is None else weights.index_select(0, order)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return values, offsets, weights, lengths


def jagged_output(out: torch.Tensor, feature_names: List[str], feature_dims: List[int], lengths: torch.Tensor,
                  pooling: int):
    """A KeyedTensor (pooled) or {feature: JaggedTensor} (NONE) over the lookup's output."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor
    if pooling != DynamicEmbPoolingMode.NONE:
        return KeyedTensor(keys=feature_names, length_per_key=feature_dims, values=out)
    F = len(feature_names)
    per_feature = lengths.view(F, -1)
    counts = per_feature.sum(1).tolist()
    return {f: JaggedTensor(values=v, lengths=per_feature[i])
            for i, (f, v) in enumerate(zip(feature_names, torch.split(out, counts)))}
