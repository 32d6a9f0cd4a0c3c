"""The storage protocol: what the embedding module, checkpoints, incremental
dumps, `table_stats` and `to_inference` may ask of a storage (API reference:
DynamicEmb_APIs.md, "Storage protocol").

Two parts:
- the training protocol (`weights`, `find`, `find_or_insert`, `export`,
  `stats` and the attributes below): enough to train and evaluate;
- the checkpoint protocol (`strategy`, `now`, `max_rows`,
  `admission_counter`, `export_rows`, `load_rows`, `clear_table`): enough to
  dump, load, dump incrementally and export for serving.

Nothing outside a storage class calls anything else on it, so a user storage
that implements both parts trains, checkpoints and serves like the built-in
ones. One that implements only the training part trains; every checkpoint
path then refuses it by name (`missing_checkpoint_methods`).
"""
import abc
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

PENDING_PREFETCHES = 2  # prefetched batches whose forward may still come (a pipeline's depth)


class RowBatch(NamedTuple):
    """Entries of one table as a checkpoint holds them."""

    keys: torch.Tensor
    values: torch.Tensor  # [n, dim], storage dtype
    optimizer_state: Optional[torch.Tensor]  # [n, state width] or None
    scores: torch.Tensor  # int64
    timestamps: Optional[torch.Tensor]  # access times of the (TIMESTAMP, LFU) pair


