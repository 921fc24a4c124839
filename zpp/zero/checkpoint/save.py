"""``save_checkpoint``: every rank's files, verified, published by rank 0 in one rename.

Layout of ``save_dir/tag/`` (format 2)::

    shard_rank00000.pt ...   per rank (rank 0 only when nothing is sharded): for each unit, its
                             owned range of the flat fp32 master weights (frozen units: the
                             parameters) and of every per-element optimizer state tensor
                             (the modes' per-element state among them, as
                             ``<mode>.<key>``: the outer anchor and momentum),
                             with the unit's names and sizes; see [Note: resharding]
    hpz_copies_rank00000.pt  with weight deltas (``zpp.weight_delta_bits``), per rank of the
                             first node: the rank's slices of hpZ's node copy (see [Note:
                             the copies in checkpoints] in zpp/zero/gather/delta.py)
    <file>_rank00000.pt ...  each mode's per-rank state, if it has one (see [Note: mode
                             state in checkpoints] in zpp/zero/modes/base.py):
                             ``onebit_optim_rankR.pt`` with a 1-bit optimizer (its state),
                             ``outer_rankR.pt`` in the hierarchical mode (schedule position,
                             pending syncs, error feedback)
    meta.pt                  buffers, optimizer hyper-parameters, scheduler state, the
                             modes' replicated state (``step_state``: the fp16 loss
                             scaler's) (rank 0)
    client_state.pt          the caller's ``client_state`` dict (rank 0)
    meta.json                the manifest: world size, stage, counters, units, and the size
                             and CRC32 of every other file (see [Note: checksums])

and ``save_dir/latest`` names the newest tag.

[Note: replicas]
In the hierarchical mode (``zpp.outer``) every node trains its own replica, sharded over its
own ranks, and the replicas differ between syncs: each node writes its own shard files (rank
numbers are the job's, node-major, so node ``n``'s files are those of ranks ``n * R`` to
``n * R + R - 1``; with nothing sharded, its first rank's alone). ``meta.json`` says
``replicas`` (nodes) and ``replica_ranks`` (``R``); a checkpoint of one ZeRO world is one
replica of all its ranks.

[Note: save protocol]
Three small collectives (:func:`~zpp.zero.checkpoint.agree.exchange`) order a save:

1. *start*: rank 0 removes what crashed saves left in ``save_dir`` and creates the staging
   directory; the ranks check that they name the same tag and learn the save id.
2. *written*: each rank writes its files into the staging directory (CRC32 computed while
   writing, fsync) and reports success or its error with the files' records. Any failure
   raises on every rank, naming the rank, the file and the error; nothing is published.
3. *published*: rank 0 checks that it sees every rank's file at its size, writes
   ``meta.json``, renames the staging directory to the tag (see [Note: publishing]),
   updates ``latest`` (``save_latest``), removes the replaced version, and reports.

A rank killed before step 3's rename leaves the tag as it was (the old version of a re-saved
tag stays loadable); killed after it, the tag is the new version, complete; ``latest`` names
a tag only once that tag is complete. The survivors raise the transport's ConnectionError
naming the phase within seconds. :func:`crash_point` marks each phase for the
fault-injection tests.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from zpp.zero.checkpoint import publish as pub
from zpp.zero.checkpoint.agree import exchange, failure, raise_agreed
from zpp.zero.checkpoint.errors import CheckpointError
from zpp.zero.checkpoint.files import fsync_dir, write_bytes, write_torch

FORMAT = 2
META_JSON = "meta.json"
META_PT = "meta.pt"
CLIENT_STATE = "client_state.pt"
#: "0" (or false/no/off) turns the fsyncs off; see [Note: durability] in files.py
FSYNC_ENV = "ZPP_CHECKPOINT_FSYNC"
#: engine counters saved and restored when the engine has them
COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")


def shard_name(rank: int) -> str:
    return f"shard_rank{rank:05d}.pt"


def copies_name(rank: int) -> str:
    """The file of rank ``rank``'s weight-delta copies (see [Note: the copies in checkpoints]
    in zpp/zero/gather/delta.py)."""
    return f"hpz_copies_rank{rank:05d}.pt"


def mode_file_name(mode, rank: int) -> str:
    """The per-rank file of a mode (see [Note: mode state in checkpoints])."""
    return f"{mode.per_rank_file}_rank{rank:05d}.pt"


def mode_key(mode) -> str:
    """The key of a mode's state in its per-rank file."""
    return mode.per_rank_key or mode.name


