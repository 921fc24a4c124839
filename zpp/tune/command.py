"""``zpp tune``: measure the collectives on each transport, plain and compressed, and write
the plan of the fastest (backend, compression) per collective and message size whose error
stays within ``--max-error``.

    zpp tune                                     # torch and mpi, 4 local ranks = 2 nodes x 2
    zpp tune --backends torch --sizes 64K:4M --max-error 0.005 --out plan.json
    zpp tune --cluster --ranks-per-node 2        # each backend through `zpp cluster run`
    mpiexec -n 8 zpp tune                        # inside a launched world: its backend only
    zpp tune --cluster --ops all_reduce --outer-params 25M --outer-step-s 3   # + zpp.outer settings
    ZPP_TUNE_FILE=zpp_tune.json python train.py  # use it: get_transport(), zpp.comm.tuned, zpp.initialize
    zpp tune --job --config ds.json -- python train.py --deepspeed_config ds.json   # the job's mode (job.py)
    zpp tune --predict --model 7b --nodes 32 --ranks-per-node 8 --inter 100gbit     # any scale (predict.py)

The sweep is ``zpp bench``'s (all_gather, reduce_scatter and all_reduce: none, int8, int4;
all_reduce also 1bit with --allow-1bit). Alone, torch ranks are spawned in-process and the MPI
sweep runs ``python -m zpp bench --backend mpi`` (which starts mpiexec); with --cluster
each backend's sweep runs on the live emulated cluster. The measured rows go to stderr,
the decision table to stdout, the plan to --out (see zpp/comm/plan.py for the format and
zpp/tune/planner.py for how it is chosen). With --outer-params and --outer-step-s the
hierarchical mode's settings follow from the measured all_reduce (zpp/tune/outer.py); they
are printed after the table and kept in the plan's meta. 1bit is excluded unless --allow-1bit: one call's
error means little for an error-feedback method, whose residual is repaid over later steps.

Exit status: 0, 1 when a sweep failed (no plan is written), 2 for bad arguments, 124 when
--timeout ran out.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

from zpp.bench import launch as _launch
from zpp.bench.argtypes import choice_list, integer, seconds, sizes_type
from zpp.bench.launch import close_world
from zpp.bench.config import BACKENDS, DTYPES, BenchConfig
from zpp.tune import job, predict

__all__ = ["HELP", "add_arguments", "run"]

HELP = "choose the transport and compression per collective and size (writes a plan)"
TUNE_OPS = ("all_gather", "reduce_scatter", "all_reduce")
DEFAULT_SIZES = "64K:16M"
DEFAULT_OUT = "zpp_tune.json"
_DEFAULT_NPROCS = 4
_DEFAULT_RANKS_PER_NODE = 2


def _max_error(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", type=choice_list(BACKENDS, "backend"), default=None,
                   help="torch,mpi or one of them (default: both; mpi only where mpi4py and mpiexec are)")
    p.add_argument("--ops", type=choice_list(TUNE_OPS, "op"), default=TUNE_OPS,
                   help=f"{','.join(TUNE_OPS)} or a part of it (default: all)")
    p.add_argument("--sizes", type=sizes_type, default=DEFAULT_SIZES,
                   help=f"logical bytes per call to measure: MIN:MAX[:FACTOR] or a comma list, suffixes "
                        f"K M G (default: {DEFAULT_SIZES})")
    p.add_argument("--max-error", type=_max_error, default=0.01,
                   help="largest measured maxrelerr (max|y-exact|/max|exact|) a compression may have "
                        "(default: 0.01)")
    p.add_argument("--allow-1bit", action="store_true",
                   help="let all_reduce choose 1bit (error feedback across steps; its one-call error "
                        "is not checked against --max-error)")
    p.add_argument("--nprocs", type=integer(1), default=None,
                   help=f"ranks (default: {_DEFAULT_NPROCS} local; --cluster: every node)")
    p.add_argument("--ranks-per-node", type=integer(1), default=None,
                   help=f"ranks per (emulated) node (default: {_DEFAULT_RANKS_PER_NODE}, 1 for an odd "
                        f"--nprocs; --cluster: 1)")
    p.add_argument("--cluster", action="store_true",
                   help="run each backend's sweep on the live emulated cluster (`zpp cluster run`)")
    p.add_argument("--out", metavar="FILE", default=DEFAULT_OUT, help=f"the plan (default: {DEFAULT_OUT})")
    p.add_argument("--iters", type=integer(1), default=10,
                   help="timed calls per size, fewer above 1 MiB (default: 10)")
    p.add_argument("--warmup", type=integer(0), default=3, help="untimed calls per size (default: 3)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="(default: float32)")
    p.add_argument("--group-size", type=integer(2, even=True), default=2048,
                   help="elements per int8/int4 quantization group (default: 2048)")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="hard limit in seconds for each backend's sweep (default: 600)")
    o = p.add_argument_group("the hierarchical mode (zpp.outer): its settings from the measured all_reduce")
    o.add_argument("--outer-params", type=_param_count, default=None, metavar="N",
                   help="trainable parameters of the model (25M, 1.3B or a plain integer); with "
                        "--outer-step-s prints the zpp.outer settings this link allows and puts them in "
                        "the plan's meta")
    o.add_argument("--outer-step-s", type=seconds, default=None, metavar="S",
                   help="seconds of one inner training step, measured without the outer sync")
    o.add_argument("--outer-fragments", type=integer(1), default=4, help="zpp.outer.fragments (default: 4)")
    o.add_argument("--outer-max-sync-every", type=integer(2), default=100,
                   help="above this sync_every (H) the advice says the link is the limit "
                        "(default: 100)")
    predict.add_arguments(p, _param_count)
    job.add_arguments(p)
    p.add_argument("job_command", nargs="*", metavar="-- COMMAND", help="with --job: the training job's command")


def _param_count(text: str) -> int:
    """``25M`` -> 25_000_000 (K, M, B or G: powers of 1000, as parameter counts are quoted)."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = 0.0
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} must be a parameter count such as 25M, 1.3B or 1000000")
    return int(value)


