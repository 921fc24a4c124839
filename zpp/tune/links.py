"""The network levels the cost model (:mod:`zpp.tune.cost`) prices, and their presets; apart
from it so that the command line can offer the presets without importing torch."""
from __future__ import annotations

import dataclasses

from zpp.cluster.netns import parse_rate

__all__ = ["LINKS", "Link", "link"]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One level of the network: bandwidth in bytes/s (one direction) and per-message
    latency. ``shared``: one link per node shared by its ranks (a NIC), else one per rank."""

    name: str
    bandwidth: float
    latency_s: float
    shared: bool


def _gbit(x: float) -> float:
    return x * 1e9 / 8


#: Presets. Inside a node: NVLink 4 (H100, 450 GB/s a direction), PCIe 4 x16 (~25 GB/s
#: usable), loopback (the emulated cluster's namespace on this 2-core machine). Between nodes
#: the node's whole injection bandwidth (an 8-GPU node with eight 400 Gbit NICs is "3200gbit").
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 450e9, 3e-6, False),
    "pcie": Link("pcie", 25e9, 10e-6, False),
    "loopback": Link("loopback", 2e9, 30e-6, False),
    "10mbit": Link("10mbit", _gbit(0.01), 200e-6, True),
    "100mbit": Link("100mbit", _gbit(0.1), 100e-6, True),
    "1gbit": Link("1gbit", _gbit(1), 50e-6, True),
    "10gbit": Link("10gbit", _gbit(10), 20e-6, True),
    "100gbit": Link("100gbit", _gbit(100), 5e-6, True),
    "400gbit": Link("400gbit", _gbit(400), 5e-6, True),
    "3200gbit": Link("3200gbit", _gbit(3200), 5e-6, True),
}


def link(text: str) -> Link:
    """A preset by name, or a link shared by a node's ranks at a tc-style rate (``25gbit``;
    ``ValueError`` naming the text otherwise), 5 us per message."""
    if text in LINKS:
        return LINKS[text]
    return Link(text, parse_rate(text) / 8, 5e-6, True)
