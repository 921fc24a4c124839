"""Sharded checkpoints that load at any world size and any stage.

Layout of ``save_dir/tag/``::

    shard_rank00000.pt ...   one per rank: for each unit, its owned range of the flat fp32
                             master weights (frozen units: the parameters) and of every
                             per-element optimizer state tensor, plus the unit's names/sizes
    meta.json                world size, stage, steps, units (human-readable)
    meta.pt                  buffers, optimizer hyper-parameters, scheduler state, the
                             engine's step state (fp16 loss scaler, skipped steps)

    onebit_optim_rank00000.pt ...   with a 1-bit optimizer: each rank's optimizer state

and ``save_dir/latest`` names the newest tag. Every file is written to a temporary name and
``os.replace``-d into place; rank 0 writes ``meta.*`` only after every rank's shard is in
place (a barrier), and ``latest`` last, so a crash never leaves a checkpoint that looks
complete but is not.

[Note: resharding]
A shard records the parameter names of its unit and the range ``[start, stop)`` of the
unit's flat buffer it covers. Loading reads every old shard file, concatenates the ranges of
each unit and cuts the result into per-parameter vectors by name; each rank then rebuilds
its own units (whatever the new world size, stage or bucket size) from those vectors and
keeps its owned range. The transient cost is one full copy of the model states per rank.

[Note: 1-bit optimizer state]
With a 1-bit optimizer (see [Note: 1-bit optimizers] in :mod:`zpp.zero.optimizer`) each
rank first writes ``onebit_optim_rankR.pt``, its optimizer ``state_dict`` (error-feedback
buffers, phase and counters, and its own weights), before the collective part, so
``latest`` never names a checkpoint without them. At the same world size every rank
restores its own file and weights; at another world size every rank loads rank 0's (the
replicated state; error feedback restarts, and the optimizer warns).
"""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import torch

FORMAT = 1
_ONEBIT_STATE = "onebit_optim_rank{:05d}.pt"


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _shard_name(rank: int) -> str:
    return f"shard_rank{rank:05d}.pt"


def save_checkpoint(engine, save_dir: str | os.PathLike, tag: str | None = None) -> str:
    """Collective: every rank writes its shard; returns the checkpoint directory."""
    world = engine.world
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in tag or tag in ("", ".", ".."):
        raise ValueError(f"save_checkpoint: tag={tag!r} must be a plain directory name")
    root = Path(save_dir)
    path = root / tag
    path.mkdir(parents=True, exist_ok=True)
    if engine.onebit_views is not None:  # first: the barrier below then precedes meta and latest
        _atomic_save({"rank": world.rank, "world_size": world.world_size,
                      "optimizer": engine.optimizer.state_dict()}, path / _ONEBIT_STATE.format(world.rank))
    opt = engine.optimizer
    units = []
    for u in engine.units:
        f, lay = u.flat, u.layout
        own = lay.owned(f.rank)
        entry = {
            "names": list(u.names), "numels": [s.numel for s in lay.slots], "padded": lay.padded_numel,
            "start": own.start, "stop": own.stop, "trainable": u.trainable,
        }
        if u.trainable:
            entry["values"] = f.master.detach().clone()
            entry["optim"] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in opt.state.get(f.master, {}).items()}
        else:
            entry["values"] = f.shard.detach().float().clone()
        units.append(entry)
    _atomic_save({"format": FORMAT, "rank": world.rank, "world_size": world.world_size,
                  "units": units}, path / _shard_name(world.rank))
    world.barrier()
    if world.rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
        _atomic_save({"format": FORMAT, "param_groups": groups, "scheduler": sched, "buffers": buffers,
                      "step_state": engine.step_state()}, path / "meta.pt")
        meta = {
            "format": FORMAT, "world_size": world.world_size, "stage": engine.config.zero.stage,
            "degree": engine.comms.degree, "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "precision": engine.config.precision,
            "units": [{"names": e["names"], "numels": e["numels"], "trainable": e["trainable"]} for e in units],
        }
        _atomic_text(json.dumps(meta, indent=1), path / "meta.json")
        _atomic_text(tag, root / "latest")
    world.barrier()
    return str(path)


