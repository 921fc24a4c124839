"""Fused CPU kernels for :mod:`zpp.quant` (``csrc/quant_cpu.c``), loaded with ctypes.

The C source is compiled at first use with ``$CC`` (default ``cc``) and
``-O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC`` into a cache directory
(``$ZPP_CACHE_DIR``, default ``~/.cache/zpp``), under a name keyed by a hash of the source,
the flags, the compiler's version and this CPU, so a changed source or machine rebuilds and
concurrent processes (several ranks starting at once) never see a half-written library:
each compiles to a private temporary file and renames it into place.

:func:`kernels` returns an object with the kernel interface of :mod:`zpp.quant.reference`
(same results, bit for bit). It raises ``RuntimeError``/``OSError`` when the library cannot
be built or loaded; :mod:`zpp.quant.dispatch` then counts a fallback to the reference.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

NAME = "cpu"
_SRC = Path(__file__).resolve().parent / "csrc" / "quant_cpu.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
_ABI_VERSION = 6

# dtype codes of the C side
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Below this many elements per thread, extra threads cost more than they save.
_MIN_PER_THREAD = 1 << 15

_lock = threading.Lock()
_kernels: "_CpuKernels | None" = None
_error: BaseException | None = None


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _compiler_version(cc: list[str]) -> str:
    try:
        res = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"zpp.quant.cpu: C compiler {' '.join(cc)!r} is not usable: {exc}") from exc
    if res.returncode != 0:
        raise RuntimeError(
            f"zpp.quant.cpu: '{' '.join(cc)} --version' failed: {(res.stderr or res.stdout).strip()}"
        )
    return res.stdout


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    tag = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    tag.append(line.strip())
                if len(tag) >= 3:
                    break
    except OSError:
        pass
    return "\n".join(tag)


def _cache_dir() -> Path:
    env = os.environ.get("ZPP_CACHE_DIR")
    path = Path(env) if env else Path.home() / ".cache" / "zpp"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        if env:
            raise
    fallback = Path(tempfile.gettempdir()) / f"zpp-cache-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def library_path() -> Path:
    """Path of the compiled library, building it first if needed."""
    cc = _compiler()
    src = _SRC.read_bytes()
    h = hashlib.sha256()
    for part in (src, " ".join(FLAGS).encode(), " ".join(cc).encode(),
                 _compiler_version(cc).encode(), _cpu_tag().encode()):
        h.update(part)
        h.update(b"\0")
    out = _cache_dir() / f"quant_cpu-{h.hexdigest()[:20]}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = cc + list(FLAGS) + [str(_SRC), "-o", tmp, "-lm"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"zpp.quant.cpu: cannot run the C compiler ({' '.join(cmd)}): {exc}") from exc
        if res.returncode != 0:
            raise RuntimeError(
                f"zpp.quant.cpu: compiling {_SRC.name} failed ({' '.join(cmd)}):\n"
                f"{(res.stderr or res.stdout).strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: readers see no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    if lib.zpp_abi_version() != _ABI_VERSION:
        raise RuntimeError(
            f"zpp.quant.cpu: library ABI {lib.zpp_abi_version()} != expected {_ABI_VERSION}"
        )
    # The kernels are called through their packed-argument entry points (no argtypes: a
    # bytes object goes in as a pointer to its buffer), which costs ~1 us a call where
    # typed ctypes arguments cost several. The test hooks keep typed signatures.
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("zpp_f16_to_f32_soft", "zpp_f32_to_f16_soft", "zpp_f32_to_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [vp, i64, vp]
        fn.restype = None
    return lib


# Argument packs of the *_p entry points (8-byte little-endian slots; see quant_cpu.c).
_Q_ARGS = struct.Struct("<13q")
_DQ_ARGS = struct.Struct("<9q")
_RS_ARGS = struct.Struct("<7qd7q")
_PACK_ARGS = struct.Struct("<5q")
_OB_ARGS = struct.Struct("<9qd")
_WS_ARGS = struct.Struct("<4qd2q")
_US_ARGS = struct.Struct("<8q")


# GNU libgomp (the one torch ships, which the library shares) is not fork-safe: once a
# parallel region has run, a forked child that starts another one hangs. A child forked
# after this process ran threaded kernels therefore runs them on its calling thread only.
_threaded = False
_serial_only = False


def _after_fork_in_child() -> None:
    global _serial_only
    _serial_only = _serial_only or _threaded


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _threads(work: int) -> int:
    global _threaded
    if _serial_only:
        return 1
    n = min(torch.get_num_threads(), work // _MIN_PER_THREAD)
    if n > 1:
        _threaded = True
        return n
    return 1


def _dt(dtype: torch.dtype) -> int:
    try:
        return _DT[dtype]
    except KeyError:
        raise TypeError(f"zpp.quant.cpu: dtype {dtype} is not supported") from None


def _cpu_flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"zpp.quant.cpu: {what} is on {t.device}, expected a CPU tensor")
    return t if t.is_contiguous() else t.contiguous()


def _params(bits, group_size) -> None:
    """The C side trusts these (they size its writes): refuse anything else up front."""
    if bits not in (4, 8) or not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise ValueError(f"zpp.quant.cpu: unsupported bits={bits!r} / group_size={group_size!r}")


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("zpp.quant.cpu: out of memory for kernel scratch buffers")


class _CpuKernels:
    """The reference's kernel interface, served by the compiled library."""

    NAME = NAME

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._q = lib.zpp_quantize_p
        self._dq = lib.zpp_dequantize_p
        self._rs = lib.zpp_reduce_sum_p
        self._pack = lib.zpp_pack_signs_p
        self._unpack = lib.zpp_unpack_signs_p
        self._ob = lib.zpp_onebit_compress_p
        self._ws = lib.zpp_signs_weighted_sum_p
        self._us = lib.zpp_unpack_scaled_p

    # -- quantize -------------------------------------------------------------------
    def _quantize(self, x, swizzle, nodes, rpn, chunk, total, bits, group_size, symmetric):
        _params(bits, group_size)
        groups = -(-total // group_size)
        data = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8)
        scales = torch.empty((groups,) if symmetric else (groups, 2), dtype=torch.float32)
        if groups:
            _check(self._q(_Q_ARGS.pack(
                x.data_ptr(), _dt(x.dtype), x.numel(), swizzle, nodes, rpn, chunk, bits,
                group_size, int(symmetric), data.data_ptr(), scales.data_ptr(), _threads(total),
            )))
        return data, scales

    def quantize(self, x, bits, group_size, symmetric):
        x = _cpu_flat(x, "input")
        return self._quantize(x, 0, 1, 1, 0, x.numel(), bits, group_size, symmetric)

    def swizzle_quantize(self, x, nodes, ranks_per_node, chunk, bits, group_size, symmetric):
        x = _cpu_flat(x, "input")
        if min(nodes, ranks_per_node) < 1 or chunk < 0:
            raise ValueError(f"zpp.quant.cpu: bad layout nodes={nodes} ranks_per_node={ranks_per_node} chunk={chunk}")
        total = nodes * ranks_per_node * chunk
        if x.numel() > total:
            raise ValueError(
                f"zpp.quant.cpu: {x.numel()} elements do not fit nodes={nodes} x "
                f"ranks_per_node={ranks_per_node} x chunk={chunk}"
            )
        return self._quantize(x, 1, nodes, ranks_per_node, chunk, total, bits, group_size, symmetric)

    # -- dequantize -----------------------------------------------------------------
    @staticmethod
    def _check_payload(data, scales, numel, bits, group_size, symmetric):
        _params(bits, group_size)
        groups = -(-numel // group_size)
        if data.numel() < groups * group_size * bits // 8 or scales.numel() < groups * (1 if symmetric else 2):
            raise ValueError(
                f"zpp.quant.cpu: payload ({data.numel()} bytes) or scales ({scales.numel()}) too "
                f"small for numel={numel} bits={bits} group_size={group_size}"
            )
        if data.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise TypeError("zpp.quant.cpu: payload must be uint8 and scales float32")

    def dequantize(self, data, scales, numel, bits, group_size, symmetric, dtype):
        out = torch.empty(numel, dtype=dtype)
        if numel == 0:
            return out
        data = _cpu_flat(data, "payload")
        scales = _cpu_flat(scales, "scales")
        self._check_payload(data, scales, numel, bits, group_size, symmetric)
        _check(self._dq(_DQ_ARGS.pack(
            data.data_ptr(), scales.data_ptr(), numel, bits, group_size, int(symmetric),
            _dt(dtype), out.data_ptr(), _threads(numel),
        )))
        return out

    def reduce_sum(self, data, scales, k, slice_numel, bits, group_size, symmetric, divisor,
                   requant_bits, requant_group_size, out_dtype):
        data = _cpu_flat(data, "payload")
        scales = _cpu_flat(scales, "scales")
        if k < 1:
            raise ValueError(f"zpp.quant.cpu: k={k} must be >= 1")
        self._check_payload(data, scales, k * slice_numel, bits, group_size, symmetric)
        work = k * slice_numel
        if requant_bits is not None:
            _params(requant_bits, requant_group_size)
        if requant_bits is None:
            out = torch.empty(slice_numel, dtype=out_dtype)
            if slice_numel:
                _check(self._rs(_RS_ARGS.pack(
                    data.data_ptr(), scales.data_ptr(), k, slice_numel, bits, group_size,
                    int(symmetric), float(divisor), 0, 0, _dt(out_dtype), out.data_ptr(),
                    0, 0, _threads(work),
                )))
            return out
        groups = -(-slice_numel // requant_group_size)
        rdata = torch.empty(groups * requant_group_size * requant_bits // 8, dtype=torch.uint8)
        rscales = torch.empty((groups,) if symmetric else (groups, 2), dtype=torch.float32)
        if slice_numel:
            _check(self._rs(_RS_ARGS.pack(
                data.data_ptr(), scales.data_ptr(), k, slice_numel, bits, group_size,
                int(symmetric), float(divisor), int(requant_bits), requant_group_size, 0, 0,
                rdata.data_ptr(), rscales.data_ptr(), _threads(work),
            )))
        return rdata, rscales

    # -- signs ----------------------------------------------------------------------
    def pack_signs(self, x):
        x = _cpu_flat(x, "input")
        n = x.numel()
        out = torch.empty(-(-n // 8), dtype=torch.uint8)
        if n:
            _check(self._pack(_PACK_ARGS.pack(x.data_ptr(), _dt(x.dtype), n, out.data_ptr(), _threads(n))))
        return out

    def unpack_signs(self, packed, numel, dtype):
        packed = _cpu_flat(packed, "packed signs")
        if packed.dtype != torch.uint8:
            raise TypeError(f"zpp.quant.cpu: packed signs dtype {packed.dtype} must be torch.uint8")
        if packed.numel() * 8 < numel:
            raise ValueError(f"zpp.quant.cpu: {packed.numel()} packed bytes cannot hold {numel} signs")
        out = torch.empty(numel, dtype=dtype)
        if numel:
            _check(self._unpack(_PACK_ARGS.pack(packed.data_ptr(), numel, _dt(dtype), out.data_ptr(), _threads(numel))))
        return out


    # -- 1-bit error feedback ([Note: 1-bit kernels] in reference.py) --------------------
    def onebit_compress(self, x, error, numel, out=None, pending=None):
        x = _cpu_flat(x, "input")
        if error.device.type != "cpu" or not error.is_contiguous() or error.dtype != torch.float32:
            raise ValueError("zpp.quant.cpu: error buffer must be a contiguous float32 CPU tensor")
        if numel > min(x.numel(), error.numel()) or error.numel() % 8:
            raise ValueError(f"zpp.quant.cpu: numel={numel}, x {x.numel()}, error {error.numel()}")
        if out is None:
            packed = torch.empty(error.numel() // 8, dtype=torch.uint8)
            scale = torch.empty(1, dtype=torch.float32)
        else:
            packed, scale = out
            _out(packed, error.numel() // 8, torch.uint8, "packed signs")
            _out(scale, 1, torch.float32, "scale")
        _check(self._ob(_OB_ARGS.pack(
            x.data_ptr(), _dt(x.dtype), numel, error.data_ptr(), error.numel(),
            packed.data_ptr(), scale.data_ptr(), _threads(error.numel()),
            int(pending is not None), float(pending or 0.0))))
        return packed, scale

    def signs_weighted_sum(self, packed, scales, chunk, divisor, out=None):
        packed, scales = _cpu_flat(packed, "packed signs"), _cpu_flat(scales, "scales")
        k = scales.numel()
        if k < 1 or chunk % 8 or packed.numel() != k * chunk // 8 or scales.dtype != torch.float32:
            raise ValueError(f"zpp.quant.cpu: {packed.numel()} bytes for k={k} chunk={chunk}")
        if out is None:
            out = torch.empty(chunk, dtype=torch.float32)
        else:
            _out(out, chunk, torch.float32, "weighted sum")
        _check(self._ws(_WS_ARGS.pack(packed.data_ptr(), scales.data_ptr(), k, chunk, float(divisor),
                                      out.data_ptr(), _threads(k * chunk))))
        return out

    def unpack_scaled(self, packed, scales, chunk, numel, dtype, out=None):
        packed, scales = _cpu_flat(packed, "packed signs"), _cpu_flat(scales, "scales")
        k = scales.numel()
        if chunk % 8 or packed.numel() != k * chunk // 8 or numel > k * chunk or scales.dtype != torch.float32:
            raise ValueError(f"zpp.quant.cpu: {packed.numel()} bytes for k={k} chunk={chunk} numel={numel}")
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        else:
            _out(out, numel, dtype, "unpacked output")
        if numel:
            _check(self._us(_US_ARGS.pack(packed.data_ptr(), scales.data_ptr(), k, chunk, numel,
                                          _dt(dtype), out.data_ptr(), _threads(numel))))
        return out


def _out(t: torch.Tensor, numel: int, dtype: torch.dtype, what: str) -> None:
    """An ``out=`` tensor the C side may write ``numel`` elements of ``dtype`` into."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"zpp.quant.cpu: out ({what}) must be a contiguous CPU tensor")
    if t.dtype != dtype or t.numel() != numel:
        raise ValueError(f"zpp.quant.cpu: out ({what}) is {t.dtype} x {t.numel()}, "
                         f"expected {dtype} x {numel}")


def kernels() -> _CpuKernels:
    """The CPU kernels, building the library on first use (memoized, failures included)."""
    global _kernels, _error
    if _kernels is not None:
        return _kernels
    with _lock:
        if _kernels is None:
            if _error is not None:
                raise _error
            try:
                _kernels = _CpuKernels(_load())
            except (OSError, RuntimeError) as exc:
                _error = exc
                raise
    return _kernels
