"""Plain-torch quantization kernels, written for clarity: the oracle for every fast path.

Every function works on flat, contiguous tensors and follows the layout and arithmetic
documented in :mod:`zpp.quant.types` exactly; fast paths must match these bit for bit.
All functions here are the same "kernel" interface that :mod:`zpp.quant.cpu` and
:mod:`zpp.quant.cuda` implement:

* ``quantize(x, bits, group_size, symmetric) -> (data, scales)``
* ``dequantize(data, scales, numel, bits, group_size, symmetric, dtype) -> x``
* ``swizzle_quantize(x, nodes, ranks_per_node, chunk, bits, group_size, symmetric)``
* ``reduce_sum(data, scales, k, slice_numel, bits, group_size, symmetric, divisor,
  requant_bits, requant_group_size, out_dtype)``
* ``pack_signs(x) -> uint8`` and ``unpack_signs(packed, numel, dtype) -> +-1``
"""
from __future__ import annotations

import torch

NAME = "reference"


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _levels(bits: int) -> int:
    return (1 << bits) - 1


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 view (groups, group_size) of x, padded; and the validity mask of each element."""
    n = x.numel()
    groups = -(-n // group_size)
    pad = groups * group_size - n
    xf = x.reshape(-1).float()
    valid = torch.ones(groups * group_size, dtype=torch.bool, device=x.device)
    if pad:
        # Pad by repeating the last element: neither absmax nor min/max change.
        xf = torch.cat([xf, xf[-1:].expand(pad)])
        valid[n:] = False
    return xf.view(groups, group_size), valid.view(groups, group_size)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: int32 flat (two's complement or unsigned) -> uint8 payload."""
    if bits == 8:
        return (codes & 0xFF).to(torch.uint8)
    nib = (codes & 0xF).view(-1, 2)
    return (nib[:, 0] | (nib[:, 1] << 4)).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """uint8 payload -> int32 codes (sign-extended when symmetric)."""
    d = data.reshape(-1).to(torch.int32)
    if bits == 8:
        codes = d
    else:
        codes = torch.stack([d & 0xF, d >> 4], dim=1).reshape(-1)
    if symmetric:
        sign_bit = 1 << (bits - 1)
        codes = torch.where(codes >= sign_bit, codes - (1 << bits), codes)
    return codes


def quantize(x: torch.Tensor, bits: int, group_size: int, symmetric: bool):
    if x.numel() == 0:
        return (
            torch.empty(0, dtype=torch.uint8, device=x.device),
            torch.empty((0,) if symmetric else (0, 2), dtype=torch.float32, device=x.device),
        )
    g, valid = _grouped(x, group_size)
    nan = torch.tensor(float("nan"), device=x.device)
    if symmetric:
        absmax = g.abs().amax(dim=1)  # NaN propagates
        scale = absmax / torch.full_like(absmax, _qmax(bits))  # tensor / tensor: IEEE division on CUDA too
        scale = torch.where(torch.isfinite(scale), scale, nan)
        usable = (scale != 0) & torch.isfinite(scale)
        safe = torch.where(usable, scale, torch.ones_like(scale))
        codes = torch.round(g / safe[:, None])  # torch.round: half to even
        codes = torch.where(usable[:, None], codes, torch.zeros_like(codes))
        codes = codes.clamp(-_qmax(bits), _qmax(bits))
        scales = scale
    else:
        mn = g.amin(dim=1) + 0.0  # + 0.0: a zero min/max is +0 whatever the reduction order
        mx = g.amax(dim=1) + 0.0
        scale = (mx - mn) / torch.full_like(mx, _levels(bits))
        bad = ~(torch.isfinite(scale) & torch.isfinite(mn))
        scale = torch.where(bad, nan, scale)
        offset = torch.where(bad, nan, mn)
        usable = (scale != 0) & ~bad
        safe = torch.where(usable, scale, torch.ones_like(scale))
        codes = torch.round((g - torch.where(bad, torch.zeros_like(mn), mn)[:, None]) / safe[:, None])
        codes = torch.where(usable[:, None], codes, torch.zeros_like(codes))
        codes = codes.clamp(0, _levels(bits))
        scales = torch.stack([scale, offset], dim=1)
    codes = torch.where(valid, codes, torch.zeros_like(codes)).to(torch.int32)
    return _pack(codes.reshape(-1), bits), scales.contiguous()


