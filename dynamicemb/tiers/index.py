"""KeyIndex: key -> (row position, score) of the tables of a backing store,
on one ScoredHashTable (a logical table each, so a call for keys of several
tables is one kernel call). Each table grows (doubling) as keys arrive and,
once at its maximum capacity, evicts the lowest-scored key of a full bucket.
Positions address rows the store keeps elsewhere (a host tensor, a file),
per table. `tids` arguments say which table each key is of; a single-table
index takes none."""
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from dynamicemb import memory
from dynamicemb.positions import scatter_rows, where_true
from dynamicemb.table import ScoredHashTable, doubling_capacities
from dynamicemb.types import DynamicEmbScoreStrategy, InsertResult

MIN_SLOTS = 1024  # where a table of the index starts (its room doubles from there)


def index_capacities(max_rows: int, bucket_capacity: int) -> Tuple[int, int]:
    """A table of the index for `max_rows` keys: (its starting slots, the
    slots it reaches), from MIN_SLOTS doubling exactly into its maximum
    (doubling_capacities; the planner charges the maximum)."""
    return doubling_capacities(MIN_SLOTS, max_rows, bucket_capacity)


class Entries(NamedTuple):
    keys: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    table_ids: torch.Tensor


def _empty_entries() -> Entries:
    e = torch.zeros(0, dtype=torch.int64)
    return Entries(e, e, e, e)


