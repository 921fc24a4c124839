"""The ``zpp`` command line.

    zpp bench [options]        time the collectives, plain and compressed (zpp.bench)
    zpp cluster up|status|down|run   an emulated slow multi-node cluster (zpp.cluster)
    zpp tune [options]         choose backend and compression per collective and size (zpp.tune)
    zpp run COMMAND ...        run COMMAND with `import deepspeed` giving zpp (zpp.as_deepspeed)
    python -m zpp bench ...    the same without the installed script

Each subcommand is a module with ``HELP``, ``add_arguments(parser)`` and
``run(args, argv) -> exit code``, named in ``COMMANDS``; adding one is one line there. Its
``--help`` text is the module's ``DESCRIPTION`` (user help), else its docstring.
"""
from __future__ import annotations

import argparse
import importlib
import sys

import zpp

__all__ = ["COMMANDS", "build_parser", "main"]

#: subcommand -> module implementing it
COMMANDS: dict[str, str] = {
    "bench": "zpp.bench.command",
    "cluster": "zpp.cluster.cli",
    "tune": "zpp.tune.command",
    "run": "zpp.compat.run_command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zpp",
        description="zpp: communication-optimized collectives for PyTorch (ZeRO++ and 1-bit).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"zpp {zpp.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.__doc__),
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(handler=module.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``zpp = "zpp.cli:main"``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return args.handler(args, argv)
