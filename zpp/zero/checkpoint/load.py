"""``load_checkpoint``: read and verify everything, agree, then apply.

[Note: resharding]
A shard records the parameter names of each unit and the range ``[start, stop)`` of the
unit's flat buffer it covers. Loading reads every shard file, checks that the ranges of
each unit tile it, concatenates them and cuts the result into per-parameter vectors by
name; each rank then rebuilds its own units (whatever the new world size, stage or bucket
size) from those vectors and keeps its owned range. The transient cost is one full copy of
the model states per rank.

[Note: no half-loaded engine]
Every rank first reads and checks every file it needs (sizes and CRC32 against
``meta.json``, the shards against ``meta.json``'s units, the names against the model) into
memory without touching the engine; the ranks then agree (see [Note: agreement] in
:mod:`zpp.zero.checkpoint.agree`), and only if every rank succeeded does any rank change
its engine. A failed load leaves every rank's engine exactly as it was. The shard files are
read as memory maps; each unit's values and optimizer state are assembled from them (memory
copies of checked bytes, nothing that can fail on bad input) only while it is applied, one
unit at a time, so a load holds one unit's state beside the engine's, not the whole model's.

[Note: loading modes]
Each mode's state is read by its reshard rule (see [Note: mode state in checkpoints] in
:mod:`zpp.zero.modes.base`): the per-element state with the units' optimizer state, the
per-rank state from this rank's file at the same job world size (else rank 0's), checked
by the mode while nothing has changed yet, the replicated state from ``meta.pt``. Without
the optimizer states (``load_optimizer_states=False``, ``load_module_only``) every mode gets
None: it starts afresh from the loaded weights (or keeps what it has: the 1-bit optimizer).

[Note: loading replicas]
A checkpoint of the hierarchical mode holds one replica per node (see [Note: replicas] in
:mod:`.save`). A hierarchical engine with as many nodes loads its own node's replica, any
ranks per node, stage or bucket size (the replica reshards as above), and its outer state:
the anchor and momentum from the units' optimizer state, the rest from its rank's
``outer_rankR.pt`` (see [Note: outer state in checkpoints] in zpp/zero/outer/sync.py). With
another number of nodes, and for an engine without ``zpp.outer``, every rank loads replica 0.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from zpp.zero.checkpoint import publish as pub
from zpp.zero.checkpoint.agree import exchange, failure, raise_agreed
from zpp.zero.checkpoint.errors import CheckpointError
from zpp.zero.checkpoint.files import check_present, describe, load_torch, read_verified
from zpp.zero.modes import MODES
from zpp.zero.checkpoint.save import (
    CLIENT_STATE,
    COUNTERS,
    FORMAT,
    META_JSON,
    META_PT,
    copies_name,
    manifest_crc,
    mode_file_name,
    mode_key,
    shard_name,
)

log = logging.getLogger("zpp.zero")


@dataclasses.dataclass
class _Read:
    """Everything a load applies, read and checked (see [Note: no half-loaded engine])."""

    path: Path
    meta: dict[str, Any]
    units: list[tuple[Any, Callable[[], tuple[torch.Tensor, dict | None]]]]  # (unit, its values and state)
    extra: dict[str, Any]  # meta.pt
    client_state: dict
    modes: list[tuple[Any, Any, bool]]  # (mode, its per-rank or replicated state or None, whether it is its own)
    copies: tuple[Any, dict[int, dict], str | None] | None  # (store, the slices it holds again, why not all)
    load_optimizer: bool
    load_scheduler: bool
    load_counters: bool


def load_checkpoint(engine, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict | None]:
    """Collective: load a checkpoint written by :func:`~zpp.zero.checkpoint.save_checkpoint`
    at any world size or stage; DeepSpeed's signature and return value.

    Args:
        load_dir: the directory of the checkpoints.
        tag: which checkpoint (Default: the one ``load_dir/latest`` names).
        load_module_strict: raise ``ValueError`` naming them if the checkpoint lacks some of
            the model's parameters or buffers, or holds some the model does not have; False
            loads those present (a unit with a missing parameter starts with fresh optimizer
            state). Parameters saved with ``exclude_frozen_parameters`` are not missing.
        load_optimizer_states: restore the optimizer's state and hyper-parameters; False
            leaves the optimizer as it is (fresh after ``initialize``), as DeepSpeed does.
        load_lr_scheduler_states: restore the schedule (False: leave it as it is).
        load_module_only: weights and buffers only: the optimizer, the schedule and the step
            counters stay as they are (DeepSpeed's warm start).

    Returns:
        ``(path of the checkpoint directory, client_state)``; ``(None, None)`` when ``tag`` is
        None and there is no ``load_dir/latest`` (with a warning, as DeepSpeed).

    Raises (on every rank, the engine untouched; see [Note: no half-loaded engine]):
        FileNotFoundError: the tag's directory does not exist (DeepSpeed raises a bare
            AssertionError here).
        CheckpointError: a missing, truncated or corrupt file, or metadata that disagrees
            with the shards, naming the file and the tag.
        ValueError: the checkpoint does not fit the model (strict names, sizes).
    """
    world = engine.job_world
    want = {"optimizer": load_optimizer_states and not load_module_only,
            "scheduler": load_lr_scheduler_states and not load_module_only, "counters": not load_module_only}
    root = Path(load_dir)
    read: _Read | None = None
    own = None
    try:
        read = _read(engine, root, tag, strict=load_module_strict, **want)
        mine = {"ok": True, "found": read is not None, "tag": None if read is None else read.path.name,
                "copies": _copies_plan(read)}
    except Exception as e:  # noqa: BLE001 - see [Note: agreement]
        mine, own = {**failure(e), "found": None, "tag": None}, e
    results = exchange(world, mine, during=f"load_checkpoint({root}): the ranks were agreeing on what they read")
    raise_agreed(results, own=own, suffix="; no rank loaded anything")
    found = {r["found"] for r in results}
    tags = {r["tag"] for r in results}
    if len(found) > 1 or len(tags) > 1:
        raise CheckpointError(
            f"load_checkpoint: the ranks read different checkpoints from {root}: "
            f"{[r['tag'] for r in results]} (one per rank; None: no {pub.LATEST} file); {root} must be on a "
            "filesystem every rank shares, and not be saved to while it loads")
    if read is None:
        if world.rank == 0:
            warnings.warn(f"load_checkpoint: no tag given and no {root / pub.LATEST}: nothing loaded",
                          stacklevel=3)
        return None, None
    _agree_copies(read, results)
    _apply(engine, read)
    return str(read.path), read.client_state


# ---------------------------------------------------------------------- reading (no engine change)
def _read(engine, root: Path, tag: Any, *, strict: bool, optimizer: bool, scheduler: bool,
          counters: bool) -> _Read | None:
    if tag is None:
        latest = root / pub.LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
        if not tag:
            raise CheckpointError(f"load_checkpoint: {latest} is empty")
    tag = str(tag)
    path = root / tag
    if not path.is_dir():
        raise FileNotFoundError(f"load_checkpoint: checkpoint tag {tag!r} not found: no directory {path}")
    meta = _read_manifest(path, tag)
    files = meta.get("files")  # None: format 1, unverified
    if files is not None:
        for name, rec in files.items():
            check_present(path / name, rec, tag)

    def record(name: str) -> dict | None:
        if files is None:
            return None
        if name not in files:
            raise CheckpointError(f"load_checkpoint: {describe(path / name, tag)} is not in meta.json's files")
        return files[name]

    by_name = _collect(path, meta, tag, record, replica=_replica(engine, meta))
    extra = load_torch(path / META_PT, record(META_PT), tag)
    _check_save_id(extra, meta, path / META_PT, tag)
    _check_names(engine, by_name, extra, meta, path, strict)
    modes = [(m, *_read_mode(engine, m, path, meta, extra, tag, record)) if optimizer else (m, None, False)
             for m in engine.modes]
    if optimizer and len(extra["param_groups"]) != len(engine.optimizer.param_groups):
        raise ValueError(f"load_checkpoint: the checkpoint {path} has {len(extra['param_groups'])} optimizer "
                         f"parameter groups, the engine {len(engine.optimizer.param_groups)}; pass "
                         "load_optimizer_states=False to start the optimizer afresh")
    client = load_torch(path / CLIENT_STATE, record(CLIENT_STATE), tag) if files is not None else {}
    unit_optimizer = optimizer and not any(m.owns_optimizer_state for m in engine.modes)
    units = [(u, functools.partial(_unit_values, u, by_name, unit_optimizer)) for u in engine.units]
    copies = _read_copies(engine, path, meta, tag, record, by_name)
    return _Read(path, meta, units, extra, client, modes, copies, optimizer, scheduler, counters)


def _read_copies(engine, path: Path, meta: dict, tag: str, record,
                 by_name: Mapping[str, Any]) -> tuple[Any, dict[int, dict], str | None] | None:
    """The gathers' store of copies, the saved slices it will hold again and why not all
    (see [Note: the copies in checkpoints] in zpp/zero/gather/delta.py); None: no store.
    Nothing changes."""
    store = engine.comms.resumable() if engine.policy.shard_parameters else None
    if store is None:
        return None
    if meta["world_size"] != engine.job_world.world_size:
        return store, {}, f"the checkpoint's world size is {meta['world_size']}, this job's " \
                          f"{engine.job_world.world_size}"
    f = path / copies_name(engine.job_world.rank - store.topology.rank + store.saved_by())
    saved = None
    if meta.get("files") is not None and f.name in meta["files"]:
        obj = load_torch(f, record(f.name), tag, mapped=True)
        _check_save_id(obj, meta, f, tag)
        saved = obj["copies"]
    return store, *store.plan(saved, engine.units, lambda u: all(n in by_name for n in u.names))


def _agree_copies(read: _Read, results: list[dict]) -> None:
    """Every rank holds the same units' copies again, or none does (see [Note: the copies
    in checkpoints] in zpp/zero/gather/delta.py)."""
    plans = [r.get("copies") for r in results]
    if read.copies is not None and any(p != plans[0] for p in plans):
        read.copies = (read.copies[0], {}, "the ranks' saved copies are of different units (one rank's world "
                                           "gather beside another's node gather would not be one collective)")


def _copies_plan(read: _Read | None) -> list | None:
    """What this rank's store would hold again, in a form the ranks compare."""
    if read is None or read.copies is None:
        return None
    return sorted((i, bool(s["stale"])) for i, s in read.copies[1].items())


