"""Run a function on a world of ranks: the harness of every multi-process test.

    results = run_world(check_fn, 4, backend="mpi", ranks_per_node=2)

``check_fn`` is a top-level function ``check_fn(transport, *args)``; it is named by
``module:qualname`` so both launchers can import it in the ranks:

* torch: one process per rank from multiprocessing (see ``START_METHOD``), with MASTER_ADDR,
  MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE set as torchrun sets them;
* mpi: ``mpiexec -n N python -m tests._mpi_worker module:qualname RESULTDIR``.

Each rank builds its transport with ``zpp.comm.registry.get_transport(backend)``
(``ZPP_RANKS_PER_NODE`` set when ``ranks_per_node`` is given), runs the function, and
pickles its outcome into RESULTDIR. The first rank error (by time) is re-raised here, chained
to a :class:`RankError` holding that rank's traceback and a line per other rank; a world
that outlives ``timeout`` seconds is killed (every rank's process group and descendants) and
the test fails with :class:`WorldTimeout`. Each rank runs with one intra-op thread. An MPI
world's leftover MPICH shared-memory segments are removed when it ends
(:class:`zpp.comm.mpi_shm.ShmWatch`); ``world.shm_removed`` lists them.

Start-up: a fresh interpreter needs 2-3 s per rank to import torch. Under mpiexec every rank
pays it; the torch launcher uses multiprocessing's "forkserver" context with torch and zpp
preloaded into the server, so ranks are forked from a clean server process (never from the
test process, which may hold threads) that has already imported them. Set
``ZPP_TEST_START_METHOD=spawn`` to use fresh interpreters instead. Tests still batch many
checks into one world function.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from zpp.comm.mpi_shm import ShmWatch, descendants

ROOT = Path(__file__).resolve().parent.parent
START_METHOD = os.environ.get("ZPP_TEST_START_METHOD", "forkserver")
#: When pytest will kill the running test (monotonic seconds) and its timeout; set by
#: tests/conftest.py for every test, None outside pytest. See :func:`world_timeout`.
TEST_DEADLINE: float | None = None
TEST_LIMIT: float | None = None
#: A world must end this long before pytest's timeout, so its own diagnostics (which ranks
#: hung, the launcher's output) reach the report instead of pytest's bare timeout.
DIAGNOSTICS_S = 15.0
ERROR_GRACE_S = 10.0  # after a rank fails, how long the others get to report before being killed
EXIT_GRACE_S = 3.0  # after every rank reported, how long processes get to exit before being killed
# Launcher variables of the test process itself must not leak into the ranks.
_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ZPP_RANKS_PER_NODE", "ZPP_COMM_BACKEND",
)


class WorldTimeout(AssertionError):
    """A world ran past run_world's hard timeout and was killed."""


class RankError(Exception):
    """What a rank raised (as text): its traceback, and how the other ranks ended."""


def mpi_available() -> bool:
    return shutil.which("mpiexec") is not None and importlib.util.find_spec("mpi4py") is not None


#: Marks for a test that needs MPICH's mpiexec and mpi4py (skipped without them).
needs_mpi = [pytest.mark.mpi, pytest.mark.skipif(not mpi_available(), reason="needs mpiexec and mpi4py")]
#: Parametrize over these to run a test under both backends.
BACKENDS = [pytest.param("torch", id="torch"), pytest.param("mpi", id="mpi", marks=needs_mpi)]


def lose_peer(t: Any, mode: str, timeout_s: float, call: Callable[[], Any]) -> tuple[str, float, str] | None:
    """Inside a world: rank 1 stops answering, the others find out. Rank 1 hangs past
    ``timeout_s`` (``mode="hang"``) or leaves (``"exit"``: it returns, and the harness ends
    its process) and returns None; every other rank runs ``call()`` and returns the
    exception's type name ("no error" if none), the seconds the call took, and the message."""
    if t.rank == 1:
        if mode == "hang":
            time.sleep(timeout_s + 3)
        return None
    return timed_call(call)


