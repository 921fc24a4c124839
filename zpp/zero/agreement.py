"""Checks that every rank starts from the same state (one small collective each)."""
from __future__ import annotations

import zlib

import torch

from zpp.comm.transport import Transport


def check_same_parameters(world: Transport, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Raise the same ValueError on every rank if any rank's parameters differ from rank 0's
    (a CRC32 per parameter, one all-gather)."""
    W = world.world_size
    if W == 1:
        return
    count = torch.tensor([len(named)], dtype=torch.int64)
    counts = torch.empty(W, dtype=torch.int64)
    world.all_gather(counts, count)
    if len(set(counts.tolist())) > 1:
        raise ValueError(f"zpp.initialize: ranks hold different numbers of parameters: {counts.tolist()}")
    mine = torch.empty(2 * len(named), dtype=torch.int64)
    for i, (_n, p) in enumerate(named):
        flat = p.detach().cpu().contiguous().reshape(-1)
        mine[2 * i] = p.numel()
        mine[2 * i + 1] = zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0
    everyone = torch.empty(W * mine.numel(), dtype=torch.int64)
    world.all_gather(everyone, mine)
    rows = everyone.view(W, -1)
    bad = (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()
    if bad:
        i = bad[0] // 2
        name, p = named[i]
        ranks = [r for r in range(W) if bool((rows[r, 2 * i:2 * i + 2] != rows[0, 2 * i:2 * i + 2]).any())]
        others = len({b // 2 for b in bad}) - 1
        raise ValueError(
            f"zpp.initialize: parameter {name!r} ({tuple(p.shape)}, {p.dtype}) differs from rank 0's on "
            f"ranks {ranks}" + (f" (and {others} more parameters differ)" if others else "")
            + "; seed the model identically on every rank or load the same weights")
