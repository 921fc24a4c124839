"""The MPI transport's point-to-point reduce_scatter ([Note: MPI ring reduce-scatter] in
zpp/comm/mpi_backend.py) against MPICH's own collective and an fp64 reference: sizes of one
piece and of many, odd slices, worlds 2, 3 and 2 x 2, every dtype it takes, sum and mean."""
import pytest
import torch

from tests.dist import needs_mpi, run_world

pytestmark = needs_mpi

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bfloat16, torch.float16]


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1009 * rank + n + 7 * DTYPES.index(dtype))
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    hi = 256 if dtype == torch.uint8 else 2**31 - 1  # large ints: the sums wrap, as MPI's do
    return torch.randint(0, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _check(t, sizes):
    """For each slice size and dtype: the ring's result, MPICH's, and the fp64 reference."""
    from zpp.comm import mpi_backend

    n, r = t.world_size, t.rank
    out = []
    for m in sizes:
        for dtype in DTYPES:
            ops = ("sum", "mean") if dtype.is_floating_point else ("sum",)
            for op in ops:
                inp = _input(r, n * m, dtype)
                got = {}
                for ring in (True, False):
                    t.ring = ring
                    o = torch.full((m,), 7, dtype=dtype)  # poisoned
                    t.reduce_scatter(o, inp.clone(), op=op)
                    got[ring] = o
                t.ring = True
                stack = torch.stack([_input(q, n * m, dtype) for q in range(n)])
                if dtype.is_floating_point:
                    ref = stack.double().sum(0).view(n, m)[r]
                    if op == "mean":
                        ref = ref / n
                    tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(dtype, 8e-3)
                    err = ((got[True].double() - ref).abs() / ref.abs().clamp_min(1)).max().item() if m else 0.0
                    ok = err <= tol
                    if dtype in (torch.bfloat16, torch.float16):  # one rounding of the fp32 sum
                        want = (stack.float().sum(0) / (n if op == "mean" else 1)).to(dtype).view(n, m)[r]
                        ok = ok and torch.equal(got[True], want)
                else:
                    want = stack.sum(0).to(dtype).view(n, m)[r]  # wraps like the ring's adds
                    ok = torch.equal(got[True], want) and torch.equal(got[False], want)
                    err = 0.0
                out.append((m, str(dtype), op, ok, err, torch.allclose(got[True].double(), got[False].double(),
                                                                      rtol=1e-2, atol=1e-2)))
    assert mpi_backend.RING_PIECE_BYTES * 3 < max(sizes) * 4  # the big size runs in several pieces
    return out


@pytest.mark.parametrize("world,per_node", [(2, None), (3, None), (4, 2)], ids=["w2", "w3", "2x2"])
def test_ring_reduce_scatter_matches_reference(world, per_node):
    results = run_world(_check, world, backend="mpi", ranks_per_node=per_node, args=([0, 1, 13, 60_001],),
                        timeout=240)
    for rank, rows in enumerate(results):
        bad = [row for row in rows if not (row[3] and row[5])]
        assert not bad, f"rank {rank}: {bad}"


def test_ring_env_switch():
    from zpp.comm.mpi_backend import ring_from_env

    assert ring_from_env({}) and ring_from_env({"ZPP_MPI_RING": "1"})
    assert not ring_from_env({"ZPP_MPI_RING": "0"}) and not ring_from_env({"ZPP_MPI_RING": "off"})
