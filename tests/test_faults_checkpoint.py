"""Checkpoint faults, injected into real gloo worlds (3 ranks, ZeRO stage 3, a small MLP).

* kill -9 of one rank at each phase of a save (zpp.zero.checkpoint.save.crash_point is
  replaced inside that rank's process), for a new tag and for re-saving an existing tag:
  the survivors raise within seconds, the tag on disk is whole (old or new version, never
  mixed), ``latest`` names a complete tag, and a fresh world loads it and trains on with
  the losses of a run that never stopped; its next save removes the crashed save's leftovers;
* a failed write on one rank (ENOSPC after 1000 bytes), over gloo and over MPI: every rank
  raises at once naming rank 1, the file and the error; nothing is published; the world
  trains and saves on; stale files of crashed saves (zpp's names only) are removed by that
  save;
* a damaged latest tag (bytes flipped, truncated, missing shard, a shard of another save,
  an edited or re-sealed meta.json): every rank raises CheckpointError naming the file and
  the tag, the engine is untouched, and the previous tag loads and continues exactly;
* where renameat2's exchange is refused, a re-saved tag is replaced through a
  ``.zpp-old-*`` directory, and a publish that died between its renames is undone.

Each case asserts the error type and message, the ranks, and the seconds to the error.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import zpp.zero as zz
from tests.dist import BACKENDS, run_world, timed_call
from zpp.zero.checkpoint import files, save

W = 3
STEPS = 8  # the reference run
WORLD_S = 90  # hard limit per world (start-up included)
TRANSPORT = {"timeout_s": 30}  # a survivor that waited this long would fail the time check anyway
MAX_ERROR_S = 10.0  # seconds from the start of the failing call to the error, on every survivor


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


CONFIG = {
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-2, "total_num_steps": 20}},
    "zero_optimization": {"stage": 3},
}


def _engine(t, seed=0):
    torch.manual_seed(seed)
    engine, *_ = zz.initialize(model=MLP(), config=CONFIG, transport=t)
    return engine


def _train(engine, rank, steps):
    losses = []
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + rank)
        loss = engine(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _fingerprint(engine) -> int:
    """CRC32 of everything a load may change on this rank."""
    crc = zlib.crc32(repr((engine.global_steps, engine.micro_steps, engine.get_lr(),
                           engine.lr_scheduler.state_dict())).encode())
    tensors = [u.flat.shard for u in engine.units] + [u.flat.master for u in engine.units if u.trainable]
    tensors += [v for st in engine.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for x in tensors:
        crc = zlib.crc32(x.detach().float().contiguous().numpy().tobytes(), crc)
    return crc


def _reference(t):
    """The losses of a run that never stops."""
    return _train(_engine(t), t.rank, range(STEPS))


def _stale(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".zpp-"))


# ---------------------------------------------------------------------- kill -9 during a save
PHASES = [  # (phase, rank killed there)
    ("staged", 1),     # before its shard is written
    ("written", 1),    # after its shard is written, before the ranks agree
    ("verified", 0),   # rank 0, manifest written, before the publishing rename
    ("published", 0),  # rank 0, after the rename, before latest
    ("latest", 0),     # rank 0, after latest, before the replaced version is removed
]
# the version on disk after the crash: global step of the tag `latest` names, and of the other complete tag
AFTER = {
    "new": {"staged": (3, None), "written": (3, None), "verified": (3, None), "published": (3, 6), "latest": (6, 3)},
    "resave": {"staged": (3, None), "written": (3, None), "verified": (3, None), "published": (6, None), "latest": (6, None)},
}


def _crash_save(t, root, mode, phase, victim):
    engine = _engine(t)
    _train(engine, t.rank, range(3))
    tag = "ck" if mode == "resave" else None
    engine.save_checkpoint(root, tag=tag)
    _train(engine, t.rank, range(3, 6))
    if t.rank == victim:
        def die(at):
            if at == phase:
                os.kill(os.getpid(), signal.SIGKILL)
        save.crash_point = die
    return timed_call(lambda: engine.save_checkpoint(root, tag=tag))


def _resume_after_crash(t, roots):
    """For each crashed save: load latest (and the other complete tag), train on; then save
    again and report what the save left."""
    ref = _reference(t)
    out = {}
    for phase, root in roots.items():
        got = {}
        for which in ("latest", "other"):
            tags = sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))
            latest = (Path(root) / "latest").read_text()
            tag = None if which == "latest" else next((x for x in tags if x != latest), None)
            if which == "other" and tag is None:
                continue
            engine = _engine(t, seed=99)
            path, client = engine.load_checkpoint(root, tag=tag)
            s = engine.global_steps
            got[which] = (Path(path).name, s, _train(engine, t.rank, range(s, s + 2)) == ref[s:s + 2], client)
        engine.save_checkpoint(root, tag="after")
        got["stale_after_save"] = _stale(Path(root))
        out[phase] = got
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["new", "resave"])
def test_kill_during_save(tmp_path, mode):
    roots = {}
    for phase, victim in PHASES:
        root = tmp_path / phase
        res = run_world(_crash_save, W, args=(str(root), mode, phase, victim), timeout=WORLD_S,
                        transport_kwargs=TRANSPORT, return_exceptions=True)
        assert isinstance(res[victim], Exception) and "exit code -9" in str(res[victim]), (phase, res[victim])
        for r in range(W):
            if r == victim:
                continue
            kind, secs, msg = res[r]
            print(f"kill rank {victim} at {mode}/{phase}: rank {r} {kind} after {secs:.2f} s")
            assert kind == "ConnectionError", (phase, r, kind, msg)
            assert secs < MAX_ERROR_S, (phase, r, secs)
            assert "save_checkpoint(tag" in msg and str(root) in msg, msg
            if victim == 0:
                assert "rank 0 was publishing the tag" in msg, msg
            else:
                assert "agreeing that every file was written" in msg, msg
        # on disk: latest names a complete tag; the re-saved tag is one whole version
        latest = (root / "latest").read_text()
        want_latest, other = AFTER[mode][phase]
        meta = json.loads((root / latest / "meta.json").read_text())
        assert meta["global_steps"] == want_latest, (phase, latest, meta["global_steps"])
        tags = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        assert len(tags) == (1 if other is None else 2), (phase, tags)
        if phase in ("staged", "written", "verified"):
            assert _stale(root), phase  # the crashed save's staging directory is still there
        roots[phase] = str(root)
    results = run_world(_resume_after_crash, W, args=(roots,), timeout=3 * WORLD_S, transport_kwargs=TRANSPORT)
    for r, res in enumerate(results):
        for phase, _ in PHASES:
            got = res[phase]
            want_latest, other = AFTER[mode][phase]
            name, steps, exact, client = got["latest"]
            assert steps == want_latest and exact and client == {}, (r, phase, got)
            if other is not None:
                assert got["other"][1] == other and got["other"][2], (r, phase, got)
            assert got["stale_after_save"] == [], (r, phase, got)


# ---------------------------------------------------------------------- a failed write, stale files
def _disk_full(t, root):
    root = Path(root)
    engine = _engine(t)
    straight = _train(engine, t.rank, range(3))
    engine.save_checkpoint(root)
    straight += _train(engine, t.rank, range(3, 6))
    real_init = files.ChecksumWriter.__init__
    if t.rank == 1:  # the disk fills up after 1000 bytes of this rank's shard
        files.ChecksumWriter.__init__ = lambda self, f: real_init(self, _FullDisk(f, 1000))
    out = {"failed": timed_call(lambda: engine.save_checkpoint(root))}
    files.ChecksumWriter.__init__ = real_init
    t.barrier()  # rank 0 removes the staging directory after the ranks agreed
    out["after_failure"] = (sorted(p.name for p in root.iterdir()), (root / "latest").read_text())
    t.barrier()  # every rank has listed before rank 0 plants the leftovers below
    # stale leftovers of crashed saves, and look-alikes that are not zpp's
    if t.rank == 0:
        (root / ".zpp-staging-0123456789abcdef-global_step9").mkdir()
        (root / ".zpp-staging-0123456789abcdef-global_step9" / "shard_rank00000.pt").write_bytes(b"x" * 10)
        (root / "global_step3" / ".shard_rank00001.pt.tmp4242").write_bytes(b"x")
        (root / ".latest.tmp77").write_text("global_step9")
        shutil.copytree(root / "global_step3", root / ".zpp-old-0123456789abcdef-global_step3")
        shutil.copytree(root / "global_step3", root / ".zpp-old-0123456789abcdef-lost")
        for keep in ("notes.txt", ".zpp-stagingfoo", "global_step3/.shard_rank1.pt.tmp5"):
            (root / keep).write_text("user's")
        (root / "mine").mkdir()
        (root / "mine" / ".latest.tmp1").write_text("user's")
    t.barrier()
    # the world is intact: save again, train on, and a fresh engine resumes the first tag exactly
    assert engine.save_checkpoint(root) is True
    out["after_save"] = sorted(p.name for p in root.iterdir())
    out["user_files"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if "user's" in _text(p))
    out["lost_restored"] = (root / "lost" / "meta.json").exists()
    straight += _train(engine, t.rank, range(6, 8))
    fresh = _engine(t, seed=99)
    fresh.load_checkpoint(root, tag="global_step3")
    out["resumed_exact"] = _train(fresh, t.rank, range(3, 8)) == straight[3:]
    return out


class _FullDisk:
    """A file that raises ENOSPC once ``room`` bytes were written to it."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _text(p: Path) -> str:
    return p.read_text(errors="replace") if p.is_file() else ""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_write_raises_everywhere_and_stale_files_go(tmp_path, backend):
    results = run_world(_disk_full, W, backend=backend, args=(str(tmp_path),), timeout=WORLD_S,
                        transport_kwargs=TRANSPORT)
    for r, res in enumerate(results):
        kind, secs, msg = res["failed"]
        print(f"ENOSPC on rank 1: rank {r} {kind} after {secs:.2f} s: {msg}")
        assert kind == "CheckpointError", (r, kind, msg)
        assert secs < MAX_ERROR_S, (r, secs)
        for part in ("rank 1 could not write shard_rank00001.pt", "'global_step6'", str(tmp_path),
                     "No space left on device", "[on rank 1 of 3]", "nothing was published"):
            assert part in msg, (r, part, msg)
        names, latest = res["after_failure"]
        assert names == ["global_step3", "latest"] and latest == "global_step3", (r, names, latest)
        assert res["after_save"] == [".zpp-stagingfoo", "global_step3", "global_step6", "latest", "lost", "mine",
                                     "notes.txt"], (r, res["after_save"])
        assert res["user_files"] == [".zpp-stagingfoo", "global_step3/.shard_rank1.pt.tmp5", "mine/.latest.tmp1",
                                     "notes.txt"], (r, res["user_files"])
        assert res["lost_restored"] and res["resumed_exact"], (r, res)