def _restore_copies(engine, read: _Read) -> None:
    if read.copies is None:
        return
    store, use, reason = read.copies
    store.restore(use, engine.units)
    if reason is not None and engine.job_world.rank == 0:
        held = f"hpZ's weight-delta copies (but the {len(use)} units' held again)" if use else \
            "hpZ's weight-delta copies"
        log.warning("zpp: load_checkpoint: %s start again from a world gather (the resumed forward weights "
                    "differ from the uninterrupted run's within the quantization error): %s", held, reason)


def _replica(engine, meta: dict) -> int:
    """Which replica this rank loads (see [Note: loading replicas])."""
    return engine.replica if meta.get("replicas", 1) == engine.replicas else 0


def _read_mode(engine, mode, path: Path, meta: dict, extra: dict, tag: str, record) -> tuple[Any, bool]:
    """A mode's state and whether it is this rank's own (see [Note: loading modes]): the
    replicated one from ``meta.pt``, or the per-rank one from this rank's file when the
    checkpoint is of the same job world, else from rank 0's (None: no such file), as the
    mode's :meth:`~zpp.zero.modes.base.Mode.check_state` accepts it."""
    own = meta["world_size"] == engine.job_world.world_size
    if mode.per_rank_file is None:
        steps = extra.get("step_state")
        return (steps.get(mode.name, {}) if steps else None), own
    f = path / mode_file_name(mode, engine.job_world.rank if own else 0)
    state = None
    if f.exists():
        obj = load_torch(f, record(f.name), tag, mapped=True)
        _check_save_id(obj, meta, f, tag)
        state = obj[mode_key(mode)]
    return mode.check_state(state, own=own, path=str(f), where=describe(f, tag)), own


