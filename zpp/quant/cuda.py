"""CUDA kernels of zpp.quant: ``cuda/quant.cu`` compiled at run time by cupy (NVRTC).

:func:`kernels` returns an object with the kernel interface of :mod:`zpp.quant.reference`
(bit-exact with it) for CUDA tensors. cupy is imported lazily: without it :func:`kernels`
raises ImportError, and :mod:`zpp.quant.dispatch` counts a fallback. Kernels run on torch's
current stream of the tensor's device and read and write torch's memory directly (raw device
pointers); outputs are allocated with torch. The module is compiled once per device.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

NAME = "cuda"

_TYPE_NAMES = {torch.float32: "float", torch.float16: "zq_half", torch.bfloat16: "zq_bf16"}
_CACHES = (1, 4)
_PER_TYPE = ("dequant_sum", "pack_signs", "unpack_scaled", "onebit_sumsq")
_NAMES = tuple(
    [f"zq_quantize<{t}, {c}>" for t in _TYPE_NAMES.values() for c in _CACHES]
    + [f"zq_swizzle_quantize<{t}, {c}>" for t in _TYPE_NAMES.values() for c in _CACHES]
    + [f"zq_requant_sum<{c}>" for c in _CACHES]
    + [f"zq_{k}<{t}>" for t in _TYPE_NAMES.values() for k in _PER_TYPE]
    + ["zq_signs_weighted_sum", "zq_onebit_scale"]
)
_OPTIONS = ("-std=c++17", "--fmad=false")
_BLOCK = 256  # elementwise kernels: threads per block, 8 elements per thread
_MAX_GROUP_BLOCK = 512  # quantize kernels: at most this many threads per group
_MAX_GRID = 2**31 - 1
# onebit_compress: elements per block of the fp64 sum of squares (ZQ_SUMSQ_BLOCK in quant.cu,
# _SUMSQ_BLOCK of the oracle, zpp/quant/reference.py) and threads per block (ZQ_SUMSQ_THREADS).
_SUMSQ_BLOCK = 2048
_SUMSQ_THREADS = 256


def source_path() -> Path:
    """Where quant.cu is read from: the checkout's ``cuda/`` when this package lives in a
    checkout of the repository, else the copy that setup.py put in ``zpp/quant/cuda_src/``."""
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    checkout = root / "cuda" / "quant.cu"
    if checkout.is_file() and (root / "setup.py").is_file() and (root / "zpp" / "quant").is_dir():
        return checkout
    packaged = here / "cuda_src" / "quant.cu"
    if packaged.is_file():
        return packaged
    raise ImportError(
        f"zpp.quant: the CUDA kernel source is missing (looked for {checkout} and {packaged})"
    )


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output of these kernels is allocated here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _out(t, shape: tuple, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    """A caller's ``out=`` buffer, checked: contiguous, ``shape`` elements of ``dtype`` on
    ``device``; returned flat (a view: the kernels write into it)."""
    if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device or not t.is_contiguous()
            or t.numel() != shape[0]):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"zpp.quant.cuda: {what} must be a contiguous {dtype} tensor of {shape[0]} elements "
                         f"on {device} (got {got})")
    return t.view(-1)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_launch(group_size: int) -> tuple[int, int]:
    """(threads per block, chunks of 8 kept in registers per thread) for one group a block."""
    chunks = _cdiv(group_size, 8)
    threads = min(_MAX_GROUP_BLOCK, _cdiv(chunks, 32) * 32)
    return threads, (1 if chunks <= threads else 4)


def _check_bits_group(bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"zpp.quant.cuda: bits={bits!r} is not supported; expected 4 or 8")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise ValueError(f"zpp.quant.cuda: group_size={group_size!r} must be a positive even integer")


def _type_name(dtype: torch.dtype) -> str:
    try:
        return _TYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"zpp.quant.cuda: dtype {dtype} is not supported; expected float32, float16 or bfloat16"
        ) from None


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"zpp.quant.cuda: {what} must be a CUDA tensor (got {where})")
    return t.reshape(-1).contiguous()


def _empty_quantized(device: torch.device, symmetric: bool):
    return (
        torch.empty(0, dtype=torch.uint8, device=device),
        torch.empty((0,) if symmetric else (0, 2), dtype=torch.float32, device=device),
    )


class _StreamHandle:
    """A raw stream handle behind the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class _CudaKernels:
    """The kernel interface of zpp.quant.reference, on CUDA tensors."""

    NAME = NAME

    def __init__(self, cupy):
        self._cp = cupy
        self._source = source_path().read_text()
        self._functions: dict[int, dict[str, object]] = {}
        self._streams: dict[tuple[int, int], object] = {}
        self._lock = threading.Lock()

    # -- compilation and launch ------------------------------------------------------------

    def _module(self, index: int) -> dict[str, object]:
        funcs = self._functions.get(index)
        if funcs is not None:
            return funcs
        with self._lock:
            funcs = self._functions.get(index)
            if funcs is None:
                cp = self._cp
                try:
                    with cp.cuda.Device(index):
                        module = cp.RawModule(
                            code=self._source, options=_OPTIONS, name_expressions=list(_NAMES)
                        )
                        module.compile()
                        funcs = {name: module.get_function(name) for name in _NAMES}
                except Exception as exc:  # a compile error must not pass for a missing cupy
                    raise RuntimeError(
                        f"zpp.quant.cuda: compiling {source_path()} for device {index} failed: {exc}"
                    ) from exc
                self._functions[index] = funcs
        return funcs

    def _stream(self, index: int, handle: int):
        """cupy's view of torch's stream ``handle`` on device ``index`` (cached)."""
        key = (index, handle)
        stream = self._streams.get(key)
        if stream is None:
            cp = self._cp
            if handle == 0:
                stream = cp.cuda.Stream.null  # torch's default stream is the legacy one
            else:
                from_external = getattr(cp.cuda.Stream, "from_external", None)  # cupy >= 14
                if from_external is not None:
                    stream = from_external(_StreamHandle(handle))
                else:
                    stream = cp.cuda.ExternalStream(handle)
            self._streams[key] = stream
        return stream

    def _launch(self, device: torch.device, name: str, grid: int, block: int, args: tuple) -> None:
        if grid > _MAX_GRID:
            raise ValueError(f"zpp.quant.cuda: {grid} blocks exceed the launch limit")
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._module(index)[name]
        with self._cp.cuda.Device(index):
            stream = self._stream(index, torch.cuda.current_stream(index).cuda_stream)
            fn((grid,), (block,), args, stream=stream)

    # -- the kernel interface --------------------------------------------------------------

    def quantize(self, x: torch.Tensor, bits: int, group_size: int, symmetric: bool):
        x = _flat(x, "input")
        tname = _type_name(x.dtype)
        _check_bits_group(bits, group_size)
        symmetric = bool(symmetric)
        n = x.numel()
        if n == 0:
            return _empty_quantized(x.device, symmetric)
        vec = int(x.data_ptr() % 16 == 0)
        return self._quantize_groups(
            x.device, f"zq_quantize<{tname}, {{cache}}>", n, bits, group_size, symmetric,
            (_ptr(x), _i64(n), _i32(group_size), _i32(bits), _i32(symmetric), _i32(vec)),
        )

    def swizzle_quantize(self, x, nodes, ranks_per_node, chunk, bits, group_size, symmetric):
        x = _flat(x, "input")
        tname = _type_name(x.dtype)
        _check_bits_group(bits, group_size)
        symmetric = bool(symmetric)
        if nodes <= 0 or ranks_per_node <= 0 or chunk < 0:
            raise ValueError(
                f"zpp.quant.cuda: bad swizzle nodes={nodes} ranks_per_node={ranks_per_node} chunk={chunk}"
            )
        n = x.numel()
        total = nodes * ranks_per_node * chunk
        if n > total:
            raise ValueError(
                f"zpp.quant.cuda: {n} elements do not fit {nodes}x{ranks_per_node} chunks of {chunk}"
            )
        if total == 0:
            return _empty_quantized(x.device, symmetric)
        vec = int(n > 0 and x.data_ptr() % 16 == 0 and chunk % 8 == 0)
        return self._quantize_groups(
            x.device, f"zq_swizzle_quantize<{tname}, {{cache}}>", total, bits, group_size, symmetric,
            (_ptr(x), _i64(n), _i64(total), _i64(chunk), _i64(nodes * chunk), _i32(ranks_per_node),
             _i32(group_size), _i32(bits), _i32(symmetric), _i32(vec)),
        )

    def _quantize_groups(self, device, name, total, bits, group_size, symmetric, args):
        """Launches a one-block-per-group kernel ``name`` (``{cache}`` filled in) over ``total``
        elements with ``args`` followed by the payload and scales it allocates; returns those."""
        groups = _cdiv(total, group_size)
        data = _alloc((groups * group_size * bits // 8,), torch.uint8, device)
        scales = _alloc((groups,) if symmetric else (groups, 2), torch.float32, device)
        threads, cache = _group_launch(group_size)
        self._launch(device, name.format(cache=cache), groups, threads, args + (_ptr(data), _ptr(scales)))
        return data, scales

    def _sum_inputs(self, data, scales, total, bits, group_size, symmetric):
        """Validated flat payload and scales holding ``total`` elements."""
        data = _flat(data, "payload")
        scales = _flat(scales, "scales")
        _check_bits_group(bits, group_size)
        if data.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise TypeError("zpp.quant.cuda: payload must be uint8 and scales float32")
        if data.device != scales.device:
            raise ValueError(f"zpp.quant.cuda: payload on {data.device} but scales on {scales.device}")
        need_data = _cdiv(total * bits, 8)
        need_scales = _cdiv(total, group_size) * (1 if symmetric else 2)
        if data.numel() < need_data or scales.numel() < need_scales:
            raise ValueError(
                f"zpp.quant.cuda: {data.numel()} payload bytes / {scales.numel()} scales cannot "
                f"hold {total} elements (bits={bits}, group_size={group_size})"
            )
        return data, scales

    @staticmethod
    def _sum_args(data, scales, k, n, bits, group_size, symmetric, divisor) -> tuple:
        """The leading arguments of zq_dequant_sum and zq_requant_sum (a ZqSumLoader)."""
        align = 8 if bits == 8 else 4
        vec = int(group_size % 8 == 0 and (k == 1 or n % 8 == 0) and data.data_ptr() % align == 0)
        has_div = divisor != 1.0
        return (_ptr(data), _ptr(scales), _i64(n), _i32(k), _i32(group_size), _i32(bits),
                _i32(symmetric), _i32(vec), _i32(has_div), np.float32(divisor if has_div else 1.0))

    def _dequant_sum(self, data, scales, k, n, bits, group_size, symmetric, divisor, dtype):
        tname = _type_name(dtype)
        out = _alloc((n,), dtype, data.device)
        args = self._sum_args(data, scales, k, n, bits, group_size, symmetric, divisor)
        self._launch(data.device, f"zq_dequant_sum<{tname}>", _cdiv(_cdiv(n, 8), _BLOCK), _BLOCK,
                     args + (_ptr(out),))
        return out

    def dequantize(self, data, scales, numel, bits, group_size, symmetric, dtype):
        _type_name(dtype)
        symmetric = bool(symmetric)
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=data.device)
        data, scales = self._sum_inputs(data, scales, numel, bits, group_size, symmetric)
        return self._dequant_sum(data, scales, 1, numel, bits, group_size, symmetric, 1.0, dtype)

    def reduce_sum(self, data, scales, k, slice_numel, bits, group_size, symmetric, divisor,
                   requant_bits, requant_group_size, out_dtype):
        symmetric = bool(symmetric)
        if k < 1:
            raise ValueError(f"zpp.quant.cuda: k={k} slices; expected at least 1")
        n = slice_numel
        if requant_bits is None:
            _type_name(out_dtype)
        else:
            _check_bits_group(requant_bits, requant_group_size)
        if n == 0:
            if requant_bits is None:
                return torch.empty(0, dtype=out_dtype, device=data.device)
            return _empty_quantized(data.device, symmetric)
        data, scales = self._sum_inputs(data, scales, k * n, bits, group_size, symmetric)
        divisor = float(divisor)
        if requant_bits is None:
            return self._dequant_sum(data, scales, k, n, bits, group_size, symmetric, divisor, out_dtype)
        args = self._sum_args(data, scales, k, n, bits, group_size, symmetric, divisor)
        return self._quantize_groups(
            data.device, "zq_requant_sum<{cache}>", n, requant_bits, requant_group_size, symmetric,
            args + (_i32(requant_group_size), _i32(requant_bits)),
        )

    def pack_signs(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat(x, "input")
        _type_name(x.dtype)
        n = x.numel()
        nbytes = _cdiv(n, 8)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        out = _alloc((nbytes,), torch.uint8, x.device)
        self._pack_signs(x, None, n, 8 * nbytes, 0, out)
        return out

    def _pack_signs(self, x, feedback, numel, nbits, pad, packed) -> None:
        """zq_pack_signs: the signs of x, or with ``feedback = (error, scale, has_pending,
        pending)`` of x + error, which it then updates (onebit_compress's last pass)."""
        null = np.uint64(0)
        if feedback is None:
            fb_args, vec = (null, null, _i32(0), np.float32(0.0)), x.data_ptr() % 16 == 0
        else:
            error, scale, has_pending, pending = feedback
            fb_args = (_ptr(error), _ptr(scale), has_pending, pending)
            vec = x.data_ptr() % 16 == 0 and error.data_ptr() % 16 == 0
        self._launch(
            x.device, f"zq_pack_signs<{_type_name(x.dtype)}>", _cdiv(nbits // 8, _BLOCK), _BLOCK,
            (_ptr(x),) + fb_args + (_i64(numel), _i64(nbits), np.uint32(pad), _i32(vec), _ptr(packed)),
        )

    def unpack_signs(self, packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        packed = _flat(packed, "packed signs")
        _type_name(dtype)
        if packed.dtype != torch.uint8:
            raise TypeError(f"zpp.quant.cuda: packed signs dtype {packed.dtype} must be torch.uint8")
        if numel < 0 or packed.numel() < _cdiv(numel, 8):
            raise ValueError(f"zpp.quant.cuda: {packed.numel()} bytes cannot hold {numel} signs")
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=packed.device)
        return self._unpack_scaled(packed, None, 8, numel, dtype, _alloc((numel,), dtype, packed.device))

    def _unpack_scaled(self, packed, scales, chunk, numel, dtype, out):
        """zq_unpack_scaled into out: ``scales[e // chunk] * sign_e`` (``scales`` None: +-1)."""
        sptr = np.uint64(0) if scales is None else _ptr(scales)
        self._launch(
            packed.device, f"zq_unpack_scaled<{_type_name(dtype)}>", _cdiv(_cdiv(numel, 8), _BLOCK),
            _BLOCK, (_ptr(packed), sptr, _i64(chunk), _i64(numel), _i32(out.data_ptr() % 16 == 0), _ptr(out)),
        )
        return out

    # -- 1-bit error feedback ([Note: 1-bit kernels] in reference.py) ----------------------

    def onebit_compress(self, x: torch.Tensor, error: torch.Tensor, numel: int, out=None, pending=None):
        packed, scale, _ = self._onebit_compress(x, error, numel, out, pending)
        return packed, scale

    def _onebit_compress(self, x, error, numel, out=None, pending=None):
        """onebit_compress, also returning its fp64 scratch, whose element 0 ends up holding the
        sum of squares (tests compare it with the oracle's)."""
        x = _flat(x, "input")
        tname = _type_name(x.dtype)
        if (not isinstance(error, torch.Tensor) or error.device != x.device or error.dtype != torch.float32
                or error.dim() != 1 or not error.is_contiguous()):
            what = (f"{error.dtype} {tuple(error.shape)} on {error.device}" if isinstance(error, torch.Tensor)
                    else type(error).__name__)
            raise ValueError(f"zpp.quant.cuda: the error buffer must be a contiguous 1-D float32 tensor "
                             f"on {x.device} (got {what})")
        nerr = error.numel()
        if not 0 <= numel <= min(x.numel(), nerr) or nerr % 8:
            raise ValueError(f"zpp.quant.cuda: numel={numel} with x of {x.numel()} and an error buffer of "
                             f"{nerr} elements (a multiple of 8 is needed)")
        dev = x.device
        if out is None:
            packed = _alloc((nerr // 8,), torch.uint8, dev)
            scale = _alloc((1,), torch.float32, dev)
        else:
            packed = _out(out[0], (nerr // 8,), torch.uint8, dev, "packed signs out")
            scale = _out(out[1], (1,), torch.float32, dev, "scale out")
        lazy = pending is not None
        lazy_args = (_i32(lazy), np.float32(pending if lazy else 0.0))
        nparts = _cdiv(numel, _SUMSQ_BLOCK)
        partials = _alloc((max(nparts, 1),), torch.float64, dev)
        if nparts:
            self._launch(dev, f"zq_onebit_sumsq<{tname}>", nparts, _SUMSQ_THREADS,
                         (_ptr(x), _ptr(error), _i64(numel)) + lazy_args + (_ptr(partials),))
        self._launch(dev, "zq_onebit_scale", 1, _SUMSQ_THREADS,
                     (_ptr(partials), _i64(nparts), _i64(numel), _ptr(scale)))
        if nerr:
            self._pack_signs(x, (error, scale) + lazy_args, numel, nerr, 1, packed)
        return packed, scale, partials

    def _signs_inputs(self, packed, scales, chunk) -> tuple[torch.Tensor, torch.Tensor, int]:
        packed, scales = _flat(packed, "packed signs"), _flat(scales, "scales")
        if packed.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise TypeError(f"zpp.quant.cuda: packed signs must be uint8 and scales float32, got "
                            f"{packed.dtype} and {scales.dtype}")
        if packed.device != scales.device:
            raise ValueError(f"zpp.quant.cuda: packed signs on {packed.device} but scales on {scales.device}")
        k = scales.numel()
        if chunk <= 0 or chunk % 8 or packed.numel() != k * chunk // 8:
            raise ValueError(f"zpp.quant.cuda: {packed.numel()} packed bytes for k={k} scales x "
                             f"chunk={chunk} (a positive multiple of 8) / 8")
        return packed, scales, k

    def signs_weighted_sum(self, packed, scales, chunk: int, divisor: float, out=None) -> torch.Tensor:
        packed, scales, k = self._signs_inputs(packed, scales, chunk)
        if k < 1:
            raise ValueError("zpp.quant.cuda: signs_weighted_sum needs at least one scale")
        divisor = float(divisor)
        has_div = divisor != 1.0
        if out is None:
            out = _alloc((chunk,), torch.float32, packed.device)
        else:
            out = _out(out, (chunk,), torch.float32, packed.device, "signs_weighted_sum out")
        self._launch(
            packed.device, "zq_signs_weighted_sum", _cdiv(chunk // 8, _BLOCK), _BLOCK,
            (_ptr(packed), _ptr(scales), _i32(k), _i64(chunk), _i32(has_div),
             np.float32(divisor if has_div else 1.0), _i32(out.data_ptr() % 16 == 0), _ptr(out)),
        )
        return out

    def unpack_scaled(self, packed, scales, chunk: int, numel: int, dtype: torch.dtype, out=None) -> torch.Tensor:
        packed, scales, k = self._signs_inputs(packed, scales, chunk)
        _type_name(dtype)
        if not 0 <= numel <= k * chunk:
            raise ValueError(f"zpp.quant.cuda: numel={numel} exceeds {k} chunks of {chunk}")
        if out is None:
            out = _alloc((numel,), dtype, packed.device)
        else:
            out = _out(out, (numel,), dtype, packed.device, "unpack_scaled out")
        if numel == 0:
            return out
        return self._unpack_scaled(packed, scales, chunk, numel, dtype, out)


_instance: _CudaKernels | None = None
_instance_lock = threading.Lock()


def kernels() -> _CudaKernels:
    """The CUDA kernels (one shared instance). Raises ImportError without cupy (or without the
    kernel source), RuntimeError when the kernels do not compile for the current device."""
    global _instance
    if _instance is not None:
        return _instance
    with _instance_lock:
        if _instance is None:
            try:
                import cupy
            except ImportError as exc:
                raise ImportError(
                    f"zpp.quant: the CUDA kernels need cupy (pip install 'zpp[cuda12]' or "
                    f"'zpp[cuda13]'): {exc}"
                ) from exc
            inst = _CudaKernels(cupy)
            if torch.cuda.is_available():
                inst._module(torch.cuda.current_device())  # surface compile errors here
            _instance = inst
    return _instance
