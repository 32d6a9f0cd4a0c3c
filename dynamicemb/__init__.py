"""dynamicemb: dynamic, hash-table-backed embedding tables for TorchRec."""
from dynamicemb.admission import AdmissionStrategy, Counter, CounterNotCheckpointable
from dynamicemb.aliases import DynamicEmbEvictStrategy
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables, BatchedDynamicEmbeddingTablesV2
from dynamicemb.memory import DynamicEmbBudgetError
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from dynamicemb.storage import EmbeddingStorage, HashTableStorage
from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.stats import table_stats
from dynamicemb.table import EvictedKeys, ExportBatch, InsertOutput, ScoredHashTable
from dynamicemb.types import (
    DynamicEmbCheckMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    InsertResult,
)

__all__ = [
    "AdmissionStrategy",
    "Counter",
    "CounterNotCheckpointable",
    "BatchedDynamicEmbeddingTables",
    "BatchedDynamicEmbeddingTablesV2",
    "DynamicEmbBudgetError",
    "DynamicEmbDump",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbLoad",
    "DynamicEmbInitializerMode",
    "DynamicEmbTableOptions",
    "EmbOptimType",
    "EmbeddingStorage",
    "FrequencyAdmissionStrategy",
    "HashTableStorage",
    "KVCounter",
    "DynamicEmbCheckMode",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "EvictedKeys",
    "ExportBatch",
    "InsertOutput",
    "InsertResult",
    "ScoredHashTable",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "table_stats",
]
