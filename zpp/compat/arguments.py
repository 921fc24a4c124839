"""DeepSpeed's command-line arguments, for scripts that call
``deepspeed.add_config_arguments(parser)`` (imports nothing heavy).

    parser = zpp.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()        # args.deepspeed_config: the JSON path, or None
    engine, *_ = zpp.initialize(args=args, model=model)
"""
from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` and return it: ``--deepspeed``,
    ``--deepspeed_config``, the deprecated ``--deepscale`` and ``--deepscale_config``
    (DeepSpeed's names, defaults, help and dests), and zpp's ``--zpp_config`` (a JSON file
    of zpp's own keys, the ``"zpp"`` section of the config)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    group.add_argument("--zpp_config", default=None, type=str,
                       help='zpp json configuration file: zpp\'s own keys (the "zpp" section of the config)')
    return parser
