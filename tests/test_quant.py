"""zpp.quant's public API: layout, error bounds, special values and bad input.

Runs on whatever implementation serves CPU tensors (the fused CPU kernels, else the
reference); tests/test_quant_cpu.py checks that the two agree bit for bit.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zpp.quant as zq
from zpp.quant import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bound(x: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    """Per-element error bound from the issue: sym absmax/(2^b-2), asym (max-min)/(2(2^b-1))."""
    xf = x.reshape(-1).float()
    n = xf.numel()
    out = torch.empty(n)
    for start in range(0, n, group_size):
        g = xf[start:start + group_size]
        if symmetric:
            b = g.abs().max() / (2 ** bits - 2)
        else:
            b = (g.max() - g.min()) / (2 * (2 ** bits - 1))
        out[start:start + group_size] = b
    return out


def _rounding(x: torch.Tensor, dtype: torch.dtype, bound: torch.Tensor | None = None) -> torch.Tensor:
    """Float rounding slack: the output is rounded to ``dtype`` at |x| + bound (where the
    fp32 dequantized value can lie), plus the fp32 steps of the dequantization itself."""
    eps = torch.finfo(dtype).eps
    mag = x.reshape(-1).float().abs() + (0 if bound is None else bound)
    subnormal_step = torch.finfo(dtype).smallest_normal * eps  # absolute spacing near zero
    return mag * eps + mag * torch.finfo(torch.float32).eps * 2 + subnormal_step


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 3000),
    group=st.sampled_from([2, 6, 32, 128, 250, 512]),
    bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.floats(-6, 6),
    seed=st.integers(0, 2**31),
)
def test_error_bound(numel, group, bits, symmetric, dtype, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10 ** log_scale + torch.rand(1, generator=g) * 10 ** log_scale
    big = torch.finfo(dtype).max
    x = x.clamp(-big, big).to(dtype)  # finite in the input dtype (fp16 tops out at 65504)
    q = zq.quantize(x, bits=bits, group_size=group, symmetric=symmetric)
    y = zq.dequantize(q)
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.float() - x.float()).abs().reshape(-1)
    # the output is rounded to dtype: allow one ulp of it on top of the quantization bound
    bound = _bound(x, bits, group, symmetric)
    assert bool((err <= bound + _rounding(x, dtype, bound)).all())
    assert q.nbytes == q.data.numel() + 4 * q.scales.numel()
    assert q.nbytes == zq.quantized_nbytes(numel, bits, group, symmetric)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_payload_size_and_dtypes(bits, symmetric):
    x = torch.randn(1000)
    q = zq.quantize(x, bits=bits, group_size=64, symmetric=symmetric)
    groups = math.ceil(1000 / 64)
    assert q.data.dtype == torch.uint8 and q.scales.dtype == torch.float32
    assert q.data.numel() == groups * 64 * bits // 8
    assert q.scales.shape == ((groups,) if symmetric else (groups, 2))
    assert q.shape == x.shape and q.dtype == x.dtype and q.bits == bits and q.group_size == 64
    # fp32 -> int8 is 1/4 of the bytes (+ scales), int4 1/8
    assert q.data.numel() * (32 // bits) == groups * 64 * 4


def test_int4_nibble_order_and_int8_twos_complement():
    # scale = 7/7 = 1 -> codes are the values themselves
    x = torch.tensor([1.0, -2.0, 7.0, -7.0, 0.0, 3.0])
    q = zq.quantize(x, bits=4, group_size=6)
    assert q.scales.tolist() == [1.0]
    # element 2i in the low nibble, 2i+1 in the high nibble, 4-bit two's complement
    assert q.data.tolist() == [(0xE << 4) | 0x1, (0x9 << 4) | 0x7, (0x3 << 4) | 0x0]
    x8 = torch.tensor([127.0, -127.0, -1.0, 0.0])
    q8 = zq.quantize(x8, bits=8, group_size=4)
    assert q8.data.tolist() == [127, 129, 255, 0]
    qa = zq.quantize(torch.tensor([0.0, 15.0]), bits=4, group_size=2, symmetric=False)
    assert qa.data.tolist() == [0xF0] and qa.scales.tolist() == [[1.0, 0.0]]


def test_round_half_to_even():
    # scale 1: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 7.0])
    q = zq.quantize(x, bits=4, group_size=6)
    assert zq.dequantize(q).tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, 7.0]


def test_padding_does_not_change_stats():
    # the padded tail of the last group must not enter min/max (asymmetric) or absmax
    x = torch.tensor([5.0, 6.0, 7.0])
    q = zq.quantize(x, bits=8, group_size=4, symmetric=False)
    assert q.scales[0, 1].item() == 5.0
    assert q.data[3].item() == 0
    assert torch.allclose(zq.dequantize(q), x, atol=2 / 255 / 2 + 1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_nonfinite_groups(symmetric, dtype):
    x = torch.randn(4 * 8)
    x[0:8] = 0.0  # all-zero group
    x[8] = float("nan")  # group 1 has NaN
    x[17] = float("inf")  # group 2 has +Inf
    x[30] = float("-inf")  # group 3 has -Inf
    x = torch.cat([x, torch.randn(8)]).to(dtype)  # group 4 finite
    y = zq.dequantize(zq.quantize(x, bits=8, group_size=8, symmetric=symmetric))
    assert torch.equal(y[0:8], torch.zeros(8, dtype=dtype))
    assert bool(torch.isnan(y[8:32]).all())
    assert bool(torch.isfinite(y[32:]).all())
    b = _bound(x[32:], 8, 8, symmetric)
    bound = b + _rounding(x[32:], dtype, b)
    assert bool(((y[32:].float() - x[32:].float()).abs() <= bound).all())


def test_constant_group_is_exact_asymmetric():
    x = torch.full((10,), 3.25)
    y = zq.dequantize(zq.quantize(x, bits=4, group_size=4, symmetric=False))
    assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_shapes(dtype):
    base = torch.randn(17, 13).to(dtype)
    x = base.t()  # non-contiguous
    q = zq.quantize(x, bits=8, group_size=16)
    y = zq.dequantize(q)
    assert y.shape == (13, 17)
    ref = zq.dequantize(zq.quantize(x.contiguous(), bits=8, group_size=16))
    assert torch.equal(y, ref)
    assert zq.dequantize(q, dtype=torch.float32).dtype == torch.float32


def test_empty_round_trip():
    for shape in [(0,), (3, 0)]:
        x = torch.empty(shape)
        q = zq.quantize(x, bits=4, group_size=8)
        assert q.nbytes == 0
        y = zq.dequantize(q)
        assert y.shape == x.shape


def test_bad_input_errors():
    with pytest.raises(TypeError, match="int64"):
        zq.quantize(torch.arange(10), bits=8)
    with pytest.raises(TypeError, match="float64"):
        zq.quantize(torch.randn(10, dtype=torch.float64))
    for bits in (2, 16, 0, True):
        with pytest.raises(ValueError, match=f"bits={bits!r}"):
            zq.quantize(torch.randn(10), bits=bits)
    for gs in (0, -4, 3, 7, 2.0):
        with pytest.raises(ValueError, match=f"group_size={gs!r}"):
            zq.quantize(torch.randn(10), group_size=gs)
    q = zq.quantize(torch.randn(100), bits=8, group_size=10)
    with pytest.raises(ValueError, match="payload"):
        zq.dequantize(q._replace(data=q.data[:-1]))
    with pytest.raises(ValueError, match="scales"):
        zq.dequantize(q._replace(scales=q.scales[:-1]))
    with pytest.raises(TypeError):
        zq.dequantize(q, dtype=torch.int32)


def test_pack_signs_bit_order_and_round_trip():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, float("nan"), -3.0, 2.0, -2.0, 5.0])
    p = zq.pack_signs(x)
    # LSB first: bits 1,0,1,1,0,0,1,0 -> 0b01001101; then bit0=1
    assert p.tolist() == [0b01001101, 0b00000001]
    s = zq.unpack_signs(p, 9)
    assert s.tolist() == [1, -1, 1, 1, -1, -1, 1, -1, 1]
    for dtype in DTYPES:
        x = torch.randn(1001).to(dtype)
        got = zq.unpack_signs(zq.pack_signs(x), 1001, dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(got, torch.where(x >= 0, 1.0, -1.0).to(dtype))
    with pytest.raises(ValueError, match="numel=17"):
        zq.unpack_signs(p, 17)
    assert zq.pack_signs(torch.empty(0)).numel() == 0


@pytest.mark.parametrize("nodes,rpn", [(1, 1), (1, 4), (2, 2), (3, 2), (2, 3)])
def test_swizzle_layout(nodes, rpn):
    world = nodes * rpn
    x = torch.randn(1003)
    q = zq.swizzle_quantize(x, nodes=nodes, ranks_per_node=rpn, bits=8, group_size=16)
    chunk = zq.reduce_scatter_chunk(1003, world, 16)
    assert q.shape == (rpn, nodes, chunk) and chunk % 16 == 0 and chunk * world >= 1003
    # part l of the payload holds chunks (node 0, l), (node 1, l), ... of the padded input
    padded = torch.zeros(world * chunk)
    padded[:1003] = x
    chunks = padded.view(nodes, rpn, chunk)
    parts = q.data.view(rpn, -1)
    scales = q.scales.view(rpn, -1)
    for l in range(rpn):
        for n in range(nodes):
            want = zq.quantize(chunks[n, l].clone(), bits=8, group_size=16)
            per = chunk // 16
            assert torch.equal(parts[l].view(nodes, -1)[n], want.data)
            assert torch.equal(scales[l].view(nodes, per)[n], want.scales)


def test_requantize_and_dequantize_sum():
    k, n = 3, 256
    xs = torch.randn(k, n)
    q = zq.quantize(xs, bits=8, group_size=64)
    parts = zq.dequantize(q)
    want = parts[0] + parts[1] + parts[2]
    got = zq.dequantize_sum(q)
    assert torch.equal(got, want)
    assert torch.equal(zq.dequantize_sum(q, divisor=3.0), want / 3.0)
    r = zq.requantize_sum(q, bits=4)
    assert r.shape == (n,) and r.bits == 4
    assert torch.equal(r.data, zq.quantize(want, bits=4, group_size=64).data)
    assert float((zq.dequantize(r) - want).abs().max()) <= float(want.abs().max()) / 14 + 1e-6
    with pytest.raises(ValueError, match="whole groups"):
        zq.requantize_sum(zq.quantize(torch.randn(3, 10), bits=8, group_size=4))


def test_reference_is_the_oracle_for_dispatch():
    """Whatever serves CPU tensors must agree with the reference on a plain case."""
    x = torch.randn(5000)
    q = zq.quantize(x, bits=4, group_size=128)
    d, s = reference.quantize(x, 4, 128, True)
    assert torch.equal(q.data, d) and torch.equal(q.scales, s)
