"""Where the ranks of ``zpp bench`` come from: a launcher's world, or local processes.

    zpp bench                                     # alone: 4 local ranks, 2 emulated nodes x 2, gloo
    zpp bench --backend mpi                       # alone: re-runs itself under mpiexec -n 4
    mpiexec -n 4 zpp bench                        # MPI world (mpi4py)
    mpiexec -n 4 zpp bench --backend torch        # torch.distributed, ranks from the MPI launch
    torchrun --nproc-per-node 4 -m zpp bench      # torch.distributed

* The launcher is found by the library's :func:`zpp.comm.launch.detect` (MPICH/hydra,
  Open MPI, MVAPICH, PMIx, srun, torchrun). Under an MPI launcher the launcher's world is
  used, with the MPI transport unless ``--backend torch``; the torch transport then builds
  its world from the launcher's numbering (see [Note: rendezvous of a torch world under an
  MPI launcher or srun] in :mod:`zpp.comm.launch`).
* Under torchrun or srun the torch backend is used.
* Alone, :func:`spawn` starts the ranks with multiprocessing (forkserver, torch preloaded;
  spawn where there is none), a free port on
  127.0.0.1, ``OMP_NUM_THREADS=1``, ``ZPP_RANKS_PER_NODE`` for the emulated nodes and a
  hard timeout; a failing rank's traceback is reported and the others are stopped.
  :func:`reexec_under_mpiexec` does the same through ``mpiexec -n N``, and removes the
  MPICH shared-memory segments that job leaves behind (:mod:`zpp.comm.mpi_shm`).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping

from zpp.comm.launch import Launch, detect
from zpp.comm.mpi_shm import ShmWatch

__all__ = ["Launch", "detect", "reexec_under_mpiexec", "spawn"]

#: Set on the ranks that :func:`reexec_under_mpiexec` starts.
CHILD_MARKER = "ZPP_BENCH_CHILD"
TIMEOUT_EXIT = 124
_GRACE_S = 10.0  # how long the other ranks may finish after one fails


def detect_for(parser: argparse.ArgumentParser) -> Launch:
    """:func:`detect` for a command: a launcher environment that does not add up is the
    command's usage error (``parser.error``, exit code 2), on every rank."""
    try:
        return detect()
    except ValueError as e:
        parser.error(str(e))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(values: Mapping[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child(fn: Callable[..., int], args: tuple, rank: int, env: dict, report) -> None:
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        code = fn(*args) or 0
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        report.send(traceback.format_exc()[-32768:])  # stays below a pipe's buffer
        report.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    report.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the work is done and flushed: skip tearing down torch (seconds on 2 cores)


def _context():
    """multiprocessing's "forkserver" with torch preloaded: the server (itself started
    fresh, never forked from this process) imports torch once and forks every rank from
    that clean state, so N ranks cost one torch import instead of N (seconds each on 2
    cores). "spawn" where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zpp.bench.command", "zpp.bench.harness",
                                "zpp.comm.registry"])
    return ctx


def spawn(fn: Callable[..., int], args: tuple, *, nprocs: int, ranks_per_node: int, timeout: float) -> int:
    """Run ``fn(*args)`` on ``nprocs`` local ranks of a torch.distributed (gloo) world of
    ``nprocs // ranks_per_node`` emulated nodes. ``fn`` (a top-level function) returns the
    rank's exit code. Returns rank 0's exit code, 1 if a rank raised or died, 124 on timeout."""
    ctx = _context()
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "ZPP_RANKS_PER_NODE": str(ranks_per_node),
    }
    procs, pipes = [], []
    for rank in range(nprocs):
        recv, send = ctx.Pipe(duplex=False)
        env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank % ranks_per_node)}
        procs.append(ctx.Process(target=_child, args=(fn, args, rank, env, send), name=f"zpp-rank{rank}"))
        pipes.append((recv, send))
    deadline = time.monotonic() + timeout  # start-up included
    # the ranks (and the forkserver) import torch before _child runs: its thread count must
    # be in their environment
    with _environ({"OMP_NUM_THREADS": "1"}):
        for p in procs:
            p.start()
    for _, send in pipes:
        send.close()
    timed_out = False
    try:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = not any(p.exitcode not in (None, 0) for p in procs)
                break
            mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(remaining, 1.0))
    except KeyboardInterrupt:
        _stop(procs)
        print("zpp bench: interrupted", file=sys.stderr)
        return 130
    running = [i for i, p in enumerate(procs) if p.exitcode is None]
    _stop(procs)
    errors = {}
    for rank, (recv, _) in enumerate(pipes):
        with contextlib.suppress(EOFError, OSError):
            if recv.poll():
                errors[rank] = recv.recv()
    if timed_out:
        print(f"zpp bench: timed out after {timeout:g} s with ranks {running} still running; "
              f"raise --timeout or use smaller --sizes", file=sys.stderr)
        return TIMEOUT_EXIT
    failed = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode != 0}
    if errors or running or set(failed) - {0} or (failed.get(0) or 0) < 0:
        _report(errors, failed, running)
        return 1
    return procs[0].exitcode or 0  # nonzero: rank 0 found values out of bounds


def _stop(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def _report(errors: dict[int, str], failed: dict[int, int | None], stopped: list[int]) -> None:
    """The first rank's traceback in full, one line for each other failure."""
    lines = []
    first = min(errors) if errors else None
    if first is not None:
        lines.append(f"zpp bench: rank {first} failed:\n{errors[first].rstrip()}")
    for rank, code in sorted(failed.items()):
        if rank == first or rank in stopped:
            continue
        if rank in errors:
            last = errors[rank].strip().splitlines()[-1]
            lines.append(f"zpp bench: rank {rank} also failed: {last}")
        elif code is not None and code < 0:
            lines.append(f"zpp bench: rank {rank} died of signal {signal.Signals(-code).name}")
        else:
            lines.append(f"zpp bench: rank {rank} exited with code {code}")
    if stopped:
        lines.append(f"zpp bench: stopped ranks {stopped}, still running {_GRACE_S:g} s after the failure")
    print("\n".join(lines), file=sys.stderr)


def reexec_under_mpiexec(argv: list[str], *, nprocs: int, ranks_per_node: int, timeout: float) -> int:
    """``mpiexec -n nprocs python -m zpp <argv>`` with the emulated node size; its exit code
    (124 on timeout, after stopping it)."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise FileNotFoundError("--backend mpi needs mpiexec or mpirun on PATH (pip install mpi4py mpich: zpp's mpi extra)")
    cmd = [exe, "-n", str(nprocs), sys.executable, "-m", "zpp", *argv]
    env = {**os.environ, "ZPP_RANKS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1",
           CHILD_MARKER: "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    with ShmWatch(proc.pid):  # the segments of a killed job: see zpp.comm.mpi_shm
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            print(f"zpp bench: timed out after {timeout:g} s under {' '.join(cmd[:3])}; "
                  f"raise --timeout or use smaller --sizes", file=sys.stderr)
            return TIMEOUT_EXIT
        except KeyboardInterrupt:
            _kill_group(proc)
            return 130


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def close_world(world) -> None:
    """Release a world a command created: its ``close()``, else (torch) the default process group."""
    close = getattr(world, "close", None)
    if callable(close):
        close()
        return
    import torch.distributed as dist

    if getattr(world, "name", None) == "torch" and dist.is_initialized():
        dist.destroy_process_group()