def timed_call(call: Callable[[], Any]) -> tuple[str, float, str]:
    """Run ``call()``: (its exception's type name or "no error", the seconds it took, the message)."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", time.monotonic() - start, ""


def assert_peers_saw_loss(results: list, timeout_s: float, sockets_close: bool) -> None:
    """:func:`lose_peer`'s results on a 3-rank world: rank 1 left; ranks 0 and 2 raised within
    ``timeout_s + 4`` seconds plus the fault channel's report window, naming their rank, a
    TimeoutError after at least ``timeout_s - 0.5`` s, or, where the lost peer's sockets close
    (``sockets_close``), a ConnectionError or TimeoutError at any time."""
    from zpp.comm.faults import REPORT_WINDOW_S

    assert results[1] is None
    for rank in (0, 2):
        kind, elapsed, msg = results[rank]
        if sockets_close:
            assert kind in ("ConnectionError", "TimeoutError"), (rank, kind, msg)
        else:
            assert kind == "TimeoutError", (rank, kind, msg)
            assert elapsed >= timeout_s - 0.5, (rank, elapsed)
        assert elapsed < timeout_s + REPORT_WINDOW_S + 4, (rank, elapsed)
        assert f"rank {rank}" in msg, msg


def world_timeout(timeout: float) -> float:
    """``timeout`` fitted inside the running test's pytest timeout (see [Note: nested timeouts]).

    [Note: nested timeouts]
    A world's hard timeout must end before pytest's timeout of the test, with
    :data:`DIAGNOSTICS_S` to spare, or pytest kills the test first and the world's report
    (which ranks hung, the launcher's output) never shows. A world whose ``timeout`` cannot
    fit the test's limit at all is the test's mistake: ``ValueError`` naming both. Several
    worlds in one test share the limit: a later world gets at most what is left of it.
    """
    if TEST_LIMIT is None or TEST_DEADLINE is None:
        return timeout
    if timeout > TEST_LIMIT - DIAGNOSTICS_S:
        raise ValueError(
            f"run_world: timeout={timeout:g} s does not fit the test's pytest timeout of {TEST_LIMIT:g} s "
            f"less {DIAGNOSTICS_S:g} s for the world's diagnostics: raise @pytest.mark.timeout or lower it"
        )
    return max(1.0, min(timeout, TEST_DEADLINE - time.monotonic() - DIAGNOSTICS_S))


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "torch",
    ranks_per_node: int | None = None,
    timeout: float = 120,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    transport_kwargs: dict[str, Any] | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Run ``fn(transport, *args)`` on ``world_size`` ranks; return each rank's value.

    Args:
        fn: a module-level function (picklable by name); its return value must pickle.
        backend: "torch" or "mpi" (the launcher and the registry name).
        ranks_per_node: exported as ZPP_RANKS_PER_NODE (torch: also LOCAL_RANK /
            LOCAL_WORLD_SIZE); None for one node.
        timeout: hard limit in seconds for the whole world, start-up included; it must fit
            inside the test's pytest timeout (see :func:`world_timeout`).
        env: extra environment variables for every rank.
        transport_kwargs: keyword arguments for ``get_transport`` (e.g. ``timeout_s``).
        return_exceptions: put each failing rank's exception in its slot instead of raising.
    """
    __tracebackhide__ = True  # pytest: show the rank's traceback, not the harness's frames
    if world_size < 1 or backend not in ("torch", "mpi"):
        raise ValueError(f"run_world: {world_size=} must be >= 1 and {backend=} 'torch' or 'mpi'")
    target = _target_of(fn)
    timeout = world_timeout(timeout)
    rank_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if ranks_per_node is not None:
        rank_env["ZPP_RANKS_PER_NODE"] = str(ranks_per_node)
    job = {"target": target, "args": tuple(args), "backend": backend, "transport_kwargs": dict(transport_kwargs or {})}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zpp-world-") as tmp:
        resultdir = Path(tmp)
        (resultdir / "job.pkl").write_bytes(pickle.dumps(job))
        if backend == "mpi":
            world = _MpiWorld(target, world_size, resultdir, rank_env)
        else:
            world = _TorchWorld(world_size, resultdir, rank_env, ranks_per_node)
        try:
            what = f"run_world({target}, {world_size=}, {backend=})"
            outcomes = _collect(world, world_size, resultdir, start + timeout, timeout, what)
        finally:
            world.kill()
    return _results(outcomes, world_size, world, return_exceptions)


# ---------------------------------------------------------------------- inside a rank
def run_rank(resultdir: str | Path, rank: int, target: str | None = None) -> None:
    """Body of every rank: build the transport, run the target, pickle the outcome."""
    resultdir = Path(resultdir)
    job = pickle.loads((resultdir / "job.pkl").read_bytes())
    try:
        import torch

        torch.set_num_threads(1)
        from zpp.comm.registry import get_transport

        fn = _resolve(target or job["target"])
        transport = get_transport(job["backend"], **job["transport_kwargs"])
        outcome = {"ok": True, "value": fn(transport, *job["args"])}
        pickle.dumps(outcome)  # fail here, as this rank's error, if the value does not pickle
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the test process
        outcome = {
            "ok": False,
            "traceback": traceback.format_exc(),
            "exc": _picklable(e),
            "type": f"{type(e).__module__}.{type(e).__qualname__}",
            "message": str(e),
            "time": time.time(),
        }
    tmp = resultdir / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.rename(resultdir / f"rank{rank}.pkl")  # atomic: the test process never sees half a file


def _torch_rank(rank: int, world_size: int, port: int, per_node: int | None, env: dict, resultdir: str) -> None:
    os.setsid()  # a process group of its own, so a timeout kills whatever the rank started
    for var in _LAUNCH_VARS:
        os.environ.pop(var, None)
    local_size = per_node or world_size
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_size), LOCAL_WORLD_SIZE=str(local_size),
    )
    os.environ.update(env)
    run_rank(resultdir, rank)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may be gone; the outcome is already written
        pass


