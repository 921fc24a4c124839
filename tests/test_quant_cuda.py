"""The CUDA kernels (zpp.quant.cuda) against the plain-torch reference, bit for bit.

Every kernel runs on the GPU and its result is compared with zpp.quant.reference computed
on CPU copies of the same inputs: payload bytes exactly, floats by their bits (NaN where the
reference has NaN, and then the canonical quiet NaN). Every output buffer the kernels
allocate is first filled with a poison byte (two different ones, each call made twice), so
an element a kernel forgets to write fails the comparison.

Skipped, with the reason, where there is no CUDA device or no cupy.
"""
from __future__ import annotations

import pytest
import torch

from zpp.quant import reference
from zpp.quant.api import reduce_scatter_chunk


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a cupy that cannot load its CUDA libraries
        return f"needs cupy (import cupy failed: {type(exc).__name__}: {exc})"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp32", "fp16", "bf16")
POISONS = (0xFF, 0x5A)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}
_CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0,
                  torch.float64: 0x7FF8000000000000}


@pytest.fixture(scope="module")
def K():
    from zpp.quant import cuda

    return cuda.kernels()


@pytest.fixture
def poisoned(monkeypatch):
    """poisoned(fn) -> [fn() with outputs pre-filled with each poison byte]."""
    from zpp.quant import cuda

    def run(fn):
        results = []
        for byte in POISONS:
            def alloc(shape, dtype, device, _byte=byte):
                t = torch.empty(shape, dtype=dtype, device=device)
                if t.numel():
                    t.view(torch.uint8).fill_(_byte)
                return t

            monkeypatch.setattr(cuda, "_alloc", alloc)
            results.append(fn())
            torch.cuda.synchronize()
        monkeypatch.undo()
        return results

    return run


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same shape and dtype; same bytes (uint8) or same float bits, NaN positions matching and
    the kernel's NaNs canonical."""
    assert got.is_cuda, f"{what}: result not on the GPU"
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.reshape(-1), want.reshape(-1)
    if got.dtype == torch.uint8:
        bad = (g != w).nonzero().flatten()
        assert bad.numel() == 0, (
            f"{what}: {bad.numel()} of {g.numel()} bytes differ, first at "
            f"{bad[:8].tolist()}: got {g[bad[:8]].tolist()} want {w[bad[:8]].tolist()}"
        )
        return
    gn, wn = torch.isnan(g), torch.isnan(w)
    bad = (gn != wn).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: NaN positions differ at {bad[:8].tolist()}: got {g[bad[:8]].tolist()} "
        f"want {w[bad[:8]].tolist()}"
    )
    gi, wi = g.view(_INT_VIEW[got.dtype]), w.view(_INT_VIEW[got.dtype])
    bad = ((gi != wi) & ~gn).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {g.numel()} values differ, first at {bad[:8].tolist()}: "
        f"got {g[bad[:8]].tolist()} want {w[bad[:8]].tolist()}"
    )
    noncanon = (gn & (gi != _CANONICAL_NAN[got.dtype])).nonzero().flatten()
    assert noncanon.numel() == 0, f"{what}: non-canonical NaN bits (unwritten?) at {noncanon[:8].tolist()}"


def _plus_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t == 0, torch.zeros_like(t), t)


def assert_quantized(got, want, what: str) -> None:
    assert_bits(got[0], want[0], f"{what} payload")
    if want[1].dim() == 2:
        # Asymmetric: the reference's amin/amax do not define which zero they return when a
        # group's extreme is a zero of either sign (the kernels give +0), so the sign of a zero
        # scale or offset is not compared.
        assert_bits(_plus_zero(got[1]), _plus_zero(want[1]), f"{what} scales")
    else:
        assert_bits(got[1], want[1], f"{what} scales")