def _note(text: str) -> None:
    print(f"zpp tune: {text}", file=sys.stderr, flush=True)


def _mpi_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None and bool(shutil.which("mpiexec") or shutil.which("mpirun"))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.predict:
        return predict.run(args)
    if args.job_command and not args.job:
        parser.error(f"unexpected arguments {args.job_command}: a command after -- goes with --job")
    if args.job:
        if args.out == DEFAULT_OUT:
            args.out = job.DEFAULT_OUT
        return job.run(args, args.job_command)
    where = _launch.detect_for(parser)
    if (args.outer_params is None) != (args.outer_step_s is None):
        parser.error("--outer-params and --outer-step-s go together (the model's size and its inner step time)")
    if args.outer_params is not None and "all_reduce" not in args.ops:
        parser.error(f"--outer-params needs all_reduce among --ops (got {','.join(args.ops)}): the outer sync "
                     "is an all-reduce")
    compress = ("none", "int8", "int4") + (("1bit",) if args.allow_1bit else ())
    try:
        cfg = BenchConfig(ops=args.ops, compress=compress, dtype=args.dtype, sizes=args.sizes,
                          warmup=args.warmup, iters=args.iters, group_size=args.group_size)
    except ValueError as e:
        parser.error(str(e))
    if where.kind != "alone":
        if args.cluster:
            parser.error(f"--cluster starts its own ranks; this process is already rank {where.rank} of a "
                         f"{where.kind} world (run `zpp tune --cluster` alone)")
        return _run_launched(args, cfg, where)
    return _run_alone(args, cfg)


# ---------------------------------------------------------------------------- alone
def _run_alone(args: argparse.Namespace, cfg: BenchConfig) -> int:
    parser = args.parser
    if args.backends is None:
        backends = ["torch"] + (["mpi"] if _mpi_available() else [])
        if "mpi" not in backends:
            _note("note: mpi4py or mpiexec missing, tuning torch only (pip install mpi4py mpich: zpp's mpi extra)")
    else:
        backends = list(args.backends)
        if "mpi" in backends and not _mpi_available():
            parser.error("--backends mpi needs mpi4py and mpiexec: pip install mpi4py mpich (zpp's mpi extra)")
    if args.cluster:
        rpn = args.ranks_per_node or 1
        if args.nprocs is not None and args.nprocs % rpn:
            parser.error(f"--nprocs {args.nprocs} is not divisible by --ranks-per-node {rpn}")
        nodes = args.nprocs // rpn if args.nprocs is not None else None
        nprocs = None
    else:
        nprocs = args.nprocs or _DEFAULT_NPROCS
        rpn = args.ranks_per_node or (_DEFAULT_RANKS_PER_NODE if nprocs % _DEFAULT_RANKS_PER_NODE == 0 else 1)
        if nprocs % rpn:
            parser.error(f"--nprocs {nprocs} is not divisible by --ranks-per-node {rpn}")
        nodes = nprocs // rpn
    _check_out(parser, args.out)
    rows: list[dict] = []
    metas: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="zpp-tune-") as tmp:
        for backend in backends:
            path = os.path.join(tmp, f"{backend}.json")
            on = (f"the cluster ({'all' if nodes is None else nodes} nodes x {rpn})" if args.cluster
                     else f"{nprocs} local ranks = {nodes} emulated nodes x {rpn}")
            _note(f"measuring {backend} on {on}; rows on stderr")
            if args.cluster:
                code = _sweep_cluster(args, cfg, backend, path, nodes, rpn)
            elif backend == "torch":
                code = _launch.spawn(_sweep_rank, (cfg, "torch", path), nprocs=nprocs, ranks_per_node=rpn,
                                     timeout=args.timeout)
            else:
                code = _sweep_mpiexec(args, cfg, path, nprocs, rpn)
            doc = _read_rows(path)
            if doc is None or code not in (0, 1):
                _note(f"the {backend} sweep failed (exit code {code}); no plan written")
                return code or 1
            if code == 1:
                _note(f"note: the {backend} sweep found values outside their error bounds; "
                      "those variants are excluded")
            metas[backend] = doc["meta"]
            rows += [{**r, "backend": backend} for r in doc["rows"]]
    return _finish(args, rows, metas, backends, source="cluster" if args.cluster else "local")


