"""Start ranks inside the node namespaces of an emulated cluster (torch.distributed or MPI).

torch backend: one process per rank, each started as
``ip netns exec zpp-n<i> env RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=..
MASTER_ADDR=<node 0> MASTER_PORT=<free port> GLOO_SOCKET_IFNAME=zpp-eth ... CMD`` in its own
process group. Ranks ``i*R .. i*R+R-1`` live on node ``i``.

mpi backend: one hydra ``mpiexec`` started inside node 0, which starts one
``hydra_pmi_proxy`` per node namespace through a small rsh-launcher script
(``ip netns exec HOST sh -c CMD``; it refuses names that are not our node namespaces).
MPICH then uses shared memory inside a node and TCP (libfabric tcp provider on ``zpp-eth``)
between nodes.

Which transport the ranks use: ``--backend B`` (``backend="B"``) starts them for B and
exports ``ZPP_COMM_BACKEND=B``, which outranks the backend of a ``zpp tune`` plan
(``ZPP_TUNE_FILE``; see [Note: which transport] in :mod:`zpp.comm.registry`; rank 0 of the
job then warns that it overrides the plan). Without it nothing is exported: the ranks are
started for the plan's backend when ``ZPP_TUNE_FILE`` names a plan, else for torch
(:func:`launch_backend`), and each rank's ``get_transport()`` follows the plan.

Output: rank 0's stdout goes to our stdout unchanged; every other stream (other ranks'
stdout, all stderr, launcher messages) goes to our stderr, each line prefixed ``[rank k]``.

Every process of a run carries ``ZPP_CLUSTER_RUN_ID`` in its environment; when the run ends
(normally, on timeout, on Ctrl-C, or after a rank failed) any process inside the node
namespaces still carrying that id is killed, so nothing of the run outlives it; then the
MPICH shared-memory segments that an mpi run's ranks mapped are removed
(:class:`zpp.comm.mpi_shm.ShmWatch`), since a killed MPI job leaves them in /dev/shm.
"""

from __future__ import annotations

import codecs
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import IO, Mapping, Sequence

from zpp.comm.mpi_shm import ShmWatch

from . import netns
from .netns import ClusterError, PrerequisiteError

BACKENDS = ("torch", "mpi")
TIMEOUT_EXIT = 124
KILL_GRACE_S = 3.0
# After one rank fails, the others get this long to finish (they usually error out quickly
# on the broken connection) before they are killed.
FAIL_GRACE_S = 5.0
RUN_ID_VAR = "ZPP_CLUSTER_RUN_ID"

_LAUNCHER_TEMPLATE = """#!/bin/sh
# zpp cluster: rsh-launcher for hydra. Usage: {script} HOST CMD...
# Runs CMD inside the network namespace HOST, which must be one of zpp's node namespaces.
host="$1"
shift
case "$host" in
  {prefix}n*) idx="${{host#{prefix}n}}" ;;
  *) echo "zpp cluster launcher: refusing namespace '$host' (not a {prefix}n<i> node)" >&2; exit 255 ;;
esac
case "$idx" in
  ''|*[!0-9]*) echo "zpp cluster launcher: refusing namespace '$host' (not a {prefix}n<i> node)" >&2; exit 255 ;;
esac
exec {ip} netns exec "$host" sh -c "$*"
"""


# --------------------------------------------------------------------------- output forwarding


class _Sink:
    """Forwards one byte stream: raw to ``target``, or line by line with a ``[label]`` prefix."""

    def __init__(self, target: IO[str], lock: threading.Lock, label: str | None):
        self.target = target
        self.lock = lock
        self.label = label
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""

    def _write(self, text: str) -> None:
        if not text:
            return
        with self.lock:
            try:
                self.target.write(text)
                self.target.flush()
            except (ValueError, OSError):
                pass  # target closed: drop

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final=final)
        if self.label is None:
            self._write(text)
            return
        text = self.partial + text
        lines = text.split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        if lines:
            self._write("".join(f"[{self.label}] {line}\n" for line in lines))

    def close(self) -> None:
        self.feed(b"", final=True)


