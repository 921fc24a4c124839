"""Run tests/fault_worker.py as a real job: plain processes, torchrun, or mpiexec.

    run = launch("torchrun", 4, "snippet", tmp_path)
    run.codes, run.results, run.output, run.leftovers

The harness of tests/test_faults.py and perf/exit_check.py. Unlike :func:`tests.dist.run_world`
it keeps each process's own exit code and output, since what is tested is how a job ends:

* "spawn": one process per rank with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each in its own session; ``codes`` has one
  exit code per rank.
* "torchrun": ``python -m torch.distributed.run --nproc-per-node N``; ``codes`` is
  torchrun's.
* "mpiexec": ``mpiexec -n N``; ``codes`` is mpiexec's; its MPICH segments are watched and
  removed afterwards (:class:`zpp.comm.mpi_shm.ShmWatch`), as zpp's launchers do.

Every process carries ``ZPP_LAUNCH_ID=<id>`` in its environment and ``TMPDIR`` pointing to a
fresh directory. After ``wait_s`` the processes still alive are reported in
``alive_at_deadline`` and killed (a stopped rank is the launcher's to end; ``spawn`` plays
the launcher). ``leftovers`` then lists the processes of the run still alive, the MPICH
segments it left, and what it left in its ``TMPDIR`` (but for torch's own ``TORCH_TMP``).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from zpp.comm.mpi_shm import ShmWatch, descendants

ROOT = Path(__file__).resolve().parent.parent
MARK = "ZPP_LAUNCH_ID"
#: TMPDIR entries torch and torchrun make and keep by design (not counted as leftovers)
TORCH_TMP = ("torchelastic_", "torchinductor_")
# launcher variables of the test process must not reach the ranks
_STRIP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
          "ZPP_RANKS_PER_NODE", "ZPP_COMM_BACKEND", "ZPP_TIMEOUT_S", "ZPP_TUNE_FILE", "TORCHELASTIC_RUN_ID")


@dataclass
class Run:
    codes: list[int | None]
    """Exit code of each rank (spawn) or of the launcher; None: killed at the deadline."""
    results: dict[int, dict]
    """What each rank wrote (rank -> record); "fault" -> the misbehaving rank's note."""
    output: str
    """stdout and stderr of every process, concatenated."""
    alive_at_deadline: list[int] = field(default_factory=list)
    """Processes of the run that were still alive at ``wait_s`` (then killed)."""
    leftovers: list[str] = field(default_factory=list)
    """Processes and MPICH segments of the run still there at the end."""
    wall_s: float = 0.0
    shm_removed: list[str] = field(default_factory=list)
    """MPICH segments the launcher-side watch removed."""
    ended: list[float | None] = field(default_factory=list)
    """``time.time()`` at which each process (as in ``codes``) was seen to end by itself."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(extra: dict[str, str] | None, run_id: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env[MARK] = run_id
    env.update(extra or {})
    return env


def marked_pids(run_id: str) -> list[int]:
    """Living processes whose environment carries this run's id."""
    needle = f"{MARK}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return [p for p in found if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(kind: str, nprocs: int, scenario: str, outdir: Path, *, env: dict[str, str] | None = None,
           wait_s: float = 120.0, until_results: list[int] | None = None) -> Run:
    """Run ``scenario`` on ``nprocs`` ranks under ``kind``; see the module docstring. With
    ``until_results``, the run is over once those ranks have written their records and
    their processes ended (the others are then ended, as a launcher would)."""
    run_id = uuid.uuid4().hex
    tmpdir = outdir / "tmp"
    tmpdir.mkdir()
    base = _base_env({"TMPDIR": str(tmpdir), **(env or {})}, run_id)
    # the worker by path, so that PYTHONPATH alone decides which zpp it imports (a baseline tree)
    worker = [sys.executable, str(ROOT / "tests" / "fault_worker.py"), scenario, str(outdir)]
    logs = [outdir / f"out{i}.log" for i in range(nprocs if kind == "spawn" else 1)]
    files = [open(p, "w+b") for p in logs]  # noqa: SIM115 - closed below
    start = time.monotonic()
    watch = None
    if kind == "spawn":
        port = str(_free_port())
        procs = [subprocess.Popen(worker, cwd=ROOT, stdout=files[r], stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**base, "RANK": str(r), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(r),
                                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port})
                 for r in range(nprocs)]
    elif kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
               "--master-port", str(_free_port()), *worker[1:]]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=base, stdout=files[0], stderr=subprocess.STDOUT,
                                  start_new_session=True)]
    elif kind == "mpiexec":
        procs = [subprocess.Popen(["mpiexec", "-n", str(nprocs), *worker], cwd=ROOT, env=base, stdout=files[0],
                                  stderr=subprocess.STDOUT, start_new_session=True)]
        watch = ShmWatch(procs[0].pid).__enter__()
    else:
        raise ValueError(f"launch: kind={kind!r}")
    deadline = start + wait_s
    alive_at_deadline: list[int] = []
    ended: list[float | None] = [None] * len(procs)
    while True:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        # decided on the ends recorded just above, never on a fresh poll(): a process that ends
        # between the two would end the run with its end time unrecorded
        done = all(t is not None for t in ended)
        if until_results is not None and all((outdir / f"rank{r}.json").exists() for r in until_results):
            if kind != "spawn" or all(ended[r] is not None for r in until_results):
                done = True
        if done:
            break
        if time.monotonic() > deadline:
            alive_at_deadline = marked_pids(run_id)
            break
        time.sleep(0.05)
    wall = time.monotonic() - start
    # the launcher's part: end whatever is left (a stopped or stuck rank), by process group
    for p in procs:
        if p.poll() is None:
            for pid in [p.pid, *descendants(p.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    removed: list[str] = []
    if watch is not None:
        watch.stop()
        removed = watch.clean()
    time.sleep(0.2)
    leftovers = [f"pid {p}" for p in marked_pids(run_id)]
    if watch is not None:
        leftovers += [s for s in sorted(watch.seen) if os.path.exists(s)]
    # torch's own, by design: torchrun's per-run log directory and the inductor cache directory
    ours = [p for p in sorted(tmpdir.iterdir()) if not p.name.startswith(TORCH_TMP)]
    leftovers += [str(p) for p in ours]
    output = ""
    for f in files:
        f.flush()
        f.seek(0)
        output += f.read().decode(errors="replace")
        f.close()
    results: dict = {}
    for r in range(nprocs):
        path = outdir / f"rank{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
    if (outdir / "fault.json").exists():
        results["fault"] = json.loads((outdir / "fault.json").read_text())
    codes = [p.returncode for p in procs]
    return Run(codes, results, output, alive_at_deadline, leftovers, wall, removed, ended)

