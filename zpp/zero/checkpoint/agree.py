"""How the ranks agree on the outcome of a checkpoint phase.

[Note: agreement]
A rank never raises alone in the middle of a save or a load: it catches its own error,
and every rank then passes a small JSON record (``ok``, the error's type and message, and
what the phase produced, e.g. the CRC32 of the files it wrote) to :func:`exchange`, one
all-gather of the lengths and one of the padded bytes. If any rank failed, every rank
raises the same exception type with the first failing rank's message and the list of
failing ranks (:func:`raise_agreed`); so a failed write raises everywhere as soon as the
other ranks finish their own writes, instead of leaving them at a barrier until the
transport's timeout. A rank that dies instead shows up as the transport's
``ConnectionError`` (or ``TimeoutError``) in the exchange, re-raised with what was in
progress.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero.checkpoint.errors import CheckpointError

#: exception types a rank may raise in a phase; the others' are re-created by name
_TYPES: dict[str, type[Exception]] = {c.__name__: c for c in (
    CheckpointError, ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError, NotImplementedError)}


def failure(e: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(e).__name__, "error": str(e) if not isinstance(e, KeyError) else str(e.args[0])}


def exchange(world: Transport, mine: dict[str, Any], *, during: str) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (collective). ``during`` says, in an error, what
    was in progress when a peer was lost."""
    data = json.dumps(mine).encode()
    W = world.world_size
    try:
        sizes = torch.empty(W, dtype=torch.int64)
        world.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
        m = int(sizes.max())
        buf = torch.zeros(m, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(W * m, dtype=torch.uint8)
        world.all_gather(out, buf)
    except (ConnectionError, TimeoutError) as exc:
        raise type(exc)(f"{during}: {exc}") from exc
    raw = out.view(W, m).numpy()
    return [json.loads(raw[r, :int(sizes[r])].tobytes()) for r in range(W)]


def raise_agreed(results: list[dict[str, Any]], *, own: BaseException | None = None, suffix: str = "",
                 types: tuple[type[Exception], ...] = ()) -> None:
    """Raise on every rank if any rank's record is not ok (see [Note: agreement]); a no-op
    otherwise. ``own``: this rank's exception, chained as the cause; ``types``: exception
    types re-created by name besides the checkpoint phases' (others become CheckpointError)."""
    failed = [r for r, res in enumerate(results) if not res["ok"]]
    if not failed:
        return
    first = results[failed[0]]
    where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    cls = {**_TYPES, **{c.__name__: c for c in types}}.get(first["type"])
    msg = first["error"] if cls is not None else f"{first['type']}: {first['error']}"
    raise (cls or CheckpointError)(f"{msg} [on {where} of {len(results)}]{suffix}") from own