def dequantize(data, scales, numel, bits, group_size, symmetric, dtype):
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=data.device)
    codes = _unpack(data, bits, symmetric).float().view(-1, group_size)
    if symmetric:
        out = codes * scales.view(-1, 1)
    else:
        s = scales.view(-1, 2)
        out = codes * s[:, 0:1]
        out = out + s[:, 1:2]
    return out.reshape(-1)[:numel].to(dtype)


def swizzle_quantize(x, nodes, ranks_per_node, chunk, bits, group_size, symmetric):
    """Quantize x laid out for the two-hop reduce-scatter.

    x (flat, numel <= nodes*ranks_per_node*chunk) is zero-padded to
    ``world*chunk`` elements and viewed as chunks ``(node, local, chunk)``; the chunks are
    reordered to ``(local, node, chunk)`` and the result is quantized. Part ``l`` of the
    payload (and of the scales), split ``ranks_per_node`` ways, then holds every node's
    chunk for local rank ``l``, in node order.
    """
    world = nodes * ranks_per_node
    total = world * chunk
    xf = torch.zeros(total, dtype=x.dtype, device=x.device)
    xf[: x.numel()] = x.reshape(-1)
    xs = xf.view(nodes, ranks_per_node, chunk).transpose(0, 1).contiguous().view(-1)
    return quantize(xs, bits, group_size, symmetric)


def reduce_sum(data, scales, k, slice_numel, bits, group_size, symmetric, divisor,
               requant_bits, requant_group_size, out_dtype):
    """Dequantize k equal slices, sum them in fp32 (in slice order), divide, and either
    requantize (``requant_bits`` set: returns (data, scales)) or return ``out_dtype``."""
    parts = dequantize(data, scales, k * slice_numel, bits, group_size, symmetric,
                       torch.float32).view(k, slice_numel)
    acc = parts[0].clone()
    for j in range(1, k):
        acc = acc + parts[j]
    if divisor != 1.0:
        acc = acc / torch.full_like(acc, divisor)
    if requant_bits is None:
        return acc.to(out_dtype)
    return quantize(acc, requant_bits, requant_group_size, symmetric)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit j (LSB first) of byte i is 1 where x[8*i + j] >= 0 (so -0.0 -> 1, NaN -> 0)."""
    n = x.numel()
    nbytes = -(-n // 8)
    bits = torch.zeros(nbytes * 8, dtype=torch.int32, device=x.device)
    bits[:n] = (x.reshape(-1) >= 0).to(torch.int32)
    weights = (1 << torch.arange(8, dtype=torch.int32, device=x.device))
    return (bits.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    bits = (packed.to(torch.int32)[:, None] >> shifts) & 1
    signs = bits.reshape(-1)[:numel].to(dtype) * 2 - 1
    return signs


# ---------------------------------------------------------------------- 1-bit building blocks
# [Note: 1-bit kernels] The error-feedback sign compression of zpp.comm.onebit, fused:
#   onebit_compress: b = x + e (fp32); scale = sqrt(sumsq / numel) with sumsq the fp64 sum of
#     b^2 in a fixed order (see _sum_squares); signs packed as pack_signs (b >= 0 -> 1, LSB
#     first); e = b - scale * sign(b), in place. Positions of e past numel are left alone
#     (they stay zero), and their bits are 1.
#     With ``pending=p`` (a float) the update is lazy: the buffer holds the previous call's b,
#     whose scale was p, so e = buf - where(buf >= 0, p, -p) first (p = 0 changes nothing: a
#     fresh or settled buffer), and on return the buffer holds the new b, the returned scale
#     being the next call's p. The same float operations in another order of calls, so a lazy
#     sequence equals the settled one bit for bit; a fast path saves a pass over memory.
#   signs_weighted_sum: m = sum_i scales[i] * sign_i, in rank order (i = 0 first), then / divisor.
#   unpack_scaled: out[j*chunk + k] = scales[j] * sign_j[k] for the first numel positions.
# The products are exact (a scale times +-1, an fp32 value squared in fp64) and every sum
# runs in a fixed order, so fast paths match these functions bit for bit, the scale included.
# Each function takes an optional ``out=`` (onebit_compress: a (packed, scale) pair) of the
# right size, dtype and device, which it fills and returns instead of allocating.

# Elements per block of the sum of squares (the C kernel's SUMSQ_BLOCK).
_SUMSQ_BLOCK = 2048


def _halving_sum(q: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two wide) by halving: q[..., :h] + q[..., h:] until 1."""
    while q.shape[-1] > 1:
        h = q.shape[-1] // 2
        q = q[..., :h] + q[..., h:]
    return q[..., 0]


