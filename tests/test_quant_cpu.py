"""The fused CPU kernels (zpp.quant.cpu) agree with the reference bit for bit.

Floats are compared on their bit patterns (``.view(int32/int16)``); NaNs only need to be
NaN in the same places (payload bits of a NaN are not specified). Kernel outputs are
allocated poisoned (two different byte patterns, results must agree) so an element the
kernel forgets to write cannot pass. Signed zeros are compared by bits too: an asymmetric
group's zero minimum/maximum is +0 in both implementations (types.py), also for groups
holding both +0.0 and -0.0, where torch's reduction order alone would pick either.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zpp.quant as zq
from zpp.quant import cpu, dispatch, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REPO = Path(__file__).resolve().parents[1]
HSET = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def K():
    return cpu.kernels()


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal dtype/shape and bits; NaN where NaN."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point():
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: payload differs at {bad}: {got.flatten()[bad].tolist()} "
                                 f"!= {want.flatten()[bad].tolist()}")
        return
    gn, wn = torch.isnan(got), torch.isnan(want)
    if not torch.equal(gn, wn):
        bad = (gn != wn).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: NaN positions differ at {bad}")
    same = _int_view(got) == _int_view(want)
    same |= gn
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        g = [got[tuple(i)].item() for i in bad]
        w = [want[tuple(i)].item() for i in bad]
        raise AssertionError(f"{what}: bits differ at {bad}: {g} != {w}")


class _PoisonTorch:
    """Stands in for the torch module inside zpp.quant.cpu: ``empty`` returns memory filled
    with a byte pattern, so unwritten outputs show."""

    def __init__(self, byte: int):
        self.byte = byte

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=torch.float32, **kw):
        t = torch.empty(*size, dtype=dtype, **kw)
        t.view(-1).view(torch.uint8).fill_(self.byte) if t.numel() else None
        return t


@contextlib.contextmanager
def _poisoned(byte: int):
    saved = cpu.torch
    cpu.torch = _PoisonTorch(byte)
    try:
        yield
    finally:
        cpu.torch = saved


def run_poisoned(fn):
    """Run fn twice with differently poisoned outputs; both must agree bit for bit."""
    with _poisoned(0x5A):
        a = fn()
    with _poisoned(0xA5):
        b = fn()
    if isinstance(a, torch.Tensor):
        assert_same(a, b, "poison 0x5A vs 0xA5")
    else:
        for x, y in zip(a, b):
            assert_same(x, y, "poison 0x5A vs 0xA5")
    return a


def check_quantized(got, want, what=""):
    """Compare (data, scales) pairs bit for bit."""
    assert_same(got[0], want[0], f"{what} payload")
    assert_same(got[1], want[1], f"{what} scales")


def make_data(n: int, dtype: torch.dtype, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g) * 10 ** (torch.rand(1, generator=g).item() * 8 - 4)
    elif kind == "shifted":  # all-positive or all-negative groups (asymmetric offsets)
        x = torch.rand(n, generator=g) * 3 + (torch.rand(1, generator=g).item() - 0.5) * 20
    elif kind == "wide":  # magnitudes across the whole range of the dtype
        fi = torch.finfo(dtype)
        lo, hi = torch.log2(torch.tensor(fi.tiny)).item() - 10, torch.log2(torch.tensor(fi.max)).item()
        e = torch.rand(n, generator=g) * (hi - lo) + lo
        x = torch.exp2(e) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "ties":  # multiples of 0.5 with absmax 127 or 7: x/scale hits .5 exactly
        m = 127 if seed % 2 else 7
        x = torch.randint(-2 * m, 2 * m + 1, (n,), generator=g).float() / 2
        x[:: max(1, n // 3)] = m
    elif kind == "special":
        x = torch.randn(n, generator=g)
        pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 3e38, -3e38,
                             1e-40, -1e-40, 1e-45, 65504.0, 65520.0, -0.0, 0.0])
        pick = torch.rand(n, generator=g) < 0.08
        x[pick] = pool[torch.randint(0, len(pool), (int(pick.sum()),), generator=g)]
    elif kind == "zeros":  # runs of signed zeros and all-zero groups
        x = torch.randn(n, generator=g)
        x[torch.rand(n, generator=g) < 0.7] = 0.0
        x[torch.rand(n, generator=g) < 0.3] = -0.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["normal", "shifted", "wide", "ties", "special", "zeros"]


# ---------------------------------------------------------------------------------------
# build, cache, dispatch
# ---------------------------------------------------------------------------------------

def test_build_flags_and_interface(K):
    assert K.NAME == "cpu"
    assert "-ffp-contract=off" in cpu.FLAGS and "-ffast-math" not in cpu.FLAGS
    assert cpu.kernels() is K  # memoized
    for name in ("quantize", "dequantize", "swizzle_quantize", "reduce_sum", "pack_signs", "unpack_signs"):
        assert callable(getattr(K, name))
    path = cpu.library_path()
    assert path.exists() and path.suffix == ".so"
    # (no-temp-files-left is checked in a private cache by the concurrent-build test: the
    # shared cache may hold a temp file of a process killed mid-build)


def test_public_api_dispatches_to_cpu(monkeypatch, K):
    monkeypatch.delenv("ZPP_QUANT_IMPL", raising=False)
    before = zq.fallback_counts().get("cpu", 0)
    assert dispatch.kernels_for(torch.device("cpu")) is K
    zq.quantize(torch.randn(10))
    assert zq.fallback_counts().get("cpu", 0) == before


def test_kernel_argument_checks(K):
    """The C side trusts sizes and parameters; the wrapper refuses what would overrun."""
    x = torch.randn(100)
    d, s = K.quantize(x, 8, 10, True)
    for bad in ((3, 10), (8, 7), (8, 0), (16, 10)):
        with pytest.raises(ValueError):
            K.quantize(x, *bad, True)
    with pytest.raises(ValueError):
        K.dequantize(d[:-1], s, 100, 8, 10, True, torch.float32)
    with pytest.raises(ValueError):
        K.dequantize(d, s[:-1], 100, 8, 10, True, torch.float32)
    with pytest.raises(ValueError):
        K.dequantize(d, s, 100, 8, 10, False, torch.float32)  # asymmetric needs 2 per group
    with pytest.raises(ValueError):
        K.reduce_sum(d, s, 2, 60, 8, 10, True, 1.0, None, None, torch.float32)
    with pytest.raises(ValueError):
        K.reduce_sum(d, s, 2, 50, 8, 10, True, 1.0, 5, 10, torch.float32)
    with pytest.raises(TypeError):
        K.quantize(torch.arange(10.0, dtype=torch.float64), 8, 10, True)
    with pytest.raises(TypeError):
        K.dequantize(d, s, 100, 8, 10, True, torch.int32)
    with pytest.raises(ValueError):
        K.unpack_signs(torch.zeros(2, dtype=torch.uint8), 17, torch.float32)
    with pytest.raises(TypeError):
        K.unpack_signs(torch.zeros(2, dtype=torch.int8), 16, torch.float32)
    with pytest.raises(ValueError):
        K.swizzle_quantize(x, 2, 2, 20, 8, 10, True)  # 100 elements > 2*2*20


def _run_py(code: str, env: dict, timeout: float = 120):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full_env.pop("ZPP_QUANT_IMPL", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_first_builds_and_missing_compiler(tmp_path):
    """Two processes build into one empty cache at once; a missing compiler falls back."""
    code = """
        import torch
        from zpp.quant import cpu, reference
        x = torch.randn(5000)
        d, s = cpu.kernels().quantize(x, 8, 64, True)
        rd, rs = reference.quantize(x, 8, 64, True)
        assert torch.equal(d, rd) and torch.equal(s, rs)
        print(cpu.library_path())
    """
    cache = tmp_path / "cache"
    procs = [_run_py(code, {"ZPP_CACHE_DIR": str(cache)}) for _ in range(2)]
    bad = tmp_path / "nocache"
    missing = _run_py("""
        import warnings, torch, zpp.quant as zq
        from zpp.quant import cpu
        try:
            cpu.kernels()
            raise SystemExit("expected a build failure")
        except RuntimeError as exc:
            assert "does-not-exist" in str(exc), exc
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            q = zq.quantize(torch.randn(100), bits=8, group_size=16)
        assert zq.fallback_counts()["cpu"] == 1, zq.fallback_counts()
        assert any("cpu kernels are unavailable" in str(m.message) for m in w)
        print("fallback ok")
    """, {"ZPP_CACHE_DIR": str(bad), "CC": "/does-not-exist/cc"})
    outs = []
    for p in procs + [missing]:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert outs[0] == outs[1]
    assert outs[2] == "fallback ok"
    assert [f.name for f in cache.iterdir()] == [Path(outs[0]).name]  # no temp files left


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_threaded_kernels(K, monkeypatch):
    """libgomp is not fork-safe; a child forked after threaded kernels must not hang."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x = torch.randn(1 << 20)
    d, _ = K.quantize(x, 8, 2048, True)  # threaded (>= 2 x 32K elements)
    assert cpu._threaded
    want = hashlib.sha256(d.numpy().tobytes()).hexdigest()
    pid = os.fork()
    if pid == 0:  # the child touches nothing but the kernels, numpy and hashlib
        ok = False
        try:
            d2, _ = K.quantize(x, 8, 2048, True)
            ok = hashlib.sha256(d2.numpy().tobytes()).hexdigest() == want
        finally:
            os._exit(0 if ok else 3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the kernels")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0


# ---------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------

def test_fp16_and_bf16_conversions_match_torch(K):
    lib = K.lib
    # every fp16 pattern -> fp32 (the portable path; F16C serves bulk data when present)
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    out = torch.empty(h.numel(), dtype=torch.float32)
    lib.zpp_f16_to_f32_soft(h.data_ptr(), h.numel(), out.data_ptr())
    assert_same(out, h.view(torch.float16).float(), "f16->f32")
    # fp32 -> fp16 / bf16 round to nearest even, across the range and at the edges
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    near = torch.cat([h.view(torch.float16).float(), torch.tensor([65504.0, 65519.99, 65520.0, 65536.0,
                      2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24, 2.0**-25 * 1.0000001, 3.0e38])])
    near = torch.cat([near, -near, torch.nextafter(near, torch.full_like(near, float("inf"))),
                      torch.nextafter(near, torch.zeros_like(near))])
    xs = torch.cat([bits.view(torch.float32), near])
    o16 = torch.empty(xs.numel(), dtype=torch.int16)
    lib.zpp_f32_to_f16_soft(xs.data_ptr(), xs.numel(), o16.data_ptr())
    assert_same(o16.view(torch.float16), xs.to(torch.float16), "f32->f16")
    lib.zpp_f32_to_bf16(xs.data_ptr(), xs.numel(), o16.data_ptr())
    assert_same(o16.view(torch.bfloat16), xs.to(torch.bfloat16), "f32->bf16")
    # and the bulk (possibly F16C) paths, through dequantize of a scale-1 payload
    vals = xs[torch.isfinite(xs)][:8192]
    q = torch.ones(vals.numel() * 2, dtype=torch.uint8)  # codes 1, group_size 2: out = scale
    for dt in (torch.float16, torch.bfloat16):
        got = K.dequantize(q, vals, vals.numel() * 2, 8, 2, True, dt)
        assert_same(got, vals.repeat_interleave(2).to(dt), f"bulk f32->{dt}")


# ---------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------

def _numels(G):
    return sorted({0, 1, 2, 7, G - 1, G, G + 1, 2 * G + 3, 5 * G - 1, 1001})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_fixed_sizes(K, bits, symmetric, dtype):
    for G in (2, 6, 64, 2048):
        for n in _numels(G):
            for kind in KINDS:
                x = make_data(n, dtype, seed=n * 7 + G + bits, kind=kind)
                want = reference.quantize(x, bits, G, symmetric)
                got = run_poisoned(lambda: K.quantize(x, bits, G, symmetric))
                check_quantized(got, want, f"G={G} n={n} {kind}")
                for out_dt in DTYPES:
                    yw = reference.dequantize(*want, n, bits, G, symmetric, out_dt)
                    yg = run_poisoned(lambda: K.dequantize(*want, n, bits, G, symmetric, out_dt))
                    assert_same(yg, yw, f"dequantize G={G} n={n} {kind} -> {out_dt}")


@settings(HSET, max_examples=120)
@given(
    n=st.integers(0, 5000),
    G=st.integers(1, 300).map(lambda v: 2 * v),
    bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_dequantize_random(K, n, G, bits, symmetric, dtype, out_dtype, kind, seed):
    x = make_data(n, dtype, seed, kind)
    want = reference.quantize(x, bits, G, symmetric)
    got = run_poisoned(lambda: K.quantize(x, bits, G, symmetric))
    check_quantized(got, want)
    yw = reference.dequantize(*want, n, bits, G, symmetric, out_dtype)
    assert_same(run_poisoned(lambda: K.dequantize(*want, n, bits, G, symmetric, out_dtype)), yw)


@settings(HSET, max_examples=60)
@given(
    n=st.integers(1, 3000),
    G=st.integers(1, 100).map(lambda v: 2 * v),
    bits=st.sampled_from([4, 8]),
    symmetric=st.booleans(),
    out_dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_arbitrary_payload_and_scales(K, n, G, bits, symmetric, out_dtype, seed):
    """Any byte (e.g. -128, -8) and any scale/offset (NaN, Inf, 0, -0, negative, subnormal)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-n // G)
    data = torch.randint(0, 256, (groups * G * bits // 8,), generator=g, dtype=torch.uint8)
    sc = torch.randn(groups * (1 if symmetric else 2), generator=g) * 10.0 ** torch.randint(-40, 38, (1,), generator=g).item()
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -3e38, 3e38, 1e-39])
    pick = torch.rand(sc.numel(), generator=g) < 0.2
    sc[pick] = pool[torch.randint(0, len(pool), (int(pick.sum()),), generator=g)]
    yw = reference.dequantize(data, sc, n, bits, G, symmetric, out_dtype)
    assert_same(run_poisoned(lambda: K.dequantize(data, sc, n, bits, G, symmetric, out_dtype)), yw)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_groups(K, symmetric, dtype):
    G = 8
    rows = [
        [0.0] * 8,
        [-0.0] * 8,
        [0.0, -0.0] * 4,
        [-0.0, 0.0, 1.0, 2.0, -0.0, 3.0, 0.0, 4.0],  # min is a mixed zero
        [-0.0, 0.0, -1.0, -2.0, -0.0, -3.0, 0.0, -4.0],  # max is a mixed zero
        [float("nan")] + [1.0] * 7,
        [1.0] * 7 + [float("-nan")],
        [float("inf")] + [0.0] * 7,
        [float("-inf"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        [float("inf"), float("-inf")] * 4,
        [3e38, -3e38, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # asymmetric range overflows
        [3.4e38, 3.4e38, 3.4e38, 1.0, 0.5, -1.0, 2.0, 3.0],
        [1e-45, -1e-45, 2e-45, 0.0, 1e-45, 3e-45, -2e-45, 0.0],  # subnormal scales
        [1e-40, 2e-40, -3e-40, 1e-39, -1e-38, 5e-39, 0.0, 1e-41],
        [2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5],  # constant: scale 0 asymmetric
        [65504.0, -65504.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5],  # ties at scale 1 (int4 symmetric)
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 125.5],  # ties at scale 1 (int8 symmetric)
        [0.0, 15.0, 0.5, 1.5, 2.5, 13.5, 14.5, 7.5],  # ties asymmetric int4
        [0.0, 255.0, 0.5, 1.5, 2.5, 253.5, 254.5, 127.5],  # ties asymmetric int8
    ]
    x = torch.tensor(rows).reshape(-1).to(dtype)
    for bits in (4, 8):
        for n in (x.numel(), x.numel() - 3, 13):
            xs = x[:n]
            want = reference.quantize(xs, bits, G, symmetric)
            got = run_poisoned(lambda: K.quantize(xs, bits, G, symmetric))
            check_quantized(got, want, f"bits={bits} n={n}")
            for out_dt in DTYPES:
                yw = reference.dequantize(*want, n, bits, G, symmetric, out_dt)
                assert_same(K.dequantize(*want, n, bits, G, symmetric, out_dt), yw, f"dq bits={bits} n={n}")


def test_large_and_threads(K, monkeypatch):
    """Large inputs split over threads give the same bits as one thread and the reference."""
    n = (1 << 20) + 12345
    for dtype in DTYPES:
        x = make_data(n, dtype, 5, "special")
        for bits, sym, G in ((8, True, 2048), (4, False, 512), (4, True, 30)):
            want = reference.quantize(x, bits, G, sym)
            monkeypatch.setattr(cpu, "_threads", lambda work: 1)
            one = K.quantize(x, bits, G, sym)
            monkeypatch.setattr(cpu, "_threads", lambda work: 2)
            two = K.quantize(x, bits, G, sym)
            monkeypatch.undo()
            check_quantized(one, want, "1 thread")
            check_quantized(two, want, "2 threads")
            yw = reference.dequantize(*want, n, bits, G, sym, dtype)
            assert_same(K.dequantize(*want, n, bits, G, sym, dtype), yw, "dequantize")
        chunk = zq.reduce_scatter_chunk(n, 6, 2048)
        want = reference.swizzle_quantize(x, 2, 3, chunk, 8, 2048, True)
        check_quantized(K.swizzle_quantize(x, 2, 3, chunk, 8, 2048, True), want, "large swizzle")


# ---------------------------------------------------------------------------------------
# swizzle
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes,rpn", [(1, 1), (1, 4), (2, 2), (3, 2), (2, 3), (4, 1)])
def test_swizzle_quantize(K, nodes, rpn):
    world = nodes * rpn
    for dtype in DTYPES:
        for bits, sym in ((4, True), (8, True), (4, False), (8, False)):
            for n, G, kind in ((1003, 16, "normal"), (0, 16, "normal"), (1, 8, "shifted"),
                               (5000, 64, "special"), (777, 6, "zeros"), (4096, 2048, "shifted")):
                x = make_data(n, dtype, n + world, kind)
                chunk = zq.reduce_scatter_chunk(n, world, G)
                want = reference.swizzle_quantize(x, nodes, rpn, chunk, bits, G, sym)
                got = run_poisoned(lambda: K.swizzle_quantize(x, nodes, rpn, chunk, bits, G, sym))
                check_quantized(got, want, f"{dtype} bits={bits} sym={sym} n={n} G={G}")


@settings(HSET, max_examples=60)
@given(
    nodes=st.integers(1, 4), rpn=st.integers(1, 4), chunk=st.integers(1, 40),
    fill=st.floats(0.0, 1.0), G=st.integers(1, 24).map(lambda v: 2 * v),
    bits=st.sampled_from([4, 8]), symmetric=st.booleans(), dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_swizzle_any_chunk(K, nodes, rpn, chunk, fill, G, bits, symmetric, dtype, seed):
    """Through the kernel interface, chunk need not hold whole groups (groups span chunks)."""
    n = int(nodes * rpn * chunk * fill)
    x = make_data(n, dtype, seed, "shifted" if seed % 2 else "special")
    want = reference.swizzle_quantize(x, nodes, rpn, chunk, bits, G, symmetric)
    got = run_poisoned(lambda: K.swizzle_quantize(x, nodes, rpn, chunk, bits, G, symmetric))
    check_quantized(got, want)


# ---------------------------------------------------------------------------------------
# reduce_sum
# ---------------------------------------------------------------------------------------

def _reduce_case(K, data, scales, k, sl, bits, G, sym, divisor, rq_bits, rq_G, out_dt, what):
    args = (data, scales, k, sl, bits, G, sym, divisor, rq_bits, rq_G, out_dt)
    want = reference.reduce_sum(*args)
    got = run_poisoned(lambda: K.reduce_sum(*args))
    if rq_bits is None:
        assert_same(got, want, what)
    else:
        check_quantized(got, want, what)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_reduce_sum(K, bits, symmetric):
    G = 64
    for k in (1, 2, 3, 4):
        for sl in (G, 3 * G) if k > 1 else (G, 40 * G):
            for kind in ("normal", "special", "zeros"):
                x = make_data(k * sl, torch.float32, k * sl + bits, kind)
                data, scales = reference.quantize(x, bits, G, symmetric)
                for divisor in (1.0, 3.0, 0.1):
                    for out_dt in DTYPES:
                        _reduce_case(K, data, scales, k, sl, bits, G, symmetric, divisor, None, None,
                                     out_dt, f"k={k} sl={sl} {kind} /{divisor} -> {out_dt}")
                    for rq_bits, rq_G in ((bits, G), (4, 6), (12 - bits, 2 * sl + 2)):
                        _reduce_case(K, data, scales, k, sl, bits, G, symmetric, divisor, rq_bits, rq_G,
                                     torch.float32, f"k={k} sl={sl} {kind} /{divisor} -> int{rq_bits}/{rq_G}")


@settings(HSET, max_examples=80)
@given(
    k=st.integers(1, 4), sl=st.integers(1, 700), G=st.integers(1, 50).map(lambda v: 2 * v),
    bits=st.sampled_from([4, 8]), symmetric=st.booleans(),
    divisor=st.sampled_from([1.0, 2.0, 3.0, 7.0, 0.1, 1e-30, 1 / 3]),
    requant=st.sampled_from([None, (4, 2), (8, 16), (4, 100), (8, 256)]),
    out_dt=st.sampled_from(DTYPES), random_payload=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_reduce_sum_random(K, k, sl, G, bits, symmetric, divisor, requant, out_dt, random_payload, seed):
    """Any slice length (slices need not hold whole groups through the kernel interface)."""
    n = k * sl
    if random_payload:
        g = torch.Generator().manual_seed(seed)
        groups = -(-n // G)
        data = torch.randint(0, 256, (groups * G * bits // 8,), generator=g, dtype=torch.uint8)
        scales = torch.rand(groups * (1 if symmetric else 2), generator=g) * 1e3 - 2e2
        scales[torch.rand(scales.numel(), generator=g) < 0.05] = float("nan")
    else:
        data, scales = reference.quantize(make_data(n, torch.float32, seed, "normal"), bits, G, symmetric)
        scales = scales.reshape(-1)
    rq_bits, rq_G = requant if requant else (None, None)
    _reduce_case(K, data, scales, k, sl, bits, G, symmetric, divisor, rq_bits, rq_G, out_dt, "random")


def test_reduce_sum_large_threads(K, monkeypatch):
    k, sl, G = 4, (1 << 18) + 2048, 2048
    x = make_data(k * sl, torch.float32, 3, "normal")
    for sym in (True, False):
        data, scales = reference.quantize(x, 8, G, sym)
        for rq in ((None, None), (4, 2048)):
            want = reference.reduce_sum(data, scales, k, sl, 8, G, sym, 4.0, *rq, torch.bfloat16)
            for nt in (1, 2):
                monkeypatch.setattr(cpu, "_threads", lambda work, nt=nt: nt)
                got = K.reduce_sum(data, scales, k, sl, 8, G, sym, 4.0, *rq, torch.bfloat16)
                monkeypatch.undo()
                if rq[0] is None:
                    assert_same(got, want, f"threads={nt}")
                else:
                    assert_same(got[0], want[0], f"threads={nt}")
                    assert_same(got[1], want[1], f"threads={nt}")


# ---------------------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_signs(K, dtype):
    specials = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"),
                             1e-45, -1e-45, 1e-40, -1e-40, 65504.0, -65504.0, 3e38, -3e38])
    nan_neg = torch.tensor([-(2**31) + 0x7FC00001], dtype=torch.int32).view(torch.float32)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 4096 + 5, 100_003, (1 << 20) + 3):
        x = make_data(n, torch.float32, n, "normal")
        if n:
            idx = torch.randint(0, n, (min(n, 64),), generator=torch.Generator().manual_seed(n))
            x[idx] = torch.cat([specials, nan_neg]).repeat(5)[: idx.numel()]
        x = x.to(dtype)
        want = reference.pack_signs(x)
        got = run_poisoned(lambda: K.pack_signs(x))
        assert_same(got, want, f"pack n={n}")
        for out_dt in DTYPES:
            assert_same(run_poisoned(lambda: K.unpack_signs(want, n, out_dt)),
                        reference.unpack_signs(want, n, out_dt), f"unpack n={n} {out_dt}")
    # trailing bits of the last byte are ignored; every byte value unpacks right
    packed = torch.arange(256, dtype=torch.uint8).repeat(3)
    for n in (8 * 768, 8 * 768 - 5, 1):
        p = packed[: -(-n // 8)]
        for out_dt in DTYPES:
            assert_same(K.unpack_signs(p, n, out_dt), reference.unpack_signs(p, n, out_dt), f"bytes n={n}")


# ---------------------------------------------------------------------------------------
# the public API on CPU tensors (dispatch -> cpu), non-contiguous inputs included
# ---------------------------------------------------------------------------------------

@pytest.fixture
def via_api(monkeypatch, K):
    monkeypatch.delenv("ZPP_QUANT_IMPL", raising=False)
    assert dispatch.kernels_for(torch.device("cpu")) is K
    return K


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_api_matches_reference(via_api, dtype):
    base = make_data(37 * 53, dtype, 11, "special").view(37, 53)
    inputs = [base.t(), base[:, ::3], base[::2, 1:], base.t()[5:, :7], base.unsqueeze(0).expand(2, 37, 53)]
    for x in inputs:
        assert not x.is_contiguous()
        flat = x.contiguous().reshape(-1)
        for bits in (4, 8):
            for sym in (True, False):
                q = zq.quantize(x, bits=bits, group_size=32, symmetric=sym)
                want = reference.quantize(flat, bits, 32, sym)
                check_quantized((q.data, q.scales), want, "api quantize")
                y = zq.dequantize(q)
                assert y.shape == x.shape and y.dtype == dtype
                assert_same(y.reshape(-1), reference.dequantize(*want, flat.numel(), bits, 32, sym, dtype))
                s = zq.swizzle_quantize(x, nodes=2, ranks_per_node=3, bits=bits, group_size=32, symmetric=sym)
                chunk = zq.reduce_scatter_chunk(flat.numel(), 6, 32)
                sw = reference.swizzle_quantize(flat, 2, 3, chunk, bits, 32, sym)
                check_quantized((s.data, s.scales), sw, "api swizzle")
        assert_same(zq.pack_signs(x), reference.pack_signs(flat))
        p = zq.pack_signs(x)
        assert_same(zq.unpack_signs(p, flat.numel(), dtype=dtype), reference.unpack_signs(p, flat.numel(), dtype))


def test_public_api_sums(via_api):
    k, n, G = 3, 512, 64
    xs = make_data(k * n, torch.float32, 2, "normal").view(n, k).t()  # non-contiguous (k, n)
    for sym in (True, False):
        q = zq.quantize(xs, bits=8, group_size=G, symmetric=sym)
        data, scales = q.data.reshape(-1), q.scales.reshape(-1)
        for dt in DTYPES:
            got = zq.dequantize_sum(q, divisor=3.0, dtype=dt)
            assert got.shape == (n,)
            assert_same(got, reference.reduce_sum(data, scales, k, n, 8, G, sym, 3.0, None, None, dt))
        r = zq.requantize_sum(q, bits=4, group_size=32)
        want = reference.reduce_sum(data, scales, k, n, 8, G, sym, 1.0, 4, 32, torch.float32)
        check_quantized((r.data, r.scales), want, "requantize_sum")
