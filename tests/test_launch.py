"""Launch detection, the backend precedence, the timeout, fault reports, MPICH segments:
everything of the process level that can be checked inside this process (the real launches
are in tests/test_faults.py)."""
from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zpp.comm as zc
from zpp.comm import launch as L
from zpp.comm import registry
from zpp.comm.faults import Fault, FaultChannel, describe
from zpp.comm.mpi_shm import ShmWatch
from zpp.comm.plan import TUNE_FILE_ENV
from zpp.comm.timeout import DEFAULT_TIMEOUT_S, resolve_timeout

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- detection
@pytest.mark.parametrize("env,want", [
    ({}, ("alone", "alone", 0, 1, 0, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     ("mpi", "hydra", 1, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("mpi", "openmpi", 3, 8, 1, 2)),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "3"}, ("mpi", "mvapich", 2, 3, None, None)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
      "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, ("slurm", "srun", 5, 6, 1, 2)),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "3,1", "PMIX_RANK": "3"}, ("mpi", "pmix", 3, 4, 0, 1)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     ("torchrun", "torchrun", 1, 2, 1, 2)),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ("torchrun", "env", 0, 2, None, None)),
    # torchrun inside an allocation that sets PMI or SLURM variables: torchrun's world
    ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "PMI_RANK": "0", "PMI_SIZE": "1",
      "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, ("torchrun", "torchrun", 0, 2, None, None)),
    # an MPI launcher's variables beat torch-style ones set by hand
    ({"RANK": "0", "WORLD_SIZE": "1", "PMI_RANK": "2", "PMI_SIZE": "4"}, ("mpi", "hydra", 2, 4, None, None)),
    # a SLURM batch script (no step size) is not a launch
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, ("alone", "alone", 0, 1, 0, 1)),
])
def test_detect(env, want):
    got = L.detect(env)
    assert (got.kind, got.launcher, got.rank, got.world_size, got.local_rank, got.local_size) == want


@pytest.mark.parametrize("env,match", [
    ({"PMI_RANK": "0", "PMI_SIZE": "four"}, "PMI_SIZE='four'"),
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "PMI_RANK=4 and PMI_SIZE=4"),
    ({"PMIX_RANK": "1"}, "PMIX_RANK='1' is set but no variable gives the world size"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 and WORLD_SIZE=0"),
])
def test_detect_refuses_what_does_not_add_up(env, match):
    with pytest.raises(ValueError, match=match):
        L.detect(env)


def test_slurm_lists():
    assert L._expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert L._expand_tasks_per_node("4") == [4]
    assert L._expand_tasks_per_node("two") is None
    assert L.first_host("node[03-05,9],gpu1") == "node03"
    assert L.first_host("gpu1,node[1-2]") == "gpu1"
    assert L.first_host("rack[2-3]-n[07-08]") == "rack2-n07"
    assert L.first_host("") is None


def test_natural_backend():
    mpi = L.detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert L.natural_backend(mpi, mpi4py=True, cuda=False)[0] == "mpi"
    assert L.natural_backend(mpi, mpi4py=True, cuda=True)[0] == "torch"  # NCCL on GPUs
    assert L.natural_backend(mpi, mpi4py=False, cuda=False)[0] == "torch"  # no mpi4py: torch from the MPI env
    for env in ({}, {"RANK": "0", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}):
        assert L.natural_backend(L.detect(env), mpi4py=True, cuda=False)[0] == "torch"


