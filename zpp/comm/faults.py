"""Who went silent: what every rank reports when a collective times out or loses a peer.

[Note: fault reports]
A collective that times out says only "I waited too long". To name the rank that went
silent, every world transport opens a *fault channel* at construction: a UDP socket per
process, whose addresses (this host's IPv4 addresses and the port, plus a job token from
rank 0) every rank learns in one small all-gather over the transport itself. The channel
needs no server: a stopped process (SIGSTOP), a dead one, or one that hosts the rendezvous
store cannot block it.

When a collective fails on a rank (a timeout, or a peer's connection closing), that rank

1. sends a report to every other rank: the op, its call number on that transport (every
   rank of a group makes the same calls in the same order, so equal numbers mean the same
   call), the group's global ranks, what it saw (timeout / connection lost), how long it
   waited;
2. collects the reports of the others for up to ``REPORT_WINDOW_S`` after a timeout (all
   ranks blocked on a silent one time out together), ``CLOSED_WINDOW_S`` after a lost
   connection (a dead peer never reports, and ranks blocked on this one fail only once it
   exits); less if every rank reported. It resends its own twice meanwhile; datagrams that
   arrived earlier wait in the socket, so a rank that failed earlier is heard too;
3. raises ``TimeoutError`` (this rank or a reporting rank timed out) or ``ConnectionError``
   (only lost connections were seen), whose message lists what was observed: the ranks
   that reported the same call, those that reported another one, and the ranks from which
   no report arrived (stopped, hung outside zpp's collectives, e.g. in a data loader, or
   dead). Nothing is guessed.

The first failure marks the world broken: every transport of the world then refuses calls
with ``RuntimeError`` naming that failure (the process groups or communicators are unusable),
and later failures reuse the collected reports without waiting again. Under MPI the job is
aborted at interpreter exit (see [Note: clean exit] in :mod:`zpp.comm.teardown`); ranks
first tell each other over the channel that they are exiting, so that every rank prints its
error before the job is torn down.

Datagrams that go nowhere (a firewall that drops UDP, an address another host cannot
route) only make the report poorer: those ranks are listed as not reporting, and the error
says the reports came over this channel.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Literal

from zpp.comm.launch import local_addresses

if TYPE_CHECKING:
    from zpp.comm.transport import Transport

__all__ = ["EXIT_GRACE_S", "REPORT_WINDOW_S", "Fault", "FaultChannel", "describe"]

#: How long a rank whose call timed out waits for the other ranks' reports.
REPORT_WINDOW_S = 3.0
#: The same after a lost connection: a dead peer never reports, and the ranks blocked on
#: this one fail only once it exits, so it waits less.
CLOSED_WINDOW_S = 1.0
#: How long a rank of a broken MPI job waits at exit for the other failing ranks to exit too.
EXIT_GRACE_S = 5.0
_RECORD_BYTES = 256  # one rank's address record in the init all-gather
_MAX_ADDRS = 6


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """What one rank saw when a collective failed."""

    op: str
    """The collective ("all_reduce", "all_gather", ...)."""
    call: int
    """Its call number on its transport (1 = the first call)."""
    group: tuple[int, ...]
    """Global ranks of the transport's group."""
    kind: Literal["timeout", "closed"]
    """"timeout": waited ``waited_s`` in vain; "closed": a peer's connection closed."""
    waited_s: float
    """Seconds this rank waited in the call."""
    detail: str = ""
    """The backend's own words (first line), for the curious."""

    def where(self) -> str:
        return f"{self.op} call {self.call} on ranks {list(self.group)}"


