"""Every rank starts from the same state: the same resolved config (a canonical form, its
digest, the keys two forms differ in, and the collective check) and the same parameters.

    check_same_config(world, config)   # at initialize, on every rank
    check_same_parameters(world, named)

[Note: config agreement]
A rank that trains with another stage, another ZeRO++ switch or another learning rate than
its peers either issues collectives of other sizes (gloo aborts the process) or silently
trains another model. :func:`check_same_config` compares the whole :class:`TrainConfig`
(stage, ZeRO++ switches, bits, group sizes, optimizer and hyper-parameters, precision,
scheduler, zpp's own keys: every field) in two collectives that have the same size on every
rank whatever the configs are: an all-gather of a 32-byte SHA-256 digest of each rank's
canonical JSON; and, only when the digests differ, an all-gather of the lengths of the
canonical JSON of one rank per distinct digest, then of those texts padded to the longest.
Every rank then holds the same texts and raises the same ``ValueError`` listing the keys
that differ and each key's value per rank. Nothing is sent that could mismatch in size, so
the check never hangs or aborts. The world layout itself (world size, ranks per node) is
the transport's and agrees by construction.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero.config import TrainConfig

__all__ = ["canonical", "canonical_json", "check_same_config", "check_same_parameters", "config_digest", "differing_keys", "flatten"]

DIGEST_BYTES = 32


def canonical(config: TrainConfig) -> dict[str, Any]:
    """Every field of ``config`` as plain JSON values (dicts, lists, numbers, strings,
    booleans, null), nested as the dataclasses are."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"canonical: expected a TrainConfig, got {type(config).__name__}")
    return _plain(config)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def canonical_json(config: TrainConfig) -> str:
    """The canonical text of ``config``: sorted keys, no spaces, floats as Python writes
    them (exact round trip); equal configs give equal texts on every machine."""
    return json.dumps(canonical(config), sort_keys=True, separators=(",", ":"), allow_nan=True)


def config_digest(config: TrainConfig) -> bytes:
    """SHA-256 of :func:`canonical_json` (32 bytes)."""
    return hashlib.sha256(canonical_json(config).encode()).digest()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves: ``{"zero": {"stage": 3}}`` -> ``{"zero.stage": 3}``; a list
    is a leaf (``optimizer.params.betas``); an empty dict is a leaf too."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


_ABSENT = object()


def differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two canonical forms (a key present in only
    one differs), sorted."""
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, _ABSENT) != fb.get(k, _ABSENT)
                  or type(fa.get(k)) is not type(fb.get(k)))


def _device(world: Transport) -> torch.device:
    """Where the transport's collectives take their tensors: NCCL carries device tensors."""
    if "nccl" in str(getattr(world, "backend", "")) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_bytes(world: Transport, data: bytes, device: torch.device) -> list[bytes]:
    """Every rank's ``data`` (any length, possibly empty), in rank order: an all-gather of
    the lengths, then of the data padded to the longest. Both calls have equal sizes on
    every rank."""
    W = world.world_size
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(W, dtype=torch.int64, device=device)
    world.all_gather(lengths, n)
    lengths = lengths.cpu().tolist()
    width = max(max(lengths), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(W * width, dtype=torch.uint8, device=device)
    world.all_gather(everyone, mine.to(device))
    rows = everyone.cpu().view(W, width)
    return [bytes(rows[r, :lengths[r]].tolist()) for r in range(W)]


def check_same_config(world: Transport, config: TrainConfig) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank's ``config`` is equal
    (every field); the message lists the keys that differ, with each key's value and the
    ranks holding it. Collective: every rank must call it. See [Note: config agreement]."""
    W = world.world_size
    if W == 1:
        return
    text = canonical_json(config).encode()
    device = _device(world)
    digest = torch.frombuffer(bytearray(hashlib.sha256(text).digest()), dtype=torch.uint8)
    digests = torch.empty(W * DIGEST_BYTES, dtype=torch.uint8, device=device)
    world.all_gather(digests, digest.to(device))
    rows = [bytes(r) for r in digests.cpu().view(W, DIGEST_BYTES).tolist()]
    if len(set(rows)) == 1:
        return
    first = {}  # digest -> the lowest rank holding it; that rank sends the text
    for r, d in enumerate(rows):
        first.setdefault(d, r)
    texts = _gather_bytes(world, text if first[rows[world.rank]] == world.rank else b"", device)
    forms = {d: flatten(json.loads(texts[r].decode())) for d, r in first.items()}
    keys = sorted({k for d in forms for k in differing_keys(forms[rows[0]], forms[d])})
    parts = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for r, d in enumerate(rows):
            v = forms[d].get(k, _ABSENT)
            by_value.setdefault("(absent)" if v is _ABSENT else json.dumps(v), []).append(r)
        parts.append(f"{k}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in by_value.items()))
    raise ValueError(f"zpp.initialize: the config differs between ranks in {len(keys)} keys; every rank must "
                     f"run the same config. " + "; ".join(parts))


def check_same_parameters(world: Transport, named: list[tuple[str, torch.nn.Parameter]], *,
                          on_mismatch: str = "raise") -> list[str]:
    """Compare every rank's parameters with rank 0's (a CRC32 per parameter, one all-gather)
    and, where they differ, raise the same ValueError on every rank (``on_mismatch="raise"``)
    or overwrite them with rank 0's (``"broadcast"``, one broadcast per differing parameter,
    as DeepSpeed broadcasts the model). Returns the names of the parameters that differed."""
    W = world.world_size
    if W == 1:
        return []
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
    sizes_differ = (rows[:, 0::2] != rows[0, 0::2]).any(dim=0)
    bad = sorted({b // 2 for b in (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()})
    if not bad:
        return []
    i = bad[0]
    name, p = named[i]
    ranks = [r for r in range(W) if bool((rows[r, 2 * i:2 * i + 2] != rows[0, 2 * i:2 * i + 2]).any())]
    if on_mismatch == "raise" or bool(sizes_differ.any()):
        raise ValueError(
            f"zpp.initialize: parameter {name!r} ({tuple(p.shape)}, {p.dtype}) differs from rank 0's on "
            f"ranks {ranks}" + (f" (and {len(bad) - 1} more parameters differ)" if len(bad) > 1 else "")
            + ("; shapes differ: build the same model on every rank" if bool(sizes_differ.any()) else
               "; seed the model identically on every rank or load the same weights"))
    with torch.no_grad():
        for i in bad:
            p = named[i][1]
            t = p.data if p.data.is_contiguous() else p.data.contiguous()
            world.broadcast(t, 0)
            if t is not p.data:
                p.data.copy_(t)
    return [named[i][0] for i in bad]
