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
@pytest.mark.parametrize("numel,pad", [(0, 8), (1, 7), (13, 3), (1000, 0), (40001, 7), (70000, 16)])
def test_onebit_compress_matches_reference(K, dtype, numel, pad):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).to(dtype)
    err0 = torch.zeros(numel + pad)
    err0[:numel] = torch.randn(numel, generator=g) * 0.1
    e_ref, e_cpu = err0.clone(), err0.clone()
    p_ref, s_ref = reference.onebit_compress(x, e_ref, numel)
    p_cpu, s_cpu = K.onebit_compress(x, e_cpu, numel)
    assert torch.equal(p_cpu, p_ref)
    # the fp64 sum of squares may differ in its last bits: the fp32 scale practically never
    torch.testing.assert_close(s_cpu, s_ref, rtol=1e-7, atol=0)
    if torch.equal(s_cpu, s_ref):
        assert torch.equal(e_cpu, e_ref)
    assert torch.equal(e_cpu[numel:], torch.zeros(pad))
    # the definition itself: b = x + e, scale = rms(b), e' = b - scale * sign(b)
    b = x.float() + err0[:numel]
    if numel:
        assert abs(float(s_ref) - float(b.norm()) / numel ** 0.5) <= 1e-5 * float(s_ref) + 1e-30
    signs = zq.unpack_signs(p_ref, numel + pad)
    assert torch.equal(signs[:numel], torch.where(b >= 0, 1.0, -1.0))
    assert bool((signs[numel:] == 1).all())


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