# ---------------------------------------------------------------------- damaged checkpoints
def _two_tags(t, root):
    engine = _engine(t)
    losses = _train(engine, t.rank, range(3))
    engine.save_checkpoint(root)
    losses += _train(engine, t.rank, range(3, 6))
    engine.save_checkpoint(root, client_state={"epoch": 1})
    return losses


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])


def _reseal(p: Path, **changes) -> None:
    meta = json.loads(p.read_text())
    meta.update(changes)
    meta["manifest_crc32"] = save.manifest_crc(meta)
    p.write_text(json.dumps(meta))


FAULTS = {  # name: (damage to root/global_step6, the file the error must name, words it must hold)
    "flipped": (lambda d: _flip(d / "shard_rank00001.pt"), "shard_rank00001.pt", "is corrupt"),
    "truncated": (lambda d: _truncate(d / "shard_rank00001.pt"), "shard_rank00001.pt", "truncated"),
    "missing": (lambda d: (d / "shard_rank00001.pt").unlink(), "shard_rank00001.pt", "is missing"),
    "other_save": (lambda d: shutil.copy(d.parent / "global_step3" / "shard_rank00001.pt", d / "shard_rank00001.pt"),
                   "shard_rank00001.pt", "meta.json records"),
    "meta_edited": (lambda d: (d / "meta.json").write_text((d / "meta.json").read_text().replace(
        '"world_size": 3', '"world_size": 2')), "meta.json", "was edited"),
    "meta_resealed": (lambda d: _reseal(d / "meta.json", world_size=2), "shard_rank00000.pt", "disagrees with meta.json"),
    "meta_truncated": (lambda d: _truncate(d / "meta.json"), "meta.json", "not valid JSON"),
}