# ---------------------------------------------------------------------- launchers
class _TorchWorld:
    def __init__(self, world_size: int, resultdir: Path, env: dict, per_node: int | None) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed", "zpp.comm.registry", "tests.dist"])
        port = _free_port()
        self.procs = [
            ctx.Process(target=_torch_rank, args=(r, world_size, port, per_node, env, str(resultdir)), name=f"rank{r}")
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def exit_note(self, rank: int) -> str:
        return f"exit code {self.procs[rank].exitcode}"

    def output(self) -> str:
        return ""

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                _kill_tree(p.pid)
            p.join(timeout=5)


class _MpiWorld:
    def __init__(self, target: str, world_size: int, resultdir: Path, env: dict) -> None:
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise RuntimeError("run_world(backend='mpi'): mpiexec is not on PATH (pip install mpich mpi4py)")
        full_env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        full_env.update(env)
        self.log = open(resultdir / "mpiexec.log", "w+b")  # noqa: SIM115 - closed in kill()
        self.text = ""
        cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", "tests._mpi_worker", target, str(resultdir)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.shm = ShmWatch(self.proc.pid).__enter__()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_note(self, rank: int) -> str:
        return f"mpiexec exit code {self.proc.returncode}"

    def output(self) -> str:
        if self.log.closed:
            return self.text
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def kill(self) -> None:
        if self.log.closed:
            return
        if self.proc.poll() is None:
            _kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.shm.stop()
        self.shm.clean()
        self.text = self.output()
        self.log.close()
        if self.text.strip():
            sys.stdout.write(f"--- mpiexec output ---\n{self.text}")


# ---------------------------------------------------------------------- collecting
def _collect(world, world_size: int, resultdir: Path, deadline: float, timeout: float, what: str) -> dict[int, dict]:
    __tracebackhide__ = True
    outcomes: dict[int, dict] = {}
    first_error = None  # monotonic time at which some rank failed or vanished
    all_in = None  # monotonic time at which every rank had reported
    while True:
        # before the scan: a rank writes its file before it exits, so ranks seen gone here
        # have their files found below (checked after the scan, a rank could write and exit
        # in between and be reported as ended without reporting)
        alive = world.alive()
        for r in range(world_size):
            path = resultdir / f"rank{r}.pkl"
            if r not in outcomes and path.exists():
                outcomes[r] = pickle.loads(path.read_bytes())
                if not outcomes[r]["ok"] and first_error is None:
                    first_error = time.monotonic()
        now = time.monotonic()
        if len(outcomes) == world_size:
            all_in = all_in or now
            if not alive or now - all_in > EXIT_GRACE_S:
                return outcomes
        elif not alive:
            return outcomes  # some ranks died without a word; reported as such
        elif first_error is not None and now - first_error > ERROR_GRACE_S:
            return outcomes
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(outcomes))
            world.kill()
            tail = world.output()[-4000:]
            raise WorldTimeout(
                f"{what}: hard timeout after {timeout:g} s; ranks {missing} had not finished "
                f"(finished: {sorted(outcomes)}); every rank was killed"
                + (f"\n--- launcher output (tail) ---\n{tail}" if tail else "")
            )
        time.sleep(0.05)


