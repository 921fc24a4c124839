"""``zpp tune --predict``: the cost model's step time, bytes and memory for every mode on a
cluster of any size, from presets or a measured compute time; nothing runs.

    zpp tune --predict --model 7b --nodes 32 --ranks-per-node 8 --intra nvlink --inter 100gbit
    zpp tune --predict --params 25M --layers 8 --nodes 2 --ranks-per-node 2 --intra loopback \\
        --inter 100mbit --compute-s 1.5 --param-bytes 4
    zpp tune --predict --model 70b --nodes 128 --ranks-per-node 8 --inter 400gbit --json out.json

See [Note: the cost model] in :mod:`zpp.tune.cost` for the formulas. A model is a preset
(``--model``: the benchmark GPT and Llama-2-shaped 7B and 70B) or ``--params`` in
``--layers`` equal units plus nothing else. The compute per step is ``--compute-s`` (the
step measured without communication, e.g. on one node) or ``6 Psi tokens / (peak x mfu)``
from ``--tokens-per-rank``, ``--peak-tflops`` and ``--mfu``. ``--memory-gb`` marks the
modes whose peak model states plus ``--other-gb`` do not fit.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zpp.tune.links import LINKS, link

# torch-free at import (``zpp --help``): zpp.tune.cost is imported where it is used

__all__ = ["MODELS", "add_arguments", "model_units", "run"]

#: name -> (layers, elements per layer, elements outside the layers)
MODELS: dict[str, tuple[int, int, int]] = {
    # perf/'s GPT 8 x 512 (tests/gpt.py, vocabulary 128, 128 positions, tied head)
    "gpt-25m": (8, 12 * 512 * 512 + 13 * 512, 2 * 128 * 512 + 2 * 512),
    # Llama-2 7B: d 4096, MLP 11008, 32 layers, vocabulary 32000, untied head
    "7b": (32, 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096, 2 * 32000 * 4096 + 4096),
    # Llama-2 70B: d 8192, grouped KV (8 heads of 128), MLP 28672, 80 layers
    "70b": (80, 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192, 2 * 32000 * 8192 + 8192),
}


def model_units(name: str | None, params: int | None, layers: int) -> list:
    """The units of a preset (one per layer, then the rest as the root unit), or ``params``
    in ``layers`` equal units (:class:`zpp.tune.cost.UnitShape` s)."""
    from zpp.tune import cost

    if name is not None:
        n, per, rest = MODELS[name]
        return [cost.UnitShape(per)] * n + [cost.UnitShape(rest)]
    assert params is not None
    return cost.even_units(params, layers)


def _link(text: str):
    """:func:`zpp.tune.links.link` for argparse."""
    try:
        return link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a preset ({', '.join(LINKS)}) nor a rate: {e}")


def add_arguments(p: argparse.ArgumentParser, param_count) -> None:
    g = p.add_argument_group("--predict: the cost model at any scale (nothing runs)")
    g.add_argument("--predict", action="store_true", help="print the predicted step, bytes and memory of each mode")
    g.add_argument("--model", choices=sorted(MODELS), default=None, help="a model shape preset")
    g.add_argument("--params", type=param_count, default=None, metavar="N", help="or: parameters (25M, 1.3B)")
    g.add_argument("--layers", type=int, default=8, help="with --params: its units (default: 8)")
    g.add_argument("--nodes", type=int, default=2, help="(default: 2)")
    g.add_argument("--intra", type=_link, default=LINKS["nvlink"],
                   help=f"inside a node: {', '.join(LINKS)} or a rate (default: nvlink)")
    g.add_argument("--inter", type=_link, default=LINKS["100gbit"],
                   help="between nodes, per node: a preset or a rate such as 25gbit (default: 100gbit)")
    g.add_argument("--compute-s", type=float, default=None, help="seconds of one step without communication")
    g.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens per rank and step (default: 4096)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="per rank, dense (default: 989, H100 bf16)")
    g.add_argument("--mfu", type=float, default=0.4, help="model flops utilization (default: 0.4)")
    g.add_argument("--param-bytes", type=int, choices=(2, 4), default=2,
                   help="bytes per parameter on the wire in gathers (default: 2, bf16; gradients reduce in fp32)")
    g.add_argument("--modes", default=None, help="comma-separated (default: all)")
    g.add_argument("--memory-gb", type=float, default=None,
                   help="memory per rank: --predict marks, --job drops, the modes predicted above it")
    g.add_argument("--other-gb", type=float, default=0.0, help="per rank beside the model states (activations)")
    g.add_argument("--json", default=None, metavar="FILE", help="also write the predictions here")


def predictions(args: argparse.Namespace) -> tuple[Any, list, dict[str, Any]]:
    """(cluster, predictions, what they assumed) for the parsed arguments."""
    from zpp.tune import cost

    rpn = args.ranks_per_node or 8
    c = cost.Cluster(args.nodes, rpn, args.intra, args.inter)
    units = model_units(args.model, args.params, args.layers)
    psi = sum(u.numel for u in units)
    other = int(args.other_gb * 1e9)
    if args.compute_s is not None:
        prof = cost.Profile(args.compute_s, other)
    else:
        prof = cost.Profile.from_flops(psi, args.tokens_per_rank, peak_flops=args.peak_tflops * 1e12, mfu=args.mfu,
                                       other_bytes=other)
    modes = []
    for name in (args.modes.split(",") if args.modes else cost.MODES):
        if name not in cost.MODES:
            raise ValueError(f"--modes: {name!r} is not a mode; choices: {', '.join(cost.MODES)}")
        modes.append(cost.MODES[name])
    rows = cost.predict(modes, units=units, cluster=c, profile=prof, param_bytes=args.param_bytes)
    meta = {"params": psi, "units": len(units), "compute_s": prof.compute_s, "param_bytes": args.param_bytes,
            "model": args.model, "tokens_per_rank": args.tokens_per_rank, "mfu": args.mfu,
            "peak_tflops": args.peak_tflops}
    return c, rows, meta


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if (args.model is None) == (args.params is None):
        parser.error("--predict needs one of --model or --params")
    try:
        c, rows, meta = predictions(args)
    except ValueError as e:
        parser.error(str(e))
    print(f"# zpp tune --predict: {meta['params']:,} parameters in {meta['units']} units, compute "
          f"{meta['compute_s']:.4g} s/step, {meta['param_bytes']}-byte parameters on the wire")
    from zpp.tune.cost import format_predictions

    print(format_predictions(rows, c))
    if args.memory_gb is not None:
        over = [r.mode for r in rows if r.peak_bytes > args.memory_gb * 1e9]
        print(f"# do not fit in {args.memory_gb:g} GB per rank: {', '.join(over) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": {"nodes": c.nodes, "ranks_per_node": c.ranks_per_node, "intra": c.intra.name,
                                   "inter": c.inter.name}, **meta, "rows": [r.to_dict() for r in rows]}, f, indent=1)
    sys.stdout.flush()
    return 0
