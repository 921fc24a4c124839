"""One rank of a launch test (tests/test_faults.py, perf/exit_check.py): a real script run by
torchrun, mpiexec or plain processes.

    python tests/fault_worker.py SCENARIO OUTDIR

Scenarios:
  snippet   the README's zpp.comm snippet (transport, topology, quantized collectives); with
            ``ZPP_EXIT=inflight`` it exits with an all-gather in flight (started, never
            waited), with ``ZPP_EXIT=destroy`` after ``destroy_process_group()``
  train     zpp.initialize on a small MLP, ``ZPP_FAULT_STEPS`` steps (Default: 3) at ZeRO
            stage ``ZPP_FAULT_STAGE`` (Default: 3, prefetch on)
  dist      zpp.init_distributed() and DeepSpeed's comm functions

``ZPP_FAULT=MODE:RANK@STEP`` makes rank RANK misbehave before step STEP of train (or before
its transport, for ``exit``): ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself), ``sleep``
(stuck outside any collective, as in a data loader), ``exit`` (exit code 3 before the
rendezvous). Before misbehaving it writes OUTDIR/fault.json (the time); every other rank
writes OUTDIR/rank<R>.json: what it saw (error type and message, the time) or its results,
then re-raises its error, as a user's script would.

Every scenario ends the way a script does: its last collective (snippet: the quantized
all-gather; train: the last step) runs after the record is written, and the process exits
right after it. That is the window of the exit abort of [Note: clean exit] in
zpp/comm/teardown.py (a record written after the last collective closes it, and hides it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def _fault() -> tuple[str, int, int] | None:
    spec = os.environ.get("ZPP_FAULT", "")
    if not spec:
        return None
    mode, _, rest = spec.partition(":")
    rank, _, step = rest.partition("@")
    return mode, int(rank), int(step or 0)


def _misbehave(outdir: Path, mode: str) -> None:
    (outdir / "fault.json").write_text(json.dumps({"mode": mode, "t": time.time(), "pid": os.getpid()}))
    sys.stdout.flush()
    sys.stderr.flush()
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "sleep":
        time.sleep(3600)
    elif mode == "exit":
        os._exit(3)
    raise ValueError(f"ZPP_FAULT mode {mode!r}")


def _write(outdir: Path, rank: int, record: dict) -> None:
    tmp = outdir / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(outdir / f"rank{rank}.json")


def snippet() -> dict:
    import torch

    from zpp.comm import get_transport, topology_of
    from zpp.comm.collectives import quantized_all_gather, quantized_reduce_scatter

    world = get_transport()
    topo = topology_of(world)
    shard = torch.full((1000,), float(world.rank))
    out = torch.empty(1000 * world.world_size)
    quantized_all_gather(out, shard, transport=world, bits=8)
    grad = torch.ones(1000 * world.world_size)
    grad_shard = torch.empty(1000)
    quantized_reduce_scatter(grad_shard, grad, topology=topo, bits=4)
    print(f"rank={world.rank} world_size={world.world_size}", flush=True)
    want = torch.arange(world.world_size, dtype=torch.float32).repeat_interleave(1000)
    record = {"rank": world.rank, "world_size": world.world_size, "backend": world.name,
              "chosen_by": getattr(world, "chosen_by", ""), "gather_ok": bool(torch.allclose(out, want, atol=0.02)),
              "reduce_ok": bool(torch.allclose(grad_shard, torch.ones(1000), atol=0.1))}

    def last() -> None:
        quantized_all_gather(out, shard, transport=world, bits=8)
        ending = os.environ.get("ZPP_EXIT", "")
        if ending == "inflight":  # exit with an all-gather started and never waited
            world.all_gather_async(torch.empty((1 << 20) * world.world_size), torch.ones(1 << 20))
        elif ending == "destroy" and world.name == "torch":
            torch.distributed.destroy_process_group()

    return record, last


def train(outdir: Path, rank: int, fault: tuple[str, int, int] | None) -> dict:
    import torch

    import zpp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": int(os.environ.get("ZPP_FAULT_STAGE", "3"))},
    }
    if os.environ.get("ZPP_FAULT_TIMEOUT"):
        cfg["zpp"] = {"timeout_s": float(os.environ["ZPP_FAULT_TIMEOUT"])}
    engine, _, _, _ = zpp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    world = engine.world
    g = torch.Generator().manual_seed(100 + world.rank)
    losses = []

    def step(i: int) -> None:
        if fault is not None and fault[1] == rank and fault[2] == i:
            _misbehave(outdir, fault[0])
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), torch.zeros(8, 4))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    steps = int(os.environ.get("ZPP_FAULT_STEPS", "3"))
    for i in range(steps - 1):
        step(i)
    state = engine.consolidated_state_dict()  # the same on every rank of one world
    checksum = float(sum(v.double().sum() for v in state.values()))
    record = {"rank": world.rank, "world_size": world.world_size, "backend": world.name,
              "chosen_by": getattr(world, "chosen_by", ""), "losses": losses, "checksum": checksum}
    return record, lambda: step(steps - 1)


def dist_api() -> dict:
    import torch

    import zpp
    from zpp import comm as dist

    zpp.init_distributed(verbose=False)
    zpp.init_distributed(verbose=False)  # idempotent
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=n - 1)
    record = {"rank": r, "world_size": n, "local_rank": dist.get_local_rank(),
              "backend": str(torch.distributed.get_backend()), "avg": t.tolist(), "bcast": b.tolist(),
              "env_local_rank": os.environ.get("LOCAL_RANK"), "env_world_size": os.environ.get("WORLD_SIZE")}
    return record, lambda: dist.barrier()


def main(argv: list[str]) -> None:
    scenario, outdir = argv[1], Path(argv[2])
    try:
        from zpp.comm.launch import detect

        rank = detect().rank
    except ImportError:  # a zpp without launch detection (perf/exit_check.py --zpp-root)
        rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
    fault = _fault()
    if fault is not None and fault[0] == "exit" and fault[1] == rank:
        _misbehave(outdir, "exit")
    try:
        if scenario == "snippet":
            record, last = snippet()
        elif scenario == "train":
            record, last = train(outdir, rank, fault)
        elif scenario == "dist":
            record, last = dist_api()
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        _write(outdir, rank, {**record, "t": time.time()})
        last()  # the script's last collective; the process exits right after it
    except Exception as e:
        _write(outdir, rank, {"rank": rank, "error": type(e).__name__, "message": str(e), "t": time.time()})
        raise


if __name__ == "__main__":
    main(sys.argv)