class FaultChannel:
    """This process's end of the fault channel of one world; see [Note: fault reports].

    Args:
        rank: this process's global rank.
        world_size: ranks in the world.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.token = secrets.token_hex(8)
        self.host = socket.gethostname()
        self.peers: list[tuple[str, list[str], int]] = []  # (hostname, addresses, port) per rank
        self.broken: str | None = None
        self.reports: dict[int, dict] = {}
        self.exiting: set[int] = set()
        self.window_s = REPORT_WINDOW_S  # the window of the exchange, for messages
        # a fault may be seen by two threads at once (the training thread's gather and the
        # reduction thread's reduce-scatter, or the hierarchical mode's sync): one exchanges
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ set-up
    @classmethod
    def open(cls, world: Transport) -> FaultChannel:
        """The channel of ``world`` (a world transport); collective: one all-gather of a
        fixed-size record per rank over ``world`` (not counted in its wire bytes)."""
        import torch

        chan = cls(world.rank, world.world_size)
        addrs = local_addresses()[:_MAX_ADDRS]
        while True:
            text = json.dumps({"h": chan.host[:64], "a": addrs, "p": chan.port, "t": chan.token}).encode()
            if len(text) <= _RECORD_BYTES or not addrs:
                break
            addrs = addrs[:-1]
        mine = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
        mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        if world.world_size > 1:
            everyone = torch.empty(_RECORD_BYTES * world.world_size, dtype=torch.uint8)
            world._meta_all_gather(everyone, mine)
        else:
            everyone = mine
        for row in everyone.view(world.world_size, _RECORD_BYTES).tolist():
            rec = json.loads(bytes(b for b in row if b).decode())
            chan.peers.append((rec["h"], list(rec["a"]), int(rec["p"])))
            if len(chan.peers) == 1:
                chan.token = rec["t"]  # rank 0's token names the job
        return chan

    def close(self) -> None:
        self.sock.close()

    # ------------------------------------------------------------------ reporting
    def report(self, fault: Fault, window_s: float | None = None) -> dict[int, dict]:
        """Send ``fault`` to every rank and collect theirs for ``window_s`` (Default:
        ``REPORT_WINDOW_S`` after a timeout, ``CLOSED_WINDOW_S`` after a lost connection; see
        the Note); the reports by global rank. After the first fault of the world: the
        reports so far, no waiting."""
        if window_s is None:
            window_s = REPORT_WINDOW_S if fault.kind == "timeout" else CLOSED_WINDOW_S
        with self._lock:
            if self.broken is None:
                self.broken = fault.where() + (" timed out" if fault.kind == "timeout" else " lost a peer")
                self.window_s = window_s
                self._exchange({"op": fault.op, "call": fault.call, "group": list(fault.group), "kind": fault.kind,
                                "waited": round(fault.waited_s, 3)}, window_s)
            else:
                self._drain(0.0)
            return dict(self.reports)

    def announce_exit(self, grace_s: float = EXIT_GRACE_S) -> None:
        """Tell every rank this one is exiting; wait until each rank that reported a fault
        has said the same, or ``grace_s`` passed (then the caller may tear the job down)."""
        self._send({"exit": True})
        deadline = time.monotonic() + grace_s
        expected = set(self.reports) - {self.rank}
        while not expected <= self.exiting and time.monotonic() < deadline:
            self._drain(min(0.2, deadline - time.monotonic()))

    def _exchange(self, body: dict, window_s: float) -> None:
        start = time.monotonic()
        deadline = start + window_s
        resend = [start + 0.3 * window_s, start + 0.7 * window_s]
        self._send(body)
        others = set(range(self.world_size)) - {self.rank}
        while time.monotonic() < deadline and not others <= set(self.reports):
            if resend and time.monotonic() >= resend[0]:
                resend.pop(0)
                self._send(body)
            self._drain(min(0.1, max(0.0, deadline - time.monotonic())))

    def _send(self, body: dict) -> None:
        data = json.dumps({"t": self.token, "from": self.rank, **body}).encode()
        mine = self.peers[self.rank][0] if self.peers else self.host
        for r, (host, addrs, port) in enumerate(self.peers):
            if r == self.rank:
                continue
            same_host = host == mine
            for addr in addrs:
                if addr.startswith("127.") and not same_host:
                    continue
                try:
                    self.sock.sendto(data, (addr, port))
                except OSError:
                    pass  # unreachable address: that rank may simply not hear from us

    def _drain(self, wait_s: float) -> None:
        """Read every datagram that arrives within ``wait_s`` (at least those queued now)."""
        deadline = time.monotonic() + wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                self.sock.settimeout(remaining)
            else:
                self.sock.setblocking(False)
            try:
                data, _ = self.sock.recvfrom(65536)
            except (BlockingIOError, TimeoutError, socket.timeout):
                return
            except OSError:
                return
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if not isinstance(msg, dict) or msg.get("t") != self.token or not isinstance(msg.get("from"), int):
                continue  # not from this job
            if msg.get("exit"):
                self.exiting.add(msg["from"])
            elif "op" in msg:
                self.reports.setdefault(msg["from"], msg)


def describe(fault: Fault, rank: int, world_size: int, reports: dict[int, dict] | None,
             window_s: float = REPORT_WINDOW_S) -> tuple[type[Exception], str]:
    """The exception class and message for ``fault`` seen on ``rank``, given the other ranks'
    ``reports`` (None: no fault channel); see [Note: fault reports]."""
    if fault.kind == "timeout":
        head = f"{fault.op} (call {fault.call} on ranks {list(fault.group)}): rank {rank} timed out after " \
               f"{fault.waited_s:.3g} s waiting for its peers"
    else:
        head = f"{fault.op} (call {fault.call} on ranks {list(fault.group)}): rank {rank} lost the connection to a peer"
    if fault.detail:
        head += f" ({fault.detail})"
    if reports is None:
        return (TimeoutError if fault.kind == "timeout" else ConnectionError), \
            head + ". No fault channel on this transport, so the silent rank is not known."
    same_kind: dict[str, list[int]] = {"timeout": [], "closed": []}
    elsewhere = []
    for r in sorted(reports):
        m = reports[r]
        if r == rank:
            continue
        if m.get("op") == fault.op and m.get("call") == fault.call and tuple(m.get("group", ())) == fault.group:
            same_kind.setdefault(m.get("kind"), []).append(r)
        else:
            verb = "timed out" if m.get("kind") == "timeout" else "lost a peer"
            elsewhere.append(f"rank {r} {verb} in {m.get('op')} call {m.get('call')} on ranks {m.get('group')}")
    silent = [r for r in range(world_size) if r != rank and r not in reports]
    seen = []
    if silent:
        seen.append(f"no report within {window_s:g} s from {_ranks(silent)} (a rank reports when its own call "
                    f"fails; one that is stopped, dead, busy outside zpp's collectives, or still waiting does not)")
    if same_kind["timeout"]:
        seen.append(f"{_ranks(same_kind['timeout'])} timed out in the same call")
    if same_kind["closed"]:
        seen.append(f"{_ranks(same_kind['closed'])} lost a peer in the same call")
    seen += elsewhere
    timed_out = fault.kind == "timeout" or any(m.get("kind") == "timeout" for r, m in reports.items() if r != rank)
    msg = head + ". Reports over zpp's fault channel: " + ("; ".join(seen) if seen else "none") + \
        ". The transport is unusable now; the job must stop."
    return (TimeoutError if timed_out else ConnectionError), msg


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"
