"""What the training benchmarks (perf/train_bench.py, perf/onebit_train_bench.py) share:
the model and data, rank launching, the modelled and the measured bytes per step.

Measured bytes: inside ``zpp cluster`` every node is a network namespace whose only link to
the other nodes is the interface ``zpp-eth``; its kernel counters count what really crossed
the node's link, frame headers included, whatever library sent it (torch DDP, FSDP2,
DeepSpeed, zpp), and the TCP segments the node retransmitted (packets dropped at the shaped
link are sent again and counted again): :mod:`zpp.cluster.linkstats`, which
tests/test_cluster_wire.py checks against zpp's wire counters.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from zpp.cluster.linkstats import read_link  # noqa: E402


def add_model_args(p: argparse.ArgumentParser, *, n_layer: int, n_embd: int, block: int, batch: int,
                   steps: int, warmup: int) -> None:
    """The GPT and run-length options both benchmarks take."""
    p.add_argument("--world", type=int, default=4, help="ranks to spawn when not under a launcher")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-embd", type=int, default=n_embd)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block", type=int, default=block, help="sequence length")
    p.add_argument("--batch", type=int, default=batch, help="sequences per rank per step")
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    p.add_argument("--model", choices=("gpt", "hf-gpt2"), default="gpt",
                   help="tests/gpt.py's GPT, or Hugging Face's GPT2LMHeadModel of the same shape")


def parse_variants(p: argparse.ArgumentParser, args: argparse.Namespace, known) -> None:
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in known]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(known)}")


def make_model(args):
    """The benchmark model: ``model(x, y)`` returns the loss of predicting ``y``."""
    from tests.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if args.model == "hf-gpt2":
        return HFCausalLM(args)
    return GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))


class HFCausalLM(torch.nn.Module):
    """Hugging Face's GPT2LMHeadModel (tied head, its own attention and MLP modules) with
    the benchmark GPT's shape and vocabulary, called as ``model(x, y)``: ``y`` is ``x``
    shifted by one, which the Hugging Face loss does itself, so it reads ``labels=x``."""

    def __init__(self, args) -> None:
        super().__init__()
        import transformers as tf

        from tests.gpt import GPTConfig

        cfg = tf.GPT2Config(vocab_size=GPTConfig().vocab_size, n_positions=args.block, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.hf = tf.GPT2LMHeadModel(cfg)

    def forward(self, x, y):
        del y
        return self.hf(input_ids=x, labels=x).loss


def modelled_bytes(kind: str, psi: int, t) -> tuple[float, float]:
    """Inter/intra-node bytes per rank per step under the transport counters' direct-exchange
    model for a library that sends without a zpp transport: ``ddp`` one fp32 all-reduce of the
    gradients, ``fsdp``/``deepspeed`` two all-gathers of the parameters and a reduce-scatter."""
    W, me = t.world_size, t.nodes[t.rank]
    inter_peers = sum(1 for n in t.nodes if n != me)
    intra_peers = W - 1 - inter_peers
    m = 4 * psi
    per_peer = 2 * m / W if kind == "ddp" else 3 * m / W
    return inter_peers * per_peer, intra_peers * per_peer


def eth_counters() -> tuple[int, int, int] | None:
    """(tx bytes, tx packets, TCP segments retransmitted) of the node link in this process's
    network namespace (:func:`zpp.cluster.linkstats.read_link`), or None outside ``zpp cluster``."""
    c = read_link()
    return None if c is None else (c.tx_bytes, c.tx_packets, c.retrans_segs)


def node_eth_per_step(t, before, after, steps: int) -> dict:
    """Every node's link counters per step, the same dict on every rank (a collective).
    ``before``/``after`` are this rank's :func:`eth_counters`; the ranks of a node share one
    namespace, so the first rank of each node reports for it. Empty outside ``zpp cluster``."""
    eth = torch.full((3,), -1.0, dtype=torch.float64)
    if before is not None and after is not None:
        eth = torch.tensor([b - a for a, b in zip(before, after)], dtype=torch.float64) / steps
    every = torch.empty(3 * t.world_size, dtype=torch.float64)
    t.all_gather(every, eth)
    every = every.view(t.world_size, 3)
    first_of_node: dict[int, int] = {}
    for r, n in enumerate(t.nodes):
        first_of_node.setdefault(n, r)
    nodes = [every[r].tolist() for _, r in sorted(first_of_node.items())]
    if min(min(n) for n in nodes) < 0:
        return {}
    return {"eth_tx_bytes_per_node": [n[0] for n in nodes], "eth_tx_packets_per_node": [n[1] for n in nodes],
            "tcp_retrans_per_node": [n[2] for n in nodes]}


def timed_steps(t, args, data, net, backward, opt_step, on_timed=None) -> tuple[dict, dict]:
    """``args.warmup`` untimed training steps, then ``args.steps`` timed ones between barriers.

    A step draws a batch from ``data`` (this rank's own stream), runs ``loss = net(x, y)``,
    ``backward(loss)`` and ``opt_step()``. Returns the row's measured fields (``step_s``;
    ``fwd_bwd_s`` and ``opt_s``, the step split at the end of ``backward``; the last ``loss``;
    every node's link bytes per step, see :func:`node_eth_per_step`) and the transport's wire
    counters over the timed steps (a snapshot; empty for a library that does not send through
    ``t``). ``on_timed()``, when given, is called between the warm-up and the timed steps."""
    g = torch.Generator().manual_seed(t.rank)
    split = [0.0, 0.0]

    def step():
        x, y = data.batch(args.batch, args.block, g)
        t0 = time.perf_counter()
        loss = net(x, y)
        backward(loss)
        t1 = time.perf_counter()
        opt_step()
        split[0] += t1 - t0
        split[1] += time.perf_counter() - t1
        return loss.item()

    losses = [step() for _ in range(args.warmup)]
    if on_timed is not None:
        on_timed()
    t.counters.reset()
    t.barrier()
    split[:] = [0.0, 0.0]
    eth0 = eth_counters()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
        losses.append(loss)
    t.barrier()
    dt = (time.perf_counter() - t0) / args.steps
    eth1 = eth_counters()
    snap = t.counters.snapshot()  # before the exchange of the link counters below
    row = {"step_s": dt, "fwd_bwd_s": split[0] / args.steps, "opt_s": split[1] / args.steps, "loss": loss,
           "losses": losses, **node_eth_per_step(t, eth0, eth1, args.steps)}
    return row, snap


def counted_per_step(snap: dict, steps: int) -> tuple[float, float]:
    """Inter- and intra-node bytes per step in a wire-counter snapshot of ``steps`` steps."""
    return (sum(s.inter_bytes for s in snap.values()) / steps, sum(s.intra_bytes for s in snap.values()) / steps)


def busiest_eth(row: dict) -> float | None:
    """The busiest node's link bytes per step (:func:`node_eth_per_step`), None outside
    ``zpp cluster``."""
    return max(row["eth_tx_bytes_per_node"]) if row.get("eth_tx_bytes_per_node") else None


def fmt_eth(row: dict, key: str) -> str:
    return ", ".join(f"{b:.0f}" for b in row[key]) if key in row else "-"


def _spawned(rank, world, per_node, port, main, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      ZPP_RANKS_PER_NODE=str(per_node))
    run_rank(main, args)


def run_rank(main, args):
    """Run ``main(transport, args)`` on this rank's torch transport (one thread per rank:
    the ranks share the cores)."""
    torch.set_num_threads(1)
    from zpp.comm.registry import get_transport

    main(get_transport("torch"), args)


def launch(main, args) -> None:
    """Under a launcher (RANK set): run this rank. Alone: spawn ``args.world`` local ranks."""
    if "RANK" in os.environ:
        run_rank(main, args)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, args.ranks_per_node, port, main, args), nprocs=args.world, join=True)