def _random(n: int, dtype: torch.dtype, seed: int, shift: float = 0.0) -> torch.Tensor:
    g = _gen(seed)
    scale = 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
    x = torch.randn(n, generator=g) * scale + shift * scale
    # a few groups of another magnitude
    if n > 64:
        x[: n // 7] *= 1e-3
    return x.to(dtype)


def _cuda(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """x on the GPU; with offset > 0, a view that starts `offset` elements into a buffer (so the
    kernels see a misaligned pointer)."""
    if not offset:
        return x.cuda()
    buf = torch.zeros(x.numel() + offset, dtype=x.dtype, device="cuda")
    buf[offset:] = x.cuda()
    return buf[offset:]


# -- quantize -------------------------------------------------------------------------------

QUANT_CASES = [
    # (numel, group_size, input offset in elements)
    (1, 2, 0),
    (7, 6, 0),
    (333, 10, 0),  # group_size % 8 != 0: scalar paths
    (130, 130, 1),
    (1000, 64, 0),
    (1000, 64, 1),  # misaligned input
    (2048, 2048, 0),
    (4097, 2048, 0),
    (10001, 256, 0),
    (5000, 4096, 0),
    (3 * 8192 + 5, 8192, 0),  # 1024 chunks per group: 4 kept per thread
    (40003, 20002, 0),  # more chunks than kept in registers: re-read
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
@pytest.mark.parametrize("n,group_size,offset", QUANT_CASES)
def test_quantize_random(K, poisoned, dtype, bits, symmetric, n, group_size, offset):
    x = _random(n, dtype, seed=n + group_size, shift=0.0 if symmetric else 2.0)
    want = reference.quantize(x, bits, group_size, symmetric)
    xc = _cuda(x, offset)
    for i, got in enumerate(poisoned(lambda: K.quantize(xc, bits, group_size, symmetric))):
        assert_quantized(got, want, f"quantize run {i}")


def _special_groups(bits: int, symmetric: bool, group_size: int) -> torch.Tensor:
    """Groups of special values (fp32), the last one partial."""
    g = _gen(7)
    qmax = (1 << (bits - 1)) - 1
    levels = (1 << bits) - 1
    groups = []

    def fill(vals):
        v = torch.tensor(vals, dtype=torch.float32)
        out = torch.randn(group_size, generator=g) * 0.1
        out[: v.numel()] = v
        return out

    groups.append(torch.zeros(group_size))  # zero group
    groups.append(fill([1.0, float("nan"), 2.0]))
    groups.append(fill([float("inf"), 1.0]))
    groups.append(fill([-1.0, float("-inf")]))
    groups.append(fill([float("nan"), float("inf"), float("-inf")]))
    groups.append(torch.full((group_size,), 5.0))  # constant: asymmetric scale 0
    groups.append(fill([3e38, -3e38]))  # asymmetric range overflows
    groups.append(torch.randn(group_size, generator=g) * 1e-40)  # subnormals
    groups.append(fill([1e-44]))  # scale underflows to a subnormal or zero
    if symmetric:  # scale exactly 1: quotients on .5 ties
        ties = [float(qmax)] + [k + 0.5 for k in range(-qmax, qmax)]
    else:
        ties = [0.0, float(levels)] + [k + 0.5 for k in range(levels)]
    t = torch.tensor(ties, dtype=torch.float32)
    groups.append(t.repeat(-(-group_size // t.numel()))[:group_size].clone())
    groups[-1][0], groups[-1][1] = ties[0], ties[1]
    x = torch.cat(groups)
    return torch.cat([x, fill([float("nan")])[: group_size // 2 + 1]])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
@pytest.mark.parametrize("group_size", (64, 6, 512))
def test_quantize_special(K, poisoned, dtype, bits, symmetric, group_size):
    x = _special_groups(bits, symmetric, group_size).to(dtype)
    want = reference.quantize(x, bits, group_size, symmetric)
    xc = x.cuda()
    for i, got in enumerate(poisoned(lambda: K.quantize(xc, bits, group_size, symmetric))):
        assert_quantized(got, want, f"quantize run {i}")


@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
def test_quantize_empty(K, symmetric):
    x = torch.empty(0, device="cuda")
    data, scales = K.quantize(x, 8, 64, symmetric)
    want = reference.quantize(x.cpu(), 8, 64, symmetric)
    assert data.shape == want[0].shape and scales.shape == want[1].shape


# -- dequantize ------------------------------------------------------------------------------

DEQUANT_CASES = [(1, 2, 0), (7, 6, 0), (333, 10, 0), (1000, 64, 0), (1000, 64, 1), (4097, 2048, 0), (10001, 256, 0)]


def _random_payload(n: int, bits: int, group_size: int, symmetric: bool, seed: int):
    g = _gen(seed)
    groups = -(-n // group_size)
    data = torch.randint(0, 256, (groups * group_size * bits // 8,), generator=g, dtype=torch.uint8)
    scales = torch.randn(groups if symmetric else groups * 2, generator=g) * 0.05
    specials = [0.0, float("nan"), float("inf"), -1.0, 1e-40, 3e38]
    for i, v in enumerate(specials[: scales.numel() // 2]):
        scales[2 * i + 1] = v
    return data, (scales if symmetric else scales.view(groups, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
@pytest.mark.parametrize("n,group_size,offset", DEQUANT_CASES)
def test_dequantize(K, poisoned, dtype, bits, symmetric, n, group_size, offset):
    data, scales = _random_payload(n, bits, group_size, symmetric, seed=n * 3 + bits)
    want = reference.dequantize(data, scales, n, bits, group_size, symmetric, dtype)
    dc, sc = _cuda(data, offset), scales.cuda().reshape(-1)
    for i, got in enumerate(poisoned(lambda: K.dequantize(dc, sc, n, bits, group_size, symmetric, dtype))):
        assert_bits(got, want, f"dequantize run {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
def test_round_trip(K, dtype, bits, symmetric):
    x = _random(5000, dtype, seed=11)
    q = K.quantize(x.cuda(), bits, 256, symmetric)
    got = K.dequantize(q[0], q[1], x.numel(), bits, 256, symmetric, dtype)
    want = reference.dequantize(*reference.quantize(x, bits, 256, symmetric), x.numel(), bits, 256, symmetric, dtype)
    assert_bits(got, want, "round trip")


def test_dequantize_empty(K):
    d = torch.empty(0, dtype=torch.uint8, device="cuda")
    s = torch.empty(0, dtype=torch.float32, device="cuda")
    assert K.dequantize(d, s, 0, 8, 64, True, torch.float16).shape == (0,)


# -- reduce_sum ------------------------------------------------------------------------------

REDUCE_CASES = [
    # (slice numel, group_size, divisor, requant group_size for bits 8, for bits 4, NaN input)
    (256, 64, 1.0, 64, 128, True),
    (2048, 2048, None, 2048, 512, False),  # divisor None: k (a mean)
    (42, 6, 0.7, 6, 10, True),  # not multiples of 8: scalar paths
    (1000, 8, 3.0, 8, 200, False),
    (8192, 8192, 1.0, 8192, 16384, False),  # 4 chunks a thread; requant group padded
]
OUT_MODES = ("fp32", "fp16", "bf16", "requant8", "requant4")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
@pytest.mark.parametrize("k", (1, 2, 3, 4))
@pytest.mark.parametrize("case", range(len(REDUCE_CASES)))
@pytest.mark.parametrize("mode", OUT_MODES)
def test_reduce_sum(K, poisoned, bits, symmetric, k, case, mode):
    n, group_size, divisor, rg8, rg4, with_nan = REDUCE_CASES[case]
    divisor = float(k) if divisor is None else divisor
    x = _random(k * n, torch.float32, seed=case * 10 + k, shift=0.0 if symmetric else 1.0)
    if with_nan:
        x[(k - 1) * n + 5] = float("nan")
    data, scales = reference.quantize(x, bits, group_size, symmetric)
    if mode.startswith("requant"):
        rbits = int(mode[len("requant"):])
        rgroup = rg8 if rbits == 8 else rg4
        out_dtype = torch.float32
    else:
        rbits, rgroup = None, None
        out_dtype = dict(zip(OUT_MODES, DTYPES))[mode]
    args = (k, n, bits, group_size, symmetric, divisor, rbits, rgroup, out_dtype)
    want = reference.reduce_sum(data, scales, *args)
    dc, sc = data.cuda(), scales.cuda().reshape(-1)
    for i, got in enumerate(poisoned(lambda: K.reduce_sum(dc, sc, *args))):
        if rbits is None:
            assert_bits(got, want, f"reduce_sum run {i}")
        else:
            assert_quantized(got, want, f"reduce_sum run {i}")


def test_reduce_sum_misaligned_payload(K, poisoned):
    n, k, g = 1024, 3, 64
    x = _random(k * n, torch.float32, seed=5)
    data, scales = reference.quantize(x, 8, g, True)
    want = reference.reduce_sum(data, scales, k, n, 8, g, True, 2.0, 4, 128, torch.float32)
    dc = _cuda(data, 3)
    for got in poisoned(lambda: K.reduce_sum(dc, scales.cuda(), k, n, 8, g, True, 2.0, 4, 128, torch.float32)):
        assert_quantized(got, want, "reduce_sum misaligned")


# -- swizzle_quantize -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("symmetric", (True, False), ids=("sym", "asym"))
@pytest.mark.parametrize("nodes,rpn", [(1, 1), (1, 4), (2, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("n,group_size", [(1000, 64), (4097, 2048), (301, 6)])
def test_swizzle_quantize(K, poisoned, dtype, bits, symmetric, nodes, rpn, n, group_size):
    x = _random(n, dtype, seed=n + nodes * 10 + rpn, shift=0.0 if symmetric else 1.0)
    chunk = reduce_scatter_chunk(n, nodes * rpn, group_size)
    args = (nodes, rpn, chunk, bits, group_size, symmetric)
    want = reference.swizzle_quantize(x, *args)
    xc = x.cuda()
    for i, got in enumerate(poisoned(lambda: K.swizzle_quantize(xc, *args))):
        assert_quantized(got, want, f"swizzle run {i}")


@pytest.mark.parametrize("chunk", (40, 13 * 2))
def test_swizzle_quantize_odd_chunk(K, poisoned, chunk):
    # chunk not a multiple of group_size nor of 8; x shorter than the padded total
    x = _random(3 * 2 * chunk - 7, torch.bfloat16, seed=chunk)
    args = (3, 2, chunk, 4, 6, False)
    want = reference.swizzle_quantize(x, *args)
    xc = _cuda(x, 1)
    for got in poisoned(lambda: K.swizzle_quantize(xc, *args)):
        assert_quantized(got, want, "swizzle odd chunk")


# -- signs -----------------------------------------------------------------------------------

SIGN_NS = (1, 7, 8, 9, 1000, 65537)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIGN_NS)
@pytest.mark.parametrize("offset", (0, 1))
def test_pack_signs(K, poisoned, dtype, n, offset):
    x = torch.randn(n, generator=_gen(n))
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), -1e-30, 1e-30])
    x[: min(n, specials.numel())] = specials[: min(n, specials.numel())]
    x = x.to(dtype)
    want = reference.pack_signs(x)
    xc = _cuda(x, offset)
    for i, got in enumerate(poisoned(lambda: K.pack_signs(xc))):
        assert_bits(got, want, f"pack_signs run {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIGN_NS)
def test_unpack_signs(K, poisoned, dtype, n):
    packed = torch.randint(0, 256, (-(-n // 8),), generator=_gen(n), dtype=torch.uint8)
    want = reference.unpack_signs(packed, n, dtype)
    pc = packed.cuda()
    for i, got in enumerate(poisoned(lambda: K.unpack_signs(pc, n, dtype))):
        assert_bits(got, want, f"unpack_signs run {i}")


def test_signs_empty(K):
    assert K.pack_signs(torch.empty(0, device="cuda")).shape == (0,)
    assert K.unpack_signs(torch.empty(0, dtype=torch.uint8, device="cuda"), 0, torch.float32).shape == (0,)


# -- streams and dispatch ----------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch.cuda, "_sleep"), reason="needs torch.cuda._sleep")
def test_runs_on_the_current_stream(K):
    """A kernel launched under torch.cuda.stream(s) must be ordered after the work queued on s."""
    x_new = _random(1 << 16, torch.float32, seed=3)
    want = reference.quantize(x_new, 8, 256, True)
    x = torch.zeros(1 << 16, device="cuda")
    src = x_new.cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep s busy; the copy below lands after it
        x.copy_(src)
        got = K.quantize(x, 8, 256, True)
    s.synchronize()
    assert_quantized(got, want, "quantize on a side stream")


def test_dispatch_picks_cuda(monkeypatch):
    import zpp.quant as zq
    from zpp.quant import dispatch

    monkeypatch.delenv("ZPP_QUANT_IMPL", raising=False)
    assert dispatch.kernels_for(torch.device("cuda")).NAME == "cuda"
    before = zq.fallback_counts().get("cuda", 0)
    x = _random(3000, torch.bfloat16, seed=1).cuda()
    q = zq.quantize(x, bits=4, group_size=128)
    want = reference.quantize(x.cpu(), 4, 128, True)
    assert_quantized((q.data, q.scales), want, "api quantize")
    assert_bits(zq.dequantize(q), reference.dequantize(*want, 3000, 4, 128, True, torch.bfloat16).view(3000), "api dequantize")
    assert zq.fallback_counts().get("cuda", 0) == before


# -- 1-bit error feedback ([Note: 1-bit kernels] in zpp/quant/reference.py) -------------------

ONEBIT_CASES = [
    # (numel, zero padding of the error buffer, offset of x in elements, offset of the error buffer)
    (0, 8, 0, 0),
    (1, 7, 0, 0),
    (13, 3, 1, 0),
    (1000, 0, 0, 0),
    (2048, 0, 0, 0),  # exactly one block of the sum of squares
    (2049, 7, 0, 0),
    (16384 * 4, 0, 0, 0),  # 32 blocks: a power of two
    (16385, 7, 0, 0),
    (40001, 7, 0, 1),  # misaligned error buffer: scalar paths
    (70000, 16, 3, 0),
    (300 * 2048 + 5, 3, 0, 0),  # 301 blocks: the tree over block sums runs across threads and within them
]


def _onebit_inputs(numel: int, pad: int, dtype: torch.dtype, seed: int):
    g = _gen(seed)
    x = torch.randn(numel, generator=g)
    if numel > 64:  # magnitudes over many decades: the order of the fp64 sum shows in its last bits
        x *= 10.0 ** torch.randint(-6, 7, (numel,), generator=g).float()
    x = x.to(dtype)
    err = torch.zeros(numel + pad)
    err[:numel] = torch.randn(numel, generator=g) * 0.1
    err[numel:] = torch.arange(pad, dtype=torch.float32) + 0.5  # must stay untouched
    return x, err


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel,pad,xoff,eoff", ONEBIT_CASES)
@pytest.mark.parametrize("pending", (None, 0.37), ids=("eager", "lazy"))
def test_onebit_compress(K, poisoned, dtype, numel, pad, xoff, eoff, pending):
    from zpp.quant import cuda

    assert cuda._SUMSQ_BLOCK == reference._SUMSQ_BLOCK
    x, err0 = _onebit_inputs(numel, pad, dtype, seed=numel + pad)
    e_ref = err0.clone()
    p_ref, s_ref = reference.onebit_compress(x, e_ref, numel, pending=pending)
    e_settled = err0[:numel] if pending is None else reference.settle(err0, numel, pending)
    sumsq = reference._sum_squares(x.float() + e_settled) if numel else None
    xc = _cuda(x, xoff)
    buffers = []

    def run():
        e = _cuda(err0, eoff)
        buffers.append(e)
        return K._onebit_compress(xc, e, numel, pending=pending)

    for i, (packed, scale, scratch) in enumerate(poisoned(run)):
        assert_bits(packed, p_ref, f"onebit packed run {i}")
        if numel:  # the oracle's order, bit for bit: the fp64 sum of squares, then the scale
            assert_bits(scratch[:1], sumsq.reshape(1), f"onebit sum of squares run {i}")
        assert_bits(scale, s_ref, f"onebit scale run {i}")
        assert_bits(buffers[i], e_ref, f"onebit error run {i}")


def test_onebit_compress_into_out(K):
    x, err0 = _onebit_inputs(5000, 8, torch.float32, seed=4)
    e_ref, e = err0.clone(), err0.cuda()
    p_ref, s_ref = reference.onebit_compress(x, e_ref, 5000)
    buf = torch.full((700,), 0x5A, dtype=torch.uint8, device="cuda")
    scale = torch.full((2,), float("nan"), device="cuda")
    packed, s = K.onebit_compress(x.cuda(), e, 5000, out=(buf[3:3 + 626], scale[1:]))
    assert packed.data_ptr() == buf[3:].data_ptr() and s.data_ptr() == scale[1:].data_ptr()
    assert_bits(buf[3:629], p_ref, "packed into out")
    assert_bits(buf[:3], torch.full((3,), 0x5A, dtype=torch.uint8), "bytes before out")
    assert_bits(scale[1:], s_ref, "scale into out")
    assert_bits(e, e_ref, "error")
    with pytest.raises(ValueError, match="626 elements"):
        K.onebit_compress(x.cuda(), err0.cuda(), 5000, out=(buf[:600], scale[1:]))


def test_onebit_compress_nonfinite_and_signed_zero(K):
    x = torch.tensor([float("nan"), -0.0, 1.0, -2.0, 0.0, 3.0, -1.0, 2.0, float("inf"), -3.0])
    for dtype in DTYPES:
        e = torch.zeros(16, device="cuda")
        packed, scale = K.onebit_compress(_cuda(x.to(dtype)), e, 10)
        want_p, want_s = reference.onebit_compress(x.to(dtype), torch.zeros(16), 10)
        assert_bits(packed, want_p, f"{dtype} packed")
        assert packed.cpu().tolist() == [0b10110110, 0b11111101]  # NaN -> 0, -0.0 -> 1, padding 1
        assert_bits(scale, want_s, f"{dtype} scale")
        assert torch.isnan(scale.cpu()).all()
        e = e.cpu()
        assert torch.isnan(e[:10]).all() and torch.equal(e[10:], torch.zeros(6))


def test_onebit_compress_rejects_bad_buffers(K):
    x = torch.ones(16, device="cuda")
    with pytest.raises(ValueError, match="float32"):
        K.onebit_compress(x, torch.zeros(16, dtype=torch.float16, device="cuda"), 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.onebit_compress(x, torch.zeros(12, device="cuda"), 12)
    with pytest.raises(ValueError, match="numel=17"):
        K.onebit_compress(x, torch.zeros(24, device="cuda"), 17)


def _weighted_inputs(k: int, chunk: int, seed: int):
    g = _gen(seed)
    packed = torch.randint(0, 256, (k * chunk // 8,), generator=g, dtype=torch.uint8)
    scales = torch.rand(k, generator=g) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
    return packed, scales


@pytest.mark.parametrize("k,chunk,divisor", [(1, 8, 1.0), (2, 64, 2.0), (3, 4104, 3.0), (4, 40000, 4.0),
                                             (5, 1032, 0.7), (7, 65536, 1.0)])
def test_signs_weighted_sum(K, poisoned, k, chunk, divisor):
    packed, scales = _weighted_inputs(k, chunk, seed=k * 131 + chunk)
    want = reference.signs_weighted_sum(packed, scales, chunk, divisor)
    pc, sc = packed.cuda(), scales.cuda()
    for i, got in enumerate(poisoned(lambda: K.signs_weighted_sum(pc, sc, chunk, divisor))):
        assert_bits(got, want, f"signs_weighted_sum run {i}")


def test_signs_weighted_sum_special_scales(K, poisoned):
    packed, _ = _weighted_inputs(4, 64, seed=9)
    for special in ([0.5, -0.0, 3e38, 3e38], [1.0, float("inf"), 2.0, 1.0], [float("nan"), 1.0, 1.0, 1.0]):
        scales = torch.tensor(special)
        want = reference.signs_weighted_sum(packed, scales, 64, 3.0)
        for got in poisoned(lambda: K.signs_weighted_sum(packed.cuda(), scales.cuda(), 64, 3.0)):
            assert_bits(got, want, f"signs_weighted_sum {special}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k,chunk,numel", [(1, 8, 8), (1, 8, 3), (3, 64, 190), (4, 4104, 16411),
                                           (2, 40000, 80000), (5, 1032, 4097)])
def test_unpack_scaled(K, poisoned, dtype, k, chunk, numel):
    packed, scales = _weighted_inputs(k, chunk, seed=k * 17 + numel)
    if k >= 3:
        scales[1] = float("nan")
        scales[2] = -0.0
    want = reference.unpack_scaled(packed, scales, chunk, numel, dtype)
    pc, sc = packed.cuda(), scales.cuda()
    for i, got in enumerate(poisoned(lambda: K.unpack_scaled(pc, sc, chunk, numel, dtype))):
        assert_bits(got, want, f"unpack_scaled run {i}")


def test_signs_outputs_into_out(K):
    """out= buffers (misaligned views of larger ones): filled, nothing around them touched."""
    packed, scales = _weighted_inputs(3, 1032, seed=3)
    big = torch.full((3 * 1032 + 1,), 7.0, device="cuda")
    got = K.signs_weighted_sum(packed.cuda(), scales.cuda(), 1032, 3.0, out=big[1:1033])
    assert got.data_ptr() == big[1:].data_ptr()
    assert_bits(big[1:1033], reference.signs_weighted_sum(packed, scales, 1032, 3.0), "weighted into out")
    assert float(big[0]) == 7.0 and bool((big[1033:] == 7.0).all())
    half = torch.full((3000,), 5.0, dtype=torch.bfloat16, device="cuda")
    K.unpack_scaled(packed.cuda(), scales.cuda(), 1032, 2995, torch.bfloat16, out=half[3:2998])
    assert_bits(half[3:2998], reference.unpack_scaled(packed, scales, 1032, 2995, torch.bfloat16), "unpack into out")
    assert bool((half[:3] == 5.0).all()) and bool((half[2998:] == 5.0).all())
    with pytest.raises(ValueError, match="float32"):
        K.signs_weighted_sum(packed.cuda(), scales.cuda(), 1032, 3.0, out=half[:1032])


def test_unpack_scaled_rejects_bad_sizes(K):
    packed, scales = torch.zeros(16, dtype=torch.uint8, device="cuda"), torch.ones(2, device="cuda")
    with pytest.raises(ValueError, match="numel=129"):
        K.unpack_scaled(packed, scales, 64, 129, torch.float32)
    with pytest.raises(ValueError, match="chunk=60"):
        K.signs_weighted_sum(packed, scales, 60, 1.0)
    assert K.unpack_scaled(packed, scales, 64, 0, torch.float32).shape == (0,)


def test_dispatch_runs_onebit_on_cuda(monkeypatch):
    import zpp.quant as zq
    from zpp.quant import dispatch

    monkeypatch.delenv("ZPP_QUANT_IMPL", raising=False)
    assert dispatch.kernels_for(torch.device("cuda")).NAME == "cuda"
    before = zq.fallback_counts()
    x, err0 = _onebit_inputs(1000, 8, torch.bfloat16, seed=2)
    e = err0.cuda()
    packed, scale = zq.onebit_compress(x.cuda(), e, numel=1000)
    e_ref = err0.clone()
    p_ref, _ = reference.onebit_compress(x, e_ref, 1000)
    assert_bits(packed, p_ref, "api onebit_compress")
    scales = torch.tensor([0.5, 2.0], device="cuda")
    two = torch.cat([packed[:63], packed[:63]])
    assert_bits(zq.signs_weighted_sum(two, scales, chunk=504, divisor=2.0),
                reference.signs_weighted_sum(two.cpu(), scales.cpu(), 504, 2.0), "api signs_weighted_sum")
    assert_bits(zq.unpack_scaled(two, scales, chunk=504, numel=1001, dtype=torch.float16),
                reference.unpack_scaled(two.cpu(), scales.cpu(), 504, 1001, torch.float16), "api unpack_scaled")
    assert zq.fallback_counts() == before  # no "cuda.<op>" fallback counted
