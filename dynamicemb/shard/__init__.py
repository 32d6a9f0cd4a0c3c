"""TorchRec sharders for collections with dynamic tables (API.md §2)."""
from dynamicemb.shard.embedding import DynamicEmbeddingCollectionSharder, ShardedDynamicEmbeddingCollection
from dynamicemb.shard.embeddingbag import (DynamicEmbeddingBagCollectionSharder, DynamicSharderMixin,
                                           ShardedDynamicEmbeddingBagCollection)
from dynamicemb.shard.fp_embeddingbag import DynamicFeatureProcessedEmbeddingBagCollectionSharder
from dynamicemb.shard.train_pipeline import PrefetchTrainPipelineSparseDist

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "DynamicFeatureProcessedEmbeddingBagCollectionSharder",
    "DynamicSharderMixin",
    "PrefetchTrainPipelineSparseDist",
    "ShardedDynamicEmbeddingBagCollection",
    "ShardedDynamicEmbeddingCollection",
]
