"""Emulate a slow multi-node cluster on one Linux machine (network namespaces + tbf).

Python API::

    from zpp import cluster
    cluster.up(2, "100mbit")              # zpp-n0, zpp-n1 behind a bridge in zpp-sw
    cluster.status()                      # dict read back from the live namespaces and qdiscs
    rc = cluster.run(["python", "bench.py"], nodes=2, ranks_per_node=2, backend="torch", timeout=600)
    cluster.down()                        # removes exactly zpp's namespaces

Command line: ``zpp cluster up|status|down|run`` or ``python -m zpp.cluster ...``.
Needs root and iproute2 (``ip``, ``tc``).
"""

from .launch import run
from .netns import (
    NODE_IF,
    PREFIX,
    SWITCH_NS,
    ClusterError,
    CommandError,
    NetemUnavailableError,
    PrerequisiteError,
    check_prerequisites,
    down,
    format_rate,
    format_status,
    missing_prerequisites,
    netem_available,
    node_address,
    node_ns,
    parse_rate,
    status,
    up,
)

__all__ = [
    "NODE_IF",
    "PREFIX",
    "SWITCH_NS",
    "ClusterError",
    "CommandError",
    "NetemUnavailableError",
    "PrerequisiteError",
    "check_prerequisites",
    "down",
    "format_rate",
    "format_status",
    "missing_prerequisites",
    "netem_available",
    "node_address",
    "node_ns",
    "parse_rate",
    "run",
    "status",
    "up",
]
