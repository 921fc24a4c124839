"""The quantized-tensor container and the checks shared by every implementation.

Layout (the same for every implementation, so payloads are interchangeable):

* The input is flattened (row-major) and cut into groups of ``group_size`` elements. The
  last group is padded; padded positions hold code 0 and do not enter the group's
  statistics.
* ``bits=8``: one byte per element. Symmetric codes are two's-complement bytes in
  [-127, 127]; asymmetric codes are unsigned in [0, 255].
* ``bits=4``: two elements per byte. Element ``2*i`` sits in the LOW nibble of byte ``i``,
  element ``2*i + 1`` in the HIGH nibble. Symmetric codes are 4-bit two's complement in
  [-7, 7]; asymmetric codes are unsigned in [0, 15].
* ``scales`` is fp32: shape ``(groups,)`` when symmetric, ``(groups, 2)`` holding
  ``(scale, offset)`` when asymmetric.
* Symmetric: ``scale = absmax / (2**(bits-1) - 1)``, ``code = rint(x / scale)`` (round half
  to even), ``x' = code * scale``. Asymmetric: ``scale = (max - min) / (2**bits - 1)``,
  ``offset = min``, ``code = rint((x - min) / scale)``, ``x' = code * scale + offset`` (two
  roundings, never a fused multiply-add). A zero scale gives code 0. A group holding NaN or
  +-Inf (or, asymmetric, whose range overflows fp32) gets scale NaN (and offset NaN), code 0,
  so it dequantizes to NaN. Only NaN's position is part of the contract, not its bit pattern
  (torch's own fp32 -> bf16 conversions disagree on it).
* A zero minimum or maximum is +0 (never -0) whatever the reduction order.
* Divisions are IEEE divisions (never a multiplication by a reciprocal).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_BITS = (4, 8)
DEFAULT_GROUP_SIZE = 2048


class QuantizedTensor(NamedTuple):
    """A block-quantized tensor: what goes on the wire, plus what is needed to read it."""

    data: torch.Tensor
    """Packed codes, uint8, ``groups * group_size * bits / 8`` bytes (see module notes)."""
    scales: torch.Tensor
    """fp32, ``(groups,)`` symmetric or ``(groups, 2)`` = (scale, offset) asymmetric."""
    shape: torch.Size
    """Shape of the original tensor."""
    dtype: torch.dtype
    """dtype of the original tensor (the default of ``dequantize``)."""
    bits: int
    group_size: int
    symmetric: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def groups(self) -> int:
        return num_groups(self.numel, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: payload plus scales (and offsets)."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def payload_bytes(numel: int, bits: int, group_size: int) -> int:
    """Payload bytes of a quantized tensor of ``numel`` elements (padding included)."""
    return num_groups(numel, group_size) * group_size * bits // 8


def scale_count(numel: int, group_size: int, symmetric: bool) -> int:
    return num_groups(numel, group_size) * (1 if symmetric else 2)


def quantized_nbytes(numel: int, bits: int, group_size: int, symmetric: bool = True) -> int:
    """Wire bytes of ``quantize`` on ``numel`` elements, without quantizing anything."""
    return payload_bytes(numel, bits, group_size) + 4 * scale_count(numel, group_size, symmetric)


def check_dtype(dtype: torch.dtype, what: str = "input") -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"zpp.quant: {what} dtype {dtype} is not supported; expected one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )


def check_params(bits: int, group_size: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"zpp.quant: bits={bits!r} is not supported; expected one of {SUPPORTED_BITS}")
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or group_size % 2
    ):
        raise ValueError(f"zpp.quant: group_size={group_size!r} must be a positive even integer")


def check_quantized(q: QuantizedTensor) -> None:
    """Validate a QuantizedTensor's payload and scales against its metadata."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"zpp.quant: expected a QuantizedTensor, got {type(q).__name__}")
    check_params(q.bits, q.group_size)
    check_dtype(q.dtype, "original")
    if q.data.dtype != torch.uint8:
        raise TypeError(f"zpp.quant: payload dtype {q.data.dtype} must be torch.uint8")
    if q.scales.dtype != torch.float32:
        raise TypeError(f"zpp.quant: scales dtype {q.scales.dtype} must be torch.float32")
    want_data = payload_bytes(q.numel, q.bits, q.group_size)
    if q.data.numel() != want_data:
        raise ValueError(
            f"zpp.quant: payload has {q.data.numel()} bytes, expected {want_data} for "
            f"shape={tuple(q.shape)} bits={q.bits} group_size={q.group_size}"
        )
    want_scales = scale_count(q.numel, q.group_size, q.symmetric)
    if q.scales.numel() != want_scales:
        raise ValueError(
            f"zpp.quant: scales have {q.scales.numel()} values, expected {want_scales} for "
            f"shape={tuple(q.shape)} group_size={q.group_size} symmetric={q.symmetric}"
        )
    if q.data.device != q.scales.device:
        raise ValueError(f"zpp.quant: payload on {q.data.device} but scales on {q.scales.device}")
