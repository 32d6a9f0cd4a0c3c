"""How a dynamic table's options travel from the plan to its kernel.

TorchRec merges `ParameterSharding.get_additional_fused_params()` into the
table's fused_params for CUSTOMIZED_KERNEL tables, and groups tables into
kernels by `tuple(sorted(fused_params.items()))`, so the values must be
hashable and dynamic tables with different options must still group into one
kernel (one hash table per batch). `OptionsRef` carries one table's options and
compares equal to every other OptionsRef; the kernel reads each table's own
ref from its ShardedEmbeddingTable.fused_params.
"""
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding

from dynamicemb.options import DynamicEmbTableOptions

OPTIONS_KEY = "dynamicemb_options"
CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


class OptionsRef:
    __slots__ = ("options",)

    def __init__(self, options: DynamicEmbTableOptions):
        self.options = options

    def __eq__(self, other):
        return isinstance(other, OptionsRef)

    def __lt__(self, other):  # sorted() of fused_params items may compare values
        return False

    def __hash__(self):
        return hash(OptionsRef)

    def __repr__(self):
        return f"OptionsRef({self.options!r})"


@dataclass
class DynamicEmbParameterSharding(ParameterSharding):
    """A ROW_WISE, CUSTOMIZED_KERNEL ParameterSharding with the table's
    per-rank DynamicEmbTableOptions."""

    dynamicemb_options: Optional[DynamicEmbTableOptions] = None

    def get_additional_fused_params(self) -> Dict[str, Any]:
        return {OPTIONS_KEY: OptionsRef(self.dynamicemb_options)}


def table_options(table) -> Optional[DynamicEmbTableOptions]:
    """The options of a ShardedEmbeddingTable of a dynamic table, else None."""
    ref = (table.fused_params or {}).get(OPTIONS_KEY)
    return ref.options if isinstance(ref, OptionsRef) else None


def init_stream(table_name: str) -> int:
    """A table's initializer stream: stable across modules, groups and ranks."""
    return zlib.crc32(table_name.encode()) & 0x7FFFFFFF