def _load_damaged(t, roots, reference):
    out = {}
    for name, root in roots.items():
        engine = _engine(t, seed=99)
        _train(engine, t.rank, range(1))  # some optimizer state a half-load would change
        before = _fingerprint(engine)
        err = timed_call(lambda: engine.load_checkpoint(root))  # noqa: B023 - called at once
        untouched = _fingerprint(engine) == before
        path, client = engine.load_checkpoint(root, tag="global_step3")
        exact = _train(engine, t.rank, range(3, 6)) == reference[t.rank][3:6]
        out[name] = (err, untouched, Path(path).name, client, exact)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_damaged_checkpoint_raises_everywhere_and_previous_tag_continues(tmp_path):
    base = tmp_path / "base"
    reference = run_world(_two_tags, W, args=(str(base),), timeout=WORLD_S, transport_kwargs=TRANSPORT)
    roots = {}
    for name, (damage, _, _) in FAULTS.items():
        root = tmp_path / name
        shutil.copytree(base, root)
        damage(root / "global_step6")
        roots[name] = str(root)
    results = run_world(_load_damaged, W, args=(roots, reference), timeout=2 * WORLD_S, transport_kwargs=TRANSPORT)
    for r, res in enumerate(results):
        for name, (_, file, words) in FAULTS.items():
            (kind, secs, msg), untouched, path, client, exact = res[name]
            print(f"{name}: rank {r} {kind} after {secs:.2f} s: {msg}")
            assert kind == "CheckpointError", (r, name, kind, msg)
            assert secs < MAX_ERROR_S, (r, name, secs)
            for part in (file, "'global_step6'", roots[name], words, f"of {W}]", "no rank loaded anything"):
                assert part in msg, (r, name, part, msg)
            assert untouched, (r, name)  # nothing was half-loaded
            assert path == "global_step3" and client == {} and exact, (r, name, path, client, exact)


