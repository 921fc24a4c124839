"""The gloo duplex path of the torch transport (see [Note: gloo duplex pairs] in
:mod:`zpp.comm.torch_backend`): all_to_all and reduce_scatter as point-to-point exchanges
split over two process groups, checked against gloo's own ops on the same ranks.

Each world function flips ``transport.gloo_duplex`` to run every call both ways and compares
the results. Inputs come in two kinds: "exact" floats (multiples of 1/4 in [-4, 4], whose
sums over <= 4 ranks are exact even in bf16, so every summation order gives the same bits)
and "random" floats (randn), where the ring's order of additions may differ from gloo's in
the last bits of fp32 and the bf16 path must equal the fp32 sum rounded once.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import zpp.comm.torch_backend as torch_backend
from tests.dist import assert_peers_saw_loss, lose_peer, run_world
from zpp.comm.topology import topology_of
from zpp.comm.torch_backend import TorchTransport, duplex_from_env
from zpp.comm.transport import Transport

SIZES = (1, 7, 13)  # elements per rank's slice: odd sizes
SUM_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
MEAN_DTYPES = (torch.float32, torch.bfloat16)
MOVE_DTYPES = SUM_DTYPES + (torch.float16, torch.uint8, torch.bool)
_CODES = {dtype: code for code, dtype in enumerate(MOVE_DTYPES)}


# ---------------------------------------------------------------------- inputs
def _data(rank: int, n: int, dtype: torch.dtype, salt: int, kind: str = "exact") -> torch.Tensor:
    """Rank ``rank``'s input of ``n`` elements; any rank can regenerate any rank's."""
    g = torch.Generator().manual_seed(1_000_003 * salt + 7919 * rank + 31 * n + _CODES[dtype])
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if not dtype.is_floating_point:
        lo, hi = max(torch.iinfo(dtype).min, -(2**40)), min(torch.iinfo(dtype).max, 2**40)
        return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)
    if kind == "exact":
        return (torch.randint(-16, 17, (n,), generator=g).to(torch.float64) / 4).to(dtype)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (1 + rank)).to(dtype)


def _both(t: Transport, call) -> tuple[torch.Tensor, torch.Tensor]:
    """``call()`` on the duplex path, then on gloo's own ops (whose list-based fallbacks
    must agree with them)."""
    t.gloo_duplex = True
    new = call()
    t.gloo_duplex = False
    try:
        old = call()
        t.prefer_single_tensor = False
        _same(call(), old, "gloo's list-based fallback against its single-tensor op")
    finally:
        t.gloo_duplex = True
        t.prefer_single_tensor = True
    return new, old


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else None
        raise AssertionError(
            f"{what}: got {got.dtype} {tuple(got.shape)} {got.tolist()[:8]}, want {want.dtype} "
            f"{tuple(want.shape)} {want.tolist()[:8]} (max |diff| {diff})"
        )


def _check_all_to_all(t: Transport, what: str) -> None:
    r, n = t.rank, t.world_size
    for dtype in MOVE_DTYPES:
        for m in SIZES + (0,):
            def call(dtype=dtype, m=m):
                out = torch.full((n * m,), 3, dtype=dtype)
                t.all_to_all(out, _data(r, n * m, dtype, salt=1, kind="random"))
                return out
            new, old = _both(t, call)
            _same(new, old, f"{what}: all_to_all {dtype} m={m}")
            want = torch.cat([_data(q, n * m, dtype, salt=1, kind="random").view(n, m)[r] for q in range(n)])
            _same(new, want, f"{what}: all_to_all {dtype} m={m} against the inputs")


def _check_reduce_scatter(t: Transport, what: str, sizes=SIZES) -> None:
    r, n = t.rank, t.world_size
    for op, dtypes in (("sum", SUM_DTYPES), ("mean", MEAN_DTYPES)):
        for dtype in dtypes:
            for m in sizes:
                def call(dtype=dtype, m=m, kind="exact"):
                    out = torch.full((m,), 3, dtype=dtype)
                    t.reduce_scatter(out, _data(r, n * m, dtype, salt=2 + m, kind=kind), op=op)
                    return out
                new, old = _both(t, call)
                _same(new, old, f"{what}: reduce_scatter {op} {dtype} m={m} (exact inputs)")
                if not dtype.is_floating_point:
                    continue
                # random inputs: the duplex path against its own definition, gloo's within rounding
                new, old = _both(t, lambda dtype=dtype, m=m: call(dtype, m, "random"))
                stack = torch.stack([_data(q, n * m, dtype, salt=2 + m, kind="random") for q in range(n)])
                mine = stack.view(n, n, m)[:, r]
                if dtype == torch.bfloat16:  # fp32 accumulation, one rounding
                    total = mine.sum(0, dtype=torch.float32)
                    want = (total / n if op == "mean" else total).to(dtype)
                    _same(new, want, f"{what}: reduce_scatter {op} bf16 m={m} (fp32 sum rounded once)")
                    tol = dict(rtol=2 ** -7 * n, atol=2 ** -7 * float(mine.abs().sum(0).max()))
                else:
                    tol = dict(rtol=1e-6 * n, atol=1e-6 * float(mine.abs().sum(0).max()))
                exact = mine.double().sum(0) / (n if op == "mean" else 1)
                for name, got in (("duplex", new), ("gloo", old)):
                    torch.testing.assert_close(
                        got.double(), exact, **tol, msg=lambda s, name=name: f"{what}: {name} {op} {dtype} m={m}: {s}"
                    )


def _check(t: Transport, what: str) -> None:
    _check_all_to_all(t, what)
    _check_reduce_scatter(t, what)
    # the ring in pieces (8 bytes: one to 13 pieces a slice; 1000 elements: the 64-piece cap)
    saved = torch_backend.RING_PIECE_BYTES
    torch_backend.RING_PIECE_BYTES = 8
    try:
        _check_reduce_scatter(t, f"{what} (ring in pieces)", sizes=(13, 1000))
    finally:
        torch_backend.RING_PIECE_BYTES = saved
    if t._companions.reverse is None:
        raise AssertionError(f"{what}: the duplex path ran without a reverse group")


# ---------------------------------------------------------------------- world functions
def _flat_world(t: Transport) -> float:
    start = time.perf_counter()
    if not t.gloo_duplex or t._companions.reverse is not None:
        raise AssertionError(f"fresh world: gloo_duplex={t.gloo_duplex}, reverse group {t._companions.reverse}")
    _check(t, f"world of {t.world_size}")
    return time.perf_counter() - start


def _two_by_two_world(t: Transport) -> dict:
    topo = topology_of(t)
    _check(t, "world 2x2")
    _check(topo.intra, f"intra {topo.intra.ranks}")
    _check(topo.inter, f"inter {topo.inter.ranks}")
    t.barrier()  # no rank leaves while another may still be connecting a sub-group
    return {"intra": topo.intra.ranks, "inter": topo.inter.ranks}


def _directions_world(t: Transport) -> list:
    """Record the process group of every send and receive of one duplex call of each op."""
    r = t.rank
    seen: list = []
    isend, irecv = dist.isend, dist.irecv

    def spy(kind, real):
        def wrapped(tensor, *args, group=None, **kwargs):
            peer = kwargs.get("group_dst", kwargs.get("group_src"))
            if peer is None:
                peer = dist.get_group_rank(group, kwargs.get("dst", kwargs.get("src")))
            seen.append((kind, peer, "fwd" if group is t.group else "rev" if group is t._companions.reverse else "other"))
            return real(tensor, *args, group=group, **kwargs)
        return wrapped

    dist.isend, dist.irecv = spy("send", isend), spy("recv", irecv)
    try:
        t.all_to_all(torch.empty(4 * t.world_size), torch.ones(4 * t.world_size))
        t.reduce_scatter(torch.empty(4), torch.ones(4 * t.world_size), op="sum")
        bf16 = torch.bfloat16
        t.reduce_scatter(torch.empty(4, dtype=bf16), torch.ones(4 * t.world_size, dtype=bf16), op="sum")
    finally:
        dist.isend, dist.irecv = isend, irecv
    for kind, peer, which in seen:
        low, high = (r, peer) if kind == "send" else (peer, r)  # (sender, receiver)
        want = "fwd" if low < high else "rev"
        if which != want:
            raise AssertionError(f"rank {r}: {kind} with peer {peer} went on {which}, want {want}: {seen}")
    return seen


def _switched_off_world(t: Transport) -> dict:
    """ZPP_GLOO_DUPLEX=0: gloo's own ops, and no reverse group anywhere."""
    n = t.world_size
    out = torch.empty(2 * n)
    t.all_to_all(out, torch.arange(2 * n, dtype=torch.float32) + 100 * t.rank)
    rs = torch.empty(2)
    t.reduce_scatter(rs, torch.ones(2 * n), op="sum")
    topo = topology_of(t)
    topo.intra.all_to_all(torch.empty(2 * topo.intra.world_size), torch.ones(2 * topo.intra.world_size))
    t.barrier()  # no rank leaves while another may still be connecting a sub-group
    return {
        "flag": t.gloo_duplex,
        "reverse": [x._companions.reverse is not None for x in (t, topo.intra, topo.inter)],
        "rs": rs.tolist(),
        "a2a": out.tolist(),
    }


