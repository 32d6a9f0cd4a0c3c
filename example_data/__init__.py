"""The example's click data: one schema (Criteo's: a label, 13 dense and 26
sparse features) filled from a generated click log, Criteo TSV files or
MovieLens ratings.

Every source gives ClickRows: dense features already transformed for the
model, one id (or none) per sample and sparse feature, and a 0/1 label.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np
import torch

NUM_DENSE = 13
SPARSE_FEATURES = [f"c{i}" for i in range(1, 27)]
# Small-vocabulary features (Criteo's C6, C9, C17 and C20 take 3 to 14
# values): native TorchRec tables of NATIVE_ROWS rows; ids are taken modulo.
NATIVE_ROWS = 128
NATIVE_FEATURES = ("c6", "c9", "c17", "c20")


def dense_transform(counts: np.ndarray) -> np.ndarray:
    """Criteo-style integer counts (negative or missing read as 0) to model
    inputs: log(1 + x), as DLRM does."""
    return np.log1p(np.maximum(counts, 0)).astype(np.float32)


@dataclass
class ClickRows:
    """N samples: dense [N, 13] float32, ids [N, 26] int64 (a feature's id,
    any int64; NATIVE_FEATURES below NATIVE_ROWS), present [N, 26] bool (False:
    the feature is missing, an empty bag), labels [N] float32 (0 or 1)."""

    dense: torch.Tensor
    ids: torch.Tensor
    present: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self):
        n = self.labels.shape[0]
        if self.dense.shape != (n, NUM_DENSE) or self.ids.shape != (n, len(SPARSE_FEATURES)) \
                or self.present.shape != self.ids.shape:
            raise ValueError(f"ClickRows: inconsistent shapes dense {tuple(self.dense.shape)}, ids "
                             f"{tuple(self.ids.shape)}, present {tuple(self.present.shape)}, labels ({n},)")

    @classmethod
    def from_numpy(cls, dense, ids, present, labels) -> "ClickRows":
        native = [SPARSE_FEATURES.index(f) for f in NATIVE_FEATURES]
        ids = np.array(ids, dtype=np.int64)
        ids[:, native] %= NATIVE_ROWS
        return cls(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), torch.from_numpy(ids),
                   torch.from_numpy(np.ascontiguousarray(present, dtype=bool)),
                   torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)))

    @classmethod
    def concat(cls, parts) -> "ClickRows":
        return cls(*(torch.cat([getattr(p, k) for p in parts]) for k in ("dense", "ids", "present", "labels")))

    def __len__(self) -> int:
        return self.labels.shape[0]

    def take(self, index: torch.Tensor) -> "ClickRows":
        return ClickRows(self.dense[index], self.ids[index], self.present[index], self.labels[index])

    def batch(self):
        """A torchrec Batch: dense features, a KeyedJaggedTensor of the sparse
        features (feature-major, a missing feature an empty bag), labels."""
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        present = self.present.t()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE_FEATURES, values=self.ids.t()[present],
                                                  lengths=present.reshape(-1).to(torch.int64))
        return Batch(dense_features=self.dense, sparse_features=kjt, labels=self.labels)


@dataclass
class ClickLog:
    """A data source: `train(start, count)` gives training samples start ..
    start + count - 1 (a finite log is read in epochs), `eval` the held-out
    samples; `labels` names what some features hold (for the printout)."""

    name: str
    train: Callable[[int, int], ClickRows]
    eval: ClickRows
    train_size: Optional[int]  # None: unbounded (generated)
    labels: Dict[str, str]


def from_rows(name: str, rows: ClickRows, eval_fraction: float, labels: Dict[str, str]) -> ClickLog:
    """A finite, time-ordered log: its last `eval_fraction` is held out."""
    n_eval = int(len(rows) * eval_fraction)
    n_train = len(rows) - n_eval
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"{name}: {len(rows)} rows are too few to hold out {eval_fraction:.0%} for evaluation")
    train_rows = rows.take(torch.arange(n_train))

    def train(start: int, count: int) -> ClickRows:
        return train_rows.take((start + torch.arange(count)) % n_train)

    return ClickLog(name, train, rows.take(torch.arange(n_train, len(rows))), n_train, labels)


def open_log(kind: str, path: Optional[str], train_samples: int, eval_samples: int, seed: int = 0,
             max_rows: Optional[int] = None, eval_fraction: float = 0.1) -> ClickLog:
    """The ClickLog of `kind`: "generated" (train_samples, then eval_samples
    held out from later in time), "criteo" or "movielens" (read from `path`,
    at most `max_rows` rows; the last `eval_fraction` held out)."""
    if kind == "generated":
        from example_data.synthetic import generated_log
        return generated_log(train_samples, eval_samples, seed)
    if path is None:
        raise ValueError(f"--data {kind} needs a PATH")
    if kind == "criteo":
        from example_data.criteo import read_criteo
        return from_rows(f"criteo {path}", read_criteo(path, max_rows), eval_fraction, {})
    if kind == "movielens":
        from example_data.movielens import MOVIELENS_LABELS, read_movielens
        return from_rows(f"movielens {path}", read_movielens(path, max_rows), eval_fraction, MOVIELENS_LABELS)
    raise ValueError(f"unknown data kind {kind!r} (generated, criteo, movielens)")
