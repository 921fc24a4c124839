"""Which launcher started this process, and the torch.distributed world it implies.

    mpiexec -n 4 python train.py              # MPICH / Intel MPI (hydra): PMI_RANK, PMI_SIZE
    mpirun -n 4 python train.py               # Open MPI: OMPI_COMM_WORLD_*; MVAPICH: MV2_COMM_WORLD_*
    srun -n 4 python train.py                 # SLURM step: SLURM_PROCID, SLURM_STEP_NUM_TASKS
    torchrun --nproc-per-node 4 train.py      # RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID
    python train.py                           # alone: a world of one

:func:`detect` reads only environment variables (no import of torch or mpi4py), so command
lines use it too. The library uses it at its entry points: :func:`zpp.comm.get_transport`
takes the launcher's natural backend (:func:`natural_backend`) when nothing else names one,
and a torch transport started by an MPI launcher or srun builds its world from the
launcher's numbering (:func:`rendezvous_point`) instead of running as a world of one.

[Note: launcher variables]
Checked in this order (the first family present wins):

1. torchrun: ``RANK`` and ``WORLD_SIZE`` with ``TORCHELASTIC_RUN_ID`` (first: torchrun may
   itself run under a batch system that sets PMI or SLURM variables).
2. MPI launchers: hydra's ``PMI_RANK`` / ``PMI_SIZE`` (local: ``MPI_LOCALRANKID`` /
   ``MPI_LOCALNRANKS``), Open MPI's ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``,
   MVAPICH's ``MV2_COMM_WORLD_*``; PMIx's ``PMIX_RANK`` with the size from one of those or
   from SLURM (PMIx sets no size variable; a ``PMIX_RANK`` with no size anywhere is an
   error, never a world of one).
3. SLURM's srun: ``SLURM_PROCID`` with ``SLURM_STEP_NUM_TASKS`` (srun sets it for the
   tasks of a step; the batch script itself has no step size and is not a launch), local
   rank ``SLURM_LOCALID``, local size from ``SLURM_STEP_TASKS_PER_NODE`` and
   ``SLURM_NODEID``.
4. ``RANK`` and ``WORLD_SIZE`` alone (torchrun's variables set by another tool).
5. Nothing: alone.

A variable that is present but not an integer raises ``ValueError`` naming it.

[Note: rendezvous of a torch world under an MPI launcher or srun]
torch.distributed needs ``MASTER_ADDR:MASTER_PORT``, an address of rank 0's host that the
other ranks can reach. :func:`rendezvous_point` takes, in order: the user's ``MASTER_ADDR``
/ ``MASTER_PORT``; on one host (the launcher's local size equals the world size),
127.0.0.1; across hosts, with mpi4py, rank 0's address broadcast over MPI (the address of
the interface named by ``GLOO_SOCKET_IFNAME``, else the one on the route to another rank's
host, else its first non-loopback address); under srun, the first host of
``SLURM_STEP_NODELIST``. The port is the user's ``MASTER_PORT``, else (with mpi4py) a port
rank 0 found free and broadcast, else ``DEFAULT_PORT``. A multi-host MPI launch without
mpi4py and without ``MASTER_ADDR`` raises ``ValueError``: there is no address to guess.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "DEFAULT_PORT",
    "Launch",
    "RendezvousPoint",
    "detect",
    "natural_backend",
    "rendezvous_point",
]

#: torch.distributed's customary port (DeepSpeed's ``distributed_port`` default).
DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """Where this process's rank comes from."""

    kind: Literal["mpi", "torchrun", "slurm", "alone"]
    """"mpi": an MPI launcher (an MPI world exists); "torchrun": torchrun or its variables;
    "slurm": srun without MPI variables; "alone": no launcher."""
    rank: int
    """This process's rank in the launch."""
    world_size: int
    """Processes in the launch."""
    local_rank: int | None = None
    """Rank on this node, where the launcher says (Default: None)."""
    local_size: int | None = None
    """Ranks on this node, where the launcher says (Default: None)."""
    launcher: str = "alone"
    """The variable family it was read from: "torchrun", "env", "hydra", "openmpi", "mvapich",
    "pmix", "srun" or "alone" (Default: "alone")."""

    @property
    def one_host(self) -> bool:
        """Whether the launcher says every rank is on this node."""
        return self.local_size is not None and self.local_size == self.world_size


