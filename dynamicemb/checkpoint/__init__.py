"""Parallel, atomic, verifiable checkpoints of dynamic tables (API.md §4)."""
from dynamicemb.checkpoint.dump import DumpHandle, DynamicEmbDump
from dynamicemb.checkpoint.format import CheckpointError
from dynamicemb.checkpoint.load import DynamicEmbLoad

__all__ = ["CheckpointError", "DumpHandle", "DynamicEmbDump", "DynamicEmbLoad"]
