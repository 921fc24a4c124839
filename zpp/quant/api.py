"""zpp.quant's public functions: validation, then the kernels of the tensor's device."""
from __future__ import annotations

import math

import torch

from zpp.quant.dispatch import kernel, kernels_for
from zpp.quant.types import (
    DEFAULT_GROUP_SIZE,
    QuantizedTensor,
    check_dtype,
    check_params,
    check_quantized,
)


def _flat(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"zpp.quant: expected a torch.Tensor, got {type(x).__name__}")
    check_dtype(x.dtype)
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    group_size: int = DEFAULT_GROUP_SIZE,
    symmetric: bool = True,
) -> QuantizedTensor:
    """Block-quantize ``x`` (fp32, fp16 or bf16; any shape, contiguous or not).

    One fp32 scale per ``group_size`` elements of the flattened tensor (scale and offset
    when ``symmetric=False``); the last group is padded. See :mod:`zpp.quant.types` for
    the exact layout and arithmetic.
    """
    check_params(bits, group_size)
    flat = _flat(x)
    data, scales = kernels_for(flat.device).quantize(flat, bits, group_size, bool(symmetric))
    return QuantizedTensor(data, scales, x.shape, x.dtype, bits, group_size, bool(symmetric))


def dequantize(q: QuantizedTensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild a tensor of ``q``'s shape, in ``dtype`` (default: the original dtype)."""
    check_quantized(q)
    dtype = q.dtype if dtype is None else dtype
    check_dtype(dtype, "output")
    out = kernels_for(q.data.device).dequantize(
        q.data.reshape(-1), q.scales.reshape(-1), q.numel, q.bits, q.group_size, q.symmetric, dtype
    )
    return out.view(q.shape)


def reduce_scatter_chunk(numel: int, world: int, group_size: int) -> int:
    """Elements per rank of a quantized reduce-scatter of ``numel`` elements over ``world``
    ranks: ``ceil(numel / world)`` rounded up to whole groups, so no group spans two ranks."""
    if world <= 0:
        raise ValueError(f"zpp.quant: world={world} must be positive")
    per_rank = -(-numel // world)
    return -(-per_rank // group_size) * group_size


def swizzle_quantize(
    x: torch.Tensor,
    *,
    nodes: int,
    ranks_per_node: int,
    bits: int = 4,
    group_size: int = DEFAULT_GROUP_SIZE,
    symmetric: bool = True,
) -> QuantizedTensor:
    """Quantize ``x`` for the two-hop (intra-node, then inter-node) reduce-scatter.

    ``x`` is flattened and zero-padded to ``world * chunk`` elements (``chunk`` from
    :func:`reduce_scatter_chunk`), read as chunks ``[node][local]``, and laid out as
    ``[local][node]``. The result has shape ``(ranks_per_node, nodes, chunk)``; splitting its
    payload and scales ``ranks_per_node`` ways gives local rank ``l`` every node's chunk for
    local rank ``l``, ready for an intra-node all-to-all.
    """
    check_params(bits, group_size)
    for name, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"zpp.quant: {name}={v!r} must be a positive integer")
    flat = _flat(x)
    chunk = reduce_scatter_chunk(flat.numel(), nodes * ranks_per_node, group_size)
    data, scales = kernels_for(flat.device).swizzle_quantize(
        flat, nodes, ranks_per_node, chunk, bits, group_size, bool(symmetric)
    )
    shape = torch.Size((ranks_per_node, nodes, chunk))
    return QuantizedTensor(data, scales, shape, x.dtype, bits, group_size, bool(symmetric))


def _slices(q: QuantizedTensor) -> tuple[int, int]:
    check_quantized(q)
    if len(q.shape) < 1 or q.shape[0] < 1:
        raise ValueError(f"zpp.quant: expected k >= 1 slices along dim 0, got shape={tuple(q.shape)}")
    k = q.shape[0]
    slice_numel = q.numel // k
    if slice_numel % q.group_size:
        raise ValueError(
            f"zpp.quant: each of the k={k} slices must hold whole groups; slice numel "
            f"{slice_numel} is not a multiple of group_size={q.group_size}"
        )
    return k, slice_numel


def requantize_sum(
    q: QuantizedTensor, *, bits: int | None = None, group_size: int | None = None
) -> QuantizedTensor:
    """Fused dequantize -> fp32 sum over dim 0 (in order) -> requantize, in one pass.

    ``q`` holds ``k`` slices along dim 0 (e.g. what an all-to-all delivered); the result has
    shape ``q.shape[1:]``, with ``bits``/``group_size`` defaulting to ``q``'s.
    """
    k, slice_numel = _slices(q)
    bits = q.bits if bits is None else bits
    group_size = q.group_size if group_size is None else group_size
    check_params(bits, group_size)
    data, scales = kernels_for(q.data.device).reduce_sum(
        q.data.reshape(-1), q.scales.reshape(-1), k, slice_numel, q.bits, q.group_size,
        q.symmetric, 1.0, bits, group_size, torch.float32,
    )
    return QuantizedTensor(data, scales, torch.Size(q.shape[1:]), q.dtype, bits, group_size, q.symmetric)


def dequantize_sum(
    q: QuantizedTensor, *, divisor: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize ``k`` slices along dim 0, sum in fp32 (in order), divide by ``divisor``."""
    k, slice_numel = _slices(q)
    check_dtype(dtype, "output")
    out = kernels_for(q.data.device).reduce_sum(
        q.data.reshape(-1), q.scales.reshape(-1), k, slice_numel, q.bits, q.group_size,
        q.symmetric, float(divisor), None, None, dtype,
    )
    return out.view(q.shape[1:])


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 bit per element, 8 per byte: bit ``j`` (LSB first) of byte ``i`` is set where
    ``x.flatten()[8*i + j] >= 0`` (``-0.0`` counts as positive, NaN as negative)."""
    flat = _flat(x)
    return kernels_for(flat.device).pack_signs(flat)


def unpack_signs(packed: torch.Tensor, numel: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a flat tensor of ``numel`` values in {-1, +1}."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"zpp.quant: packed signs dtype {packed.dtype} must be torch.uint8")
    check_dtype(dtype, "output")
    if numel < 0 or packed.numel() != -(-numel // 8):
        raise ValueError(
            f"zpp.quant: {packed.numel()} packed bytes cannot hold numel={numel} signs "
            f"(expected {-(-max(numel, 0) // 8)})"
        )
    return kernels_for(packed.device).unpack_signs(packed.reshape(-1).contiguous(), numel, dtype)


def onebit_compress(
    x: torch.Tensor, error: torch.Tensor, *, numel: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, pending: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-feedback sign compression, fused (see [Note: 1-bit kernels] in reference.py).

    ``b = x + error``; returns ``(packed signs of b, scale)`` with
    ``scale = sqrt(mean(b**2))`` (a 1-element fp32 tensor) and updates ``error`` in place to
    ``b - scale * sign(b)``. ``error`` is fp32, contiguous, with ``numel`` (Default:
    ``x.numel()``) real elements followed by zero padding to a multiple of 8; the packed signs
    cover all of it (padding bits are 1).

    ``out``: a (uint8 packed signs of ``error.numel() / 8`` bytes, 1-element fp32 scale) pair to
    fill instead of allocating. ``pending``: the lazy form; ``error`` then holds the previous
    call's ``b`` and ``pending`` that call's scale (0.0 for a fresh buffer), and on return it
    holds this call's ``b``: pass the returned scale as the next call's ``pending``, and
    :func:`zpp.quant.reference.settle` gives the error it stands for. Bit for bit the same
    results as the eager form, one pass over memory fewer.
    """
    flat = _flat(x)
    numel = flat.numel() if numel is None else numel
    if error.dtype != torch.float32 or not error.is_contiguous() or error.dim() != 1:
        raise TypeError(f"zpp.quant: error buffer must be a contiguous 1-D float32 tensor, got "
                        f"{error.dtype} {tuple(error.shape)}")
    if not 0 <= numel <= min(flat.numel(), error.numel()) or error.numel() % 8:
        raise ValueError(f"zpp.quant: numel={numel} with x of {flat.numel()} and an error buffer of "
                         f"{error.numel()} elements (a multiple of 8 is needed)")
    if error.device != flat.device:
        raise ValueError(f"zpp.quant: x on {flat.device} but error buffer on {error.device}")
    if out is not None:
        _check_out(out[0], error.numel() // 8, torch.uint8, flat.device, "onebit_compress signs")
        _check_out(out[1], 1, torch.float32, flat.device, "onebit_compress scale")
    if pending is not None:
        pending = float(pending)
        if not math.isfinite(pending) or pending < 0:
            raise ValueError(f"zpp.quant: pending={pending} must be a finite scale >= 0")
    return kernel(flat.device, "onebit_compress")(flat, error, numel, out=out, pending=pending)


def signs_weighted_sum(
    packed: torch.Tensor, scales: torch.Tensor, *, chunk: int, divisor: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_i scales[i] * sign_i / divisor`` (fp32, rank order) over ``k = scales.numel()``
    packed sign vectors of ``chunk`` elements each, laid back to back in ``packed``; into
    ``out`` (``chunk`` fp32 elements) when given."""
    if _check_signs(packed, scales, chunk) == 0:
        raise ValueError("zpp.quant: signs_weighted_sum needs at least one scale")
    if out is not None:
        _check_out(out, chunk, torch.float32, packed.device, "signs_weighted_sum")
    fn = kernel(packed.device, "signs_weighted_sum")
    return fn(packed.reshape(-1), scales.reshape(-1), chunk, float(divisor), out=out)


def unpack_scaled(
    packed: torch.Tensor, scales: torch.Tensor, *, chunk: int, numel: int,
    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first ``numel`` of ``scales[j] * sign_j`` laid out chunk after chunk; into ``out``
    (``numel`` contiguous elements of ``dtype``) when given."""
    k = _check_signs(packed, scales, chunk)
    check_dtype(dtype, "output")
    if not 0 <= numel <= k * chunk:
        raise ValueError(f"zpp.quant: numel={numel} exceeds {k} chunks of {chunk}")
    if out is not None:
        _check_out(out, numel, dtype, packed.device, "unpack_scaled")
    return kernel(packed.device, "unpack_scaled")(packed.reshape(-1), scales.reshape(-1), chunk,
                                                 numel, dtype, out=out)


def _check_out(out: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.numel() != numel \
            or out.device != device or not out.is_contiguous():
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"zpp.quant: {what} out= must be a contiguous {dtype} tensor of {numel} "
                         f"elements on {device}, got {got}")


def _check_signs(packed: torch.Tensor, scales: torch.Tensor, chunk: int) -> int:
    if packed.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"zpp.quant: packed signs must be uint8 and scales float32, got "
                        f"{packed.dtype} and {scales.dtype}")
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"zpp.quant: chunk={chunk} must be a positive multiple of 8")
    k = scales.numel()
    if packed.numel() != k * chunk // 8:
        raise ValueError(f"zpp.quant: {packed.numel()} packed bytes, expected {k} scales x "
                         f"chunk={chunk} / 8 = {k * chunk // 8}")
    if not packed.is_contiguous() or not scales.is_contiguous():
        raise ValueError("zpp.quant: packed signs and scales must be contiguous")
    return k
