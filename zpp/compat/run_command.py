"""``zpp run``: a command whose Python processes get zpp when they import ``deepspeed``.

    zpp run torchrun --nproc-per-node 2 train.py          # a Hugging Face Trainer script, unchanged
    zpp run accelerate launch --config_file ds.yaml train.py
    zpp run python train_lightning.py                     # Lightning's strategy="deepspeed_stage_3"
    zpp run --path                                        # the folder to put on PYTHONPATH by hand

See :mod:`zpp.as_deepspeed` for what it changes (one folder first on ``PYTHONPATH``) and why.
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "run a command with `import deepspeed` giving zpp (Trainer, accelerate, Lightning)"
DESCRIPTION = """\
Run COMMAND with `import deepspeed` giving zpp in every Python process it starts: the Hugging
Face Trainer, accelerate and Lightning then train on zpp with no line of the script changed.
zpp puts one folder first on PYTHONPATH (a `deepspeed` package that forwards to zpp, and a
`deepspeed` distribution entry, version 0.19.8+zpp.<version>, that the front-ends' version
checks accept) and sets ZPP_AS_DEEPSPEED=1. Nothing else changes; outside `zpp run`,
`import deepspeed` is whatever is installed. A real DeepSpeed installed beside it is not used,
and rank 0 says so.

examples:
  zpp run torchrun --nproc-per-node 2 train.py
  zpp run accelerate launch --config_file ds.yaml train.py
  zpp run python train_lightning.py
  export PYTHONPATH=$(zpp run --path)${PYTHONPATH:+:$PYTHONPATH}
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", action="store_true", help="print the folder to put first on PYTHONPATH, and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="the command to run")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from zpp.compat import as_deepspeed

    if args.path:
        if args.cmd:
            args.parser.error("--path takes no command")
        print(as_deepspeed.shim_path())
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        args.parser.error("no command: zpp run COMMAND [ARGS...], e.g. zpp run torchrun --nproc-per-node 2 train.py")
    env = as_deepspeed.environ()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        args.parser.error(f"command not found: {cmd[0]!r}")
    except PermissionError as e:
        args.parser.error(f"cannot run {cmd[0]!r}: {e}")
    return 127  # not reached