# (launcher, rank, size, local rank, local size); see [Note: launcher variables]
_MPI_VARS = (
    ("hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
)


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def detect(env: Mapping[str, str] | None = None) -> Launch:
    """The launch this process belongs to; see [Note: launcher variables]."""
    env = os.environ if env is None else env
    torchrun = "RANK" in env and "WORLD_SIZE" in env
    if torchrun and "TORCHELASTIC_RUN_ID" in env:
        return _torchrun(env, "torchrun")
    for launcher, rank, size, local_rank, local_size in _MPI_VARS:
        if rank in env and size in env:
            return _checked(Launch("mpi", _int(env, rank), _int(env, size), _int(env, local_rank),
                                   _int(env, local_size), launcher), rank, size)
    slurm = _slurm(env)
    if "PMIX_RANK" in env:
        if slurm is None:
            raise ValueError(
                f"PMIX_RANK={env['PMIX_RANK']!r} is set but no variable gives the world size (PMIx sets "
                f"none): launch with mpirun/mpiexec (OMPI_COMM_WORLD_SIZE, PMI_SIZE) or srun "
                f"(SLURM_STEP_NUM_TASKS), or set RANK and WORLD_SIZE")
        rank = _int(env, "PMIX_RANK")
        if rank != slurm.rank:
            raise ValueError(f"PMIX_RANK={rank} but SLURM_PROCID={slurm.rank}: the launcher's numbering does not add up")
        return dataclasses.replace(slurm, kind="mpi", launcher="pmix")
    if slurm is not None:
        return slurm
    if torchrun:
        return _torchrun(env, "env")
    return Launch("alone", 0, 1, 0, 1, "alone")


def _checked(launch: Launch, rank_var: str, size_var: str) -> Launch:
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise ValueError(f"{rank_var}={launch.rank} and {size_var}={launch.world_size} do not describe a rank of a world")
    return launch


def _torchrun(env: Mapping[str, str], launcher: str) -> Launch:
    return _checked(Launch("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                           _int(env, "LOCAL_WORLD_SIZE"), launcher), "RANK", "WORLD_SIZE")


def _slurm(env: Mapping[str, str]) -> Launch | None:
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    local_size = None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE")
    node = _int(env, "SLURM_NODEID")
    if per_node and node is not None:
        counts = _expand_tasks_per_node(per_node)
        if counts is not None and 0 <= node < len(counts):
            local_size = counts[node]
    return _checked(Launch("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"),
                           _int(env, "SLURM_LOCALID"), local_size, "srun"), "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def _expand_tasks_per_node(text: str) -> list[int] | None:
    """SLURM's ``2(x3),1`` -> ``[2, 2, 2, 1]``; None if it does not parse."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM host list: ``node[03-05,9],gpu1`` -> ``node03``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)
    return host or None


# ---------------------------------------------------------------------- backend choice
def mpi4py_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def natural_backend(launch: Launch, *, mpi4py: bool, cuda: bool) -> tuple[str, str]:
    """The transport a launch asks for when nothing else names one, and why.

    An MPI launcher on a CPU job with mpi4py installed: "mpi" (the MPI world already
    exists: no rendezvous address, no port to collide; it is what ``zpp bench`` and ``zpp
    tune`` run under mpiexec). With CUDA, "torch" (NCCL; zpp's MPI transport stages CUDA
    tensors through host memory unless MPI is CUDA-aware). Every other launch: "torch".
    """
    if launch.kind == "mpi":
        if not mpi4py:
            return "torch", f"launched by {launch.launcher} (an MPI launcher) but mpi4py is not installed"
        if cuda:
            return "torch", f"launched by {launch.launcher} on a CUDA machine (NCCL)"
        return "mpi", f"launched by {launch.launcher} (an MPI launcher, CPU job)"
    if launch.kind == "alone":
        return "torch", "the default"
    return "torch", f"launched by {launch.launcher}"


# ---------------------------------------------------------------------- rendezvous
@dataclasses.dataclass(frozen=True, slots=True)
class RendezvousPoint:
    """A torch.distributed world as seen by one rank; see [Note: rendezvous of a torch world
    under an MPI launcher or srun]."""

    rank: int
    """This rank."""
    world_size: int
    """Ranks in the world."""
    local_rank: int
    """Rank on this node."""
    local_size: int | None
    """Ranks on this node, where known."""
    addr: str
    """``MASTER_ADDR``: rank 0's host (or torchrun's agent)."""
    port: int
    """``MASTER_PORT``."""
    source: str
    """How the address was chosen (for messages)."""

    def env(self) -> dict[str, str]:
        """torch.distributed's variables for this point."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port)}
        if self.local_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_size)
        return out


def rendezvous_point(launch: Launch, env: Mapping[str, str], *, port: int | None = None,
                     timeout_s: float | None = None) -> RendezvousPoint:
    """Where the ranks of ``launch`` meet; collective over the MPI world when it broadcasts
    rank 0's address or port. ``port`` is the port to use when the environment sets none
    (Default: a free port broadcast with mpi4py, else ``DEFAULT_PORT``); ``timeout_s``
    bounds ``MPI_Init`` (see :mod:`zpp.comm.mpi_init`)."""
    user_addr, user_port = env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")
    local_rank = launch.local_rank if launch.local_rank is not None else 0
    if launch.kind in ("torchrun", "alone"):
        if launch.world_size == 1 and user_addr is None:
            return RendezvousPoint(launch.rank, 1, local_rank, launch.local_size, "127.0.0.1",
                                   user_port or port or DEFAULT_PORT, "a world of one")
        missing = [v for v, x in (("MASTER_ADDR", user_addr), ("MASTER_PORT", user_port)) if x is None]
        if missing:
            raise ValueError(f"{launch.launcher} world of {launch.world_size} ranks: {' and '.join(missing)} not set")
        return RendezvousPoint(launch.rank, launch.world_size, local_rank, launch.local_size, user_addr, user_port,
                               "MASTER_ADDR / MASTER_PORT")
    if launch.kind == "mpi" and mpi4py_available():
        return _mpi_point(launch, user_addr, user_port or port, env, timeout_s)
    how = "the environment"
    addr = user_addr
    if addr is None and launch.one_host:
        addr, how = "127.0.0.1", f"one host ({launch.launcher}: {launch.local_size} local ranks of {launch.world_size})"
    if addr is None and launch.kind == "slurm":
        host = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
        if host:
            addr, how = host, "the first host of SLURM_STEP_NODELIST"
    if addr is None:
        raise ValueError(
            f"a {launch.launcher} launch of {launch.world_size} ranks "
            + (f"with {launch.local_size} on this host " if launch.local_size is not None else "")
            + "needs rank 0's address for torch.distributed: set MASTER_ADDR (and MASTER_PORT) to an "
            "address of rank 0's host that every rank can reach, or install mpi4py so zpp can broadcast it")
    return RendezvousPoint(launch.rank, launch.world_size, local_rank, launch.local_size, addr,
                           user_port or port or DEFAULT_PORT, how)


def _mpi_point(launch: Launch, user_addr: str | None, port: int | None, env: Mapping[str, str],
               timeout_s: float | None) -> RendezvousPoint:
    from zpp.comm.mpi_init import mpi

    MPI = mpi(timeout_s)

    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.world_size or comm.Get_rank() != launch.rank:
        raise ValueError(f"the MPI world (rank {comm.Get_rank()} of {comm.Get_size()}) does not match the "
                         f"{launch.launcher} variables (rank {launch.rank} of {launch.world_size})")
    hosts = comm.allgather(MPI.Get_processor_name())
    me = hosts[launch.rank]
    local_rank = launch.local_rank if launch.local_rank is not None else hosts[:launch.rank].count(me)
    local_size = launch.local_size if launch.local_size is not None else hosts.count(me)
    one_host = len(set(hosts)) == 1 and local_size == launch.world_size
    answer: tuple | None = None
    if launch.rank == 0:
        try:
            if user_addr is not None:
                addr, how = user_addr, "MASTER_ADDR"
            elif one_host:
                addr, how = "127.0.0.1", "one host"
            else:
                addr, how = _address_for_peers(hosts, env), "rank 0's address, broadcast over MPI"
            answer = (addr, port or _free_port(), how, None)
        except (OSError, ValueError) as e:
            answer = (None, None, None, f"rank 0 could not find an address the other hosts can reach ({e}); "
                                        f"set MASTER_ADDR to one")
    addr, chosen_port, how, error = comm.bcast(answer, root=0)
    if error is not None:
        raise ValueError(error)
    return RendezvousPoint(launch.rank, launch.world_size, local_rank, local_size, addr, chosen_port, how)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _address_for_peers(hosts: list[str], env: Mapping[str, str]) -> str:
    """Rank 0's IPv4 address for ranks on other hosts; see the Note."""
    ifname = env.get("GLOO_SOCKET_IFNAME")
    if ifname:
        addr = interface_address(ifname.split(",")[0])
        if addr is None:
            raise ValueError(f"GLOO_SOCKET_IFNAME={ifname!r} has no IPv4 address here")
        return addr
    other = next((h for h in hosts if h != hosts[0]), None)
    if other is not None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(other), 9))  # UDP: no packet is sent
                addr = s.getsockname()[0]
            if not addr.startswith("127."):
                return addr
        except OSError:
            pass
    for addr in local_addresses():
        if not addr.startswith("127."):
            return addr
    raise ValueError("no non-loopback IPv4 address on this host")


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def local_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (interfaces on Linux, else the host name's)."""
    found: list[str] = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        addr = interface_address(name)
        if addr and addr not in found:
            found.append(addr)
    if not found:
        try:
            found = list(dict.fromkeys(socket.gethostbyname_ex(socket.gethostname())[2]))
        except OSError:
            found = []
    if "127.0.0.1" not in found:
        found.append("127.0.0.1")
    return sorted(found, key=lambda a: a.startswith("127."))