def _pump_pipe(fd: IO[bytes], sink: _Sink) -> None:
    try:
        while True:
            data = os.read(fd.fileno(), 65536)
            if not data:
                break
            sink.feed(data)
    except OSError:
        pass
    finally:
        sink.close()
        try:
            fd.close()
        except OSError:
            pass


class _FileTail(threading.Thread):
    """Follow files that appear and grow (hydra's per-rank -outfile-pattern files)."""

    def __init__(self, paths_sinks: Sequence[tuple[str, _Sink]], interval: float = 0.05):
        super().__init__(daemon=True)
        self.items = [[path, sink, None] for path, sink in paths_sinks]
        self.interval = interval
        self.stop = threading.Event()

    def _poll(self) -> None:
        for item in self.items:
            path, sink, fh = item
            if fh is None:
                try:
                    fh = item[2] = open(path, "rb")
                except FileNotFoundError:
                    continue
            while True:
                data = fh.read(65536)
                if not data:
                    break
                sink.feed(data)

    def run(self) -> None:
        while not self.stop.is_set():
            self._poll()
            self.stop.wait(self.interval)
        self._poll()
        for _, sink, fh in self.items:
            sink.close()
            if fh is not None:
                fh.close()


# --------------------------------------------------------------------------- process control


def _exit_code(rc: int) -> int:
    """Popen's return code as a shell would show it (signal N -> 128+N)."""
    return 128 - rc if rc < 0 else rc


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run_pids(run_id: str, namespaces: Sequence[str]) -> list[int]:
    """Processes inside ``namespaces`` whose environment carries this run's id."""
    marker = f"{RUN_ID_VAR}={run_id}".encode()
    me = os.getpid()
    found = []
    for ns in namespaces:
        res = netns.sh(["ip", "netns", "pids", ns], check=False)
        for tok in res.stdout.split():
            if not tok.isdigit() or int(tok) == me:
                continue
            try:
                with open(f"/proc/{tok}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if marker in env:
                found.append(int(tok))
    return found


def _kill_run_leftovers(run_id: str, namespaces: Sequence[str], grace: float = KILL_GRACE_S) -> int:
    """SIGTERM, then SIGKILL, every process of this run still alive in the namespaces."""
    pids = _run_pids(run_id, namespaces)
    if not pids:
        return 0
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _run_pids(run_id, namespaces):
            return len(pids)
        time.sleep(0.1)
    for p in _run_pids(run_id, namespaces):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


class _Job:
    def __init__(self, label: str, argv: list[str], out_sink: _Sink, err_sink: _Sink):
        self.label = label
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: killpg reaches its children
        )
        self.killed = False
        self.threads = [
            threading.Thread(target=_pump_pipe, args=(self.proc.stdout, out_sink), daemon=True),
            threading.Thread(target=_pump_pipe, args=(self.proc.stderr, err_sink), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def signal(self, sig: int) -> None:
        _killpg(self.proc.pid, sig)


def _stop_jobs(jobs: Sequence[_Job], grace: float = KILL_GRACE_S) -> None:
    live = [j for j in jobs if j.proc.poll() is None]
    for j in live:
        j.killed = True
        j.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(j.proc.poll() is None for j in live):
        time.sleep(0.05)
    for j in live:
        j.signal(signal.SIGKILL)  # the group may outlive its leader
        try:
            j.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _supervise(
    jobs: Sequence[_Job],
    timeout: float | None,
    err: IO[str],
    lock: threading.Lock,
    fail_grace: float = FAIL_GRACE_S,
) -> int:
    """Wait for the jobs; kill them on timeout, Ctrl-C, or some time after a failure."""

    def note(msg: str) -> None:
        with lock:
            try:
                err.write(f"zpp cluster run: {msg}\n")
                err.flush()
            except (ValueError, OSError):
                pass

    start = time.monotonic()
    first_fail: tuple[float, _Job] | None = None
    try:
        while True:
            pending = [j for j in jobs if j.proc.poll() is None]
            if not pending:
                break
            now = time.monotonic()
            if first_fail is None:
                for j in jobs:
                    rc = j.proc.returncode
                    if rc is not None and rc != 0:
                        first_fail = (now, j)
                        break
            if timeout is not None and now - start > timeout:
                note(f"timed out after {timeout:g} s; killing {len(pending)} process(es)")
                _stop_jobs(jobs)
                return TIMEOUT_EXIT
            if first_fail is not None and now - first_fail[0] > fail_grace:
                j = first_fail[1]
                note(
                    f"{j.label} exited with {_exit_code(j.proc.returncode)}; killing "
                    f"{len(pending)} remaining process(es) after {fail_grace:g} s"
                )
                _stop_jobs(jobs)
                break
            time.sleep(0.05)
    except BaseException:  # KeyboardInterrupt, SystemExit, ...
        note("interrupted; killing all processes")
        _stop_jobs(jobs)
        raise
    codes = [_exit_code(j.proc.returncode) for j in jobs if not j.killed and j.proc.returncode is not None]
    return max(codes) if codes else 1


# --------------------------------------------------------------------------- helpers


def free_port(namespace: str) -> int:
    """A TCP port that is free on all addresses inside ``namespace`` right now."""
    code = (
        "import socket; s = socket.socket(); s.bind(('', 0)); "
        "print(s.getsockname()[1]); s.close()"
    )
    res = netns.sh(["ip", "netns", "exec", namespace, sys.executable, "-c", code])
    return int(res.stdout.strip())


def find_mpiexec() -> str:
    """MPICH's hydra mpiexec: next to this Python first (pip's mpich wheel), else on PATH."""
    here = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec")
    if not found:
        raise PrerequisiteError(
            "the mpi backend needs MPICH's hydra `mpiexec` (`pip install mpi4py mpich`: zpp's mpi extra); "
            "none found next to this Python or on PATH"
        )
    return found


def write_launcher(directory: str) -> str:
    """Write the hydra rsh-launcher script into ``directory``; returns its path."""
    path = os.path.join(directory, "zpp-netns-launcher.sh")
    ip = shutil.which("ip") or "ip"
    with open(path, "w") as f:
        f.write(_LAUNCHER_TEMPLATE.format(script=path, prefix=netns.PREFIX, ip=ip))
    os.chmod(path, 0o700)
    return path


def _check_cluster(nodes: int | None) -> tuple[int, dict]:
    st = netns.status()
    if not st["up"] or not st["nodes"]:
        raise ClusterError(
            "no cluster is up; start one with `zpp cluster up --nodes N --rate RATE`"
        )
    have = [n["index"] for n in st["nodes"]]
    if nodes is None:
        nodes = st["num_nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"invalid node count {nodes!r}: must be a positive integer")
    if have[:nodes] != list(range(nodes)):
        raise ClusterError(
            f"the cluster has {st['num_nodes']} node(s) ({', '.join(n['namespace'] for n in st['nodes'])}); "
            f"{nodes} requested. Bring up a bigger one with `zpp cluster up --nodes {nodes} --rate RATE`"
        )
    if st["switch"] is None:
        raise ClusterError(f"the cluster is incomplete: switch namespace {netns.SWITCH_NS} is missing")
    for n in st["nodes"][:nodes]:
        if n["problems"] or not n["address"]:
            raise ClusterError(
                f"node {n['namespace']} is not usable: {', '.join(n['problems']) or 'no address'}; "
                "recreate the cluster with `zpp cluster up`"
            )
    return nodes, st


# --------------------------------------------------------------------------- run


def run(
    cmd: Sequence[str],
    nodes: int | None = None,
    ranks_per_node: int = 1,
    backend: str | None = None,
    timeout: float | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    env: dict[str, str] | None = None,
    master_port: int | None = None,
    fail_grace: float = FAIL_GRACE_S,
) -> int:
    """Run ``cmd`` as ``nodes * ranks_per_node`` ranks on the cluster; returns the exit code.

    ``backend``: "torch" or "mpi", exported to the ranks as ``ZPP_COMM_BACKEND``; None: the
    backend of the ``ZPP_TUNE_FILE`` plan (in our environment or ``env``), else "torch",
    not exported (see :func:`launch_backend`).

    ``nodes`` defaults to every node of the cluster. Returns the worst exit code of the
    ranks (a rank killed by signal N counts 128+N), or 124 on ``timeout`` (seconds). On
    Ctrl-C everything is killed and ``KeyboardInterrupt`` re-raised. ``env`` adds variables
    for the ranks. ``stdout``/``stderr`` default to ``sys.stdout``/``sys.stderr``.
    """
    netns.check_prerequisites()
    cmd = [str(c) for c in cmd]
    if not cmd:
        raise ValueError("no command given to run")
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    backend, exported, note = launch_backend(backend, {**os.environ, **extra})
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"invalid ranks per node {ranks_per_node!r}: must be a positive integer")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"invalid timeout {timeout!r}: must be > 0 seconds")
    nodes, st = _check_cluster(nodes)
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    lock = threading.Lock()
    run_id = uuid.uuid4().hex
    namespaces = [netns.node_ns(i) for i in range(nodes)]
    world = nodes * ranks_per_node
    common = {
        "ZPP_RANKS_PER_NODE": str(ranks_per_node),
        "ZPP_NUM_NODES": str(nodes),
        **exported,
        "PYTHONUNBUFFERED": "1",
        RUN_ID_VAR: run_id,
    }
    if note:
        with lock:
            err.write(f"zpp cluster run: {note}\n")
            err.flush()

    def env_args(d: dict[str, str]) -> list[str]:
        return [f"{k}={v}" for k, v in d.items()]

    watches: list[ShmWatch] = []
    try:
        if backend == "torch":
            port = master_port or free_port(namespaces[0])
            master = st["nodes"][0]["address"]
            jobs: list[_Job] = []
            try:
                for i, ns in enumerate(namespaces):
                    for lr in range(ranks_per_node):
                        rank = i * ranks_per_node + lr
                        renv = {
                            "RANK": str(rank),
                            "WORLD_SIZE": str(world),
                            "LOCAL_RANK": str(lr),
                            "LOCAL_WORLD_SIZE": str(ranks_per_node),
                            "GROUP_RANK": str(i),
                            "NODE_RANK": str(i),
                            "MASTER_ADDR": master,
                            "MASTER_PORT": str(port),
                            "GLOO_SOCKET_IFNAME": netns.NODE_IF,
                            "TP_SOCKET_IFNAME": netns.NODE_IF,
                            **common,
                            **extra,
                        }
                        argv = ["ip", "netns", "exec", ns, "env", *env_args(renv), *cmd]
                        label = f"rank {rank}"
                        out_sink = _Sink(out, lock, None) if rank == 0 else _Sink(err, lock, label)
                        err_sink = _Sink(err, lock, label)
                        jobs.append(_Job(label, argv, out_sink, err_sink))
            except BaseException:
                _stop_jobs(jobs)
                raise
            code = _supervise(jobs, timeout, err, lock, fail_grace)
            _drain(jobs)
            return code
        return _run_mpi(cmd, nodes, ranks_per_node, namespaces, timeout, out, err, lock,
                        {**common, **extra}, watches)
    finally:
        _kill_run_leftovers(run_id, namespaces)
        for watch in watches:  # after the leftovers: nothing of the run maps them any more
            watch.stop()
            watch.clean()


def launch_backend(backend: str | None, env: Mapping[str, str]) -> tuple[str, dict[str, str], str | None]:
    """How :func:`run` starts the ranks: ``(backend, variables to export, note)``.

    ``backend`` given: that one, exported as ``ZPP_COMM_BACKEND`` (the note says when it
    overrides the plan named by ``env``'s ``ZPP_TUNE_FILE``). None: the plan's backend when
    ``env`` names a plan (a backend the cluster cannot start falls back to "torch", noted),
    else "torch"; nothing exported, so the ranks' ``get_transport()`` follows the plan.
    ValueError for an unknown backend or a malformed plan."""
    from zpp.comm.plan import TUNE_FILE_ENV, load_plan

    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"invalid backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    path = env.get(TUNE_FILE_ENV) or None
    plan = load_plan(path) if path else None
    if backend is not None:
        note = None
        if plan is not None and plan.backend() != backend:
            note = (f"--backend {backend} sets ZPP_COMM_BACKEND={backend}, which overrides the tune plan "
                    f"{plan.source} (it chose {plan.backend()}); the ranks run on {backend}")
        return backend, {"ZPP_COMM_BACKEND": backend}, note
    if plan is None:
        return "torch", {}, None
    chosen = plan.backend()
    if chosen not in BACKENDS:
        return "torch", {}, (f"the tune plan {plan.source} chose backend {chosen!r}, which `zpp cluster run` "
                             f"cannot start ({', '.join(BACKENDS)}); starting torch-style ranks")
    return chosen, {}, f"starting {chosen} ranks, the backend of the tune plan {plan.source} (no --backend)"


def _drain(jobs: Sequence[_Job], wait: float = 2.0) -> None:
    """Let the output threads finish (pipes close when the process groups are gone)."""
    deadline = time.monotonic() + wait
    for j in jobs:
        for t in j.threads:
            t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for j in jobs for t in j.threads):
        for j in jobs:  # stragglers of the group still hold the pipes: end them
            j.signal(signal.SIGKILL)
        for j in jobs:
            for t in j.threads:
                t.join(2.0)