def _results(outcomes: dict[int, dict], n: int, world, return_exceptions: bool) -> list[Any]:
    __tracebackhide__ = True
    for r in range(n):
        if r not in outcomes:
            outcomes[r] = {
                "ok": False, "exc": None, "type": "?", "time": float("inf"), "traceback": "",
                "message": f"rank {r} ended without reporting ({world.exit_note(r)})",
            }
    lines = []
    for r in range(n):
        o = outcomes[r]
        lines.append(f"  rank {r}: " + ("ok" if o["ok"] else f"{o['type']}: {o['message'].splitlines()[0] if o['message'] else ''}"))
    summary = "\n".join(lines)
    failed = [r for r in range(n) if not outcomes[r]["ok"]]
    if return_exceptions:
        return [outcomes[r]["value"] if outcomes[r]["ok"] else _exception(r, outcomes[r], summary) for r in range(n)]
    if not failed:
        return [outcomes[r]["value"] for r in range(n)]
    r = min(failed, key=lambda k: outcomes[k]["time"])
    o = outcomes[r]
    detail = RankError(
        f"rank {r} failed first; every rank:\n{summary}\n--- rank {r} traceback ---\n{o['traceback']}"
        + (f"\n--- launcher output (tail) ---\n{world.output()[-4000:]}" if world.output() else "")
    )
    exc = o["exc"]
    if exc is None:
        raise detail
    raise exc from detail


def _exception(rank: int, outcome: dict, summary: str) -> BaseException:
    exc = outcome["exc"]
    if exc is None:
        exc = RankError(f"rank {rank}: {outcome['type']}: {outcome['message']}")
    exc.__cause__ = RankError(f"rank {rank} traceback:\n{outcome['traceback']}\nevery rank:\n{summary}")
    return exc


# ---------------------------------------------------------------------- small helpers
def _target_of(fn: Callable) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"run_world: {fn!r} must be a module-level function importable by name "
            f"(got module={module!r}, qualname={qualname!r})"
        )
    return f"{module}:{qualname}"


def _resolve(target: str) -> Callable:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _picklable(e: BaseException) -> BaseException | None:
    try:
        copy = pickle.loads(pickle.dumps(e))  # carries type and args; not the traceback
        return copy if isinstance(copy, BaseException) else None
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid`` (hydra proxies may
    put ranks in groups of their own)."""
    victims = [pid, *descendants(pid)]
    try:
        if os.getpgid(pid) == pid:  # only a group the rank leads: never the test process's own
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for v in victims:
        try:
            os.kill(v, signal.SIGKILL)
        except ProcessLookupError:
            pass
