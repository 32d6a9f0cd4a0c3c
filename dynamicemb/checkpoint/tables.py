"""The dynamic tables of a model, by name, with what a checkpoint records of them."""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from dynamicemb import rules
from dynamicemb.aliases import flat_per_table
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTables
from dynamicemb.stats import dynamic_tables
from dynamicemb.types import checked_table_names
from dynamicemb.storage_protocol import require_checkpoint_protocol


@dataclass
class TableRef:
    module: BatchedDynamicEmbeddingTables
    index: int  # the table's index in the module

    @property
    def options(self):
        return self.module.table_options[self.index]

    @property
    def storage(self):
        return self.module.storage

    def meta(self) -> dict:
        """What the manifest records of a table (and load checks)."""
        m, o = self.module, self.options
        return {
            "dim": o.dim,
            "dtype": str(m.embedding_dtype).replace("torch.", ""),
            "optimizer": m.optimizer,
            "optimizer_state_width": m.storage.weights()[self.index].shape[1] - o.dim,
            "hyper_parameters": {name: getattr(m, name) for name in rules.HYPER_PARAMETERS},
            "optimizer_step": m.optimizer_step,
            "step": m.step,
            "score_strategy": self.storage.strategy(self.index),
            "custom_score": self.storage.custom_scores[self.index],
            "dist_type": o.dist_type,
            "num_embeddings": o.num_embeddings,
            "bucket_capacity": o.bucket_capacity,
            "admission_counter": self.storage.admission_counter(self.index) is not None,
            # What serving needs (dynamicemb.inference.from_dump): the features
            # the table feeds, its pooling as the user configured it, and what a
            # missing key reads in eval (packed initializer, seed).
            "feature_names": m.feature_names_of(self.index),
            "is_weighted": m.is_weighted,
            "pooling": m.table_pooling_name(self.index),
            "eval_initializer": self.storage.eval_init_params[self.index].tolist(),
            "seed": m.seed,
        }


def model_tables(model: torch.nn.Module, table_names: Optional[Sequence[str]] = None,
                 what: str = "checkpoint", check: bool = True) -> Dict[str, TableRef]:
    """name -> TableRef for the model's dynamic tables (all, or the named
    ones); with `check`, raises for a module whose storage cannot be
    checkpointed (`what` names the caller in the message)."""
    found = dynamic_tables(model)
    if check:
        for m in dict.fromkeys(m for _, m, _ in found):
            require_checkpoint_protocol(m.storage, m.table_names, what)
    tables = {name: TableRef(m, i) for name, m, i in found}
    if table_names is None:
        return tables
    if not isinstance(table_names, str):
        table_names = flat_per_table(table_names, f"{what}(table_names=...)", "a list of table names")
    table_names = checked_table_names(table_names, what)
    missing = [n for n in table_names if n not in tables]
    if missing:
        raise ValueError(f"the model has no dynamic tables named {missing}; it has {sorted(tables)}")
    return {n: tables[n] for n in table_names}


def rank_world(pg: Optional[dist.ProcessGroup]):
    if pg is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def check_group(tables: Dict[str, TableRef], pg: Optional[dist.ProcessGroup], what: str) -> None:
    """Refuses a `pg` other than the group that shards the tables: a load
    routes keys by pg's ranks and a dump names its shards by them, so another
    group would drop or repeat keys unsaid."""
    if not dist.is_initialized():
        return
    given = tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
    for m in dict.fromkeys(ref.module for ref in tables.values()):
        if m.shard_ranks is not None and m.shard_ranks != given:
            raise ValueError(f"{what}: tables {m.table_names} are sharded over ranks {list(m.shard_ranks)}, but "
                             f"pg={'the default group' if pg is None else 'the group given'} has ranks "
                             f"{list(given)}: pass the process group the model was sharded with "
                             f"(DistributedModelParallel's env.process_group)")

