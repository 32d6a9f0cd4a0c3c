"""Variable batch sizes per feature (TorchRec's VBE) over the dynamic kernels.

Our routing and kernels take bags in a uniform layout: every feature has the
same number of bags. A VBE batch gives feature f its own count B_f. It runs
through them padded: each feature's bags are followed by empty ones up to the
largest count (an empty bag has no id: it routes, looks up and updates
nothing), and the padding is dropped again where TorchRec expects the VBE
layout (the routed lengths before the all-to-all; the pooled embeddings
before the reduce-scatter, rank by rank, feature by feature, sample by
sample: FBGEMM's VBE output). On gloo, the reduce-scatter of uneven chunks
(a VBE batch's, or ranks' batches of different sizes) gets a backward that
gloo can run."""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.types import NoWait


def real_bags(bags_per_feature: Sequence[int], device, copies: int = 1) -> Tuple[torch.Tensor, int]:
    """Where the real bags sit in the padded layout ([copy][feature][bag of
    the largest count], flat), made on the host (no device sync), and the
    padded count."""
    width = max(bags_per_feature, default=0)
    per_feature = [torch.arange(c) + f * width for f, c in enumerate(bags_per_feature)]
    one = torch.cat(per_feature) if per_feature else torch.zeros(0, dtype=torch.int64)
    step = len(bags_per_feature) * width
    at = torch.cat([one + k * step for k in range(copies)]) if copies else one[:0]
    return at.to(device), width


def padded_lengths(lengths: torch.Tensor, bags_per_feature: Sequence[int]) -> torch.Tensor:
    """Feature-major lengths of B_f bags per feature -> F x max(B_f) lengths,
    the bags past a feature's count empty."""
    at, width = real_bags(bags_per_feature, lengths.device)
    out = torch.zeros(len(bags_per_feature) * width, dtype=lengths.dtype, device=lengths.device)
    out[at] = lengths
    return out


def unpadded_routed_lengths(routed: torch.Tensor, bags_per_feature: Sequence[int], world: int) -> torch.Tensor:
    """The routing's lengths of a padded batch ([rank][feature][padded bag])
    with the padding dropped: [rank][feature][bag of the feature's count]."""
    at, _ = real_bags(bags_per_feature, routed.device, copies=world)
    return routed[at]


def padded_offsets(lengths: torch.Tensor, bags_per_feature: Sequence[int]) -> torch.Tensor:
    lengths = padded_lengths(lengths, bags_per_feature)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def vbe_output(pooled: torch.Tensor, stride_per_key_per_rank: List[List[int]], dims: Sequence[int],
               output_offsets: Optional[torch.Tensor] = None, output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel's pooled [max bags, sum dims] output of a padded VBE batch in
    TorchRec's 1-D VBE layout: for each source rank r, each feature f, the
    B_{f,r} bags that rank r sent, D_f values each (feature f's bags arrived
    rank after rank). With `output` and `output_offsets` ([rank][feature]
    element offsets into it: TorchRec's merge of several kernels), a copy of
    `output` with this kernel's blocks written there. The indices are made on
    the host: no device sync."""
    world = len(stride_per_key_per_rank[0]) if stride_per_key_per_rank else 0
    width = pooled.shape[1]
    col = [0]
    for d in dims:
        col.append(col[-1] + d)
    parts, sizes = [], []
    for r in range(world):
        for f, strides in enumerate(stride_per_key_per_rank):
            first, count, d = sum(strides[:r]), strides[r], dims[f]
            bags = torch.arange(first, first + count).unsqueeze(1)
            parts.append((bags * width + col[f] + torch.arange(d)).view(-1))
            sizes.append(count * d)
    gather = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    flat = pooled.reshape(-1)[gather.to(pooled.device)]
    if output is None:
        return flat
    # Element j of block k (at flat position first_k + j) goes to
    # output_offsets[k] + j: flat position + (output_offsets[k] - first_k).
    sizes_t = torch.tensor(sizes, dtype=torch.int64, device=output.device)
    shift = output_offsets.reshape(-1).to(torch.int64) - (torch.cumsum(sizes_t, 0) - sizes_t)
    total = flat.numel()
    at = torch.arange(total, device=output.device) + shift.repeat_interleave(sizes_t, output_size=total)
    return output.index_copy(0, at, flat)


class _ReduceScatterV(torch.autograd.Function):
    """Reduce-scatter of uneven per-rank chunks whose backward all-gathers
    them padded to the largest (gloo gathers only equal sizes; TorchRec's
    ReduceScatterV backward gathers uneven ones: NCCL only), dividing by the
    world size as TorchRec's does."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, splits: List[int], pg) -> torch.Tensor:
        out = local.new_empty(splits[dist.get_rank(pg)])
        dist.reduce_scatter(out, list(local.split(splits)), group=pg)
        ctx.splits, ctx.pg = splits, pg
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        splits, width = ctx.splits, max(ctx.splits)
        padded = grad.new_zeros(width)
        padded[:grad.numel()] = grad
        gathered = grad.new_empty(len(splits) * width)
        dist.all_gather_into_tensor(gathered, padded, group=ctx.pg)
        grad_input = torch.cat([gathered[r * width:r * width + s] for r, s in enumerate(splits)])
        if get_gradient_division():  # as TorchRec's reduce-scatters do
            grad_input.div_(len(splits))
        return grad_input, None, None


class GlooVariableBatchReduceScatter(torch.nn.Module):
    """TorchRec's VariableBatchPooledEmbeddingsReduceScatter (the RW output
    dist of a VBE batch), for gloo: the same splits ([rank][feature] batch
    sizes times the features' dims) and result."""

    def __init__(self, pg) -> None:
        super().__init__()
        self._pg = pg

    def forward(self, local_embs: torch.Tensor, batch_size_per_rank_per_feature: List[List[int]],
                embedding_dims: List[int]) -> PooledEmbeddingsAwaitable:
        splits = [sum(b * d for b, d in zip(sizes, embedding_dims)) for sizes in batch_size_per_rank_per_feature]
        return PooledEmbeddingsAwaitable(NoWait(_ReduceScatterV.apply(local_embs, splits, self._pg)))


class DynamicRwPooledEmbeddingDist(RwPooledEmbeddingDist):
    """TorchRec's RW output dist, with reduce-scatters of uneven chunks on
    gloo that can train: a VBE batch's (GlooVariableBatchReduceScatter), and
    a batch whose ranks have different batch sizes (a short last batch),
    whose TorchRec backward all-gathers uneven chunks (NCCL only)."""

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None):
        if (sharding_ctx is not None and not sharding_ctx.variable_batch_per_feature and self._codecs is None
                and len(set(sharding_ctx.batch_size_per_rank)) > 1 and dist.get_backend(self._pg) == dist.Backend.GLOO):
            width = local_embs.shape[1]
            splits = [b * width for b in sharding_ctx.batch_size_per_rank]
            out = _ReduceScatterV.apply(local_embs.contiguous().view(-1), splits, self._pg)
            return PooledEmbeddingsAwaitable(NoWait(out.view(-1, width)))
        return super().forward(local_embs, sharding_ctx)

    def _create_output_dist_module(self, sharding_ctx=None) -> None:
        if (sharding_ctx is not None and sharding_ctx.variable_batch_per_feature and self._codecs is None
                and dist.get_backend(self._pg) == dist.Backend.GLOO):
            self._dist = GlooVariableBatchReduceScatter(self._pg)
        else:
            super()._create_output_dist_module(sharding_ctx)