def step_state(engine) -> dict[str, Any]:
    """The modes' replicated state, by mode name (``meta.pt``'s ``step_state``)."""
    return {m.name: m.state_dict() for m in engine.modes if m.per_rank_file is None}


def crash_point(phase: str) -> None:
    """Test seam: called at each phase of a save ("staged": a rank's staging directory is
    there, nothing written; "written": its files are written, before the ranks agree;
    rank 0 only: "verified": before the publishing rename, "published": after it, before
    ``latest``; "latest": after ``latest``, before the old version is removed). Does nothing;
    tests/test_faults_checkpoint.py replaces it inside one rank's process to kill that rank
    there."""


def manifest_crc(manifest: dict[str, Any]) -> int:
    """CRC32 of a manifest's fields other than ``manifest_crc32`` (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def check_tag(tag: str) -> None:
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or "\0" in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag={tag!r} must be a plain directory name (no '/', not starting with '.')")


def save_checkpoint(engine, save_dir: str | os.PathLike, tag: Any = None,
                    client_state: dict = {},  # noqa: B006 - DeepSpeed's signature; never mutated
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Collective: write a sharded checkpoint of ``engine`` as ``save_dir/tag`` (see
    [Note: save protocol]); DeepSpeed's signature and return value (True).

    Args:
        save_dir: the directory of the checkpoints (created if missing; every rank must see
            the same filesystem).
        tag: the checkpoint's name (Default: ``global_step<global_steps>``); the same on
            every rank. Re-saving a tag replaces it atomically.
        client_state: any picklable dict; rank 0's is saved and ``load_checkpoint`` returns
            it.
        save_latest: point ``save_dir/latest`` at this tag.
        exclude_frozen_parameters: leave out the parameters the engine does not train;
            loading then keeps the loading model's own values for them.

    Raises:
        CheckpointError: a rank could not write its files, or rank 0 could not publish them
            (on every rank, naming the rank, the file and the error).
        ValueError / TypeError: a bad tag, ranks disagreeing on the tag, a ``client_state``
            that is not a dict (on every rank).
        ConnectionError / TimeoutError: a rank was lost during the save (from the transport).
    """
    world = engine.job_world
    rank = world.rank
    root = Path(save_dir)
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    where = f"save_checkpoint(tag {tag!r}, {root})"
    durable = os.environ.get(FSYNC_ENV, "1").strip().lower() not in ("0", "false", "no", "off")

    # 1. start
    mine: dict[str, Any] = {"ok": True, "tag": tag, "save_id": None}
    staging = None
    try:
        check_tag(tag)
        if rank == 0:
            if not isinstance(client_state, dict):
                raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
            root.mkdir(parents=True, exist_ok=True)
            pub.remove_stale(root)
            save_id = secrets.token_hex(pub.SAVE_ID_CHARS // 2)
            staging = pub.staging_dir(root, tag, save_id)
            staging.mkdir()
            mine["save_id"] = save_id
    except Exception as e:  # noqa: BLE001 - reported to every rank, see [Note: agreement]
        mine, own = {**mine, **failure(e)}, e
    else:
        own = None
    results = exchange(world, mine, during=f"{where}: starting")
    tags = [r["tag"] for r in results]
    if staging is not None and (len(set(tags)) > 1 or not all(r["ok"] for r in results)):
        shutil.rmtree(staging, ignore_errors=True)
    raise_agreed(results, own=own)
    if len(set(tags)) > 1:
        raise ValueError(f"save_checkpoint: the ranks name different tags: {tags} (one per rank)")
    save_id = results[0]["save_id"]
    staging = pub.staging_dir(root, tag, save_id)

    # 2. written
    mine, own = {"ok": True, "files": {}}, None
    try:
        if rank and not staging.is_dir():
            raise CheckpointError(
                f"save_checkpoint: rank {rank} does not see the staging directory {staging} that rank 0 "
                f"created: {root} must be on a filesystem every rank shares")
        crash_point("staged")
        mine["files"] = _write_rank_files(engine, staging, tag, save_id, client_state, exclude_frozen_parameters,
                                          durable)
        crash_point("written")
    except Exception as e:  # noqa: BLE001
        mine, own = {**mine, **failure(e)}, e
    results = exchange(world, mine, during=f"{where}: the ranks were agreeing that every file was written")
    failed = [r for r, res in enumerate(results) if not res["ok"]]
    if failed and rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise_agreed(results, own=own, suffix=f"; nothing was published: tag {tag!r} in {root} is as it was")

    # 3. published
    mine, own = {"ok": True}, None
    if rank == 0:
        published = False
        try:
            files = {name: {**rec, "rank": r} for r, res in enumerate(results) for name, rec in res["files"].items()}
            _check_visible(staging, files, root)
            _write_manifest(engine, staging, tag, save_id, files, exclude_frozen_parameters, durable)
            crash_point("verified")
            old = pub.publish(staging, root / tag, save_id, durable=durable)
            published = True
            crash_point("published")
            if save_latest:
                pub.write_latest(root, tag, durable=durable)
            crash_point("latest")
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            if not published:
                shutil.rmtree(staging, ignore_errors=True)
            mine, own = {**mine, **failure(e)}, e
            if not isinstance(e, CheckpointError):
                done = (f"tag {tag!r} was published but {root / pub.LATEST} was not updated" if published
                        else f"nothing was published: tag {tag!r} is as it was")
                mine["type"] = "CheckpointError"
                mine["error"] = f"save_checkpoint: rank 0 could not publish tag {tag!r} in {root}: " \
                                f"{type(e).__name__}: {e}; {done}"
    results = exchange(world, mine, during=f"{where}: rank 0 was publishing the tag (the tag holds its previous "
                                           "or its new version, each complete)")
    raise_agreed(results, own=own)
    return True


def _write_rank_files(engine, staging: Path, tag: str, save_id: str, client_state: dict,
                      exclude_frozen: bool, durable: bool) -> dict[str, dict]:
    """This rank's files in the staging directory; their records."""
    world = engine.job_world
    rank = world.rank
    out: dict[str, dict] = {}

    def put(name: str, obj: Any) -> None:
        try:
            out[name] = write_torch(obj, staging / name, durable=durable)
        except Exception as e:
            raise CheckpointError(f"save_checkpoint: rank {rank} could not write {name} of tag {tag!r} in "
                                  f"{staging.parent}: {type(e).__name__}: {e}") from e

    for m in engine.modes:  # per-rank state; see [Note: mode state in checkpoints]
        if m.per_rank_file is not None:
            put(mode_file_name(m, rank), {"rank": rank, "world_size": world.world_size, "save_id": save_id,
                                          mode_key(m): m.state_dict()})
    store = engine.comms.resumable() if engine.policy.shard_parameters else None
    # one node's ranks write them: the other nodes hold the same (see [Note: the copies in
    # checkpoints] in zpp/zero/gather/delta.py)
    if store is not None and store.saved_by() == store.topology.rank:
        put(copies_name(rank), {"rank": rank, "world_size": world.world_size, "save_id": save_id,
                                "copies": store.state_dict(engine.units)})
    if engine.comms.degree > 1 or engine.world.rank == 0:  # unsharded: a replica's ranks hold the same values
        put(shard_name(rank), {"format": FORMAT, "save_id": save_id, "rank": rank, "world_size": world.world_size,
                               "units": _unit_entries(engine, exclude_frozen)})
    if rank == 0:
        opt = engine.optimizer
        sched = engine.lr_scheduler
        put(META_PT, {
            "format": FORMAT, "save_id": save_id,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "scheduler": sched.state_dict() if sched is not None else None,
            "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
            "step_state": step_state(engine),
        })
        put(CLIENT_STATE, client_state)
    return out


def _unit_entries(engine, exclude_frozen: bool) -> list[dict[str, Any]]:
    opt = engine.optimizer
    units = []
    for u in engine.units:
        if exclude_frozen and not u.trainable:
            continue
        f, lay = u.flat, u.layout
        own = lay.owned(f.rank)
        entry = {"names": list(u.names), "numels": [s.numel for s in lay.slots], "padded": lay.padded_numel,
                 "start": own.start, "stop": own.stop, "trainable": u.trainable}
        on_disk = u.comms.params_swap.values(u) if u.on_disk else None  # views of the file, no copy
        if u.trainable:
            entry["values"] = on_disk if on_disk is not None else _alone(f.master)
            entry["optim"] = {k: (_alone(v) if isinstance(v, torch.Tensor) else v)
                              for k, v in opt.state.get(f.master, {}).items()}
            for m in engine.modes:  # state a mode keeps outside the optimizer (NVMe), under its own keys
                entry["optim"].update(m.swapped_state(u))
            for m in engine.modes:  # per-element mode state reshards like the optimizer's
                entry["optim"].update({f"{m.name}.{k}": v for k, v in m.unit_state(u).items()})
        else:
            entry["values"] = on_disk if on_disk is not None else _alone(f.shard.detach().float())
        units.append(entry)
    return units


def _alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as a tensor that is its whole storage: itself if it is one already (a
    stage 3 shard, an optimizer moment: no copy, so a save holds no second copy of the model
    states), else a copy (a view into a larger buffer, which ``torch.save`` would write whole).
    ``torch.save`` runs before the engine changes anything again."""
    t = t.detach()
    whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def _check_visible(staging: Path, files: dict[str, dict], root: Path) -> None:
    """Rank 0 sees every rank's file at the size that rank wrote."""
    for name, rec in files.items():
        try:
            size = (staging / name).stat().st_size
        except FileNotFoundError:
            size = None
        if size != rec["bytes"]:
            raise CheckpointError(
                f"save_checkpoint: rank 0 sees {name} of rank {rec['rank']} with {size} bytes, rank "
                f"{rec['rank']} wrote {rec['bytes']}: {root} must be on a filesystem every rank shares")


def _write_manifest(engine, staging: Path, tag: str, save_id: str, files: dict[str, dict],
                    exclude_frozen: bool, durable: bool) -> None:
    units = [u for u in engine.units if u.trainable or not exclude_frozen]
    manifest = {
        "format": FORMAT, "tag": tag, "save_id": save_id, "world_size": engine.job_world.world_size,
        "replicas": engine.replicas,
        "replica_ranks": engine.world.world_size,
        "stage": engine.train_config.zero.stage, "degree": engine.comms.degree, "precision": engine.train_config.precision,
        **{c: int(getattr(engine, c)) for c in COUNTERS if getattr(engine, c, None) is not None},
        "optimizer": type(engine.optimizer).__name__,
        "scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
        "units": [{"names": list(u.names), "numels": [s.numel for s in u.layout.slots], "trainable": u.trainable}
                  for u in units],
        "excluded_frozen": [n for u in engine.units if exclude_frozen and not u.trainable for n in u.names],
        "checksum": "crc32",
        "files": dict(sorted(files.items())),
    }
    manifest["manifest_crc32"] = manifest_crc(manifest)
    write_bytes(json.dumps(manifest, indent=1).encode(), staging / META_JSON, durable=durable)
    fsync_dir(staging, durable)
