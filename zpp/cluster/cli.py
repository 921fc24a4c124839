"""Command line for ``zpp cluster``: up / status / down / run.

Wiring into another CLI::

    sub = parser.add_subparsers(dest="command")
    add_cluster_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)          # every cluster subcommand sets ``func``; it returns the exit code

Or, following ``zpp/cli.py``'s COMMANDS convention, ``"cluster": "zpp.cluster.cli"``: this
module has ``HELP``, ``add_arguments(parser)`` and ``run(args, argv)``.

Standalone: ``python -m zpp.cluster ...`` (see :func:`main`).

Exit codes: 0 success; 1 a cluster operation failed; 2 bad arguments or a missing
prerequisite (root, iproute2, netem for --delay, mpiexec for --backend mpi); for ``run``
the ranks' worst exit code, 124 on timeout, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Callable, Sequence

from . import launch, netns
from .netns import ClusterError

_EPILOG = (
    "Nodes are network namespaces zpp-n0, zpp-n1, ... (address 198.18.0.<i+1>, interface "
    "zpp-eth) joined by a bridge in namespace zpp-sw; each node link is shaped with tbf in "
    "both directions. Needs root and iproute2."
)


def _rate_arg(text: str) -> str:
    try:
        netns.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _delay_arg(text: str) -> str:
    try:
        netns.parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected seconds > 0") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected seconds > 0")
    return v


def _err(msg: str) -> None:
    print(f"zpp cluster: error: {msg}", file=sys.stderr, flush=True)


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn our exceptions into a message and an exit code."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as exc:
            _err(str(exc))
            return 2
        except ClusterError as exc:
            _err(str(exc))
            return exc.exit_code
        except KeyboardInterrupt:
            _err("interrupted")
            return 130

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_guard
def cmd_up(args: argparse.Namespace) -> int:
    st = netns.up(args.nodes, args.rate, delay=args.delay)
    print(netns.format_status(st))
    return 0 if st["complete"] else 1


@_guard
def cmd_status(args: argparse.Namespace) -> int:
    st = netns.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(netns.format_status(st))
    return 0


@_guard
def cmd_down(args: argparse.Namespace) -> int:
    removed = netns.down()
    print("removed " + ", ".join(removed) if removed else "no cluster")
    return 0


@_guard
def cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command given; usage: zpp cluster run [options] -- CMD ...")

    def on_term(signum, frame):  # a polite kill of us ends the ranks as Ctrl-C does
        raise KeyboardInterrupt

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, on_term)
        except ValueError:  # not the main thread
            pass
    try:
        return launch.run(
            cmd,
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            backend=args.backend,
            timeout=args.timeout,
        )
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _no_subcommand(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return show


def _fill(cluster: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = cluster.add_subparsers(dest="cluster_command", metavar="{up,status,down,run}")

    p = sub.add_parser("up", help="create (or replace) the emulated cluster",
                       description="Create the emulated cluster; an existing one is removed first.",
                       epilog=_EPILOG)
    p.add_argument("--nodes", type=_positive_int, default=2, help="number of nodes (default 2)")
    p.add_argument("--rate", type=_rate_arg, required=True,
                   help="per-link rate, each direction, tc units: 500kbit, 100mbit, 1gbit, 2.5gbit "
                        "(note: tc's 'mbps' means megaBYTES per second)")
    p.add_argument("--delay", type=_delay_arg, default=None,
                   help="one-way delay between nodes (e.g. 5ms); needs the kernel's netem qdisc")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="show nodes, addresses and link rates")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("down", help="remove every zpp cluster namespace (and nothing else)")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser(
        "run", help="run a command as ranks on the cluster nodes",
        usage="%(prog)s [--nodes N] [--ranks-per-node R] [--backend {torch,mpi}] [--timeout S] -- CMD ...",
        description=(
            "Run CMD as NODES*R ranks. torch: one process per rank with RANK, WORLD_SIZE, "
            "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME set. "
            "mpi: MPICH hydra mpiexec with one proxy per node. --backend B also exports "
            "ZPP_COMM_BACKEND=B to the ranks, which outranks the backend of a `zpp tune` plan "
            "(ZPP_TUNE_FILE; rank 0 then warns that it overrides the plan); without --backend "
            "nothing is exported and the ranks are started for the plan's backend (torch without "
            "a plan). Rank 0's stdout goes to stdout; everything else to stderr prefixed with the "
            "rank. Exit code: the ranks' worst, 124 on timeout."),
    )
    p.add_argument("--nodes", type=_positive_int, default=None,
                   help="nodes to use (default: all nodes of the cluster)")
    p.add_argument("--ranks-per-node", type=_positive_int, default=1, help="ranks per node (default 1)")
    p.add_argument("--backend", choices=launch.BACKENDS, default=None,
                   help="the ranks' transport, exported as ZPP_COMM_BACKEND (overrides a ZPP_TUNE_FILE "
                        "plan's backend); default: the plan's backend, else torch, not exported")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="kill everything after this many seconds (exit code 124)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=cmd_run)

    cluster.set_defaults(func=_no_subcommand(cluster))
    return cluster


#: one-line help, for ``zpp.cli``'s COMMANDS convention (``"cluster": "zpp.cluster.cli"``)
HELP = "emulate a slow multi-node cluster with network namespaces"
#: ``zpp cluster --help``'s text
DESCRIPTION = """\
Emulate a slow multi-node cluster on this machine: each node is a network namespace behind
a link shaped with tbf (both directions), so collectives between nodes cross a slow link
while ranks of one node talk over loopback. Needs root and iproute2.

  zpp cluster up --nodes 2 --rate 100mbit
  zpp cluster run --nodes 2 --ranks-per-node 2 --backend torch -- zpp bench --sizes 1M:4M
  zpp cluster status
  zpp cluster down

`zpp cluster COMMAND --help` describes each command."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zpp.cli`` convention: fill an existing ``cluster`` parser with up/status/down/run."""
    parser.epilog = _EPILOG
    _fill(parser)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """``zpp.cli`` convention: run the parsed cluster subcommand; returns the exit code."""
    return args.func(args)


def add_cluster_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``cluster`` (with up/status/down/run) to an ``add_subparsers()`` object.

    Each subcommand sets ``args.func``; call ``args.func(args)`` to run it, it returns the
    exit code.
    """
    cluster = subparsers.add_parser(
        "cluster", help="emulate a slow multi-node cluster with network namespaces",
        description="Emulate a slow multi-node cluster on this machine.", epilog=_EPILOG,
    )
    return _fill(cluster)


def build_parser(prog: str = "zpp cluster") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Emulate a slow multi-node cluster on this machine.", epilog=_EPILOG
    )
    return _fill(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m zpp.cluster {up,status,down,run} ...``."""
    parser = build_parser("python -m zpp.cluster")
    args = parser.parse_args(None if argv is None else list(argv))
    return args.func(args)