def _run_mpi(
    cmd: list[str],
    nodes: int,
    ranks_per_node: int,
    namespaces: list[str],
    timeout: float | None,
    out: IO[str],
    err: IO[str],
    lock: threading.Lock,
    env: dict[str, str],
    watches: list[ShmWatch],
) -> int:
    mpiexec = find_mpiexec()
    world = nodes * ranks_per_node
    tmp = tempfile.mkdtemp(prefix="zpp-cluster-")
    tail = None
    try:
        launcher = write_launcher(tmp)
        menv = {
            "MPICH_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": netns.NODE_IF,
            **env,
        }
        hosts = ",".join(f"{ns}:{ranks_per_node}" for ns in namespaces)
        argv = [
            "ip", "netns", "exec", namespaces[0], "env", *[f"{k}={v}" for k, v in menv.items()],
            mpiexec,
            "-iface", netns.NODE_IF,
            "-launcher", "rsh", "-launcher-exec", launcher,
            "-hosts", hosts,
            "-n", str(world),
            "-outfile-pattern", os.path.join(tmp, "out.%r"),
            "-errfile-pattern", os.path.join(tmp, "err.%r"),
            *cmd,
        ]
        sinks = []
        for r in range(world):
            label = f"rank {r}"
            sinks.append((os.path.join(tmp, f"out.{r}"), _Sink(out, lock, None) if r == 0 else _Sink(err, lock, label)))
            sinks.append((os.path.join(tmp, f"err.{r}"), _Sink(err, lock, label)))
        tail = _FileTail(sinks)
        tail.start()
        job = _Job("mpiexec", argv, _Sink(err, lock, "mpiexec"), _Sink(err, lock, "mpiexec"))
        watches.append(ShmWatch(job.proc.pid).__enter__())
        code = _supervise([job], timeout, err, lock)
        _drain([job])
        return code
    finally:
        if tail is not None:
            tail.stop.set()
            tail.join(5.0)
        shutil.rmtree(tmp, ignore_errors=True)