def read_parameters(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The parameters of the checkpoint directory ``path`` (``save_dir/tag``) by name, each
    ``{"values": fp32 vector, <optimizer state key>: ...}``, checked as a load checks them;
    no engine or process group needed."""
    path = Path(path)
    meta = _read_manifest(path, path.name)
    files = meta.get("files")
    by_name = _collect(path, meta, path.name, lambda name: None if files is None else files[name])
    return {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
            for n, p in by_name.items()}


def _read_manifest(path: Path, tag: str) -> dict[str, Any]:
    f = path / META_JSON
    if not f.exists():
        raise CheckpointError(f"load_checkpoint: {describe(f, tag)} is missing: an incomplete save of an older "
                              "zpp, or not a zpp checkpoint")
    try:
        meta = json.loads(read_verified(f, None, tag))
    except ValueError as e:
        raise CheckpointError(
            f"load_checkpoint: {describe(f, tag)} is not valid JSON (truncated or corrupt): {e}") from e
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in (1, FORMAT):
        raise CheckpointError(
            f"load_checkpoint: {describe(f, tag)} has format={fmt!r}; this zpp reads 1 and {FORMAT}")
    if fmt == 1:
        warnings.warn(f"load_checkpoint: {path} is a format-1 checkpoint (no checksums): its files are not "
                      "verified", stacklevel=4)
        return meta
    if meta.get("manifest_crc32") != manifest_crc(meta):
        raise CheckpointError(f"load_checkpoint: {describe(f, tag)} is corrupt or was edited: its CRC32 does "
                              f"not match its manifest_crc32 ({meta.get('manifest_crc32')!r})")
    return meta


def _check_save_id(obj: dict, meta: dict, f: Path, tag: str) -> None:
    if "save_id" in meta and obj.get("save_id") != meta["save_id"]:
        raise CheckpointError(f"load_checkpoint: {describe(f, tag)} belongs to another save (save_id "
                              f"{obj.get('save_id')!r}, meta.json {meta['save_id']!r})")


def _collect(path: Path, meta: dict, tag: str, record, replica: int = 0) -> dict[str, SavedParameter]:
    """Per parameter name of replica ``replica``: its :class:`SavedParameter` (values and
    optimizer state); see [Note: resharding]. Checks the shards against ``meta.json``."""
    per = meta.get("replica_ranks", meta["world_size"])  # see [Note: loading replicas]
    ranks = range(replica * per, replica * per + (1 if meta["degree"] == 1 else per))
    declared = {tuple(u["names"]): u["numels"] for u in meta["units"]}
    pieces: dict[tuple, dict[int, dict]] = {k: {} for k in declared}
    for r in ranks:
        f = path / shard_name(r)
        shard = load_torch(f, record(f.name), tag, mapped=True)
        _check_save_id(shard, meta, f, tag)

        def bad(what: str, f=f) -> CheckpointError:
            return CheckpointError(f"load_checkpoint: {describe(f, tag)} disagrees with meta.json: {what}")

        if shard.get("world_size") != meta["world_size"] or shard.get("rank") != r:
            raise bad(f"it is rank {shard.get('rank')} of {shard.get('world_size')}, expected rank {r} of "
                      f"{meta['world_size']}")
        for e in shard["units"]:
            key = tuple(e["names"])
            if declared.get(key) != e["numels"]:
                raise bad(f"unit {key[0]!r}.. has sizes {e['numels']}, meta.json {declared.get(key)}")
            if e["values"].numel() != e["stop"] - e["start"]:
                raise bad(f"unit {key[0]!r}.. covers [{e['start']}, {e['stop']}) with {e['values'].numel()} values")
            pieces[key][e["start"]] = e
    out: dict[str, dict] = {}
    for names, ranges in pieces.items():
        n = sum(declared[names])
        entries = [ranges[s] for s in sorted(ranges)]
        end = 0
        for e in entries:
            if e["start"] != end:
                break
            end = e["stop"]
        if end < n:
            raise CheckpointError(f"load_checkpoint: tag {tag!r} ({path}): the shards cover only [0, {end}) of the "
                                  f"{n} elements of unit {names[0]!r}.. (meta.json lists it)")
        sliced, scalars = ["values"], {}
        for k, v in entries[0].get("optim", {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == entries[0]["values"].numel():
                sliced.append(k)
            else:
                scalars[k] = v  # per-tensor scalars such as Adam's step
        off = 0
        for name, numel in zip(names, declared[names], strict=True):
            out[name] = SavedParameter(entries, off, numel, tuple(sliced), scalars)
            off += numel
    return out


class SavedParameter(Mapping):
    """One parameter of a checkpoint, ``{"values": fp32 vector, <optimizer key>: tensor or
    scalar}``: each per-element tensor is cut from the shard files' mapped tensors when it is
    asked for (this parameter's range alone; nothing is kept), so reading a checkpoint
    holds no copy of the model states (see [Note: no half-loaded engine])."""

    __slots__ = ("_entries", "_off", "numel", "_sliced", "_scalars")

    def __init__(self, entries: list[dict], off: int, numel: int, sliced: tuple[str, ...], scalars: dict) -> None:
        self._entries, self._off, self.numel = entries, off, numel
        self._sliced, self._scalars = sliced, scalars

    def per_element(self, key: str) -> bool:
        return key in self._sliced

    def __getitem__(self, key: str) -> Any:
        if key in self._scalars:
            return self._scalars[key]
        if key not in self._sliced:
            raise KeyError(key)
        def of(e: dict) -> torch.Tensor:
            return e["values"] if key == "values" else e["optim"][key]

        lo, hi, parts = self._off, self._off + self.numel, []
        for e in self._entries:  # each covers [start, stop) of the unit, in order, contiguous
            a, b = max(lo, e["start"]), min(hi, e["stop"])
            if a < b:
                parts.append(of(e)[a - e["start"]:b - e["start"]])
        if not parts:  # a parameter of no elements
            return of(self._entries[0])[:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __iter__(self):
        yield from self._sliced
        yield from self._scalars

    def __len__(self) -> int:
        return len(self._sliced) + len(self._scalars)


def _check_names(engine, by_name: dict, extra: dict, meta: dict, path: Path, strict: bool) -> None:
    """Sizes must match; with ``strict`` the names too (parameters and buffers)."""
    params = {n: s.numel for u in engine.units for n, s in zip(u.names, u.layout.slots, strict=True)}
    sizes = [f"{n} ({by_name[n].numel} in the checkpoint, {k} in the model)"
             for n, k in params.items() if n in by_name and by_name[n].numel != k]
    if sizes:
        raise ValueError(f"load_checkpoint: {path}: parameters of another size: {sizes[:8]} (of {len(sizes)})")
    if not strict:
        return
    excluded = set(meta.get("excluded_frozen", ()))
    buffers = {n for n, _ in engine.module.named_buffers()}
    missing = [n for n in params if n not in by_name and n not in excluded]
    missing += [n for n in buffers if n not in extra["buffers"]]
    unexpected = [n for n in by_name if n not in params] + [n for n in extra["buffers"] if n not in buffers]
    if missing or unexpected:
        raise ValueError(
            f"load_checkpoint: {path} does not match the model: missing {missing[:8]} (of {len(missing)}), "
            f"unexpected {unexpected[:8]} (of {len(unexpected)}); pass load_module_strict=False to load the rest")


def _unit_values(u, by_name: dict, with_optimizer: bool) -> tuple[torch.Tensor, dict | None]:
    """The unit's full flat values (``layout.numel``) and its optimizer state (None: fresh);
    parameters the checkpoint lacks keep the engine's current values."""
    f, lay = u.flat, u.layout
    parts = [by_name.get(n) for n in u.names]
    if all(p is not None for p in parts):
        values = torch.cat([p["values"] for p in parts])
    else:
        base = torch.zeros(lay.padded_numel, dtype=torch.float32)
        if f.full is not None and not u.comms.policy.shard_parameters:
            base.copy_(f.full.detach().float().cpu())
        own = lay.owned(f.rank)
        with u.resident():
            base[own] = (f.master if f.master is not None else f.shard).detach().float().cpu()
        for p, slot in zip(parts, lay.slots, strict=True):
            if p is not None:
                base[slot.offset:slot.offset + slot.numel] = p["values"]
        values = base[:lay.numel]
    if not (u.trainable and with_optimizer) or any(p is None for p in parts):
        return values, None
    state = {}
    for k in parts[0]:
        if k == "values":
            continue
        per_element = all(p.per_element(k) and p.numel == slot.numel for p, slot in zip(parts, lay.slots, strict=True))
        if per_element:  # else per-tensor (Adam's step; a client optimizer's 1-element counter): as saved
            whole = torch.cat([p[k] for p in parts])
            full = torch.zeros(lay.padded_numel, dtype=whole.dtype)
            full[:lay.numel] = whole
            state[k] = full[lay.owned(f.rank)].clone().to(f.master.device)
        else:
            v = parts[0][k]
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return values, state


# ---------------------------------------------------------------------- applying (every rank read everything)
def _apply(engine, read: _Read) -> None:
    opt = engine.optimizer
    unit_optimizer = read.load_optimizer and not any(m.owns_optimizer_state for m in engine.modes)
    for u, assemble in read.units:  # one unit's values and state in memory at a time
        values, state = assemble()
        u.load_flat(values)
        state = dict(state) if state else {}
        by_mode = {name: {} for name in MODES}  # per-element mode state: see [Note: loading modes]
        for k in list(state):
            name, _, key = k.partition(".")
            if key and name in by_mode:  # (a mode this engine lacks: dropped)
                by_mode[name][key] = state.pop(k)
        for m in engine.modes:
            m.load_unit_state(u, (by_mode.get(m.name) or None) if read.load_optimizer else None)
        if u.trainable and unit_optimizer:
            if state:
                opt.state[u.flat.master] = state
            else:
                opt.state.pop(u.flat.master, None)
            for m in engine.modes:
                m.optimizer_state_loaded(u)
        del values, state
    _restore_copies(engine, read)  # after every unit's weights: loading them dropped the copies
    if read.load_optimizer:
        for g, saved in zip(opt.param_groups, read.extra["param_groups"], strict=True):
            g.update(saved)
    for m in engine.modes:
        m.after_load()
    if read.load_scheduler and engine.lr_scheduler is not None and read.extra["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(read.extra["scheduler"])
    buffers = dict(engine.module.named_buffers())
    for n, b in read.extra["buffers"].items():
        if n in buffers:
            buffers[n].data.copy_(b)
    if read.load_counters:
        for c in COUNTERS:
            if c in read.meta and hasattr(engine, c):
                setattr(engine, c, int(read.meta[c]))
    engine.zero_grad()
    for m, state, own in read.modes:  # per-rank and replicated mode state
        m.load_state_dict(state, own=own)