class KeyIndex:
    def __init__(self, name: str, max_rows: int, bucket_capacity: int = 128):
        self.bucket_capacity = bucket_capacity
        self.names: List[str] = []
        self.max_rows: List[int] = []
        self.min_slots: List[int] = []  # where each table starts, and starts again when cleared
        self.max_slots: List[int] = []  # its maximum, which its start doubles into exactly
        self.ht: Optional[ScoredHashTable] = None
        self.pos: Optional[torch.Tensor] = None  # per slot: its key's row position
        self.add_table(name, max_rows)

    # ---- tables --------------------------------------------------------------------

    def add_table(self, name: str, max_rows: int) -> int:
        """Declares one more table (empty, at its start); returns its id."""
        self.names.append(name)
        self.max_rows.append(max_rows)
        lo, hi = index_capacities(max_rows, self.bucket_capacity)
        self.min_slots.append(lo)
        self.max_slots.append(hi)
        caps = (self.ht.capacities() if self.ht is not None else []) + [lo]
        self._rebuild(caps)
        return len(self.names) - 1

    def reserve(self, table: int, rows: int) -> None:
        """Table `table` starts with slots for `rows` keys (at most its
        maximum), where it holds none yet."""
        if self.size(table) or rows <= self.min_slots[table]:
            return
        lo, hi = doubling_capacities(rows, self.max_rows[table], self.bucket_capacity)
        self.min_slots[table], self.max_slots[table] = lo, hi
        caps = self.ht.capacities()
        caps[table] = lo
        self._rebuild(caps)

    def _rebuild(self, caps: List[int]) -> None:
        """A new hash table of per-table capacities `caps`, every entry
        moved into it (the tables whose capacity changes are empty: the
        others' buckets keep their keys, so none overflows)."""
        old, old_pos = self.ht, self.pos
        # CUSTOMIZED: the table keeps the scores it is given (clock readings,
        # steps or counts of the caching table's own strategy).
        self.ht = ScoredHashTable(caps, bucket_capacity=self.bucket_capacity, num_tables=len(caps),
                                  score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED, table_names=self.names)
        self.pos = memory.full(sum(caps), -1, torch.int64, "cpu")  # read and written at random
        if old is None:
            return
        for b in old.export(batch_size=1 << 20):
            out = self.ht.insert(b.keys, b.table_ids, scores=b.scores, evict=False)
            if bool((out.results == InsertResult.FAILED).any()):  # cannot happen (see above)
                raise RuntimeError(f"the key index of tables {self.names} overflowed while rebuilt")
            self.pos.index_copy_(0, out.indices, old_pos.index_select(0, b.indices))

    def _export_id(self, table: int) -> Optional[int]:
        return table if len(self.names) > 1 else None

    def _tids(self, tids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if tids is None and len(self.names) > 1:
            raise ValueError(f"the key index of tables {self.names} needs table ids")
        return tids

    def __len__(self) -> int:
        return self.ht.size()

    def size(self, table: int = 0) -> int:
        return self.ht.size(table)

    # ---- keys ----------------------------------------------------------------------

    def find(self, keys: torch.Tensor, tids: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(found, positions, scores) of the keys (-1 / 0 where missing)."""
        slots, found = self.ht.lookup(keys, self._tids(tids))
        safe, missing = slots.clamp(min=0), ~found
        # index_select: several times faster than advanced indexing on the CPU
        pos = self.pos.index_select(0, safe).masked_fill_(missing, -1)
        return found, pos, self.ht.slot_scores.index_select(0, safe).masked_fill_(missing, 0)

    def take_found(self, keys: torch.Tensor, tids: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Removes the keys the index holds; returns (their positions in keys,
        ascending, their row positions, their scores)."""
        return self.ht.take(keys, self._tids(tids), self.pos)

    def add(self, keys: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor,
            tids: Optional[torch.Tensor] = None) -> Entries:
        """Adds distinct keys not in the index. Returns the entries displaced
        once a table is at its maximum (the lowest-scored of a full bucket),
        whose positions the store frees."""
        if not keys.numel():
            return _empty_entries()
        tids = self._tids(tids)
        failed = self._place(keys, positions, scores, tids)
        if failed is None:
            return _empty_entries()
        ht = self.ht
        evicted = []
        while bool(failed.any()):  # at the maximum: evict (a new call, so this add's own keys may go too)
            sel = where_true(failed)
            last = ht.insert(keys[sel], None if tids is None else tids[sel], scores=scores[sel], evict=True)
            ev = last.evicted
            evicted.append(Entries(ev.keys, self.pos[ev.indices].clone(), ev.scores, ev.table_ids))
            ok = last.results != InsertResult.FAILED
            self.pos[last.indices[ok]] = positions[sel[ok]]
            failed = failed.clone()
            failed[sel[ok]] = False
        if not evicted:
            return _empty_entries()
        return Entries(*(torch.cat(parts) for parts in zip(*evicted)))

    def add_if_room(self, keys: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor,
                    tids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """add, evicting nothing: the keys that find no slot (their bucket
        full with the table at its maximum) are left out; returns a mask of them."""
        failed = self._place(keys, positions, scores, self._tids(tids)) if keys.numel() else None
        return torch.zeros(keys.shape, dtype=torch.bool) if failed is None else failed

    def _place(self, keys, positions, scores, tids) -> Optional[torch.Tensor]:
        """Inserts the keys with their positions, growing (doubling) tables
        below their maximum as their buckets fill; returns a mask of the keys
        left without a slot (None: none was)."""
        ht = self.ht
        failures = ht.get_counters()["failed"]  # read, not a pass over the results
        out = ht.insert(keys, tids, scores=scores, evict=False)
        if ht.get_counters()["failed"] == failures:  # the usual case: every key found a free slot
            scatter_rows(self.pos.view(-1, 1), out.indices, positions.view(-1, 1))
            return None
        failed = out.results == InsertResult.FAILED
        ok = where_true(~failed)
        self.pos[out.indices[ok]] = positions[ok]
        all_tids = torch.zeros_like(keys) if tids is None else tids
        while bool(failed.any()):  # grow (doubling) the tables below their maximum; positions move with the slots
            caps = ht.capacities()
            grow = {t for t in all_tids[failed].unique().tolist() if caps[t] < self.max_slots[t]}
            if not grow:
                break
            self._grow([2 * c if t in grow else c for t, c in enumerate(caps)])
            sel = where_true(failed)
            out = ht.insert(keys[sel], None if tids is None else tids[sel], scores=scores[sel], evict=False,
                            same_call=True)
            ok = out.results != InsertResult.FAILED
            self.pos[out.indices[ok]] = positions[sel[ok]]
            failed = failed.clone()
            failed[sel[ok]] = False
        return failed

    def _grow(self, caps: Sequence[int]) -> None:
        slots = sum(caps)
        old_idx, new_idx = self.ht.grow(list(caps))
        pos = memory.full(slots, -1, torch.int64, "cpu")
        pos[new_idx] = self.pos[old_idx]
        self.pos = pos

    # ---- whole tables --------------------------------------------------------------

    def items(self, batch_size: int = 1 << 16, table: int = 0) -> Iterator[Tuple[torch.Tensor, ...]]:
        """(keys, positions, scores) of every key of a table."""
        for b in self.ht.export(batch_size=batch_size, table_id=self._export_id(table)):
            yield b.keys, self.pos[b.indices], b.scores

    def live_slots(self, table: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots, positions) of every key of a table, in the order of their
        positions (a store compacting its rows copies them in that order)."""
        slots = [b.indices for b in self.ht.export(batch_size=1 << 20, table_id=self._export_id(table))]
        slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        pos = self.pos[slots]
        order = pos.argsort()
        return slots[order], pos[order]

    def move(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New positions of the keys at `slots` (from live_slots, no insert since)."""
        self.pos[slots] = positions

    def shift_scores(self, delta: int, table: int = 0) -> None:
        """Adds delta to every score of a table (clock readings carried to another clock)."""
        for b in self.ht.export(batch_size=1 << 20, table_id=self._export_id(table)):
            self.ht.slot_scores[b.indices] += delta

    def clear(self, table: int = 0) -> None:
        """Removes every key of a table; it starts again at its start."""
        caps = self.ht.capacities()
        caps[table] = self.min_slots[table]
        if len(self.names) == 1:
            self.ht = None
        else:  # the others' entries move to the new table; this one's are dropped first
            for b in list(self.ht.export(batch_size=1 << 20, table_id=table)):
                self.ht.erase(b.keys, table)
        self._rebuild(caps)


class TableView:
    """One table of a KeyIndex, with a single-table index's calls."""

    def __init__(self, index: KeyIndex, table: int):
        self.index, self.table = index, table

    def __len__(self) -> int:
        return self.index.size(self.table)

    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.index.find(keys, torch.full_like(keys, self.table))

    def items(self, batch_size: int = 1 << 16) -> Iterator[Tuple[torch.Tensor, ...]]:
        return self.index.items(batch_size, self.table)

    def live_slots(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.index.live_slots(self.table)

    def move(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.index.move(slots, positions)

    def clear(self) -> None:
        self.index.clear(self.table)