def _check_out(parser: argparse.ArgumentParser, out: str) -> None:
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        parser.error(f"--out {out}: folder {folder} does not exist")


def _read_rows(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or "meta" not in doc or "rows" not in doc:
        return None
    return doc


def _bench_argv(cfg: BenchConfig, backend: str, path: str) -> list[str]:
    return ["bench", "--backend", backend, "--op", ",".join(cfg.ops), "--compress", ",".join(cfg.compress),
            "--sizes", ",".join(str(s) for s in cfg.sizes), "--iters", str(cfg.iters), "--warmup",
            str(cfg.warmup), "--dtype", cfg.dtype, "--group-size", str(cfg.group_size), "--json", path]


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _sweep_mpiexec(args, cfg: BenchConfig, path: str, nprocs: int, rpn: int) -> int:
    """``python -m zpp bench --backend mpi ...``: it re-runs itself under mpiexec."""
    cmd = [sys.executable, "-m", "zpp", *_bench_argv(cfg, "mpi", path), "--nprocs", str(nprocs),
           "--ranks-per-node", str(rpn), "--timeout", str(args.timeout)]
    env = {k: v for k, v in os.environ.items() if k not in ("ZPP_COMM_BACKEND", _launch.CHILD_MARKER)}
    fd = _stderr_fd()
    try:
        proc = subprocess.run(cmd, env=env, stdout=fd if fd is not None else subprocess.PIPE,
                              stderr=None if fd is not None else subprocess.STDOUT, text=True,
                              timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        _note(f"the mpi sweep ran past --timeout {args.timeout:g} s")
        return _launch.TIMEOUT_EXIT
    if fd is None and proc.stdout:
        sys.stderr.write(proc.stdout)
    return proc.returncode


def _sweep_cluster(args, cfg: BenchConfig, backend: str, path: str, nodes: int | None, rpn: int) -> int:
    """``zpp cluster run --backend B -- python -m zpp bench ...``; bench's table to stderr."""
    from zpp.cluster import launch as cluster_launch
    from zpp.cluster.netns import ClusterError

    cmd = [sys.executable, "-m", "zpp", *_bench_argv(cfg, backend, path)]
    try:
        return cluster_launch.run(cmd, nodes=nodes, ranks_per_node=rpn, backend=backend,
                                  timeout=args.timeout, stdout=sys.stderr)
    except ValueError as e:
        _note(f"error: {e}")
        return 2
    except ClusterError as e:
        _note(f"error: {e}")
        return getattr(e, "exit_code", 1) or 1


def _sweep_rank(cfg: BenchConfig, backend: str, json_path: str | None) -> int:
    """One rank of a spawned sweep (:func:`zpp.bench.launch.spawn`): rows printed to stderr
    and written to ``json_path`` as ``zpp bench --json`` does, on rank 0. The exit code: 1
    on rank 0 when a value was outside its error bound (as ``zpp bench``), else 0."""
    found = _sweep(cfg, backend, json_path)
    return 1 if found is not None and any(r["wrong"] for r in found[1]) else 0


def _sweep(cfg: BenchConfig, backend: str, json_path: str | None):
    """Run the sweep on this rank; on rank 0 return (meta, rows as dicts), else None."""
    import dataclasses
    import warnings

    from zpp.bench.harness import run_sweep, sweep_meta
    from zpp.bench.report import Table, write_json
    from zpp.comm.registry import get_transport
    from zpp.comm.topology import topology_of

    world = get_transport(backend)
    try:
        lead = world.rank == 0
        if not lead:
            warnings.filterwarnings("ignore", message="zpp.quant")
        topology = topology_of(world)
        meta = sweep_meta(cfg, world, topology, backend)
        table = Table(sys.stderr) if lead else None
        if lead:
            table.header(meta)
        rows = run_sweep(cfg, world, topology, on_op=table.op if lead else None,
                         on_row=table.row if lead else None)
        if not lead:
            return None
        table.footer()
        if json_path:
            write_json(json_path, meta, rows)
        return meta, [dataclasses.asdict(r) for r in rows]
    finally:
        close_world(world)


# ---------------------------------------------------------------------------- launched
def _run_launched(args: argparse.Namespace, cfg: BenchConfig, where: _launch.Launch) -> int:
    """This process is one rank of a launcher's world: tune that world's backend only."""
    parser = args.parser
    lead = where.rank == 0
    backend = os.environ.get("ZPP_COMM_BACKEND") or ("mpi" if where.kind == "mpi" else "torch")
    if backend not in BACKENDS:
        parser.error(f"ZPP_COMM_BACKEND={backend!r} must be one of {', '.join(BACKENDS)}")
    if where.kind == "torchrun" and backend == "mpi":
        parser.error("the mpi backend cannot run under torchrun; start zpp tune with mpiexec -n N")
    if lead:
        ignored = [b for b in (args.backends or ()) if b != backend]
        _note(f"inside a {where.kind} world of {where.world_size} ranks: tuning its backend, {backend}, only"
              + (f" (--backends {','.join(ignored)} ignored)" if ignored else "")
              + (f" (--nprocs {args.nprocs} ignored)" if args.nprocs not in (None, where.world_size) else ""))
    if args.ranks_per_node is not None:
        if where.world_size % args.ranks_per_node:
            parser.error(f"the {where.kind} world of {where.world_size} ranks is not divisible by "
                         f"--ranks-per-node {args.ranks_per_node}")
        os.environ["ZPP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    if lead:
        _check_out(parser, args.out)
    try:
        found = _sweep(cfg, backend, None)
    except Exception:
        print(f"zpp tune: rank {where.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
        if backend == "mpi" and where.world_size > 1 and "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)  # the other ranks would wait forever
        return 1
    if found is None:
        return 0
    meta, rows = found
    return _finish(args, [{**r, "backend": backend} for r in rows], {backend: meta}, [backend],
                   source=f"{where.kind} world")


# ---------------------------------------------------------------------------- the plan
def _finish(args, rows: list[dict], metas: dict[str, dict], backends: list[str], *, source: str) -> int:
    import zpp
    from zpp.tune.planner import build_plan, format_table

    worlds = {(m["world_size"], m["ranks_per_node"]) for m in metas.values()}
    if len(worlds) != 1:
        _note(f"the backends ran on different worlds {sorted(worlds)}; no plan written")
        return 1
    (size, rpn), = worlds
    first = metas[backends[0]]
    meta = {
        "zpp": zpp.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": first.get("host"),
        "source": source,
        "sizes": list(first.get("sizes", [])),
        "iters": first.get("iters"),
        "warmup": first.get("warmup"),
        "transports": {b: m.get("transport") for b, m in metas.items()},
        "quant_kernels": first.get("quant_kernels"),
    }
    advice = None
    if args.outer_params is not None:
        from zpp.tune.outer import advise

        advice = advise(rows, params=args.outer_params, step_s=args.outer_step_s, fragments=args.outer_fragments,
                        max_sync_every=args.outer_max_sync_every, allow_1bit=args.allow_1bit,
                        nodes=size // rpn, ranks_per_node=rpn)
        meta["outer"] = advice.to_dict()
    plan = build_plan(rows, world_size=size, ranks_per_node=rpn, max_error=args.max_error,
                      allow_1bit=args.allow_1bit, backends=backends, dtype=args.dtype,
                      group_size=args.group_size, meta=meta)
    plan.save(args.out)
    sys.stdout.write(format_table(plan))
    if advice is not None:
        from zpp.tune.outer import format_advice

        sys.stdout.write(format_advice(advice))
    sys.stdout.flush()
    _note(f"wrote {args.out}; use it with ZPP_TUNE_FILE={args.out}")
    return 0
