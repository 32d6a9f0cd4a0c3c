"""dynamicemb: dynamic, hash-table-backed embedding tables for TorchRec."""
from dynamicemb.table import EvictedKeys, ExportBatch, InsertOutput, ScoredHashTable
from dynamicemb.types import (
    DynamicEmbCheckMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    InsertResult,
)

__all__ = [
    "DynamicEmbCheckMode",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "EvictedKeys",
    "ExportBatch",
    "InsertOutput",
    "InsertResult",
    "ScoredHashTable",
]
