"""One table's rows, whole or split in two parts (a hybrid table).

A table whose rows (values and optimizer state) exceed its share of
global_hbm_for_values keeps its first rows (the head, the share's worth) in
accelerator memory and the rest (the tail) in host memory: pinned on a CUDA
device, where the kernels read and write it in place through its mapped
pointer. Row r is in the head below `split`, else row r - split of the tail:
the rule of csrc/embedding/row_parts.h, which every kernel follows. A row's
place follows its hash table slot, so a table's growth keeps the head full
and adds to the tail.

The kernels take a module's rows as one list (HashTableStorage.weights): one
tensor per table, or, when a table is split, every head then every tail.
This module holds the Python side of the rule: reads and writes of rows by
index across the parts (export, load, growth)."""
from typing import List, Optional, Sequence

import torch

from dynamicemb import memory


def new_parts(rows: int, width: int, head_rows: Optional[int], dtype: torch.dtype, device: torch.device
              ) -> "TableRows":
    """Zero-filled rows of a table, split at head_rows (None: no split; the
    pages are touched here, not by the first steps, as a static table's
    initialisation touches them). On a CUDA device the tail is pinned host
    memory."""
    head = rows if head_rows is None else min(rows, head_rows)
    tail = None
    if head < rows:
        if device.type == "cuda":
            tail = torch.zeros(rows - head, width, dtype=dtype, pin_memory=True)
        else:
            tail = memory.zeros((rows - head, width), dtype, device)
    return TableRows(memory.zeros((head, width), dtype, device), tail)


class TableRows:
    """Rows [0, split) in `head`, rows [split, count) in `tail` (None: none).
    Reads come back on the head's device."""

    def __init__(self, head: torch.Tensor, tail: Optional[torch.Tensor] = None):
        self.head, self.tail = head, tail

    @property
    def split(self) -> int:
        return self.head.shape[0]

    @property
    def count(self) -> int:
        return self.split + (0 if self.tail is None else self.tail.shape[0])

    @property
    def shape(self):
        return (self.count, self.head.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.head.dtype

    @property
    def device(self) -> torch.device:
        return self.head.device

    def element_size(self) -> int:
        return self.head.element_size()

    def columns(self, lo: int, hi: Optional[int] = None) -> "TableRows":
        """Columns [lo, hi) of every row (views of both parts)."""
        return TableRows(self.head[:, lo:hi], None if self.tail is None else self.tail[:, lo:hi])

    def _where(self, rows: torch.Tensor):
        """(positions in the head, their rows), (positions in the tail, their rows there)."""
        in_head = rows < self.split
        at_head = in_head.nonzero().squeeze(1)
        at_tail = (~in_head).nonzero().squeeze(1)
        return (at_head, rows.index_select(0, at_head)), (at_tail, rows.index_select(0, at_tail) - self.split)

    def index_select(self, dim: int, rows: torch.Tensor, out_device: Optional[torch.device] = None) -> torch.Tensor:
        """Rows `rows` (any order, repeats allowed), as a new tensor on
        out_device (default: the head's). Each part's rows cross to it once
        (a dump's host rows do not go through the device)."""
        assert dim == 0
        out_device = self.device if out_device is None else torch.device(out_device)
        rows = rows.to(self.device)
        if self.tail is None:
            return self.head.index_select(0, rows).to(out_device)
        out = torch.empty((rows.numel(), self.head.shape[1]), dtype=self.dtype, device=out_device)
        for part, (at, r) in zip((self.head, self.tail), self._where(rows)):
            out[at.to(out_device)] = part.index_select(0, r.to(part.device)).to(out_device)
        return out

    def write(self, rows: torch.Tensor, values) -> None:
        """Row rows[i] := values[i] (a tensor of len(rows) rows, or a scalar for all)."""
        rows = rows.to(self.device)
        if self.tail is None:
            self.head[rows] = values if not torch.is_tensor(values) else values.to(self.device, self.dtype)
            return
        (at_h, r_h), (at_t, r_t) = self._where(rows)
        for part, at, r in ((self.head, at_h, r_h), (self.tail, at_t, r_t)):
            if torch.is_tensor(values):
                part[r.to(part.device)] = values.to(self.device, self.dtype).index_select(0, at).to(part.device)
            else:
                part[r.to(part.device)] = values

    def zero_(self) -> None:
        for part in self.parts():
            part.zero_()

    def parts(self) -> List[torch.Tensor]:
        return [self.head] + ([] if self.tail is None else [self.tail])


def kernel_weights(rows: Sequence[TableRows]) -> List[torch.Tensor]:
    """The kernels' list (row_parts.h): each table's head; when any table is
    split, then each table's tail (an empty one for a table kept whole)."""
    heads = [r.head for r in rows]
    if all(r.tail is None for r in rows):
        return heads
    return heads + [r.tail if r.tail is not None else r.head[:0] for r in rows]
