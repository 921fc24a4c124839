"""The error a checkpoint raises when its files cannot be written or read as recorded."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a written one is not what its ``meta.json``
    records (a missing, truncated or corrupt file, a file of another save, metadata that
    disagrees with the shards). The message names the file, the tag and the directory; it is
    raised on every rank (see [Note: agreement] in :mod:`zpp.zero.checkpoint.agree`)."""
