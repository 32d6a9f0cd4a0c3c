"""One rank's failure raised on every rank: dumps and loads gather each
rank's status (None, or its error as text) after each phase, then raise_any
makes the failing rank raise its own error and the others an error naming
it, so that no rank is left waiting in a later collective."""
from typing import Callable, List, Optional

from dynamicemb.checkpoint.format import CheckpointError


def status(error: Optional[BaseException]) -> Optional[str]:
    """What the other ranks learn of this rank's error (None: it succeeded)."""
    if error is None:
        return None
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def raise_any(statuses: List[Optional[str]], mine: Optional[BaseException],
              naming: Callable[[int, str], BaseException]) -> None:
    """Raises this rank's own error, else naming(rank, status) of the first
    rank that failed; returns when every rank succeeded."""
    if mine is not None:
        raise mine
    bad = next((r for r, s in enumerate(statuses) if s is not None), None)
    if bad is not None:
        raise naming(bad, statuses[bad])
