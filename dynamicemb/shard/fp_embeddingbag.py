"""FeatureProcessedEmbeddingBagCollection (position-weighted features) with
dynamic tables: TorchRec's sharder over our EBC sharder. TorchRec's sharded
collection writes each id's position into the weights before the input dist
when its tables are sharded ROW_WISE, the routing carries them, and its
feature processors turn them into position weights before our kernel, which
takes them as per-id weights (their gradient reaches the position weights)."""
from typing import Dict, Optional

from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

from dynamicemb.shard.embeddingbag import DynamicEmbeddingBagCollectionSharder, DynamicSharderMixin


class DynamicFeatureProcessedEmbeddingBagCollectionSharder(DynamicSharderMixin,
                                                           FeatureProcessedEmbeddingBagCollectionSharder):
    """Drop-in for FeatureProcessedEmbeddingBagCollectionSharder: its
    collection's dynamic tables get our kernel. `ebc_sharder`: a
    DynamicEmbeddingBagCollectionSharder (default: one with `fused_params`)."""

    def __init__(self, ebc_sharder: Optional[DynamicEmbeddingBagCollectionSharder] = None,
                 qcomm_codecs_registry: Optional[Dict] = None, fused_params: Optional[Dict] = None) -> None:
        if ebc_sharder is not None and not isinstance(ebc_sharder, DynamicEmbeddingBagCollectionSharder):
            raise TypeError(f"ebc_sharder must be a DynamicEmbeddingBagCollectionSharder, got "
                            f"{type(ebc_sharder).__name__}")
        if ebc_sharder is not None and fused_params is not None:
            raise ValueError("give fused_params to the ebc_sharder, not beside it")
        super().__init__(ebc_sharder=ebc_sharder or DynamicEmbeddingBagCollectionSharder(
            fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry),
            qcomm_codecs_registry=qcomm_codecs_registry)
