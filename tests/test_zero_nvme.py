"""The NVMe tier (offload_optimizer.device "nvme"; [Note: NVMe swap] in zpp/zero/nvme.py and
zpp/zero/modes/nvme.py): training equals the in-memory run to the bit at stages 1-3 with
Adam(W) and SGD, only scalars stay in memory between steps, checkpoints move between the two
tiers both ways, bad paths and a full disk fail on every rank before training, the file is
locked, truncated and removed, and a file system without O_DIRECT falls back, counted."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world, timed_call
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import _batches, train_steps
from zpp.zero.memory import model_state_bytes
from zpp.zero.nvme import SwapFile
from zpp.zero.offload_config import AioConfig


def _config(stage, optimizer="AdamW", nvme=None, buffer_count=2, aio=None):
    params = {"lr": 3e-3} if optimizer != "SGD" else {"lr": 0.05, "momentum": 0.9}
    cfg = {"optimizer": {"type": optimizer, "params": params},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 4096, "allgather_bucket_size": 4096}}
    if nvme is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme,
                                                        "buffer_count": buffer_count}
        cfg["aio"] = aio or {"block_size": 8192, "queue_depth": 2, "thread_count": 2}
    return cfg


def _model():
    torch.manual_seed(1234)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))


def _masters(engine):
    return [u.flat.master.detach().clone() for u in engine.units if u.trainable]


def _run(t, stage, optimizer, nvme, steps=5):
    batches = _batches("gpt", t.rank, steps)
    out = {}
    for name, path in (("memory", None), ("nvme", nvme)):
        engine, *_ = zz.initialize(model=_model(), config=_config(stage, optimizer, path), transport=t)
        losses = train_steps(engine, batches)
        rec = {"losses": losses, "masters": _masters(engine), "units": len(engine.units)}
        if path is not None:
            mode = engine.mode("nvme")
            per_element = [k for st in engine.optimizer.state.values() for k, v in st.items()
                           if isinstance(v, torch.Tensor) and v.dim() > 0]
            swap = mode.swap.path
            rec.update(stats=mode.stats(), per_element=per_element, exists=swap.exists(),
                       optimizer_bytes=model_state_bytes(engine.units, engine.optimizer, engine.modes)["optimizer"],
                       buffer_bytes=mode.buffers.nbytes)
        engine.close()
        if path is not None:
            rec["exists_after_close"] = swap.exists()
        out[name] = rec
    return out


@pytest.mark.parametrize("stage,optimizer", [(1, "AdamW"), (2, "Adam"), (3, "AdamW"), (3, "SGD")])
def test_nvme_training_equals_memory_to_the_bit(tmp_path, stage, optimizer):
    for r in run_world(_run, 2, args=(stage, optimizer, str(tmp_path)), timeout=150):
        mem, nv = r["memory"], r["nvme"]
        assert nv["losses"] == mem["losses"]
        for a, b in zip(nv["masters"], mem["masters"], strict=True):
            assert torch.equal(a, b)
        s = nv["stats"]
        states = 1 if optimizer == "SGD" else 2
        assert s["direct"] and s["fallbacks"] == 0
        # every step after the first reads each unit's state once, every step writes it once
        assert s["written_bytes"] == 5 * s["file_bytes"] and s["read_bytes"] == 4 * s["file_bytes"]
        numel = sum(m.numel() for m in nv["masters"])
        assert s["file_bytes"] >= states * numel * 4
        assert nv["per_element"] == []  # between steps only scalars (step) stay in memory
        assert nv["optimizer_bytes"] == nv["buffer_bytes"] <= 2 * max(m.numel() for m in nv["masters"]) * 4 * \
            states + 2 * 4096 * states
        assert nv["exists"] and not nv["exists_after_close"]
        assert mem["units"] >= 3  # buffer_count=2: buffers are reused across units


def _checkpoint_roundtrip(t, root):
    batches = _batches("gpt", t.rank, 6)
    out = {}
    # uninterrupted in memory
    e, *_ = zz.initialize(model=_model(), config=_config(2), transport=t)
    out["ref"] = train_steps(e, batches)
    e.close()
    # 3 steps on one tier, save, resume 3 on the other
    for first, second in (("nvme", "memory"), ("memory", "nvme")):
        path = {"nvme": str(Path(root) / "swap"), "memory": None}
        e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=path[first]), transport=t)
        losses = train_steps(e, batches[:3])
        e.save_checkpoint(str(Path(root) / f"ckpt-{first}"), tag="t3")
        e.close()
        e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=path[second]), transport=t)
        e.load_checkpoint(str(Path(root) / f"ckpt-{first}"), tag="t3")
        losses += train_steps(e, batches[3:])
        out[f"{first}->{second}"] = losses
        e.close()
    return out


def test_checkpoints_move_between_nvme_and_memory_exactly(tmp_path):
    for r in run_world(_checkpoint_roundtrip, 2, args=(str(tmp_path),), timeout=200):
        assert r["nvme->memory"] == r["ref"]
        assert r["memory->nvme"] == r["ref"]


def _bad_path(t, path, fail_rank, outer=False):
    if fail_rank is not None and t.rank == fail_rank:  # this rank's disk is full
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = full
    cfg = _config(2, nvme=path)
    if outer:  # one rank per node: each ZeRO world is one rank, the job is two
        cfg["zpp"] = {"outer": {"sync_every": 4}}
    try:
        zz.initialize(model=_model(), config=cfg, transport=t)
    except ValueError as e:
        return str(e)
    return None


def test_an_unwritable_nvme_path_fails_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for msg in run_world(_bad_path, 2, args=(str(blocker / "swap"), None), timeout=90):
        assert msg is not None and "offload_optimizer.nvme_path=" in msg and "a-file" in msg


def test_a_full_disk_fails_on_every_rank_before_training(tmp_path):
    for msg in run_world(_bad_path, 2, args=(str(tmp_path), 1), timeout=90):
        assert msg is not None and "cannot reserve" in msg and "on rank 1 of 2" in msg
        assert "No space left on device" in msg


def test_a_full_disk_on_another_node_fails_every_rank_of_the_job(tmp_path):
    """Under zpp.outer the ZeRO world is the node; the swap files are agreed over the job."""
    for msg in run_world(_bad_path, 2, args=(str(tmp_path), 1, True), ranks_per_node=1, timeout=90):
        assert msg is not None and "cannot reserve" in msg and "on rank 1 of 2" in msg


def _corrupt(t, root):
    batches = _batches("gpt", t.rank, 3)
    e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=str(Path(root) / "swap")), transport=t)
    train_steps(e, batches[:2])
    e.save_checkpoint(str(Path(root) / "ckpt"), tag="good")
    e.mode("nvme").buffers.finish_writes()
    if t.rank == 1:  # something else writes into rank 1's swap file
        fd = os.open(e.mode("nvme").swap.path, os.O_WRONLY)
        os.pwrite(fd, b"\xff" * 16, 4096)
        os.fsync(fd)
        os.close(fd)
    out = {}
    try:
        e.save_checkpoint(str(Path(root) / "ckpt"), tag="bad")
    except Exception as ex:  # noqa: BLE001
        out["save"] = (type(ex).__name__, str(ex))
    out["latest"] = (Path(root) / "ckpt" / "latest").read_text().strip()
    out["tags"] = sorted(p.name for p in (Path(root) / "ckpt").iterdir() if not p.name.startswith("."))
    # the step reads it too: rank 1's read fails before its optimizer sees it, and every rank
    # raises at the end of the step (not rank 0 at the transport's timeout)
    x, y = batches[2]
    e.backward(e(x, y))
    out["step"] = timed_call(e.step)
    return out


def test_a_corrupted_swap_file_is_never_read_into_a_checkpoint_or_the_step(tmp_path):
    res = run_world(_corrupt, 2, args=(str(tmp_path),), timeout=120, transport_kwargs={"timeout_s": 20})
    for rank, r in enumerate(res):
        kind, msg = r["save"]
        assert kind == "CheckpointError" and "corrupt" in msg and "optimizer_rank00001.swp" in msg, (rank, msg)
        assert "on rank 1 of 2" in msg and "nothing was published" in msg
        assert r["latest"] == "good" and r["tags"] == ["good", "latest"], r
        kind, secs, msg = r["step"]
        assert kind == "OSError" and "is corrupt" in msg and "[on rank 1 of 2]" in msg, (rank, kind, msg)
        assert "bytes at offset 0 have CRC32" in msg and "load the last checkpoint" in msg  # its 8 KiB request
        assert secs < 10, (rank, secs)  # agreed at the step's end, far below the 20 s transport timeout


def _crash(t, root, where):
    from zpp.zero.checkpoint import save
    from zpp.zero.modes.nvme import NvmeMode

    batches = _batches("gpt", t.rank, 6)
    e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=str(Path(root) / "swap")), transport=t)
    train_steps(e, batches[:3])
    e.save_checkpoint(str(Path(root) / "ckpt"))
    if t.rank == 1:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "step":  # after the step's first unit went to the file, in the middle of the rest
            real, calls = NvmeMode._swap_out, []

            def swap_out(self, *args):
                calls.append(1)
                if len(calls) == 2:
                    die()
                return real(self, *args)
            NvmeMode._swap_out = swap_out
        else:  # the save's shard written, before the ranks agree
            save.crash_point = lambda at: die() if at == "written" else None

    def go():
        train_steps(e, batches[3:5])
        e.save_checkpoint(str(Path(root) / "ckpt"))
    return timed_call(go)


def _resume(t, root):
    batches = _batches("gpt", t.rank, 6)
    e, *_ = zz.initialize(model=_model(), config=_config(2), transport=t)
    ref = train_steps(e, batches)
    e.close()
    swap = Path(root) / "swap" / "zpp_swap" / f"optimizer_rank{t.rank:05d}.swp"
    left = any(swap.read_bytes()) if swap.exists() else None  # the crashed run's file (no close removed it)
    e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=str(Path(root) / "swap")), transport=t)
    fresh = e.mode("nvme").swap.stats()["read_bytes"], any(swap.read_bytes())
    path, _ = e.load_checkpoint(str(Path(root) / "ckpt"))
    out = {"tag": Path(path).name, "exact": train_steps(e, batches[3:]) == ref[3:], "left": left, "fresh": fresh}
    e.close()
    return out


@pytest.mark.parametrize("where", ["step", "save"])
def test_a_rank_killed_mid_step_or_mid_save_resumes_exactly_from_the_last_tag(tmp_path, where):
    res = run_world(_crash, 2, args=(str(tmp_path), where), timeout=120, transport_kwargs={"timeout_s": 20},
                    return_exceptions=True)
    assert isinstance(res[1], Exception) and "exit code -9" in str(res[1]), res[1]
    kind, secs, msg = res[0]
    assert kind in ("ConnectionError", "TimeoutError"), (kind, msg)
    res = run_world(_resume, 2, args=(str(tmp_path),), timeout=150)
    for r in res:
        assert r["tag"] == "global_step3" and r["exact"], r
        assert r["fresh"] == (0, False), r  # a fresh file (zeros where old state was), nothing read
    assert res[1]["left"] is True  # rank 1 was killed: its file, with its state, stayed and was truncated


def test_an_unclosed_swap_file_goes_at_interpreter_exit(tmp_path):
    code = ("import sys; from zpp.zero.nvme import SwapFile; from zpp.zero.offload_config import AioConfig; "
            f"s = SwapFile({str(tmp_path)!r}, 0, AioConfig(), reserve=8192); print(s.path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = Path(out.stdout.strip())
    assert path.parent.parent == tmp_path and not path.exists() and not path.parent.exists()


def test_the_swap_file_is_locked_truncated_and_removed(tmp_path):
    aio = AioConfig()
    stale = tmp_path / "zpp_swap" / "optimizer_rank00000.swp"
    stale.parent.mkdir()
    stale.write_bytes(b"x" * 10_000)  # a crashed run's file
    a = SwapFile(str(tmp_path), 0, aio, reserve=8192)
    assert a.path == stale and stale.stat().st_size == 8192  # truncated, then reserved afresh
    with pytest.raises(ValueError, match="in use by another process"):
        SwapFile(str(tmp_path), 0, aio)
    a.close()
    assert not stale.exists() and not stale.parent.exists()


def test_a_refused_direct_transfer_falls_back_to_buffered_io_counted(tmp_path):
    s = SwapFile(str(tmp_path), 3, AioConfig(), reserve=8192)
    try:
        if not s.direct:
            pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT at open (the open-time fallback)")
        data = bytearray(os.urandom(4097))
        s._pwrite(memoryview(data)[1:], 0)  # misaligned: the kernel refuses it under O_DIRECT (EINVAL)
        assert not s.direct and s.fallbacks == 1
        back = bytearray(4096)
        s._pread(memoryview(back), 0)
        assert back == data[1:]
        with pytest.raises(ValueError, match="in use"):  # the lock survived the reopen
            SwapFile(str(tmp_path), 3, AioConfig())
    finally:
        s.close()


def test_workers_refused_direct_io_at_once_all_fall_back_to_one_buffered_descriptor(tmp_path, monkeypatch):
    """Four workers refused (EINVAL) at the same moment: one opens the buffered descriptor, all
    four retry on it; the lock is held throughout (the direct descriptor stays open)."""
    import threading

    s = SwapFile(str(tmp_path), 4, AioConfig(queue_depth=2, thread_count=2), reserve=4 * 4096)
    try:
        if not s.direct:
            pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT at open (the open-time fallback)")
        direct, real = s.fd, os.pwrite
        meet = threading.Barrier(4, timeout=20)

        def pwrite(fd, data, offset):
            if fd == direct:
                meet.wait()  # all four are in a direct write before any is refused
            return real(fd, data, offset)
        monkeypatch.setattr(os, "pwrite", pwrite)
        data = bytearray(os.urandom(4 * 4096 + 1))
        chunks = [memoryview(data)[1 + i * 4096:1 + (i + 1) * 4096] for i in range(4)]  # misaligned
        for f in [s.pool.submit(s._pwrite, c, i * 4096) for i, c in enumerate(chunks)]:
            f.result(timeout=30)
        assert not s.direct and s.fallbacks == 1 and s.fd != direct
        back = bytearray(4 * 4096)
        for i in range(4):
            s._pread(memoryview(back)[i * 4096:(i + 1) * 4096], i * 4096)
        assert back == data[1:]
        with pytest.raises(ValueError, match="in use"):
            SwapFile(str(tmp_path), 4, AioConfig())
    finally:
        s.close()
    assert not s.path.exists()


class _Reordering(torch.optim.Optimizer):
    """Two state tensors per parameter; at its third step the optimizer re-inserts ``a`` after
    ``b`` (so the per-element state's layout changes while both are views of a read buffer)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["n"] = 0
                    st["a"], st["b"] = torch.zeros_like(p), torch.zeros_like(p)
                st["n"] += 1
                if st["n"] == 3:
                    st["a"] = st.pop("a")
                st["a"].mul_(0.9).add_(p.grad)
                st["b"].mul_(0.5).add_(p.grad.abs())
                p.add_(st["a"] + 0.1 * st["b"], alpha=-group["lr"])


def _reorder(t, root):
    batches = _batches("gpt", t.rank, 5)
    out = {}
    for name, path in (("memory", None), ("nvme", root)):
        cfg = _config(2, nvme=path)
        del cfg["optimizer"]
        e, *_ = zz.initialize(model=_model(), optimizer=lambda groups: _Reordering(groups), config=cfg, transport=t)
        out[name] = (train_steps(e, batches), _masters(e))
        if path is not None:
            out["buffers"] = len(e.mode("nvme").buffers.all)
        e.close()
    return out


def test_a_state_layout_change_is_copied_into_a_fresh_buffer(tmp_path):
    for r in run_world(_reorder, 2, args=(str(tmp_path),), timeout=120):
        (ml, mm), (nl, nm) = r["memory"], r["nvme"]
        assert nl == ml
        for a, b in zip(nm, mm, strict=True):
            assert torch.equal(a, b)
        assert r["buffers"] <= 2  # buffer_count holds after the change


def _order(t, root):
    from zpp.zero.modes.nvme import NvmeMode

    batches = _batches("gpt", t.rank, 3)
    e, *_ = zz.initialize(model=_model(), config=_config(2, nvme=root, buffer_count=2), transport=t)
    mode, events = e.mode("nvme"), []
    units = {id(u.flat.master): k for k, u in enumerate(mode.units)}
    real_read, real_step = mode.swap.read, e.optimizer.step

    def read(region, buf):
        events.append(("read", next(k for k, r in mode.regions.items() if r is region)))
        return real_read(region, buf)

    def step(*a, **kw):
        events.append(("step", [units[id(p)] for g in e.optimizer.param_groups for p in g["params"]
                                if p.grad is not None]))
        return real_step(*a, **kw)
    mode.swap.read, e.optimizer.step = read, step
    train_steps(e, batches[:1])
    first = list(events)
    events.clear()
    train_steps(e, batches[1:])
    e.close()
    return first, events, isinstance(mode, NvmeMode)


def test_with_two_buffers_the_next_read_runs_under_the_step(tmp_path):
    """[Note: NVMe step order]: with buffer_count=2 and both buffers free at the step's start,
    unit 1's read is issued before unit 0 steps (it used to wait until unit 0's write)."""
    for first, later, _ in run_world(_order, 2, args=(str(tmp_path),), timeout=90):
        assert [k for kind, k in first if kind == "read"] == []  # the first step has nothing on disk
        steps = [k for kind, k in later if kind == "step"]
        reads = [k for kind, k in later if kind == "read"]
        assert len(steps) == 2 * len(reads) // 2 and len(reads) >= 6
        kinds = [kind for kind, _ in later]
        assert kinds[:3] == ["read", "read", "step"], later[:4]  # read 0, read 1 (under step 0), step 0
        assert later[0] == ("read", 0) and later[1] == ("read", 1) and later[2] == ("step", [0])


def _failing_build(t, root):
    from zpp.zero.modes.nvme import NvmeMode
    from zpp.zero.modes.onebit import OneBitMode

    built, real = [], NvmeMode.build.__func__

    def build(cls, engine):
        built.append(real(cls, engine))  # held here, so no garbage collection closes it instead
        return built[-1]

    def refuse(cls, engine):
        raise ValueError("a later mode refused")
    NvmeMode.build, OneBitMode.build = classmethod(build), classmethod(refuse)
    try:
        zz.initialize(model=_model(), config=_config(2, nvme=root), transport=t)
    except ValueError as e:
        msg = str(e)
    swap = built[0].swap
    return msg, swap.path.exists(), swap.fd, swap.pool._shutdown


def test_a_later_mode_failing_to_build_closes_the_swap_file(tmp_path):
    for msg, exists, fd, shut in run_world(_failing_build, 2, args=(str(tmp_path),), timeout=90):
        assert msg == "a later mode refused" and not exists and fd == -1 and shut


def test_config_keys():
    from zpp.zero.deepspeed_config import from_deepspeed

    c = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 3, "pin_memory": True,
        "pipeline_read": True, "fast_init": False}},
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True}})
    off = c.zero.offload_optimizer
    assert (off.device, off.nvme_path, off.buffer_count) == ("nvme", "/local_nvme", 3)
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.workers) == (262144, 32, 32)
    with pytest.raises(ValueError, match="nvme_path"):
        from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    c = from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/p", "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 10**9}}})
    assert (c.zero.offload_param.device, c.zero.offload_param.nvme_path, c.zero.offload_param.buffer_count) == \
        ("nvme", "/p", 5)
    with pytest.raises(ValueError, match="nvme_path"):
        from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(ValueError, match="block_size"):
        from_deepspeed({"aio": {"block_size": 5000}})
    with pytest.raises(ValueError, match="buffer_count"):
        from_deepspeed({"zero_optimization": {"stage": 1, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/x", "buffer_count": 1}}})


def test_on_a_cuda_job_the_masters_and_the_step_are_on_the_host():
    from zpp.zero.deepspeed_config import from_deepspeed
    from zpp.zero.offload import Offload

    cfg = from_deepspeed(_config(2, nvme="/x"))
    assert Offload.from_config(cfg, torch.device("cuda", 0)) == Offload(optimizer=True)
    assert Offload.from_config(cfg, torch.device("cpu")) == Offload()  # there already


def _cuda(t, stage, nvme):
    batches = [(x.cuda(), y.cuda()) for x, y in _batches("gpt", t.rank, 4)]
    out = {}
    for name in ("cpu", "nvme"):
        cfg = _config(stage, nvme=nvme if name == "nvme" else None)
        if name == "cpu":
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine, *_ = zz.initialize(model=_model().cuda(), config=cfg, transport=t)
        out[name] = (train_steps(engine, batches), _masters(engine), engine.units[0].flat.master.device.type)
        engine.close()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_on_cuda_equals_cpu_offload(tmp_path, stage):
    """GPU -> host -> NVMe: the same host step as offload_optimizer "cpu", so the same bits."""
    for r in run_world(_cuda, 1, args=(stage, str(tmp_path)), timeout=150, backend="torch"):
        (cl, cm, cdev), (nl, nm, ndev) = r["cpu"], r["nvme"]
        assert cdev == ndev == "cpu" and nl == cl
        for a, b in zip(nm, cm, strict=True):
            assert torch.equal(a, b)