# ---------------------------------------------------------------------- rendezvous point
def test_rendezvous_point_without_mpi4py(monkeypatch):
    monkeypatch.setattr(L, "mpi4py_available", lambda: False)  # never MPI_Init in the test process
    one_host = L.detect({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"})
    p = L.rendezvous_point(one_host, {})
    assert (p.rank, p.world_size, p.local_rank, p.local_size, p.addr, p.port) == (1, 4, 1, 4, "127.0.0.1", 29500)
    assert p.env() == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert L.rendezvous_point(one_host, {"MASTER_PORT": "1234"}).port == 1234
    two_hosts = L.detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    with pytest.raises(ValueError, match="set MASTER_ADDR .* or install mpi4py"):
        L.rendezvous_point(two_hosts, {})
    p = L.rendezvous_point(two_hosts, {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4000"})
    assert (p.addr, p.port, p.local_rank, p.local_size) == ("10.0.0.7", 4000, 1, 2)
    srun = L.detect({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                     "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    p = L.rendezvous_point(srun, {"SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert (p.addr, p.port, p.local_size) == ("gpu07", 29500, 2)
    torchrun = L.detect({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT not set"):
        L.rendezvous_point(torchrun, {})


def test_local_addresses_list_loopback_last():
    addrs = L.local_addresses()
    assert addrs and addrs[-1].startswith("127.")
    assert all(socket.inet_aton(a) for a in addrs)


# ---------------------------------------------------------------------- timeout
def test_resolve_timeout():
    assert resolve_timeout(None, {}) == DEFAULT_TIMEOUT_S == 300.0
    assert resolve_timeout(None, {"ZPP_TIMEOUT_S": "12.5"}) == 12.5
    assert resolve_timeout(7, {"ZPP_TIMEOUT_S": "12.5"}) == 7.0  # the argument wins
    with pytest.raises(ValueError, match="ZPP_TIMEOUT_S='soon'"):
        resolve_timeout(None, {"ZPP_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match=r"\$ZPP_TIMEOUT_S=0.0"):
        resolve_timeout(None, {"ZPP_TIMEOUT_S": "0"})
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s="):
            resolve_timeout(bad, {})
    with pytest.raises(TypeError, match="timeout_s=True"):
        resolve_timeout(True, {})


def test_config_timeout_and_transport_fields():
    from zpp.zero.config import ZppConfig, from_deepspeed

    assert ZppConfig().transport is None and ZppConfig().timeout_s is None
    cfg = from_deepspeed({"zpp": {"timeout_s": 30, "transport": "mpi"}})
    assert (cfg.zpp.timeout_s, cfg.zpp.transport) == (30, "mpi")
    for bad in (0, -3, "30", True, float("inf")):
        with pytest.raises(ValueError, match="timeout_s="):
            ZppConfig(timeout_s=bad)
    with pytest.raises(ValueError, match="transport=''"):
        ZppConfig(transport="")


# ---------------------------------------------------------------------- precedence
class _Chosen(Exception):
    pass


def _fake_factory(name):
    def make(**kwargs):
        raise _Chosen(name, kwargs)
    return make


@pytest.fixture
def fake_backends(monkeypatch):
    """Both registry entries raise _Chosen(name, kwargs) instead of building a world."""
    for name in ("torch", "mpi"):
        monkeypatch.setitem(registry._REGISTRY, name, _fake_factory(name))
    for var in (registry.BACKEND_ENV, TUNE_FILE_ENV, "PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE",
                "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _chosen(**kwargs):
    with pytest.raises(_Chosen) as info:
        registry.get_transport(**kwargs)
    return info.value.args


def test_backend_precedence(fake_backends, monkeypatch, tmp_path):
    """explicit > $ZPP_COMM_BACKEND > tune plan > torch.distributed initialized > launcher > torch."""
    from tests.test_tune import _sample_plan  # a plan whose backend is "mpi"

    assert registry.resolve_backend() == ("torch", "the default")
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setattr(registry, "mpi4py_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name, source = registry.resolve_backend()
    assert name == "mpi" and "hydra" in source  # the launcher's natural backend
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert registry.resolve_backend() == ("torch", "torch.distributed is already initialized")
    path = tmp_path / "plan.json"
    _sample_plan().save(path)
    monkeypatch.setenv(TUNE_FILE_ENV, str(path))
    assert registry.resolve_backend() == ("mpi", str(path))
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    assert registry.resolve_backend() == ("torch", "$ZPP_COMM_BACKEND")
    assert registry.resolve_backend("mpi")[0] == "mpi"
    assert _chosen(name="mpi", timeout_s=4) == ("mpi", {"timeout_s": 4})


def test_initialize_follows_the_precedence(fake_backends, monkeypatch):
    """zpp.initialize: the config's zpp.transport is explicit; without it $ZPP_COMM_BACKEND
    counts (its default used to be "torch", which hid the variable); zpp.timeout_s reaches
    the factory."""
    import zpp

    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv(registry.BACKEND_ENV, "mpi")
    with pytest.raises(_Chosen) as info:
        zpp.initialize(model=model, config={})
    assert info.value.args == ("mpi", {})
    with pytest.raises(_Chosen) as info:
        zpp.initialize(model=model, config={"zpp": {"transport": "torch", "timeout_s": 9}})
    assert info.value.args == ("torch", {"timeout_s": 9})


# ---------------------------------------------------------------------- fault reports
def test_describe_names_what_was_seen():
    f = Fault("all_reduce", 17, (0, 1, 2, 3), "timeout", 5.0, "gloo: Timed out waiting 5000ms")
    reports = {2: {"op": "all_reduce", "call": 17, "group": [0, 1, 2, 3], "kind": "timeout"},
               3: {"op": "all_gather", "call": 9, "group": [1, 3], "kind": "closed"}}
    cls, msg = describe(f, 0, 4, reports, 3.0)
    assert cls is TimeoutError
    assert msg.startswith("all_reduce (call 17 on ranks [0, 1, 2, 3]): rank 0 timed out after 5 s")
    assert "no report within 3 s from rank 1" in msg
    assert "rank 2 timed out in the same call" in msg
    assert "rank 3 lost a peer in all_gather call 9 on ranks [1, 3]" in msg
    # only lost connections seen: ConnectionError; one rank that timed out makes it a TimeoutError
    closed = Fault("broadcast", 2, (0, 1, 2), "closed", 0.1)
    assert describe(closed, 1, 3, {0: {"op": "broadcast", "call": 2, "group": [0, 1, 2], "kind": "closed"}})[0] \
        is ConnectionError
    assert describe(closed, 1, 3, {0: {"op": "broadcast", "call": 2, "group": [0, 1, 2], "kind": "timeout"}})[0] \
        is TimeoutError
    cls, msg = describe(f, 0, 4, None)
    assert cls is TimeoutError and "No fault channel" in msg


def _channels(n):
    chans = [FaultChannel(r, n) for r in range(n)]
    for c in chans:
        c.peers = [(socket.gethostname(), ["127.0.0.1"], d.port) for d in chans]
        c.token = chans[0].token
    return chans


def test_fault_channel_exchange():
    """Three channels in this process: rank 1 reports first; rank 0 then hears it at once,
    and nothing from rank 2 (which never reports) within its window."""
    chans = _channels(3)
    try:
        f1 = Fault("all_gather", 4, (0, 1, 2), "timeout", 2.0)
        got1 = chans[1].report(f1, window_s=0.2)
        assert set(got1) == set()  # nobody else had reported
        start = time.monotonic()
        got0 = chans[0].report(Fault("all_gather", 4, (0, 1, 2), "timeout", 2.0), window_s=0.5)
        assert set(got0) == {1} and got0[1]["call"] == 4 and got0[1]["kind"] == "timeout"
        assert 0.45 < time.monotonic() - start < 3  # waited its window for rank 2
        assert chans[0].broken == "all_gather call 4 on ranks [0, 1, 2] timed out"
        # a datagram without the job's token is ignored
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps({"t": "other-job", "from": 2, "op": "x", "call": 1}).encode(),
                     ("127.0.0.1", chans[0].port))
        time.sleep(0.1)
        assert 2 not in chans[0].report(Fault("barrier", 5, (0, 1, 2), "timeout", 1.0))
        # exits are announced and awaited: rank 1 reported, so rank 0 waits for its exit note
        chans[1].announce_exit(grace_s=0.0)
        start = time.monotonic()
        chans[0].announce_exit(grace_s=2.0)
        assert chans[0].exiting == {1} and time.monotonic() - start < 1.5
    finally:
        for c in chans:
            c.close()


# ---------------------------------------------------------------------- MPICH segments
_MAPPER = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(60)
"""


def _mapper(path):
    proc = subprocess.Popen([sys.executable, "-c", _MAPPER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "mapped"
    return proc


def test_shm_watch_removes_only_its_jobs_segments(tmp_path):
    ours, theirs, stray = (tmp_path / f"mpich_shm_{n}_0" for n in ("aa", "bb", "cc"))
    for p in (ours, theirs, stray):
        p.write_bytes(b"\0" * 4096)
    job, other = _mapper(ours), _mapper(theirs)
    try:
        with ShmWatch(job.pid, shm_dir=str(tmp_path), interval_s=0.05) as watch:
            time.sleep(0.3)
            assert watch.seen == {str(ours)}
            job.send_signal(signal.SIGKILL)  # the job dies without unlinking its segment
            job.wait()
        assert watch.removed == [str(ours)] and not ours.exists()
        assert theirs.exists() and stray.exists()  # another job's (mapped) and one never seen
        # a recorded segment still mapped is kept (after the settle time)
        watch2 = ShmWatch(other.pid, shm_dir=str(tmp_path))
        watch2.sample()
        assert watch2.clean(settle_s=0.2) == [] and theirs.exists()
    finally:
        for p in (job, other):
            p.kill()
            p.wait()


# ---------------------------------------------------------------------- module surface
def test_command_line_imports_no_torch():
    code = ("import sys, zpp, zpp.cli, zpp.comm.launch; zpp.cli.build_parser(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=60)


def test_deepspeed_comm_surface():
    import zpp
    from zpp.comm import dist

    assert set(dist.__all__) <= set(zc.__all__)
    for name in dist.__all__:
        assert getattr(zc, name) is getattr(dist, name)
    assert zpp.init_distributed is dist.init_distributed and zpp.comm.get_rank is dist.get_rank
    want = ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout", "init_method",
            "dist_init_required", "config", "rank", "world_size"]
    assert list(inspect.signature(zpp.init_distributed).parameters) == want
    assert [m.name for m in dist.ReduceOp] == ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "UNUSED"]
    for fn, params in ((dist.all_reduce, ["tensor", "op", "group", "async_op"]),
                       (dist.all_gather_into_tensor, ["output_tensor", "tensor", "group", "async_op"]),
                       (dist.reduce_scatter_tensor, ["output_tensor", "tensor", "op", "group", "async_op"]),
                       (dist.broadcast, ["tensor", "src", "group", "async_op"]),
                       (dist.reduce, ["tensor", "dst", "op", "group", "async_op"])):
        assert list(inspect.signature(fn).parameters)[:len(params)] == params


def test_deepspeed_comm_needs_a_world():
    from zpp.comm import dist

    if torch.distributed.is_initialized():
        pytest.skip("this process already has a torch.distributed world")
    assert dist.is_initialized() is False and dist.is_available()
    with pytest.raises(RuntimeError, match=r"zpp.comm.get_rank: .*zpp.init_distributed\(\)"):
        dist.get_rank()
    with pytest.raises(RuntimeError, match="zpp.comm.all_reduce"):
        dist.all_reduce(torch.ones(1))
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        dist.init_distributed(dist_init_required=False)
    with pytest.raises(NotImplementedError, match="comms_logger"):
        dist.init_distributed(config={"comms_logger": {"enabled": True}})
