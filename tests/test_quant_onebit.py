"""The fused 1-bit kernels ([Note: 1-bit kernels] in zpp/quant/reference.py) against the
plain-torch reference, and the public API's checks."""
import pytest
import torch

import zpp.quant as zq
from zpp.quant import cpu, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def K():
    try:
        return cpu.kernels()
    except (OSError, RuntimeError) as exc:  # pragma: no cover - needs a C compiler
        pytest.skip(f"CPU kernels unavailable: {exc}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,pad", [(0, 8), (1, 7), (13, 3), (1000, 0), (2048, 0), (2049, 7),
                                       (40001, 7), (70000, 16), (135175, 1)])
def test_onebit_compress_matches_reference(K, dtype, numel, pad):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).to(dtype)
    err0 = torch.zeros(numel + pad)
    err0[:numel] = torch.randn(numel, generator=g) * 0.1
    e_ref, e_cpu = err0.clone(), err0.clone()
    p_ref, s_ref = reference.onebit_compress(x, e_ref, numel)
    p_cpu, s_cpu = K.onebit_compress(x, e_cpu, numel)
    assert torch.equal(p_cpu, p_ref)
    # the sum of squares runs in one documented order: scale and errors are bit-exact
    assert torch.equal(s_cpu, s_ref) and torch.equal(e_cpu, e_ref)
    assert torch.equal(e_cpu[numel:], torch.zeros(pad))
    # the definition itself: b = x + e, scale = rms(b), e' = b - scale * sign(b)
    b = x.float() + err0[:numel]
    if numel:
        assert abs(float(s_ref) - float(b.norm()) / numel ** 0.5) <= 1e-5 * float(s_ref) + 1e-30
    signs = zq.unpack_signs(p_ref, numel + pad)
    assert torch.equal(signs[:numel], torch.where(b >= 0, 1.0, -1.0))
    assert bool((signs[numel:] == 1).all())


def test_sum_squares_order():
    """The documented order: halving trees within blocks of 2048, then over the block sums."""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(3 * 2048 + 5, generator=g) * torch.logspace(-20, 20, 3 * 2048 + 5)
    q = b.double() ** 2
    blocks = []
    for k in range(4):
        v = torch.zeros(2048, dtype=torch.float64)
        part = q[k * 2048:(k + 1) * 2048]
        v[:part.numel()] = part
        while v.numel() > 1:
            v = v[:v.numel() // 2] + v[v.numel() // 2:]
        blocks.append(v[0])
    want = (blocks[0] + blocks[2]) + (blocks[1] + blocks[3])
    got = reference._sum_squares(b)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    torch.testing.assert_close(got, q.sum(), rtol=1e-12, atol=0)


def test_onebit_compress_exact_across_threads_and_sizes(K):
    """Many sum blocks, several threads, magnitudes where a different order would show."""
    n = (1 << 18) + 13
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g) * torch.logspace(-8, 8, n)
    err0 = torch.zeros(n + 3)
    want = reference.onebit_compress(x, err0.clone(), n)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            e = err0.clone()
            got = K.onebit_compress(x, e, n)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,pad", [(1, 7), (2053, 3), (70000, 16)])
def test_lazy_update_equals_settled(K, impl, dtype, numel, pad):
    """pending=: the buffer carries b and the scale settles it on the next call; the signs,
    scales and settled errors equal the eager sequence's bit for bit, call after call."""
    mod = reference if impl == "reference" else K
    g = torch.Generator().manual_seed(numel + 1)
    eager, lazy = torch.zeros(numel + pad), torch.zeros(numel + pad)
    pending = 0.0
    for step in range(4):
        x = (torch.randn(numel, generator=g) * 10 ** (step - 2)).to(dtype)
        p1, s1 = mod.onebit_compress(x, eager, numel)
        p2, s2 = mod.onebit_compress(x, lazy, numel, pending=pending)
        assert torch.equal(p1, p2) and torch.equal(s1, s2), step
        assert torch.equal(lazy[numel:], torch.zeros(pad))
        pending = float(s2)
        assert torch.equal(reference.settle(lazy, numel, pending), eager[:numel]), step


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_out_buffers(K, impl):
    """out= fills the given tensors (same values as allocating) and returns them."""
    mod = reference if impl == "reference" else K
    g = torch.Generator().manual_seed(5)
    n, k, chunk = 1003, 4, 256
    x = torch.randn(n, generator=g)
    e1, e2 = torch.zeros(1024), torch.zeros(1024)
    p, s = mod.onebit_compress(x, e1, n)
    op, os_ = torch.empty(128, dtype=torch.uint8), torch.empty(1)
    rp, rs = mod.onebit_compress(x, e2, n, out=(op, os_))
    assert rp is op and rs is os_ and torch.equal(op, p) and torch.equal(os_, s) and torch.equal(e1, e2)
    scales = torch.rand(k, generator=g)
    w = mod.signs_weighted_sum(p, scales, chunk, 4.0)
    ow = torch.empty(chunk)
    assert mod.signs_weighted_sum(p, scales, chunk, 4.0, out=ow) is ow and torch.equal(ow, w)
    for dtype in DTYPES:
        u = mod.unpack_scaled(p, scales, chunk, n, dtype)
        ou = torch.empty(n, dtype=dtype)
        assert mod.unpack_scaled(p, scales, chunk, n, dtype, out=ou) is ou and torch.equal(ou, u)
    if impl == "cpu":
        with pytest.raises(ValueError, match="expected torch.float32 x 256"):
            K.signs_weighted_sum(p, scales, chunk, 4.0, out=torch.empty(255))
        with pytest.raises(ValueError, match="contiguous"):
            K.unpack_scaled(p, scales, chunk, n, torch.float32, out=torch.empty(2 * n)[::2])