class RowBlocks:
    """Rows `rows` of `source` ([slots, width]: a tensor, or a table's rows in
    parts, table_rows.TableRows), gathered block by block on demand: bounded
    memory for streaming a large export to disk."""

    BLOCK_BYTES = 4 << 20

    def __init__(self, source, rows: torch.Tensor):
        self.source, self.rows = source, rows.to(source.device)
        self.dtype = source.dtype
        self.shape = (rows.numel(), source.shape[1])

    def blocks(self) -> Iterator[torch.Tensor]:
        """Contiguous CPU tensors whose concatenation is the rows, in order
        (a hybrid table's host rows go to the CPU directly, not through the device)."""
        step = max(1, self.BLOCK_BYTES // max(1, self.shape[1] * self.source.element_size()))
        cpu = torch.device("cpu")
        for i in range(0, self.shape[0], step):
            part = self.rows[i:i + step]
            if isinstance(self.source, torch.Tensor):
                yield self.source.index_select(0, part).cpu()
            else:
                yield self.source.index_select(0, part, out_device=cpu)

    def materialize(self) -> torch.Tensor:
        return self.source.index_select(0, self.rows)


@dataclass
class FindOrInsertResult:
    """The keys of a find_or_insert call with their rows, in the order the
    storage chose: on the CPU, that of the rows' addresses (kernels that then
    write the rows at random run faster in it), else the input order."""

    keys: torch.Tensor
    table_ids: torch.Tensor
    rows: torch.Tensor  # table-local row per key, -1 when the key has no row
    inverse: Optional[torch.Tensor]  # the given inverse, renumbered to this order
    failed: torch.Tensor  # per table: keys that could not be stored in this call (on any device)
    rejected: torch.Tensor  # per table: keys refused by admission in this call


class EmbeddingStorage(abc.ABC):
    """What the module needs of a storage. Besides the methods below, a
    storage has the attributes the module's kernels read:

    - ``init_params`` / ``eval_init_params``: the packed initializer of each
      table (DynamicEmbInitializerArgs.packed) for training / eval reads;
    - ``unstored_init_params`` (optional; None: ``init_params``): what a
      training read of a key with no row gets (a key not admitted yet reads
      its admission strategy's initializer_args);
    - ``custom_scores``: per table, the CUSTOMIZED score set by ``set_score``;
    - ``version``: an int that changes whenever a row returned earlier may now
      belong to another key or have moved (eviction, growth, erasure, a
      load). A backward whose forward saw another version finds its keys'
      rows again instead of updating rows that are no longer theirs.
    """

    init_params: torch.Tensor
    eval_init_params: torch.Tensor
    unstored_init_params: Optional[torch.Tensor] = None
    custom_scores: List[int]
    version: int = 0

    # ---- the training protocol --------------------------------------------------------------

    @abc.abstractmethod
    def weights(self) -> List[torch.Tensor]:
        """Per table, the [rows, dim + state] tensor the kernels address; or,
        when some table's rows are in two parts (table_rows.py), every
        table's head, then every table's tail."""

    @abc.abstractmethod
    def find(self, keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the keys (-1 where missing); inserts nothing, scores unchanged."""

    @abc.abstractmethod
    def find_or_insert(self, keys: torch.Tensor, table_ids: torch.Tensor, counts: torch.Tensor, step: int,
                       inverse: Optional[torch.Tensor] = None) -> FindOrInsertResult:
        """Rows of distinct keys, storing the missing ones (admission and
        capacity permitting) with their initial value and fresh optimizer
        state; refreshes scores. `counts`: occurrences of each key (LFU);
        `inverse`: key positions (of a batch's indices) to renumber along
        with the keys. A storage whose takes_padded_keys() says so also
        takes `key_count` (the module passes it only then)."""

    def takes_padded_keys(self) -> bool:
        """Whether find_or_insert takes ``key_count`` (int64 [1] on the keys'
        device): the keys from position key_count[0] on are padding
        (emb_unique_padded's), found, stored and counted nowhere, with row
        -1. A step whose count stays on the device then never waits for it.
        False by default."""
        return False

    @abc.abstractmethod
    def export(self, table_id: int, batch_size: int = 1 << 16, threshold: Optional[int] = None
               ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Batches of (keys, rows [n, dim + state], scores) of one table; with
        `threshold`, only the entries scored at or above it."""

    @abc.abstractmethod
    def stats(self, table_id: int) -> Dict[str, int]:
        """size, capacity, inserted, evicted, failed, admission_rejected."""

    def lookup_forward(self, indices: torch.Tensor, offsets: torch.Tensor, feature_table: List[int],
                       per_sample_weights: Optional[torch.Tensor], pooling: int, output_dtype: torch.dtype
                       ) -> Optional[torch.Tensor]:
        """The eval forward (gather + pool, missing keys read their eval
        initial value) fused with the lookup, without dedup; None when this
        storage has no fused path (the module then dedups, finds and gathers)."""
        return None

    def prefetch(self, keys: torch.Tensor, table_ids: torch.Tensor) -> None:
        """Readies a coming batch's distinct keys (a tiered storage moves their
        rows into its cache); nothing by default. Of the batches prefetched,
        the last PENDING_PREFETCHES count as coming (the older ones' forwards
        are taken not to come)."""

    def batch_done(self, newest: bool = False) -> None:
        """A training batch's backward has run (its rows may move again);
        `newest`: the batch of the last forward, which gets no backward."""

    def flush(self, state: Optional[dict] = None) -> None:
        """Writes every row to its last tier (a tiered storage); a persistent
        tier also keeps `state` (the module's counters, JSON-able) for
        saved_state(). Nothing by default."""

    def close(self) -> None:
        """Releases what the storage holds beyond its tensors (a backing store
        it opened: files, locks); nothing by default."""

    def saved_state(self) -> Optional[dict]:
        """The state given to the last flush of a persistent tier that this
        storage reopened (None: none)."""
        return None

    def budget_reached(self, table_id: int) -> Optional[str]:
        """Why a table stores no more keys when its memory budget is the
        reason (DynamicEmbTableOptions.memory_budget), else None: the module
        adds it to the report of the keys that failed."""
        return None

    def insert_rows(self, table_id: int, keys: torch.Tensor, values: torch.Tensor,
                    optimizer_state: Optional[torch.Tensor] = None, step: int = 0) -> torch.Tensor:
        """Stores distinct `keys` of one table with the given values (and
        optimizer state; a fresh one when None), bypassing admission (tests, tools);
        returns their rows, -1 where a key could not be stored."""
        raise NotImplementedError(f"{type(self).__name__} does not support insert_rows")

    # ---- the checkpoint protocol ------------------------------------------------------------
    # Defaults raise: a storage that leaves them out trains but cannot be
    # checkpointed, and every checkpoint path says so before writing anything.

    def strategy(self, table_id: int) -> int:
        """The table's score strategy code (dynamicemb.rules / types.strategy_code)."""
        raise self._not_checkpointable("strategy")

    def now(self, table_id: int) -> int:
        """The table's clock reading (ScoredHashTable.now): clock scores are
        dumped as ages against it and loaded back against the new clock."""
        raise self._not_checkpointable("now")

    def max_rows(self, table_id: int) -> Optional[int]:
        """The most keys the table may hold on this rank (None: no limit); a
        load refuses a shard larger than this before touching any row."""
        raise self._not_checkpointable("max_rows")

    def admission_counter(self, table_id: int):
        """The table's AdmissionCounter (dynamicemb.admission), or None."""
        raise self._not_checkpointable("admission_counter")

    def export_rows(self, table_id: int, batch_size: int = 1 << 16, lazy: bool = False) -> Iterator[RowBatch]:
        """Every entry of one table: keys, values, optimizer state, scores
        (and the (TIMESTAMP, LFU) access times). With `lazy`, values and
        optimizer state may be RowBlocks read when consumed."""
        raise self._not_checkpointable("export_rows")

    def load_rows(self, table_id: int, batch: RowBatch) -> None:
        """Stores entries exactly as exported (optimizer state zero when
        None). Raises, naming the table, when a key cannot be stored or
        displaces another: a load never drops keys silently."""
        raise self._not_checkpointable("load_rows")

    def clear_table(self, table_id: int) -> int:
        """Removes every entry of one table; returns how many."""
        raise self._not_checkpointable("clear_table")

    def _not_checkpointable(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not implement the checkpoint protocol ({method}); implement "
            f"{', '.join(CHECKPOINT_METHODS)} (dynamicemb.storage_protocol) to dump, load and export its tables")


CHECKPOINT_METHODS = ("strategy", "now", "max_rows", "admission_counter", "export_rows", "load_rows",
                      "clear_table")


def missing_checkpoint_methods(storage: EmbeddingStorage) -> List[str]:
    """The checkpoint protocol's methods a storage leaves to the raising defaults."""
    cls = type(storage)
    return [m for m in CHECKPOINT_METHODS if getattr(cls, m, None) is getattr(EmbeddingStorage, m)]


def require_checkpoint_protocol(storage: EmbeddingStorage, table_names, what: str) -> None:
    """Raises, naming the tables and the methods missing, when `storage`
    cannot serve `what` (a dump, a load, an export) through the checkpoint protocol."""
    missing = missing_checkpoint_methods(storage)
    if missing:
        raise TypeError(f"{what}: the storage of dynamic tables {list(table_names)} ({type(storage).__name__}) does "
                        f"not implement the checkpoint protocol: {', '.join(missing)} missing "
                        f"(dynamicemb.storage_protocol)")
