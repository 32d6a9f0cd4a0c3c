"""Input distribution of a row-wise sharding that holds dynamic tables: each
feature routes by its own rule (dynamic: the table's dist_type, keys
unchanged; native: TorchRec's block rule with local rows), then TorchRec's
KJTAllToAll sends each rank its keys."""
import re
from typing import List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb._ops import ops
from dynamicemb.contiguous import contiguous_as
from dynamicemb.shard import vbe as vbe_layout
from dynamicemb.types import check_finite_weights, check_ids


class DynamicRwSparseFeaturesDist(RwSparseFeaturesDist):
    def __init__(self, pg: dist.ProcessGroup, num_features: int, feature_hash_sizes: List[int], rules: List[int],
                 params: List[int], device: Optional[torch.device] = None, is_sequence: bool = False,
                 has_feature_processor: bool = False) -> None:
        # With feature processors (a FeatureProcessedEmbeddingBagCollection),
        # TorchRec puts each id's position in its bag into the weights before
        # this input dist; the routing carries them, and the feature processor
        # turns them into position weights after it.
        super().__init__(pg=pg, num_features=num_features, feature_hash_sizes=feature_hash_sizes, device=device,
                         is_sequence=is_sequence)
        if not len(rules) == len(params) == num_features:
            raise ValueError(f"{len(rules)} routing rules for {num_features} features")
        self._rules = list(rules)
        self._params = list(params)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        vbe = sparse_features.variable_stride_per_key()
        if vbe and self._is_sequence:
            raise NotImplementedError("dynamicemb: variable batch sizes per feature (VBE) are for pooled "
                                      "collections (EmbeddingBagCollection), not EmbeddingCollection")
        # Refused here, before the routing casts them: float ids would be
        # truncated silently, NaN weights would poison the rows they update.
        keys = sparse_features.keys()
        check_ids(sparse_features.values(), keys, "dynamicemb (input dist)")
        w = sparse_features.weights_or_none()
        if w is not None and not torch.is_floating_point(w):
            if self._is_sequence:  # an EmbeddingCollection takes no weights: TorchRec's ignore them
                w = None
            else:
                # TorchRec's kernels ignore them on one rank and fail on several;
                # cast to float by the routing, they would weigh the ids silently.
                raise TypeError(f"dynamicemb (input dist): per-sample weights of features {keys} must be "
                                f"floating point, got {w.dtype}: cast them (weights.float()) or leave them out")
        n = sparse_features.values().numel()
        if w is not None and w.numel() != n:
            raise ValueError(f"dynamicemb (input dist): features {keys}: {w.numel()} per-sample weights for {n} "
                             f"ids; give one weight per id")
        if w is not None:
            check_finite_weights(w, sparse_features.offsets(), keys, "dynamicemb (input dist)")
        lengths = contiguous_as(sparse_features.lengths(), torch.int64)
        bags = max(sparse_features.stride_per_key(), default=0) if vbe else sparse_features.stride()
        if vbe:  # routed in the uniform layout, with empty bags (vbe.py)
            lengths = vbe_layout.padded_lengths(lengths, sparse_features.stride_per_key())
        try:
            lengths, values, weights, permute = ops.route_keys(
                lengths,
                contiguous_as(sparse_features.values(), torch.int64),
                None if w is None else contiguous_as(w, torch.float32),
                self._rules, self._params, self._world_size)
        except RuntimeError as e:
            raise _named(e, keys, bags) from None
        if self._is_sequence:
            self.unbucketize_permute_tensor = permute
        if vbe:  # as TorchRec's bucketize sends a VBE batch: each rank the real bags of every feature
            layout = dict(lengths=vbe_layout.unpadded_routed_lengths(lengths, sparse_features.stride_per_key(),
                                                                     self._world_size),
                          stride_per_key_per_rank=sparse_features.stride_per_key_per_rank() * self._world_size)
        else:
            layout = dict(lengths=lengths, stride=sparse_features.stride())
        routed = KeyedJaggedTensor(keys=sparse_features.keys() * self._world_size, values=values,
                                   weights=weights if w is not None else None, **layout)
        return self._dist(routed)


def _named(error: RuntimeError, keys: List[str], bags: int) -> Exception:
    """The routing's refusal of a batch's lengths, naming the feature (bag j
    of the feature-major lengths is bag j % bags of feature j // bags)."""
    msg = str(error).splitlines()[0]
    m = re.search(r"negative length at bag (\d+)", msg)
    if m and bags > 0 and int(m.group(1)) // bags < len(keys):
        j = int(m.group(1))
        return ValueError(f"dynamicemb (input dist): feature {keys[j // bags]!r} has a negative length in bag "
                          f"{j % bags}")
    m = re.search(r"lengths sum to (\d+) but there are (\d+) values", msg)
    if m:
        return ValueError(f"dynamicemb (input dist): the lengths of features {keys} sum to {m.group(1)}, but the "
                          f"batch holds {m.group(2)} ids")
    return error