# ---------------------------------------------------------------------- publishing without renameat2
def test_publish_without_exchange(tmp_path, monkeypatch):
    """Where the atomic exchange is refused, a re-saved tag goes through .zpp-old-<id>-<tag>;
    a publish that died between its two renames is undone by the next save's cleanup."""
    from zpp.zero.checkpoint import publish

    def version(d: Path, text: str) -> Path:
        d.mkdir()
        (d / "meta.json").write_text(text)
        return d

    root = tmp_path
    version(root / "ck", "old")
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    staging = version(publish.staging_dir(root, "ck", "0" * 16), "new")
    old = publish.publish(staging, root / "ck", "0" * 16)
    assert old == root / ".zpp-old-0000000000000000-ck" and (old / "meta.json").read_text() == "old"
    assert (root / "ck" / "meta.json").read_text() == "new" and not staging.exists()
    # died between the renames: the tag is gone, its old version waits under .zpp-old-*
    old.rename(root / ".zpp-old-1111111111111111-ck")
    (root / "ck").rename(root / ".zpp-staging-1111111111111111-ck")
    assert sorted(publish.remove_stale(root)) == [".zpp-old-1111111111111111-ck", ".zpp-staging-1111111111111111-ck"]
    assert (root / "ck" / "meta.json").read_text() == "old" and _stale(root) == []