def _dead_peer_world(t: Transport, op: str, mode: str, timeout_s: float) -> tuple | None:
    n = t.world_size
    t.all_to_all(torch.empty(4 * n), torch.ones(4 * n))  # everyone is up; the reverse group exists
    t.reduce_scatter(torch.empty(4), torch.ones(4 * n))
    if op == "all_to_all":
        return lose_peer(t, mode, timeout_s, lambda: t.all_to_all(torch.empty(1000 * n), torch.ones(1000 * n)))
    return lose_peer(t, mode, timeout_s, lambda: t.reduce_scatter(torch.empty(1000), torch.ones(1000 * n)))


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_duplex_equals_gloo(world_size):
    run_world(_flat_world, world_size, backend="torch", timeout=180)


@pytest.mark.timeout(200)
def test_duplex_equals_gloo_on_sub_transports():
    got = run_world(_two_by_two_world, 4, backend="torch", ranks_per_node=2, timeout=180)
    assert [g["intra"] for g in got] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [g["inter"] for g in got] == [(0, 2), (1, 3), (0, 2), (1, 3)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_each_direction_has_its_own_group(world_size):
    seen = run_world(_directions_world, world_size, backend="torch", timeout=100)
    for rank, calls in enumerate(seen):
        peers = {p for _, p, _ in calls}
        assert peers == set(range(world_size)) - {rank}, (rank, calls)  # the all_to_all reached everyone
        assert {w for _, _, w in calls} == {"fwd", "rev"}, (rank, calls)  # every rank sends up and down


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "env,kwargs", [({"ZPP_GLOO_DUPLEX": "0"}, {}), ({}, {"gloo_duplex": False})], ids=["env", "kwarg"]
)
def test_switch_off(env, kwargs):
    got = run_world(
        _switched_off_world, 4, backend="torch", ranks_per_node=2, env=env, transport_kwargs=kwargs, timeout=100
    )
    for rank, g in enumerate(got):
        assert g["flag"] is False
        assert g["reverse"] == [False, False, False], g
        assert g["rs"] == [4.0, 4.0]
        assert g["a2a"] == [float(100 * q + 2 * rank + k) for q in range(4) for k in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exit", pytest.param("hang", marks=pytest.mark.slow)])  # a hang waits out the timeout: 8 s
@pytest.mark.parametrize("op", ["all_to_all", "reduce_scatter"])
def test_dead_peer_raises(op, mode):
    timeout_s = 5.0
    results = run_world(
        _dead_peer_world, 3, backend="torch", args=(op, mode, timeout_s),
        transport_kwargs={"timeout_s": timeout_s}, timeout=60,
    )
    assert_peers_saw_loss(results, timeout_s, sockets_close=mode == "exit")


def _disagreeing_world(t: Transport) -> str | None:
    """Ranks that read different ZPP_GLOO_DUPLEX values fail at init, all of them, not later."""
    env = {**os.environ, "ZPP_GLOO_DUPLEX": "0" if t.rank == 0 else "1"}
    try:
        TorchTransport.init(env=env)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_ranks_disagreeing_on_the_switch_raise():
    got = run_world(_disagreeing_world, 3, backend="torch", timeout=100)
    for msg in got:
        assert msg is not None and "gloo_duplex" in msg and "disagree" in msg, msg


def test_duplex_env_values():
    assert duplex_from_env({}) is True
    assert duplex_from_env({"ZPP_GLOO_DUPLEX": "1"}) is True
    assert duplex_from_env({"ZPP_GLOO_DUPLEX": " Off "}) is False
    assert duplex_from_env({"ZPP_GLOO_DUPLEX": "0"}) is False
    with pytest.raises(ValueError, match="ZPP_GLOO_DUPLEX"):
        duplex_from_env({"ZPP_GLOO_DUPLEX": "maybe"})
