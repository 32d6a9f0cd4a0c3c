"""Which rank owns a key of a row-wise sharded dynamic table (API.md §1
dist_type); the kernels share the rules in csrc/dist/route_rules.h.

  hash_roundrobin (default): fmix64(key) % world
  roundrobin:                key mod world (non-negative remainder)
  continuous:                blocks of ceil(num_embeddings / world) over key mod num_embeddings

Keys reach their owner unchanged (no rewriting to local offsets).
"""
import torch

from dynamicemb._ops import ops
from dynamicemb.contiguous import contiguous_as

__all__ = ["owners"]

# Rule codes of route_rules.h.
ROUTE_BLOCK = 0  # TorchRec's native row-wise rule (for native tables routed alongside)
DIST_TYPES = {"hash_roundrobin": 1, "roundrobin": 2, "continuous": 3}


def route_rule(dist_type: str, table_name: str = "?") -> int:
    try:
        return DIST_TYPES[dist_type]
    except KeyError:
        raise ValueError(f"table {table_name!r}: unknown dist_type {dist_type!r}; "
                         f"use one of {sorted(DIST_TYPES)}") from None


def route_param(dist_type: str, num_embeddings) -> int:
    """The rule's parameter: num_embeddings for continuous, else unused (1)."""
    if dist_type == "continuous":
        if not num_embeddings or num_embeddings <= 0:
            raise ValueError("dist_type 'continuous' needs the table's num_embeddings")
        return int(num_embeddings)
    return 1


def owners(keys: torch.Tensor, dist_type: str, world_size: int, num_embeddings=None) -> torch.Tensor:
    """The owning rank of each key."""
    return ops.route_owners(contiguous_as(keys, torch.int64), route_rule(dist_type),
                            route_param(dist_type, num_embeddings), world_size)
