"""``zpp bench``: time the collectives, plain and compressed, nccl-tests style.

    zpp bench                                   # 4 local ranks = 2 emulated nodes x 2, gloo
    zpp bench --op all_gather --compress int8,int4 --sizes 64K:64M --json ag.json
    zpp bench -n 8 --ranks-per-node 4           # 8 local ranks = 2 emulated nodes x 4
    mpiexec -n 8 zpp bench --ranks-per-node 4   # MPI; torchrun --nproc-per-node 4 -m zpp bench

Under a launcher the node layout is the launcher's (one node of all ranks for a plain
``mpiexec -n 4`` or ``torchrun --nproc-per-node 4``) unless --ranks-per-node or
ZPP_RANKS_PER_NODE says otherwise.

Rank 0 prints the table on stdout (and nothing else there); notes and progress go to
stderr. Exit status: 0, 1 when a rank failed or a value was out of its error bound,
2 for bad arguments, 124 when --timeout ran out.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback

from zpp.bench import launch as _launch
from zpp.bench import plot
from zpp.bench.argtypes import choice_list, integer, seconds, sizes_type
from zpp.bench.config import (
    BACKENDS,
    COMPRESSIONS,
    DEFAULT_SIZES,
    DTYPES,
    OPS,
    VARIANT_NAMES,
    BenchConfig,
    applicable,
)
from zpp.bench.launch import close_world

__all__ = ["HELP", "add_arguments", "run"]

HELP = "time the collectives, plain and compressed (nccl-tests style)"
_DEFAULT_NPROCS = 4
_DEFAULT_RANKS_PER_NODE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", type=choice_list(OPS, "op"), default="all",
                   help=f"{'|'.join(OPS)}|all, or a comma list (default: all)")
    p.add_argument("--compress", type=choice_list(COMPRESSIONS, "compression"), default="all",
                   help="none|2hop|int8|int4|1bit|all, or a comma list; those that do not apply to an op "
                        "are skipped; 2hop is reduce_scatter's two hops (intra-node, then inter-node) "
                        "uncompressed, qgZ's baseline (default: all)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="default: mpi under mpiexec/mpirun, else torch (gloo when spawning)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    p.add_argument("--sizes", type=sizes_type, default=DEFAULT_SIZES,
                   help=f"logical bytes per call: MIN:MAX[:FACTOR], a comma list or one size, "
                        f"suffixes K M G (default: {DEFAULT_SIZES})")
    p.add_argument("--warmup", type=integer(0), default=5, help="untimed calls per size (default: 5)")
    p.add_argument("--iters", type=integer(1), default=20,
                   help="timed calls per size, fewer above 1 MiB (default: 20)")
    p.add_argument("--json", metavar="FILE", help="write every row and the header as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw busbw against size (needs the plot extra: pip install 'zpp[plot]')")
    p.add_argument("-n", "--nprocs", type=integer(1), default=None,
                   help=f"local ranks to spawn when started alone (default: {_DEFAULT_NPROCS})")
    p.add_argument("--ranks-per-node", type=integer(1), default=None,
                   help=f"ranks per (emulated) node; spawning: default {_DEFAULT_RANKS_PER_NODE} "
                        f"(1 for an odd --nprocs); under a launcher: what it reports")
    p.add_argument("--group-size", type=integer(2, even=True), default=2048,
                   help="elements per int8/int4 quantization group (default: 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default: 0)")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="hard limit in seconds when spawning ranks (default: 600)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate, then run the sweep here (under a launcher) or start the ranks."""
    parser: argparse.ArgumentParser = args.parser
    where = _launch.detect_for(parser)
    quiet = where.rank != 0 or os.environ.get(_launch.CHILD_MARKER) == "1"
    variants, skipped = applicable(args.op, args.compress)
    if not variants:
        have = "; ".join(f"{op}: {', '.join(VARIANT_NAMES[op])}" for op in args.op)
        parser.error(f"--op {','.join(args.op)} --compress {','.join(args.compress)}: nothing to run, "
                     f"no variant {', '.join(skipped)} (there are {have})")
    if skipped and args.compress != COMPRESSIONS and not quiet:
        print(f"zpp bench: note: skipping {', '.join(skipped)} (no such variant)", file=sys.stderr)
    if args.plot and not plot.available():
        parser.error(plot.MISSING)
    try:
        cfg = BenchConfig(ops=args.op, compress=args.compress, dtype=args.dtype, sizes=args.sizes,
                          warmup=args.warmup, iters=args.iters, group_size=args.group_size,
                          seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    if where.kind == "alone":
        return _start_ranks(args, argv, cfg)
    return _run_launched(args, cfg, where, quiet)


def _start_ranks(args: argparse.Namespace, argv: list[str], cfg: BenchConfig) -> int:
    """Started alone: local ranks over gloo, or this command again under mpiexec."""
    parser = args.parser
    nprocs = args.nprocs or _DEFAULT_NPROCS
    rpn = args.ranks_per_node or (_DEFAULT_RANKS_PER_NODE if nprocs % _DEFAULT_RANKS_PER_NODE == 0 else 1)
    if nprocs % rpn:
        parser.error(f"--nprocs {nprocs} is not divisible by --ranks-per-node {rpn}")
    backend = args.backend or "torch"
    if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
        parser.error("--backend mpi needs mpi4py: pip install mpi4py mpich (zpp's mpi extra)")
    how = "mpiexec" if backend == "mpi" else "torch.distributed (gloo)"
    print(f"zpp bench: {nprocs} local ranks = {nprocs // rpn} emulated nodes x {rpn}, over {how}",
          file=sys.stderr)
    if backend == "mpi":
        try:
            return _launch.reexec_under_mpiexec(argv, nprocs=nprocs, ranks_per_node=rpn, timeout=args.timeout)
        except FileNotFoundError as e:
            parser.error(str(e))
    return _launch.spawn(run_rank, (cfg, "torch", (args.json, args.plot)), nprocs=nprocs,
                         ranks_per_node=rpn, timeout=args.timeout)


def _run_launched(args: argparse.Namespace, cfg: BenchConfig, where: _launch.Launch, quiet: bool) -> int:
    """Under mpiexec or torchrun: this process is one rank of the launcher's world."""
    parser = args.parser
    backend = args.backend or ("mpi" if where.kind == "mpi" else "torch")
    if where.kind == "torchrun" and backend == "mpi":
        parser.error("--backend mpi cannot run under torchrun; start it with mpiexec -n N")
    if args.nprocs is not None and args.nprocs != where.world_size and not quiet:
        print(f"zpp bench: note: --nprocs {args.nprocs} ignored, the {where.kind} world has "
              f"{where.world_size} ranks", file=sys.stderr)
    if args.ranks_per_node is not None:
        if where.world_size % args.ranks_per_node:
            parser.error(f"the {where.kind} world of {where.world_size} ranks is not divisible by "
                         f"--ranks-per-node {args.ranks_per_node}")
        os.environ["ZPP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    try:
        return run_rank(cfg, backend, (args.json, args.plot))
    except Exception:
        print(f"zpp bench: rank {where.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        sys.stderr.flush()
        if backend == "mpi" and where.world_size > 1 and "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)  # the other ranks would wait forever
        return 1


def run_rank(cfg: BenchConfig, backend: str, outputs: tuple[str | None, str | None]) -> int:
    """One rank's whole run: transport, sweep, and on rank 0 the table and files.
    Returns the exit code (1 on rank 0 when a value was out of bounds)."""
    import warnings

    from zpp.bench.harness import run_sweep, sweep_meta
    from zpp.bench.report import Table, loopback_note, write_json
    from zpp.cluster.launch import RUN_ID_VAR
    from zpp.comm.registry import get_transport
    from zpp.comm.topology import topology_of

    world = get_transport(backend)
    try:
        lead = world.rank == 0
        if not lead:  # rank 0 reports a kernel fallback once
            warnings.filterwarnings("ignore", message="zpp.quant")
        topology = topology_of(world)
        meta = sweep_meta(cfg, world, topology, backend)
        table = Table(sys.stdout) if lead else None
        if lead:
            table.header(meta)
        # a progress line only when the table goes elsewhere (on one terminal, rows are progress)
        progress = _progress if lead and sys.stderr.isatty() and not sys.stdout.isatty() else None
        rows = run_sweep(cfg, world, topology, on_op=table.op if lead else None,
                         on_row=table.row if lead else None, progress=progress)
        if progress:
            sys.stderr.write("\r\033[K")
        if not lead:
            return 0
        wrong = table.footer()
        note = loopback_note(rows, on_cluster=RUN_ID_VAR in os.environ)
        if note:
            print(f"zpp bench: {note}", file=sys.stderr)
        json_path, plot_path = outputs
        if json_path:
            write_json(json_path, meta, rows)
        if plot_path:
            from zpp.bench.plot import plot_rows

            plot_rows(rows, plot_path, meta)
        if wrong:
            print(f"zpp bench: {wrong} values outside their error bounds (#wrong)", file=sys.stderr)
            return 1
        return 0
    finally:
        close_world(world)


def _progress(text: str) -> None:
    sys.stderr.write(f"\r\033[K[zpp bench] {text}")
    sys.stderr.flush()