def _sum_squares(b: torch.Tensor) -> torch.Tensor:
    """fp64 sum of b**2: b**2 (exact in fp64) zero-padded to whole blocks of _SUMSQ_BLOCK,
    each block summed by a halving tree; the block sums zero-padded to a power of two and
    summed by a halving tree. Fixed order: any implementation gets the same bits."""
    q = b.double().square()
    blocks = -(-q.numel() // _SUMSQ_BLOCK)
    q = torch.nn.functional.pad(q, (0, blocks * _SUMSQ_BLOCK - q.numel()))
    sums = _halving_sum(q.view(blocks, _SUMSQ_BLOCK))
    p2 = 1 << (blocks - 1).bit_length()
    return _halving_sum(torch.nn.functional.pad(sums, (0, p2 - blocks)))


def _into(out, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def settle(error: torch.Tensor, numel: int, pending: float) -> torch.Tensor:
    """The error a lazy buffer stands for: buf - where(buf >= 0, p, -p) on the first numel."""
    e = error[:numel]
    p = torch.full((), float(pending), dtype=torch.float32, device=error.device)
    return e - torch.where(e >= 0, p, -p)


def onebit_compress(x: torch.Tensor, error: torch.Tensor, numel: int, out=None, pending=None):
    e = error[:numel] if pending is None else settle(error, numel, pending)
    b = x.reshape(-1)[:numel].float() + e
    if numel:
        scale = (_sum_squares(b) / numel).sqrt().float()
    else:
        scale = torch.zeros((), dtype=torch.float32, device=error.device)
    full = torch.zeros(error.numel(), dtype=torch.float32, device=error.device)
    full[:numel] = b
    packed = pack_signs(full)
    error[:numel] = b - torch.where(b >= 0, scale, -scale) if pending is None else b
    if out is None:
        return packed, scale.reshape(1)
    return _into(out[0], packed), _into(out[1], scale.reshape(1))


def signs_weighted_sum(packed: torch.Tensor, scales: torch.Tensor, chunk: int, divisor: float,
                       out=None):
    k = scales.numel()
    signs = unpack_signs(packed, k * chunk, torch.float32).view(k, chunk)
    acc = signs[0] * scales[0]
    for i in range(1, k):
        acc = acc + signs[i] * scales[i]
    if divisor != 1.0:
        acc = acc / torch.full_like(acc, divisor)
    return _into(out, acc)


def unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int, dtype,
                  out=None):
    k = scales.numel()
    signs = unpack_signs(packed, k * chunk, torch.float32).view(k, chunk)
    return _into(out, (signs * scales.view(k, 1)).reshape(-1)[:numel].to(dtype))
