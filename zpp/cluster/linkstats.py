"""What the kernel counted on a node's link: the byte and packet counters of the node
interface, read from inside the node's network namespace.

    from zpp.cluster.linkstats import read_link
    before = read_link()          # in a rank started by ``zpp cluster run``
    ...                           # collectives
    sent = read_link() - before   # LinkCounters: tx/rx bytes and packets, TCP retransmits

Inside ``zpp cluster`` every node is a network namespace whose only way to the other nodes
is :data:`~zpp.cluster.netns.NODE_IF`; its counters (``/proc/net/dev``, which shows the
namespace of the reading process) count every frame that crossed the node's link, headers
included, whatever library sent it. ``/proc/net/snmp`` adds the TCP segments the namespace
retransmitted: a segment dropped at the shaped link is sent again and counted again.

[Note: frame overhead]
A TCP segment of ``MSS`` payload bytes leaves as one Ethernet frame of ``MSS + FRAME_OVERHEAD``
bytes: Ethernet 14 + IPv4 20 + TCP 20 + the timestamp option 12 = 66 (the veth counters
include the Ethernet header, not the FCS). With the links' MTU of 1500 the MSS is
1500 - 20 - 20 - 12 = 1448, so at most ``66 / 1448 = 4.56%`` of the payload is headers; a
GSO/TSO super-packet is counted once with one header, so the measured share is lower. The
receiver answers with pure ACKs of 66 bytes, at most one per received segment (usually one
per two, fewer with GRO), so a node's transmitted bytes may add up to another 4.56% of what
it received. :func:`header_bound` is this bound.
"""
from __future__ import annotations

import dataclasses

from zpp.cluster.netns import NODE_IF

__all__ = ["FRAME_OVERHEAD", "MSS", "LinkCounters", "header_bound", "read_link"]

FRAME_OVERHEAD = 14 + 20 + 20 + 12
"""Bytes of headers per TCP segment on the wire (Ethernet, IPv4, TCP with timestamps)."""
MSS = 1500 - 20 - 20 - 12
"""TCP payload bytes per full segment at MTU 1500 with timestamps."""


@dataclasses.dataclass(frozen=True, slots=True)
class LinkCounters:
    """A node interface's kernel counters (cumulative, or a difference of two readings)."""

    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    rx_packets: int
    retrans_segs: int
    """TCP segments the namespace retransmitted (all interfaces)."""

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def as_list(self) -> list[int]:
        return list(dataclasses.astuple(self))


def read_link(dev: str = NODE_IF) -> LinkCounters | None:
    """``dev``'s counters in this process's network namespace; None where it has no ``dev``
    (outside ``zpp cluster``)."""
    try:
        with open("/proc/net/dev") as f:
            rows = [rest.split() for name, _, rest in (line.partition(":") for line in f) if name.strip() == dev]
        with open("/proc/net/snmp") as f:
            tcp = [line.split()[1:] for line in f if line.startswith("Tcp:")]
    except OSError:
        return None
    if not rows or len(tcp) < 2:
        return None
    row = rows[0]  # receive: bytes packets errs drop fifo frame compressed multicast; transmit: bytes packets ...
    retrans = int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
    return LinkCounters(tx_bytes=int(row[8]), tx_packets=int(row[9]), rx_bytes=int(row[0]),
                        rx_packets=int(row[1]), retrans_segs=retrans)


def header_bound(sent_payload: float, received_payload: float) -> float:
    """The most header bytes a node transmits for ``sent_payload`` TCP payload bytes sent and
    ``received_payload`` received: one :data:`FRAME_OVERHEAD` per full segment of each (data
    segments and their ACKs), rounded up. See [Note: frame overhead]."""
    return FRAME_OVERHEAD * (-(-sent_payload // MSS) + -(-received_payload // MSS))
