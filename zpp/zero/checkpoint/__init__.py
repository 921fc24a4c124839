"""Sharded checkpoints: verified, published atomically, loadable at any world size and stage.

=========================  ==================================================================
:mod:`.save`               ``save_checkpoint``: the layout and [Note: save protocol]
:mod:`.load`               ``load_checkpoint``: [Note: resharding], [Note: no half-loaded engine]
:mod:`.files`              CRC32-checked, fsync-ed files: [Note: checksums], [Note: durability]
:mod:`.publish`            staging, the atomic rename, ``latest``, stale files: [Note: publishing]
:mod:`.agree`              every rank raises or none does: [Note: agreement]
:mod:`.consolidate`        ``consolidated_state_dict``
=========================  ==================================================================
"""
from zpp.zero.checkpoint.consolidate import consolidated_state_dict
from zpp.zero.checkpoint.errors import CheckpointError
from zpp.zero.checkpoint.load import load_checkpoint
from zpp.zero.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "consolidated_state_dict", "load_checkpoint", "save_checkpoint"]
