"""``Transport.all_gather_async`` on both transports, at worlds 2, 4 and 2 nodes x 2: results
equal the blocking all-gather's, wire counters equal too, works in flight overlap blocking
calls, misuse raises (double wait, touching an output in flight), the quantized all-gather
started asynchronously equals the blocking one, and a dead peer raises TimeoutError inside
``wait()`` (see [Note: asynchronous collectives] in :mod:`zpp.comm.transport`)."""
from __future__ import annotations


import pytest
import torch

from tests.dist import BACKENDS, lose_peer, needs_mpi, run_world
from zpp.comm.faults import REPORT_WINDOW_S
from zpp.comm.collectives import quantized_all_gather, quantized_all_gather_async
from zpp.comm.transport import Transport

LAYOUTS = [pytest.param(2, None, id="2"), pytest.param(4, None, id="4"), pytest.param(4, 2, id="2x2")]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def _data(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + 31 * rank + n)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(0, 200, (n,), generator=g).to(dtype)


def _stack(n: int, world: int, dtype, salt: int) -> torch.Tensor:
    return torch.cat([_data(q, n, dtype, salt) for q in range(world)])


def _async_world(t: Transport, per_node: int) -> dict:
    r, W = t.rank, t.world_size
    rep: dict = {}
    # results, several works in flight across blocking calls, waited in order
    for k, dtype in enumerate(DTYPES):
        outs, works = [], []
        for salt, n in ((1, 7), (2, 4099)):
            out = torch.empty(W * n, dtype=dtype)
            works.append(t.all_gather_async(out, _data(r, n, dtype, salt + 10 * k)))
            outs.append((out, n, salt + 10 * k))
        x = torch.ones(5)
        t.all_reduce(x)  # a blocking collective while both are in flight
        if not torch.equal(x, torch.full((5,), float(W))):
            raise AssertionError(f"all_reduce between async gathers: {x}")
        if len(t.inflight) != 2 or not all(w.asynchronous for w in works):
            raise AssertionError(f"in flight: {t.inflight}")
        for w, (out, n, salt) in zip(works, outs):
            w.wait()
            if not torch.equal(out, _stack(n, W, dtype, salt)):
                raise AssertionError(f"all_gather_async {dtype} n={n} rank {r}")
    if t.inflight:
        raise AssertionError(f"still in flight after wait: {t.inflight}")
    # wire counters: the same booking as the blocking all_gather
    book = {}
    for name, call in (("async", t.all_gather_async), ("blocking", t.all_gather)):
        t.counters.reset()
        w = call(torch.empty(6 * W), torch.ones(6))
        if w is not None:
            w.wait()
        s = t.counters.snapshot()["all_gather"]
        book[name] = (s.calls, s.logical_bytes, s.intra_bytes, s.inter_bytes)
    rep["wire"] = book
    # misuse: waiting twice; touching an output still in flight
    errors = {}
    out = torch.empty(3 * W)
    w = t.all_gather_async(out, torch.full((3,), float(r)))
    try:
        t.all_reduce(out[:3])
        errors["overlap"] = None
    except RuntimeError as e:
        errors["overlap"] = str(e)
    w.wait()
    if not torch.equal(out, torch.arange(W).float().repeat_interleave(3)):
        raise AssertionError(f"after a refused overlapping call: {out}")
    # the same for works composed over the world: the quantized all-gather, and the two-hop one
    from zpp.comm.collectives import hierarchical_all_gather_async
    from zpp.comm.topology import topology_of

    for name, start in (("overlap quantized", lambda o: quantized_all_gather_async(
                            o, torch.full((4,), float(r)), transport=t, bits=8, group_size=4)),
                        ("overlap two-hop", lambda o: hierarchical_all_gather_async(
                            o, torch.full((4,), float(r)), topology=topology_of(t)))):
        out = torch.empty(4 * W)
        w = start(out)
        if w not in t.inflight:
            raise AssertionError(f"{name}: {w!r} is not in the world's works in flight {t.inflight}")
        try:
            t.all_reduce(out[4:8])
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
        w.wait()
        if t.inflight or not torch.equal(out, torch.arange(W).float().repeat_interleave(4)):
            raise AssertionError(f"{name}: after a refused overlapping call: {out}, {t.inflight}")
    try:
        w.wait()
        errors["twice"] = None
    except RuntimeError as e:
        errors["twice"] = str(e)
    try:
        t.all_gather_async(torch.empty(3 * W + 1), torch.ones(3))
        errors["size"] = None
    except ValueError as e:
        errors["size"] = str(e)
    rep["errors"] = errors
    # qwZ started asynchronously == blocking, bytes included
    for dtype in (torch.float32, torch.bfloat16):
        shard = _data(r, 1000, dtype, 99)
        a, b = torch.empty(W * 1000, dtype=dtype), torch.empty(W * 1000, dtype=dtype)
        t.counters.reset()
        quantized_all_gather(a, shard, transport=t, bits=8, group_size=256)
        s1 = t.counters.snapshot()
        t.counters.reset()
        w = quantized_all_gather_async(b, shard, transport=t, bits=8, group_size=256)
        x = torch.ones(2)
        t.all_reduce(x)
        w.wait()
        s2 = t.counters.snapshot()
        s2.pop("all_reduce")
        if not torch.equal(a, b) or s1 != s2:
            raise AssertionError(f"quantized async {dtype}: {s1} vs {s2}")
    # a sub-transport (one node's ranks) in flight next to a world collective
    if per_node < W:
        from zpp.comm.topology import topology_of

        topo = topology_of(t)
        out = torch.empty(per_node * 9)
        w = topo.intra.all_gather_async(out, torch.full((9,), float(r)))
        x = torch.ones(3)
        t.all_reduce(x)
        w.wait()
        node = r // per_node
        want = torch.arange(node * per_node, (node + 1) * per_node).float().repeat_interleave(9)
        if not torch.equal(out, want):
            raise AssertionError(f"intra async: {out} want {want}")
    t.barrier()
    return rep


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size,per_node", LAYOUTS)
def test_all_gather_async(backend, world_size, per_node):
    reps = run_world(_async_world, world_size, backend=backend, ranks_per_node=per_node,
                     args=(per_node or world_size,), timeout=150)
    k = 6 * 4
    for rank, rep in enumerate(reps):
        assert rep["wire"]["async"] == rep["wire"]["blocking"], rep["wire"]
        p = per_node or world_size
        assert rep["wire"]["async"] == (1, k * world_size, k * (p - 1), k * (world_size - p)), rep["wire"]
        errs = rep["errors"]
        for key in ("overlap", "overlap quantized", "overlap two-hop"):
            assert errs[key] and "wait() that work" in errs[key], (key, errs)
        assert errs["twice"] and "already waited" in errs["twice"], errs
        assert errs["size"] and "expected world_size*inp" in errs["size"], errs


