"""Pages of a file's shared memory map faulted in ahead of the writes that
will reach them, on a background thread (FileStore's appends: a page's first
write costs a page-cache allocation and fault, which would otherwise fall on
the training step)."""
import ctypes
import errno
import os
import queue
import sys
import threading
from typing import Optional


class Prefaulter:
    """The thread (madvise MADV_POPULATE_WRITE, Linux >= 5.14; ctypes
    releases the GIL during the call). Content is never changed. Each
    request names its map's generation and runs under the file's lock, so a
    remap or close (which bump the generation under that lock) never leaves
    it working on a map that is gone."""

    MADV_POPULATE_WRITE = 23

    def __init__(self):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._madvise = None
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            threading.Thread(target=self._run, name="dynamicemb-prefault", daemon=True).start()

    @property
    def enabled(self) -> bool:
        return self._madvise is not None

    def submit(self, rows_file, generation: int, begin: int, end: int) -> None:
        """Fault in bytes [begin, end) of rows_file's map (it has `lock`,
        `generation` and `address`), if it is still that generation's."""
        self._queue.put((rows_file, generation, begin, end))

    def _run(self) -> None:
        while True:
            f, generation, begin, end = self._queue.get()
            with f.lock:
                if f.generation != generation:
                    continue  # remapped or closed since
                if self._madvise(f.address + begin, end - begin, self.MADV_POPULATE_WRITE) != 0:
                    if ctypes.get_errno() == errno.EINVAL:  # a kernel without it: no more requests
                        self._madvise = None
                        return
                    # else (out of memory, a signal): the appends fault those pages themselves


AHEAD = 8 << 20  # bytes of each map kept faulted in past its last append
_prefaulter: Optional[Prefaulter] = None
_prefaulter_pid = -1


def prefaulter() -> Prefaulter:
    """The process's prefaulter (a forked child starts its own)."""
    global _prefaulter, _prefaulter_pid
    if _prefaulter is None or _prefaulter_pid != os.getpid():
        _prefaulter, _prefaulter_pid = Prefaulter(), os.getpid()
    return _prefaulter
