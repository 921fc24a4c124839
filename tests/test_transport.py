"""The transports (torch.distributed / gloo and MPI) against computed expectations.

Every world function below runs on every rank and checks every rank's results itself: each
rank's input is a deterministic function of (rank, size, dtype), so each rank can compute
what every collective must return. Checks are batched into one world per layout to keep
start-up cost low (each rank imports torch).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.dist import BACKENDS, ROOT, assert_peers_saw_loss, lose_peer, needs_mpi, run_world
from zpp.comm.transport import Transport

# (world_size, ranks_per_node); None = one node
LAYOUTS = [
    pytest.param(1, None, id="1"),
    pytest.param(2, None, id="2"),
    pytest.param(4, None, id="4"),
    pytest.param(4, 2, id="2x2"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool)


# ---------------------------------------------------------------------- reference data
def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input. Floats are multiples of 1/4 in [-4, 4], so sums over 4 ranks
    and their means are exact even in bf16 / fp16: comparisons can be exact."""
    g = torch.Generator().manual_seed(7919 * salt + 104729 * rank + 13 * n + DTYPES.index(dtype))
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dtype.is_floating_point:
        return (torch.randint(-16, 17, (n,), generator=g).to(torch.float64) / 4).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reduce(stack: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """The reference reduction over ranks (dim 0), in a wide type, cast back to ``dtype``."""
    if dtype == torch.bool:  # logical: sum / max = any, min = all
        return stack.all(0) if op == "min" else stack.any(0)
    if op == "max":
        return stack.max(0).values
    if op == "min":
        return stack.min(0).values
    if dtype.is_floating_point:
        total = stack.double().sum(0)
        return (total / stack.shape[0] if op == "mean" else total).to(dtype)
    total = stack.long().sum(0)
    if dtype == torch.uint8:  # unsigned addition wraps
        total = total % 256
    return total.to(dtype)


def _expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)} {got.tolist()[:12]} want {want.dtype} {tuple(want.shape)} {want.tolist()[:12]}")


def _wire(t: Transport, op: str, call) -> tuple[int, int, int, int]:
    """(calls, logical, intra, inter) that one call books under ``op``."""
    t.counters.reset()
    call()
    s = t.counters.snapshot()
    if set(s) != {op}:
        raise AssertionError(f"counters after one {op}: {s}")
    return s[op].calls, s[op].logical_bytes, s[op].intra_bytes, s[op].inter_bytes