def test_onebit_compress_nonfinite_and_signed_zero(K):
    x = torch.tensor([float("nan"), -0.0, 1.0, -2.0, 0.0, 3.0, -1.0, 2.0])
    for impl in (reference, K):
        e = torch.zeros(8)
        p, s = impl.onebit_compress(x, e, 8)
        assert torch.isnan(s).all() and torch.isnan(e).all()
        assert p.tolist() == [0b10110110]  # NaN -> 0, -0.0 -> 1


@pytest.mark.parametrize("k,chunk,divisor", [(1, 8, 1.0), (2, 64, 2.0), (3, 4104, 3.0), (4, 40000, 4.0)])
def test_signs_weighted_sum_matches_reference(K, k, chunk, divisor):
    g = torch.Generator().manual_seed(k)
    packed = torch.randint(0, 256, (k * chunk // 8,), dtype=torch.uint8, generator=g)
    scales = torch.rand(k, generator=g) + 0.1
    want = reference.signs_weighted_sum(packed, scales, chunk, divisor)
    got = K.signs_weighted_sum(packed, scales, chunk, divisor)
    assert torch.equal(got, want)
    signs = zq.unpack_signs(packed, k * chunk).view(k, chunk)
    torch.testing.assert_close(got, (signs * scales[:, None]).sum(0) / divisor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,chunk,numel", [(1, 8, 5), (2, 64, 128), (3, 4104, 12000), (4, 20000, 79993)])
def test_unpack_scaled_matches_reference(K, dtype, k, chunk, numel):
    g = torch.Generator().manual_seed(numel)
    packed = torch.randint(0, 256, (k * chunk // 8,), dtype=torch.uint8, generator=g)
    scales = torch.rand(k, generator=g) * 3
    want = reference.unpack_scaled(packed, scales, chunk, numel, dtype)
    got = K.unpack_scaled(packed, scales, chunk, numel, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_public_api_checks():
    with pytest.raises(TypeError, match="error buffer"):
        zq.onebit_compress(torch.randn(8), torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 8"):
        zq.onebit_compress(torch.randn(5), torch.zeros(5))
    with pytest.raises(ValueError, match="chunk=12"):
        zq.signs_weighted_sum(torch.zeros(3, dtype=torch.uint8), torch.ones(2), chunk=12)
    with pytest.raises(ValueError, match="expected 2 scales"):
        zq.unpack_scaled(torch.zeros(3, dtype=torch.uint8), torch.ones(2), chunk=8, numel=4)
    with pytest.raises(ValueError, match="numel=17"):
        zq.unpack_scaled(torch.zeros(2, dtype=torch.uint8), torch.ones(2), chunk=8, numel=17)
    p, s = zq.onebit_compress(torch.randn(10), torch.zeros(16))
    assert p.numel() == 2 and s.shape == (1,)


def test_public_api_out_and_pending():
    """zpp.quant's 1-bit functions take out= and pending= like the kernels, and refuse an out=
    of the wrong size or dtype and a bad pending scale with a ValueError naming it."""
    import zpp.quant as zq

    n, chunk = 100, 104
    x = torch.randn(n)
    e_eager, e_lazy = torch.zeros(chunk), torch.zeros(chunk)
    signs, scale = torch.empty(chunk // 8, dtype=torch.uint8), torch.empty(1)
    pending = 0.0
    for _ in range(3):
        p_e, s_e = zq.onebit_compress(x, e_eager, numel=n)
        got = zq.onebit_compress(x, e_lazy, numel=n, out=(signs, scale), pending=pending)
        assert got[0] is signs and got[1] is scale
        assert torch.equal(signs, p_e) and torch.equal(scale, s_e)
        pending = float(scale)
    assert torch.equal(reference.settle(e_lazy, n, pending), e_eager[:n])
    scales = torch.tensor([0.5, 2.0])
    packed = torch.cat([signs, signs])
    avg = torch.empty(chunk)
    assert zq.signs_weighted_sum(packed, scales, chunk=chunk, divisor=2.0, out=avg) is avg
    assert torch.equal(avg, zq.signs_weighted_sum(packed, scales, chunk=chunk, divisor=2.0))
    dec = torch.empty(150, dtype=torch.bfloat16)
    assert zq.unpack_scaled(packed, scales, chunk=chunk, numel=150, dtype=torch.bfloat16, out=dec) is dec
    assert torch.equal(dec, zq.unpack_scaled(packed, scales, chunk=chunk, numel=150, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="onebit_compress signs .* 13 elements"):
        zq.onebit_compress(x, e_eager, numel=n, out=(torch.empty(12, dtype=torch.uint8), scale))
    with pytest.raises(ValueError, match="signs_weighted_sum"):
        zq.signs_weighted_sum(packed, scales, chunk=chunk, out=torch.empty(chunk, dtype=torch.float64))
    with pytest.raises(ValueError, match="unpack_scaled"):
        zq.unpack_scaled(packed, scales, chunk=chunk, numel=150, out=torch.empty(150, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="pending=-1.0"):
        zq.onebit_compress(x, e_eager, numel=n, pending=-1.0)
