"""Allocation of the long-lived arrays that kernels read at random (slot
arrays, embedding rows), and the memory budgets that bound their growth."""
from typing import Callable, Optional, Sequence, Union

import torch

from dynamicemb._ops import ops

# Hash table bytes per slot: key (8), score (8), digest (1), epoch (1).
TABLE_BYTES_PER_SLOT = 18


def table_bytes(slots: int, row_bytes: int) -> int:
    """Bytes of a table of `slots` slots on one rank: its rows (values and
    optimizer state, `row_bytes` each) and its hash table. The one measure
    of memory_budget and of the planner's reservation."""
    return slots * (row_bytes + TABLE_BYTES_PER_SLOT)


def empty(shape: Union[int, Sequence[int]], dtype: torch.dtype, device: torch.device,
          own_mapping: bool = False) -> torch.Tensor:
    """torch.empty, with a large CPU array backed by 2 MiB pages where the
    kernel offers them (csrc/common/huge_pages_cpu.h): asked for before its
    pages are first touched. own_mapping: in a fresh 2 MiB-aligned mapping
    of its own, which 2 MiB pages can back whole (served tables: read at
    random, never resized)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return ops.empty_huge(shape, dtype, own_mapping)


def full(shape: Union[int, Sequence[int]], value, dtype: torch.dtype, device: torch.device,
         own_mapping: bool = False) -> torch.Tensor:
    """empty(...) filled with value."""
    return empty(shape, dtype, device, own_mapping).fill_(value)


def zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype, device: torch.device,
          own_mapping: bool = False) -> torch.Tensor:
    """full(shape, 0, ...)."""
    return full(shape, 0, dtype, device, own_mapping)


def in_own_mapping(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's copy in a mapping of its own (empty's own_mapping); other devices' as they are."""
    if t.device.type != "cpu":
        return t
    return empty(t.shape, t.dtype, t.device, own_mapping=True).copy_(t)


# ---- memory budgets (DynamicEmbTableOptions.memory_budget) -----------------------------------


class DynamicEmbBudgetError(RuntimeError):
    """A table's new keys could not be stored because it is at its memory
    budget (raised under DynamicEmbCheckMode.ERROR; the keys are counted as
    failed). The message names the table, its rows, bytes and budget."""


def allocation_failed(error: BaseException) -> bool:
    """Whether an error is the allocator refusing memory (CPU or device)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


class TableBudget:
    """How far one table may grow on this rank: up to `max_slots` (its
    max_capacity in slots) whatever the budget; past it, a table that
    cannot evict (`grows_past_max`) doubles while the doubled table's
    table_bytes fit `budget` bytes. Checked before any allocation."""

    def __init__(self, name: str, row_bytes: int, max_slots: int, budget: Optional[int], grows_past_max: bool):
        self.name = name
        self.row_bytes = row_bytes
        self.max_slots = max_slots
        # No budget given: the bytes at max_capacity (outside a planner).
        self.budget = table_bytes(max_slots, row_bytes) if budget is None else budget
        self.grows_past_max = grows_past_max
        slots = max_slots
        while grows_past_max and table_bytes(2 * slots, row_bytes) <= self.budget:
            slots *= 2
        self.limit = slots  # the most slots growth may reach
        self.refusal: Optional[str] = None  # what the allocator said when a growth within the budget failed

    def refused(self, slots: int, error: str) -> None:
        """The allocator refused a growth within the budget: the table stops at `slots`."""
        self.limit = min(self.limit, slots)
        self.refusal = error.splitlines()[0] if error else "out of memory"

    def reached(self, size_of: Callable[[], int], slots: int) -> Optional[str]:
        """Why a table of size_of() keys in `slots` slots stores no more keys,
        when its budget (or memory that its budget promised but was not
        there) is the reason (None otherwise). The size, on CUDA a wait for
        the device, is asked for only then."""
        if slots < self.limit or not (self.grows_past_max or self.refusal):
            return None
        size = size_of()
        if self.refusal is not None:
            return (f"table {self.name!r} could not grow past {slots} slots ({size} rows, "
                    f"{table_bytes(slots, self.row_bytes)} bytes on this rank): the allocation failed within its "
                    f"memory_budget of {self.budget} bytes per rank ({self.refusal}); give it a memory_budget this "
                    f"device can hold, or free memory")
        return (f"table {self.name!r} is at its memory budget: {size} rows in {slots} slots take "
                f"{table_bytes(slots, self.row_bytes)} bytes on this rank, and doubling to {2 * slots} slots would "
                f"take {table_bytes(2 * slots, self.row_bytes)}, over its memory_budget of {self.budget} bytes per "
                f"rank (a NO_EVICTION table cannot evict); raise memory_budget in its DynamicEmbTableOptions (or "
                f"the planner's no_eviction_growth), or use a score_strategy that evicts")