# ---------------------------------------------------------------------- the world function
def _collectives_world(t: Transport, per_node: int) -> dict:
    r, n = t.rank, t.world_size
    want_nodes = tuple(q // per_node for q in range(n))
    if t.nodes != want_nodes or t.ranks != tuple(range(n)):
        raise AssertionError(f"layout: {t.nodes=} {t.ranks=}, want nodes {want_nodes}")
    intra_peers = per_node - 1
    inter_peers = n - per_node
    report: dict = {"wire": {}}
    start = time.perf_counter()
    for dtype in DTYPES:
        _check_moves(t, dtype, r, n)
        _check_reductions(t, dtype, r, n)
    if t.name == "torch":  # the list-based fallbacks of [Note: single-tensor collectives and fallbacks]
        t.prefer_single_tensor = False
        for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
            _check_moves(t, dtype, r, n)
            _check_reductions(t, dtype, r, n)
        t.prefer_single_tensor = True
    report["check_s"] = time.perf_counter() - start

    # wire bytes, per [Note: what is counted]; the metadata check is not counted
    k = 6 * 4  # bytes of 6 fp32 elements per rank
    x = torch.ones(6 * n)
    got = {
        "all_gather": _wire(t, "all_gather", lambda: t.all_gather(torch.empty(6 * n), torch.ones(6))),
        "reduce_scatter": _wire(t, "reduce_scatter", lambda: t.reduce_scatter(torch.empty(6), x.clone(), op="sum")),
        "all_reduce": _wire(t, "all_reduce", lambda: t.all_reduce(x.clone())),
        "all_to_all": _wire(t, "all_to_all", lambda: t.all_to_all(torch.empty(6 * n), x.clone())),
        "broadcast": _wire(t, "broadcast", lambda: t.broadcast(x.clone(), src=n - 1)),
    }
    src_sends = k * n if r == n - 1 else 0
    want = {
        "all_gather": (1, k * n, k * intra_peers, k * inter_peers),
        "reduce_scatter": (1, k * n, k * intra_peers, k * inter_peers),
        "all_reduce": (1, k * n, 2 * k * intra_peers, 2 * k * inter_peers),
        "all_to_all": (1, k * n, k * intra_peers, k * inter_peers),
        "broadcast": (1, k * n, src_sends * intra_peers, src_sends * inter_peers),
    }
    if got != want:
        raise AssertionError(f"wire counters on rank {r}: {got} want {want}")
    report["wire"] = got

    # bad input that every rank can see: TypeError / ValueError before any traffic
    errors = {}
    for name, call in {
        "complex": lambda: t.all_reduce(torch.ones(4, dtype=torch.complex64)),
        "int_mean_all_reduce": lambda: t.all_reduce(torch.ones(4, dtype=torch.int64), op="mean"),
        "int_mean_reduce_scatter": lambda: t.reduce_scatter(torch.empty(2, dtype=torch.int32), torch.ones(2 * n, dtype=torch.int32), op="mean"),
        "rs_max": lambda: t.reduce_scatter(torch.empty(2), torch.ones(2 * n), op="max"),
        "ag_out_size": lambda: t.all_gather(torch.empty(3 * n + 1), torch.ones(3)),
    }.items():
        try:
            call()
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = (type(e).__name__, str(e))
    report["errors"] = errors

    if n > 1:
        report["mismatch"] = _check_mismatch(t, r, n)
    t.barrier()
    return report


def _check_moves(t: Transport, dtype: torch.dtype, r: int, n: int) -> None:
    for m in (7, 0):  # an odd size and an empty call
        inp = _data(r, m, dtype, salt=1)
        out = torch.empty(n, m, dtype=dtype)  # 2-d output: rank-major rows
        t.all_gather(out, inp)
        _expect_equal(out, torch.stack([_data(q, m, dtype, salt=1) for q in range(n)]), f"all_gather {dtype} m={m}")

        inp = _data(r, 3 * n * m, dtype, salt=2)
        out = torch.empty(3 * n * m, dtype=dtype)
        t.all_to_all(out, inp)
        want = torch.cat([_data(q, 3 * n * m, dtype, salt=2).view(n, -1)[r] for q in range(n)])
        _expect_equal(out, want, f"all_to_all {dtype} m={m}")

        src = n - 1
        buf = _data(r, 5 * m, dtype, salt=3)
        t.broadcast(buf, src=src)
        _expect_equal(buf, _data(src, 5 * m, dtype, salt=3), f"broadcast {dtype} m={m} src={src}")


def _check_reductions(t: Transport, dtype: torch.dtype, r: int, n: int) -> None:
    ops = ["sum", "max", "min"] + (["mean"] if dtype.is_floating_point else [])
    for op in ops:
        for m in (11, 0):
            buf = _data(r, m, dtype, salt=4)
            t.all_reduce(buf, op=op)
            stack = torch.stack([_data(q, m, dtype, salt=4) for q in range(n)])
            _expect_equal(buf, _reduce(stack, op, dtype), f"all_reduce {op} {dtype} m={m}")
        if op in ("sum", "mean"):
            m = 5
            inp = _data(r, m * n, dtype, salt=5)
            out = torch.empty(m, dtype=dtype)
            t.reduce_scatter(out, inp, op=op)
            stack = torch.stack([_data(q, m * n, dtype, salt=5) for q in range(n)])
            _expect_equal(out, _reduce(stack, op, dtype).view(n, m)[r], f"reduce_scatter {op} {dtype}")


def _check_mismatch(t: Transport, r: int, n: int) -> dict:
    """Calls that disagree across ranks must raise ValueError on every rank, and leave the
    transport usable."""
    out = {}
    cases = {
        "size": lambda: t.all_gather(torch.empty(n * (4 + (r == 0))), torch.ones(4 + (r == 0))),
        "dtype": lambda: t.all_reduce(torch.ones(4, dtype=torch.float32 if r else torch.float64)),
        "op": lambda: t.broadcast(torch.ones(4)) if r == 0 else t.all_reduce(torch.ones(4)),
        "src": lambda: t.broadcast(torch.ones(4), src=r),
    }
    for name, call in cases.items():
        t.counters.reset()
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        if t.counters.snapshot():
            raise AssertionError(f"mismatched {name} call was counted: {t.counters.snapshot()}")
        x = torch.ones(3)
        t.all_reduce(x)
        _expect_equal(x, torch.full((3,), float(n)), f"all_reduce after mismatched {name}")
    return out


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size,per_node", LAYOUTS)
def test_collectives(backend, world_size, per_node):
    reports = run_world(
        _collectives_world, world_size, backend=backend, ranks_per_node=per_node,
        args=(per_node or world_size,), timeout=180,
    )
    assert len(reports) == world_size
    for rank, rep in enumerate(reports):
        errs = rep["errors"]
        assert errs["complex"][0] == "TypeError" and "complex64" in errs["complex"][1]
        assert errs["rs_max"][0] == "ValueError"
        assert errs["ag_out_size"][0] == "ValueError"
        if world_size > 1:  # a 1-rank world returns before the backend sees the op
            assert errs["int_mean_all_reduce"][0] == "TypeError" and "int64" in errs["int_mean_all_reduce"][1]
            assert errs["int_mean_reduce_scatter"][0] == "TypeError" and "int32" in errs["int_mean_reduce_scatter"][1]
            for case, msg in rep["mismatch"].items():
                assert msg is not None, f"rank {rank}: mismatched {case} did not raise"
                assert "disagree" in msg, msg
    if per_node == 2:  # the worked example of [Note: what is counted]: 2 nodes x 2 ranks
        n = 6 * 4
        assert all(rep["wire"]["all_gather"] == (1, 4 * n, n, 2 * n) for rep in reports)


def _dead_peer_world(t: Transport, mode: str, timeout_s: float):
    t.all_reduce(torch.ones(4))  # everyone is up
    return lose_peer(t, mode, timeout_s, lambda: t.all_reduce(torch.ones(1000)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend,mode",
    [("torch", "exit"), ("torch", "hang"), pytest.param("mpi", "exit", marks=[*needs_mpi, pytest.mark.slow], id="mpi-exit")],
)
def test_dead_peer_raises_within_timeout(backend, mode):
    timeout_s = 5.0
    results = run_world(
        _dead_peer_world, 3, backend=backend, args=(mode, timeout_s),
        transport_kwargs={"timeout_s": timeout_s}, timeout=60,
    )
    # gloo: the peer's sockets close when it exits; MPI and a hung peer: the timeout
    assert_peers_saw_loss(results, timeout_s, sockets_close=backend == "torch" and mode == "exit")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_mpi, id="mpi")])
def test_mpi_world_mismatch_is_a_clear_error(_):
    """torchrun-style environment (WORLD_SIZE=2) but a lone MPI process: refuse, saying why."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "ZPP_RANKS_PER_NODE")}
    env.update(WORLD_SIZE="2", RANK="0", PYTHONPATH=str(ROOT))
    code = "from zpp.comm.registry import get_transport; get_transport('mpi')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr and "WORLD_SIZE=2" in proc.stderr and "mpiexec" in proc.stderr, proc.stderr
