"""Run one of the front-end scripts as a user would, and read its result.

    res = run("accelerate", tmp_path, engine="zpp", args=["--stage", "3"])

* engine "zpp": ``python -m zpp run <launch>``: the script's ``import deepspeed`` is zpp;
* engine "deepspeed": the launch as it is, in ``python`` (an environment with real DeepSpeed;
  on CPU it needs ``DS_ACCELERATOR=cpu``, set here);
* engine "ddp": the launch with ``--engine ddp`` (the front-end's own DDP path, the reference).

The Trainer and accelerate scripts run under ``torch.distributed.run --nproc-per-node 2``;
Lightning starts its 2 ranks itself. Each run gets a free port, its own session, and a hard
timeout (fitted inside the running test's pytest timeout, see [Note: nested timeouts] in
tests/dist.py): past it the whole process group is killed and the error carries the output.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCRIPTS = {"trainer": "hf_trainer.py", "accelerate": "accel.py", "lightning": "lit.py", "zero3_load": "hf_zero3_load.py"}
WORLD = 2
_STRIP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
          "ZPP_RANKS_PER_NODE", "ZPP_COMM_BACKEND", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_DEEPSPEED")


class ScriptFailed(AssertionError):
    pass


def command(frontend: str, engine: str, args: list[str], python: str = sys.executable, world: int = WORLD) -> list[str]:
    script = str(HERE / SCRIPTS[frontend])
    args = [*args, "--engine", "ddp"] if engine == "ddp" else list(args)
    if frontend == "lightning":
        launch = [python, script, *args]
    else:
        launch = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
                  str(dist._free_port()), script, *args]
    return [python, "-m", "zpp", "run", *launch] if engine == "zpp" else launch


def run(frontend: str, workdir: Path, *, engine: str = "zpp", args: list[str] = (), timeout: float = 240,
        python: str = sys.executable, out: str = "result.json", world: int = WORLD,
        ranks_per_node: int | None = None) -> dict:
    """Run the script in ``workdir`` on ``world`` ranks (Lightning: its own 2), with
    ``ranks_per_node`` per emulated node (Default: one node); returns its result record (see
    common.write_result)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _STRIP}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(dist._free_port()), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if ranks_per_node is not None:
        env["ZPP_RANKS_PER_NODE"] = str(ranks_per_node)
    if engine == "deepspeed":
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/ds_ext"))
    cmd = command(frontend, engine, [*args, "--out", out], python, world)
    limit = dist.world_timeout(timeout)
    with open(workdir / "output.log", "w+b") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        log.seek(0)
        output = log.read().decode(errors="replace")
    if code != 0:
        why = f"killed after {limit:.0f} s" if code is None else f"exit code {code}"
        raise ScriptFailed(f"{' '.join(cmd)}: {why}\n{output[-6000:]}")
    return json.loads((workdir / out).read_text())
