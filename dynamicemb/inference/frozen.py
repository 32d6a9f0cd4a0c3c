"""A table's frozen content (keys, values, features, eval initializer): what
an InferenceEmbeddingTable is built from, whatever the source (a training
module, a dump)."""
from dataclasses import dataclass, field
from typing import List

import torch

from dynamicemb import rules
from dynamicemb.options import DynamicEmbInitializerArgs, DynamicEmbInitializerMode

# The packed eval initializer of a table that reads zeros for a missing key.
ZEROS_INIT = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0).packed(None, 0)


def packed_init(row) -> List[float]:
    """A packed initializer as a dump recorded it: columns added since
    (rules.INIT_ARGS grows at its end; a new column's 0 keeps the old
    behaviour) are filled with 0."""
    row = [float(v) for v in row]
    return row + [0.0] * (len(rules.INIT_ARGS) - len(row))


@dataclass
class FrozenTable:
    """One table's content for an InferenceEmbeddingTable.

    ``eval_init``: the packed eval initializer (DynamicEmbInitializerArgs.packed
    with the table's num_embeddings and random stream) that a missing key
    reads; zeros by default.
    """

    name: str
    keys: torch.Tensor  # int64 [n], distinct
    values: torch.Tensor  # [n, dim] floating
    feature_names: List[str]
    eval_init: List[float] = field(default_factory=lambda: list(ZEROS_INIT))

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])
