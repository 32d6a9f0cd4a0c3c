"""A user storage written against the storage protocol alone: each table
holds keys [0, rows) at row = key (a dense array with a presence mask),
scored by STEP. It shares no code with HashTableStorage, so a module that
trains, dumps, loads and serves through it shows that those paths use the
protocol only."""
from typing import Optional

import torch

from dynamicemb._ops import ops
from dynamicemb.storage_protocol import EmbeddingStorage, FindOrInsertResult, RowBatch
from dynamicemb.types import DynamicEmbScoreStrategy, strategy_code


class DenseStorage(EmbeddingStorage):
    def __init__(self, names, options, state_widths, dtype, seed, streams=None):
        self.names, self.dims, self.seed = list(names), [o.dim for o in options], seed
        self.rows = [o.max_capacity for o in options]
        streams = list(range(len(options))) if streams is None else list(streams)
        self.init_params = torch.tensor([o.initializer_args.packed(o.num_embeddings or o.max_capacity, s)
                                         for o, s in zip(options, streams)], dtype=torch.float64)
        self.eval_init_params = torch.tensor([o.eval_initializer_args.packed(o.num_embeddings or o.max_capacity, s)
                                              for o, s in zip(options, streams)], dtype=torch.float64)
        self._weights = [torch.zeros(n, d + w, dtype=dtype) for n, d, w in zip(self.rows, self.dims, state_widths)]
        self.present = [torch.zeros(n, dtype=torch.bool) for n in self.rows]
        self.scores = [torch.zeros(n, dtype=torch.int64) for n in self.rows]
        self.inserted = [0] * len(options)
        self.failed = [0] * len(options)
        self.custom_scores = [0] * len(options)
        self.version = 0

    # ---- training ----------------------------------------------------------------------

    def weights(self):
        return self._weights

    def _rows(self, keys, table_ids, insert: bool, step: int = 0):
        rows = torch.full_like(keys, -1)
        failed = torch.zeros(len(self.rows), dtype=torch.int64)
        new = torch.zeros_like(keys, dtype=torch.bool)
        for t, n in enumerate(self.rows):  # a loop over tables, not keys
            mine = table_ids == t
            inside = mine & (keys >= 0) & (keys < n)
            k = keys[inside]
            if insert:
                new[inside] = ~self.present[t][k]
                self.present[t][k] = True
                self.scores[t][k] = step
                failed[t] = int((mine & ~inside).sum())
                self.inserted[t] += int(new[inside].sum())
                self.failed[t] += int(failed[t])
            rows[inside] = torch.where(self.present[t][k], k, -1)
        return rows, new, failed

    def find(self, keys, table_ids):
        return self._rows(keys, table_ids, insert=False)[0]

    def find_or_insert(self, keys, table_ids, counts, step, inverse=None):
        rows, new, failed = self._rows(keys, table_ids, insert=True, step=step)
        if bool(new.any()):
            ops.emb_init_rows(self._weights, rows[new], table_ids[new], keys[new], self.dims, self.init_params,
                              self.seed)
        return FindOrInsertResult(keys, table_ids, rows, inverse, failed, torch.zeros_like(failed))

    def export(self, table_id, batch_size=1 << 16, threshold=None):
        keys = self.present[table_id].nonzero().squeeze(1)
        if threshold is not None:
            keys = keys[self.scores[table_id][keys] >= threshold]
        for i in range(0, keys.numel(), batch_size):
            k = keys[i:i + batch_size]
            yield k, self._weights[table_id][k], self.scores[table_id][k]

    def stats(self, table_id):
        return dict(size=int(self.present[table_id].sum()), capacity=self.rows[table_id],
                    inserted=self.inserted[table_id], evicted=0, failed=self.failed[table_id],
                    admission_rejected=0)

    # ---- checkpoint ----------------------------------------------------------------------

    def strategy(self, table_id):
        return strategy_code(DynamicEmbScoreStrategy.STEP)

    def now(self, table_id):
        return 0

    def max_rows(self, table_id):
        return self.rows[table_id]

    def admission_counter(self, table_id):
        return None

    def export_rows(self, table_id, batch_size=1 << 16, lazy=False):
        dim = self.dims[table_id]
        for k, rows, scores in self.export(table_id, batch_size):
            yield RowBatch(k, rows[:, :dim], rows[:, dim:], scores, None)

    def load_rows(self, table_id, batch: RowBatch):
        k, n, dim = batch.keys, self.rows[table_id], self.dims[table_id]
        if bool(((k < 0) | (k >= n)).any()):
            raise RuntimeError(f"table {self.names[table_id]!r}: loaded keys outside [0, {n})")
        self.present[table_id][k] = True
        self.scores[table_id][k] = batch.scores
        w = self._weights[table_id]
        w[k, :dim] = batch.values.to(w.dtype)
        w[k, dim:] = 0 if batch.optimizer_state is None else batch.optimizer_state.to(w.dtype)
        self.version += 1

    def clear_table(self, table_id):
        removed = int(self.present[table_id].sum())
        self.present[table_id].zero_()
        self._weights[table_id].zero_()
        self.version += 1
        return removed


class TrainingOnlyStorage(DenseStorage):
    """Implements the training protocol only (the checkpoint methods fall
    back to the protocol's raising defaults)."""

    strategy = EmbeddingStorage.strategy
    now = EmbeddingStorage.now
    export_rows = EmbeddingStorage.export_rows
    load_rows = EmbeddingStorage.load_rows
