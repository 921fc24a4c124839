"""Joining a torch.distributed world, bounded by the timeout, with the absent ranks named.

[Note: rendezvous]
``init_torch_world`` is how zpp creates the default process group (``TorchTransport.init``,
``zpp.init_distributed``):

1. The launch (:func:`zpp.comm.launch.detect`) gives rank and world size; a process with no
   launcher is a world of one (an in-memory store, no network).
2. The rendezvous point (:func:`zpp.comm.launch.rendezvous_point`): torchrun's
   ``MASTER_ADDR:MASTER_PORT``, or the one derived from an MPI launcher or srun.
3. The store: a ``TCPStore`` hosted by rank 0 (under torchrun, by torchrun's agent, as torch
   does), every wait on it bounded by ``timeout_s``. A rank that cannot reach it within
   ``timeout_s`` raises ``TimeoutError`` naming the address and who hosts it.
4. Every rank announces itself in the store and waits for all the others; after
   ``timeout_s`` each waiting rank raises ``TimeoutError`` naming the ranks that never
   joined (they died before the rendezvous or were never started). No rank stays blocked.
5. ``init_process_group`` on that store (keys under ``default_pg``, as torch's ``env://``
   does), with ``timeout_s`` as the group's timeout; its own timeouts are re-raised as
   ``TimeoutError``.

With ``init_method`` (``tcp://``, ``file://``), torch's own rendezvous runs instead, with
the same timeout.

[Note: who never joined]
Rank 0 hosts the store (but under torchrun), so when it gives up and exits the store goes
with it, and a rank still waiting would only see a closed connection. So rank 0, at its
deadline, writes the verdict (the ranks that never joined) into the store and stays until
every rank that joined has read it (at most ``_VERDICT_WAIT_S``); the other ranks wait up
to that much past their own deadline for the verdict, and raise the same ``TimeoutError``.
A rank whose store connection fails raises ``ConnectionError`` naming the store's host.
"""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping

import torch.distributed as dist

from zpp.comm.launch import Launch, RendezvousPoint, detect, rendezvous_point

__all__ = ["init_torch_world"]

_JOINS = [0]  # rendezvous made by this process; keys of each are apart
_VERDICT_WAIT_S = 5.0  # see [Note: who never joined]


def init_torch_world(backend: str, timeout_s: float, env: Mapping[str, str], *, launch: Launch | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     port: int | None = None) -> RendezvousPoint | None:
    """Create torch.distributed's default group; see [Note: rendezvous]. Returns the
    rendezvous point (None for a world of one or an ``init_method``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method is not None:
        with _timeouts(f"rendezvous at {init_method}", timeout_s):
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
        return None
    launch = detect(env) if launch is None else launch
    if rank >= 0 or world_size > 0:  # explicit numbering overrides the launcher's
        if rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(f"rank={rank} and world_size={world_size} must both be given, 0 <= rank < world_size")
        launch = Launch("torchrun" if launch.kind == "alone" else launch.kind, rank, world_size,
                        launch.local_rank, launch.local_size, launch.launcher)
    if launch.world_size == 1 and not env.get("MASTER_ADDR"):
        dist.init_process_group(backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
        return None
    point = rendezvous_point(launch, env, port=port, timeout_s=timeout_s)
    store = _open_store(point, env, timeout_s)
    _join(store, point, env, timeout_s)
    with _timeouts(f"init_process_group at {point.addr}:{point.port}", timeout_s):
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=point.rank,
                                world_size=point.world_size, timeout=timeout)
    return point


def _agent_store(env: Mapping[str, str]) -> bool:
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _open_store(point: RendezvousPoint, env: Mapping[str, str], timeout_s: float) -> dist.Store:
    agent = _agent_store(env)
    host = "torchrun's agent" if agent else "rank 0"
    try:
        return dist.TCPStore(point.addr, point.port, None, point.rank == 0 and not agent,
                             datetime.timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if point.rank == 0 and not agent:
            raise OSError(f"rendezvous: rank 0 could not open the store at {point.addr}:{point.port} "
                          f"({point.source}): {first}") from e
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        raise (TimeoutError if timed_out else ConnectionError)(
            f"rendezvous: rank {point.rank} could not reach the store at {point.addr}:{point.port} "
            f"({point.source}), hosted by {host}" + (f", within {timeout_s:g} s" if timed_out else "")
            + f": {first}") from e


def _join(store: dist.Store, point: RendezvousPoint, env: Mapping[str, str], timeout_s: float) -> None:
    """Announce this rank, wait for all; name the absent ones after ``timeout_s``. See
    [Note: who never joined]."""
    _JOINS[0] += 1
    prefix = f"zpp/join/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_JOINS[0]}"
    n = point.world_size
    agent = _agent_store(env)
    host = "torchrun's agent" if agent else "rank 0"
    decides = agent or point.rank == 0  # the store outlives this rank: it may decide and leave
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    with _timeouts(f"rendezvous at {point.addr}:{point.port}", timeout_s, store_host=host):
        store.set(f"{prefix}/rank{point.rank}", "1")
        joined = store.add(f"{prefix}/count", 1)
        while joined < n:
            if time.monotonic() > deadline + (0 if decides else _VERDICT_WAIT_S):
                break
            if not decides and store.check([f"{prefix}/verdict"]):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
            joined = store.add(f"{prefix}/count", 0)
        if joined >= n:
            return
        if store.check([f"{prefix}/verdict"]):
            verdict = store.get(f"{prefix}/verdict").decode()
            store.add(f"{prefix}/acks", 1)
        else:
            absent = [r for r in range(n) if not store.check([f"{prefix}/rank{r}"])]
            who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
            verdict = f"{who} of {n} never joined (died before the rendezvous, or never started)"
            if not agent and point.rank == 0:  # keep the store up until the others have read it
                store.set(f"{prefix}/verdict", verdict)
                present = n - len(absent)
                until = time.monotonic() + _VERDICT_WAIT_S
                while store.add(f"{prefix}/acks", 0) < present - 1 and time.monotonic() < until:
                    time.sleep(0.05)
    raise TimeoutError(f"rendezvous at {point.addr}:{point.port} ({point.source}): rank {point.rank} waited "
                       f"{timeout_s:g} s; {verdict}")


class _timeouts:
    """Re-raise torch's timeouts inside the block as ``TimeoutError`` naming ``what``; with
    ``store_host``, a store whose connection fails as ``ConnectionError`` naming its host."""

    def __init__(self, what: str, timeout_s: float, store_host: str | None = None) -> None:
        self.what, self.timeout_s, self.store_host = what, timeout_s, store_host

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, TimeoutError) or not isinstance(exc, RuntimeError):
            return False
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise TimeoutError(f"{self.what}: no answer within {self.timeout_s:g} s ({first})") from exc
        if self.store_host is not None and isinstance(exc, getattr(dist, "DistNetworkError", ())):
            raise ConnectionError(f"{self.what}: lost the connection to the store, hosted by {self.store_host} "
                                  f"({first})") from exc
        return False


def export_env(point: RendezvousPoint, env: dict | None = None) -> None:
    """Set torch.distributed's variables of ``point`` where they are unset (as DeepSpeed's
    MPI discovery does), so scripts that read ``LOCAL_RANK`` find it."""
    env = os.environ if env is None else env
    for key, value in point.env().items():
        env.setdefault(key, value)