def _collect(path: Path, meta: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: ``{"values": fp32, <optimizer key>: tensor or scalar}``; see
    [Note: resharding]."""
    ranks = range(1) if meta["degree"] == 1 else range(meta["world_size"])
    pieces: dict[tuple, dict] = {}
    for r in ranks:
        shard = torch.load(path / _shard_name(r), map_location="cpu", weights_only=False)
        for e in shard["units"]:
            key = tuple(e["names"])
            slot = pieces.setdefault(key, {"numels": e["numels"], "ranges": {}})
            slot["ranges"][e["start"]] = e
    out: dict[str, dict] = {}
    for names, slot in pieces.items():
        entries = [slot["ranges"][s] for s in sorted(slot["ranges"])]
        n = sum(slot["numels"])
        flat = {"values": torch.cat([e["values"] for e in entries])[:n]}
        sliced = {"values"}
        for k, v in entries[0].get("optim", {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == entries[0]["values"].numel():
                flat[k] = torch.cat([e["optim"][k] for e in entries])[:n]
                sliced.add(k)
            else:
                flat[k] = v  # per-tensor scalars such as Adam's step
        off = 0
        for name, numel in zip(names, slot["numels"], strict=True):
            out[name] = {k: (v[off:off + numel] if k in sliced else v) for k, v in flat.items()}
            off += numel
    return out


def load_checkpoint(engine, load_dir: str | os.PathLike, tag: str | None = None) -> str:
    """Load a checkpoint written by :func:`save_checkpoint` at any world size or stage;
    every rank reads the shards it needs. Returns the checkpoint directory."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"load_checkpoint: no tag given and no {latest}")
        tag = latest.read_text().strip()
    path = root / tag
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"load_checkpoint: {meta_path} missing (incomplete or not a zpp checkpoint)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: format={meta.get('format')} in {meta_path}, expected {FORMAT}")
    onebit = _onebit_state_file(engine, path, meta) if engine.onebit_views is not None else None
    by_name = _collect(path, meta)
    missing = [n for u in engine.units for n in u.names if n not in by_name]
    if missing:
        raise ValueError(f"load_checkpoint: parameters {missing[:8]} (of {len(missing)}) are not in {path}")
    opt = engine.optimizer
    for u in engine.units:
        parts = [by_name[n] for n in u.names]
        values = torch.cat([p["values"] for p in parts])
        u.load_flat(values)
        if u.trainable:
            f, lay = u.flat, u.layout
            state = {}
            for k, v in parts[0].items():
                if k == "values":
                    continue
                if isinstance(v, torch.Tensor) and v.dim() == 1 and all(
                        isinstance(p.get(k), torch.Tensor) for p in parts):
                    full = torch.zeros(lay.padded_numel, dtype=v.dtype)
                    full[:lay.numel] = torch.cat([p[k] for p in parts])
                    state[k] = full[lay.owned(f.rank)].clone().to(f.master.device)
                else:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if state:
                opt.state[f.master] = state
            else:
                opt.state.pop(f.master, None)
    extra = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
    for g, saved in zip(opt.param_groups, extra["param_groups"], strict=False):
        g.update(saved)
    if engine.lr_scheduler is not None and extra["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(extra["scheduler"])
    buffers = dict(engine.module.named_buffers())
    for n, b in extra["buffers"].items():
        if n in buffers:
            buffers[n].data.copy_(b)
    engine.global_steps = int(meta["global_steps"])
    engine.micro_steps = int(meta["micro_steps"])
    engine.load_step_state(extra.get("step_state"))  # fp16 loss scale, skipped steps
    engine.zero_grad()
    if onebit is not None:  # see [Note: 1-bit optimizer state]
        engine.optimizer.load_state_dict(torch.load(onebit, map_location="cpu", weights_only=False)["optimizer"])
        engine.optimizer.flat.write_params()  # this rank's own weights (0/1 Adam's local steps)
        for u in engine.units:
            if u.trainable:
                u.publish()
    return str(path)


def _onebit_state_file(engine, path: Path, meta: dict) -> Path:
    """The 1-bit optimizer state this rank loads (its own, or rank 0's at another world
    size); checked before anything is loaded."""
    world = engine.world
    f = path / _ONEBIT_STATE.format(world.rank if meta["world_size"] == world.world_size else 0)
    if not f.exists():
        raise FileNotFoundError(
            f"load_checkpoint: {f} missing: the checkpoint holds no {type(engine.optimizer).__name__} state "
            "(saved with another optimizer?); load the module's weights and start the optimizer afresh instead")
    return f


def consolidated_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full model ``state_dict`` (every key, tied names included), on every rank.
    Collective with sharded parameters (gathers one unit at a time, exact)."""
    from zpp.zero.comm_api import Phase

    keys = list(engine.module.state_dict(keep_vars=True).keys())
    names: dict[int, list[str]] = collections.defaultdict(list)
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names[id(p)].append(n)
    out: dict[str, torch.Tensor] = {}
    for u in engine.units:
        was = u.gathered
        u.gather(Phase.EXACT)  # full precision, from the primary shards
        for p in u.params:
            for n in names[id(p)]:
                out[n] = p.detach().clone()
        if not was:
            u.release()
    for n, b in engine.module.named_buffers(remove_duplicate=False):
        out[n] = b.detach().clone()
    return {k: out[k] for k in keys if k in out}
