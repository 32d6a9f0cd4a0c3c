"""Durability helpers shared by the checkpoint writer and the file store:
a file or a directory entry is on disk once fsynced (a rename is durable
only after its directory is)."""
import os


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Makes the directory's entries (created, renamed, removed files) durable."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: str) -> None:
    """Makes a file written through another handle durable."""
    _fsync(path, os.O_RDONLY)