def _one_rank(t: Transport) -> tuple:
    out = torch.empty(4)
    w = t.all_gather_async(out, torch.arange(4.0))
    w.wait()
    return torch.equal(out, torch.arange(4.0)), w.asynchronous, len(t.inflight)


def test_one_rank_completes_at_once():
    assert run_world(_one_rank, 1, timeout=60) == [(True, False, 0)]


def _dead_peer_world(t: Transport, mode: str, timeout_s: float):
    t.all_reduce(torch.ones(4))  # everyone is up
    return lose_peer(t, mode, timeout_s, lambda: t.all_gather_async(torch.empty(2000), torch.ones(1000)).wait())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,mode", [("torch", "hang"), pytest.param("mpi", "exit", marks=[*needs_mpi, pytest.mark.slow], id="mpi")])
def test_dead_peer_raises_in_wait(backend, mode):
    timeout_s = 4.0
    results = run_world(_dead_peer_world, 2, backend=backend, args=(mode, timeout_s),
                        transport_kwargs={"timeout_s": timeout_s, "check_metadata": False}, timeout=60)
    kind, elapsed, msg = results[0]
    assert kind == "TimeoutError", (kind, msg)
    assert timeout_s - 0.5 <= elapsed < timeout_s + REPORT_WINDOW_S + 4, elapsed  # the fault channel's window
    assert "all_gather" in msg and "rank 0" in msg, msg
    assert "no report within 3 s from rank 1" in msg, msg  # the peer that left never reported
