"""How far qgZ's reduced gradient is from the exact mean, by code width and group size, on
real gradients of tests/gpt.py's GPT (one process; no transport).

    python perf/qgz_error.py --sizes 4x128,6x256,8x512 --groups 128,512,2048 \\
        --json perf/results/qgz_error.json

For each size: the GPT trains ``--warm-steps`` AdamW steps on the character corpus (so the
gradients are a trained model's, not an initialisation's), then ``--ranks`` batches give one
flat gradient per rank. The exact result is their mean. qgZ's numerics are simulated with
zpp.quant's own quantizer, in the two hops the engine runs: every rank quantizes its
gradient (groups of G), each node sums its ranks' dequantized gradients, requantizes the
node's sum (groups of G) and the nodes' dequantized sums are added and divided by the ranks.
(The engine quantizes per destination chunk, so a group never straddles two ranks' slices;
with chunks a multiple of G the codes are the same.) Printed per size, bits and G: the
relative L2 error ``|q - exact| / |exact|`` and the bits per entry on the wire.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import runinfo  # noqa: E402
import zpp.quant as zq  # noqa: E402


def _roundtrip(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return zq.dequantize(zq.quantize(x, bits=bits, group_size=group))


def simulate_qgz(grads: torch.Tensor, ranks_per_node: int, bits: int, group: int) -> torch.Tensor:
    """The mean over ``grads``' rows (one per rank, node-major) through qgZ's two quantized hops."""
    ranks, n = grads.shape
    pad = -n % group
    g = torch.nn.functional.pad(grads, (0, pad))
    nodes = ranks // ranks_per_node
    node_sums = torch.stack([
        sum(_roundtrip(g[k * ranks_per_node + i], bits, group) for i in range(ranks_per_node))
        for k in range(nodes)])
    total = sum(_roundtrip(node_sums[k], bits, group) for k in range(nodes))
    return (total / ranks)[:n]


def gradients(layers: int, width: int, args, seed: int) -> tuple[torch.Tensor, int]:
    """One flat gradient per rank (rows) after ``args.warm_steps`` of training, and the parameter count."""
    from tests.gpt import GPT, CharCorpus, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=4, block_size=args.block))
    data = CharCorpus(max_bytes=2_000_000)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(args.warm_steps):
        x, y = data.batch(args.batch, args.block, gen)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    rows = []
    for _ in range(args.ranks):
        x, y = data.batch(args.batch, args.block, gen)
        model(x, y).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        model.zero_grad()
    return torch.stack(rows), sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4x128,6x256", help="LAYERSxWIDTH, comma-separated")
    p.add_argument("--groups", default="128,512,2048")
    p.add_argument("--bits", default="4,8")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.ranks % args.ranks_per_node:
        p.error(f"--ranks={args.ranks} is not a multiple of --ranks-per-node={args.ranks_per_node}")
    rows = []
    print(f"{'size':>8} {'params':>10} {'bits':>4} {'group':>6} {'bits/entry':>10} {'rel. L2 error':>14}")
    for size in args.sizes.split(","):
        layers, width = (int(v) for v in size.split("x"))
        grads, psi = gradients(layers, width, args, args.seed)
        exact = grads.mean(0)
        for bits in (int(b) for b in args.bits.split(",")):
            for group in (int(g) for g in args.groups.split(",")):
                q = simulate_qgz(grads, args.ranks_per_node, bits, group)
                err = float((q - exact).norm() / exact.norm())
                per_entry = bits + 32 / group
                rows.append({"size": size, "params": psi, "bits": bits, "group_size": group,
                             "bits_per_entry": per_entry, "rel_l2_error": err})
                print(f"{size:>8} {psi:>10} {bits:>4} {group:>6} {per_entry:>10.3f} {err:>14.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runinfo.provenance(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
