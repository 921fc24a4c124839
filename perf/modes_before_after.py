"""Losses and wire bytes of every engine variant, to compare two revisions of zpp bit for bit.

    python perf/modes_before_after.py --json out.json [--save-dir D | --load-dir D]
    PYTHONPATH=/path/to/other/checkout python perf/modes_before_after.py --json before.json

One 2 nodes x 2 ranks gloo world on loopback (``ZPP_RANKS_PER_NODE=2``); per variant
(stages 1-3, qwZ, hpZ, qgZ, ZeRO++, 1-bit Adam, 0/1 Adam, 1-bit LAMB, fp16, fp16 with
overflows (skipped steps), offload, the hierarchical mode) a small GPT trains STEPS steps
with gradient clipping; rank 0 prints the
losses (``repr`` of each float) and the wire counters of the training steps (per op: calls,
logical, intra-node and inter-node bytes) of every rank. The zpp under test is the one
Python imports (``PYTHONPATH`` first), so the same script measures any checkout.

``--save-dir D`` saves a checkpoint of every variant after STEPS steps into ``D/<variant>``
and trains RESUME more steps (their losses are ``resumed``); ``--load-dir D`` also builds
each variant afresh, loads ``D/<variant>`` (written by another revision) and trains RESUME
steps (``loaded``): they must equal the ``resumed`` losses of the run that saved.

``--compare BEFORE.json`` (a ``--json`` of another revision) writes, instead of this run's
record alone, both records and per variant whether the losses, the bytes and the resumed
losses are identical (this repository's perf/results/modes_before_after.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # tests.dist, tests.gpt; appended: PYTHONPATH's zpp wins
sys.path.append(str(HERE))
# the ranks import this file as ``modes_before_after`` (after PYTHONPATH's entries, as here)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE.parent), str(HERE)) if p)

STEPS, RESUME = 8, 2
ONEBIT = {"OneBitAdam": {"freeze_step": 3}, "OneBitLamb": {"freeze_step": 3, "coeff_beta": 0.8},
          "ZeroOneAdam": {"var_freeze_step": 4, "var_update_scaler": 2, "local_step_scaler": 2,
                          "local_step_clipper": 2}}
ZPP3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
VARIANTS = {
    "stage1": ({"zero_optimization": {"stage": 1}}),
    "stage2": ({"zero_optimization": {"stage": 2}}),
    "stage3": ({"zero_optimization": ZPP3}),
    "qwZ": ({"zero_optimization": {**ZPP3, "zero_quantized_weights": True}}),
    "hpZ": ({"zero_optimization": {**ZPP3, "zero_hpz_partition_size": 2}}),
    "qgZ": ({"zero_optimization": {**ZPP3, "zero_quantized_gradients": True}}),
    "ZeRO++": ({"zero_optimization": {**ZPP3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                      "zero_quantized_gradients": True}}),
    **{name: ({"optimizer": {"type": name, "params": {"lr": 3e-3, **extra}}, "zero_optimization": {"stage": 0}})
       for name, extra in ONEBIT.items()},
    "fp16-stage2": ({"zero_optimization": {"stage": 2},
                     "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3}}),
    "fp16-skips-stage3": ({"zero_optimization": ZPP3,  # too large a scale: overflows, skipped steps
                           "fp16": {"enabled": True, "initial_scale_power": 22, "loss_scale_window": 2,
                                    "hysteresis": 1}}),
    "offload-stage3": ({"zero_optimization": {**ZPP3, "offload_optimizer": {"device": "cpu"},
                                              "offload_param": {"device": "cpu"}}}),
    "outer-stage2": ({"zero_optimization": {"stage": 2},
                      "zpp": {"outer": {"sync_every": 2, "fragments": 2, "delay": 1, "compression": "1bit"}}}),
}


def _config(name: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    for k, v in VARIANTS[name].items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) and k != "optimizer" else v
    cfg["zero_optimization"] = {"reduce_bucket_size": 3000, **cfg["zero_optimization"]}
    cfg["zpp"] = {"check_metadata": False, **cfg.get("zpp", {})}
    return cfg


def _batches(rank: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 128, (4, 16), generator=g)
        out.append((x, x.clone()))
    return out


def _train(engine, batches) -> list[str]:
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(repr(loss.item()))
    return losses


def _world(t, save_dir, load_dir):
    import torch

    import zpp.zero as zz
    from tests.gpt import GPT, GPTConfig

    out = {}
    batches = _batches(t.rank, STEPS + RESUME)
    for name in VARIANTS:
        torch.manual_seed(1234)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=128))
        engine, *_ = zz.initialize(model=model, config=_config(name), transport=t)
        t.counters.reset()
        rec = {"losses": _train(engine, batches[:STEPS])}
        rec["skipped"] = engine.skipped_steps
        if getattr(engine, "outer", None) is not None:  # a background sync still running books its bytes
            engine.outer.wait()
        rec["bytes"] = {k: [v.calls, v.logical_bytes, v.intra_bytes, v.inter_bytes]
                        for k, v in sorted(t.counters.snapshot().items())}
        if save_dir is not None:
            engine.save_checkpoint(save_dir, tag=name)
            rec["resumed"] = _train(engine, batches[STEPS:])
        engine.close()
        if load_dir is not None:
            torch.manual_seed(1234)
            model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=128))
            engine, *_ = zz.initialize(model=model, config=_config(name), transport=t)
            engine.load_checkpoint(load_dir, tag=name)
            rec["loaded"] = _train(engine, batches[STEPS:])
            engine.close()
        out[name] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--save-dir", help="save each variant's checkpoint here, then train RESUME steps")
    ap.add_argument("--load-dir", help="load each variant's checkpoint from here, then train RESUME steps")
    ap.add_argument("--compare", help="a --json of another revision: write both and whether they are identical")
    args = ap.parse_args(argv)
    import runinfo
    import zpp
    from modes_before_after import _world  # importable by name in the ranks
    from tests.dist import run_world

    per_rank = run_world(_world, 4, ranks_per_node=2, timeout=900, args=(args.save_dir, args.load_dir))
    variants = {name: {"losses": [r[name].get("losses") for r in per_rank],
                       "bytes": [r[name].get("bytes") for r in per_rank],
                       "resumed": [r[name].get("resumed") for r in per_rank],
                       "loaded": [r[name].get("loaded") for r in per_rank],
                       "skipped_steps": [r[name].get("skipped") for r in per_rank]} for name in VARIANTS}
    zroot = Path(zpp.__file__).resolve().parent.parent
    record = {**runinfo.provenance(), "zpp": str(zroot), "zpp_revision": runinfo.git_revision(zroot),
              "world": "2 nodes x 2 ranks, gloo, loopback", "steps": STEPS, "variants": variants}
    for name, v in variants.items():
        inter = sum(b[3] for b in (v["bytes"][0] or {}).values())
        print(f"{name:16s} losses(rank0)={v['losses'][0]} inter_bytes(rank0)={inter} resumed={v['resumed'][0]} "
              f"loaded={v['loaded'][0]}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        same = {name: {what: before["variants"][name][what] == v[what] for what in ("losses", "bytes", "resumed")}
                for name, v in variants.items()}
        if args.load_dir:  # the checkpoints of BEFORE, loaded here, train as they did there
            for name, v in variants.items():
                same[name]["loaded_before"] = before["variants"][name]["resumed"] == v["loaded"]
        for name, s in same.items():
            print(f"{name:16s} " + " ".join(f"{k} {'identical' if ok else 'DIFFERENT'}" for k, ok in s.items()))
        record = {**runinfo.provenance(), "before": before, "after": record, "identical": same}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
