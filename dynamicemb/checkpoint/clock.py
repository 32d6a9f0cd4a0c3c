"""Clock scores across a checkpoint (TIMESTAMP, NO_EVICTION, the (TIMESTAMP,
LFU) pair's access times).

A checkpoint stores them as ages against the saving rank's table clock, with
that clock's reading and its offset to the wall clock. A load gives back the
readings themselves when the saving ranks' clocks and the loading table's are
one clock (the same offset to the wall clock, to within a second: one host
since its boot, as a job restarted on its machine): incremental_dump's
thresholds from before the save then still select the keys touched since.
Otherwise (another host, or a checkpoint without readings) ages count back
from the load, which keeps the rows' order; thresholds from before it do not
apply (incremental_dump warns)."""
import time
from typing import List, Optional, Tuple

from dynamicemb import rules

ONE_CLOCK_NS = 10**9  # offsets to the wall clock this close: one clock


def reading(storage, table_id: int) -> dict:
    """The table clock now, with its offset to the wall clock (read together)."""
    now = storage.now(table_id)
    return {"clock": now, "clock_to_unix": now - time.time_ns()}


def saved_reading(storage, table_id: int) -> Optional[dict]:
    """What a checkpoint of the table records of its clock: reading(), or
    None for a table whose scores and access times are no clock readings."""
    return reading(storage, table_id) if rules.access_time_is_clock(storage.strategy(table_id)) else None


def latest_of_one_clock(readings: List[Optional[dict]]) -> Optional[dict]:
    """The latest of `readings` when every one is there and all are of one
    clock; else None (each age then counts back from the load)."""
    if not readings or any(r is None for r in readings):
        return None
    offsets = [r["clock_to_unix"] for r in readings]
    if max(offsets) - min(offsets) > ONE_CLOCK_NS:
        return None
    return max(readings, key=lambda r: r["clock"])


def restore_base(storage, table_id: int, latest: Optional[dict]) -> Tuple[int, bool]:
    """(base, exact): what ages relative to the saving clock's `latest`
    reading count back from on this table, and whether that gives back the
    saved readings. The table's clock is the saving clock: `latest` itself
    (exact). Another clock, or no common saving clock (latest None): the
    table's clock now."""
    mine = reading(storage, table_id)
    if latest is not None and abs(mine["clock_to_unix"] - latest["clock_to_unix"]) <= ONE_CLOCK_NS \
            and latest["clock"] <= mine["clock"]:
        return latest["clock"], True
    return mine["clock"], False
