"""Compressed collectives, written once over :class:`~zpp.comm.transport.Transport`.

* :func:`quantized_all_gather` (qwZ): quantize the shard, all-gather payload and scales,
  dequantize. Plain counterpart: ``Transport.all_gather``. :func:`quantized_all_gather_async`
  starts it and dequantizes at ``wait()``; with a ``topology`` its all-gathers run in two
  hops (:func:`hierarchical_all_gather_async`).
* :func:`hierarchical_all_gather_async`: the all-gather in two hops, inter-node among the
  ranks of equal local rank, then intra-node, so each node's link carries every other
  node's shards once per rank of the node (``(N - 1) / N`` of the buffer per rank), not once
  per ring pass (``(W - 1) / W`` of it on gloo's and MPICH's ring); the result is the
  all-gather's, byte for byte.
* :func:`quantized_reduce_scatter` (qgZ): two all-to-all hops (intra-node, then inter-node)
  over int4/int8 payloads with a swizzled layout and a fused dequantize-sum-requantize in
  between. Plain counterparts: :func:`hierarchical_reduce_scatter` (the same two hops in full
  precision) and ``Transport.reduce_scatter``.
* :func:`quantized_all_reduce`: the mean, as :func:`quantized_reduce_scatter` then
  :func:`quantized_all_gather` of each rank's slice of the mean (the hierarchical mode's
  int8/int4 outer all-reduce). Plain counterpart: ``Transport.all_reduce(op="mean")``.
* The 1-bit error-feedback all-reduce lives in :mod:`zpp.comm.onebit`.

Each one books its transport traffic under its own name with the logical bytes of the data
it stands for (see [Note: what is counted] in :mod:`zpp.comm.counters`).

[Note: reduce-scatter layout]
For ``n`` input elements over ``W`` ranks, rank ``r`` owns elements
``[r*s, (r+1)*s)`` with ``s = ceil(n / W)`` (``out`` holds ``s`` elements; positions past
``n`` count as zeros). On the wire each slice is padded to ``chunk`` elements, ``s`` rounded
up to whole quantization groups, so no group spans two ranks. Ranks are node-major:
global rank ``node * R + local``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

import zpp.quant as zq
from zpp.comm.transport import Transport, Work, agreed, dtype_code
from zpp.quant.types import DEFAULT_GROUP_SIZE, check_params

_QAG_TAG = 0x514147  # "QAG": a quantized all-gather's agreement, told apart from other check_agree calls

__all__ = [
    "effective_group_size",
    "hierarchical_all_gather_async",
    "hierarchical_reduce_scatter",
    "quantized_all_gather",
    "quantized_all_gather_async",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "quantized_reduce_scatter_hops",
]


def effective_group_size(group_size: int, numel: int) -> int:
    """The quantization group a collective uses for ``numel`` elements per rank:
    ``group_size``, but no larger than the data rounded up to even, so a small shard is not
    padded to one large group (which would send more than the plain collective)."""
    check_params(8, group_size)
    return min(group_size, max(2, numel + (numel & 1)))


def quantized_all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    *,
    transport: Transport,
    bits: int = 8,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """qwZ: ``out`` (``world_size * shard.numel()`` elements) receives every rank's
    ``dequantize(quantize(shard))`` in rank order, exactly. Any shard size; fp32, fp16 or
    bf16 (``out`` may have another float dtype than ``shard``). The group size is
    :func:`effective_group_size` of ``group_size`` and the shard."""
    quantized_all_gather_async(out, shard, transport=transport, bits=bits, group_size=group_size).wait()
    return out


def two_hop(topology) -> bool:
    """Whether :func:`hierarchical_all_gather_async` over ``topology`` differs from the flat
    all-gather (more than one node, more than one rank per node)."""
    return topology is not None and topology.nodes > 1 and topology.ranks_per_node > 1


def hierarchical_all_gather_async(out: torch.Tensor, inp: torch.Tensor, *, topology,
                                  name: str = "hierarchical_all_gather") -> Work:
    """``out`` (``world_size * inp.numel()`` elements) receives every rank's ``inp`` in rank
    order, as ``topology.world.all_gather`` gives, in two hops: the all-gather over
    ``topology.inter`` (this rank's local rank on every node) starts now; ``wait()`` waits
    for it, runs the all-gather of its result over ``topology.intra`` and copies the
    ``(local, node)`` blocks into rank order (ranks are node-major). Booked under ``name``
    as one call (the intra hop, at ``wait()``, adds its bytes). Over a topology without two
    levels it is the world's all-gather."""
    world = topology.world
    if not two_hop(topology):
        return world.all_gather_async(out, inp)
    R, N, n = topology.ranks_per_node, topology.nodes, inp.numel()
    if out.numel() != world.world_size * n:
        raise ValueError(f"{name}: out has {out.numel()} elements, expected world_size*inp = "
                         f"{world.world_size}*{n}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous ({out.shape=} {out.stride()=})")
    first = torch.empty(N * n, dtype=inp.dtype, device=inp.device)
    with world.counters.collective(name, out.numel() * out.element_size()):
        work = topology.inter.all_gather_async(first, inp.reshape(-1))

    def finish() -> None:
        work.wait()
        second = torch.empty(R * N * n, dtype=inp.dtype, device=inp.device)
        with world.counters.collective(name, 0, continued=True):
            topology.intra.all_gather(second, first)
        out.view(N, R, n).copy_(second.view(R, N, n).transpose(0, 1))

    return world.adopt(Work(name, finish, asynchronous=work.asynchronous), out)


def quantized_all_gather_async(
    out: torch.Tensor,
    shard: torch.Tensor,
    *,
    transport: Transport,
    bits: int = 8,
    group_size: int = DEFAULT_GROUP_SIZE,
    topology=None,
) -> Work:
    """:func:`quantized_all_gather` started: the shard is quantized and the all-gather of its
    codes and scales (one message) is in flight when it returns; ``wait()`` waits for it and
    dequantizes into ``out``. Bytes are booked at the call (see [Note: asynchronous
    collectives] in :mod:`zpp.comm.transport`). With ``topology`` (of ``transport``) the
    all-gather runs in two hops (:func:`hierarchical_all_gather_async`; the intra-node hop
    at ``wait()``), with the same result."""
    world = transport.world_size
    if out.numel() != world * shard.numel():
        raise ValueError(
            f"quantized_all_gather: out has {out.numel()} elements, expected "
            f"world_size*shard = {world}*{shard.numel()}"
        )
    if not out.is_contiguous():
        raise ValueError(f"quantized_all_gather: out must be contiguous ({out.shape=} {out.stride()=})")
    group_size = effective_group_size(group_size, shard.numel())
    hops = 2 if two_hop(topology) else 1
    # padding hides a shard-size mismatch from the transport's own check; these values fix
    # every call below (op, sizes, dtypes), so the calls started at once skip their own
    # checks (see [Note: agreed calls] in zpp.comm.transport)
    transport.check_agree("quantized_all_gather",
                          (_QAG_TAG, shard.numel(), bits, group_size, dtype_code(shard.dtype), hops),
                          ("call", "shard numel", "bits", "group size", "dtype#", "hops"))
    q = zq.quantize(shard, bits=bits, group_size=group_size)
    # codes and scales travel as one message (one collective per hop instead of two: on a
    # slow or busy network each call costs its latency); the bytes are the same
    ncodes = q.data.numel()
    payload = torch.cat([q.data.reshape(-1), q.scales.reshape(-1).contiguous().view(torch.uint8)])
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=shard.device)
    with transport.counters.collective("quantized_all_gather", out.numel() * out.element_size()), agreed():
        if hops == 2:  # (its second hop, at wait(), checks itself)
            work = hierarchical_all_gather_async(gathered, payload, topology=topology, name="quantized_all_gather")
        else:
            work = transport.all_gather_async(gathered, payload)

    def finish() -> None:
        work.wait()  # a two-hop work books its intra-node hop as the rest of this call
        rows = gathered.view(world, payload.numel())  # (explicit: a shard may be empty)
        data = rows[:, :ncodes].contiguous().view(-1)
        scales = torch.empty(world, rows.shape[1] - ncodes, dtype=torch.uint8, device=rows.device)
        scales = scales.copy_(rows[:, ncodes:]).view(-1).view(torch.float32)  # (a fresh, aligned buffer)
        n = shard.numel()
        padded = q.groups * group_size
        # Every rank's payload is whole groups, so the gathered payload reads as one tensor.
        whole = zq.QuantizedTensor(data, scales, torch.Size((world * padded,)), shard.dtype, bits,
                                   group_size, True)
        if padded == n:
            out.view(-1).copy_(zq.dequantize(whole, dtype=out.dtype))
        else:
            full = zq.dequantize(whole, dtype=out.dtype).view(world, padded)
            out.view(world, n).copy_(full[:, :n])

    return transport.adopt(Work("quantized_all_gather", finish, asynchronous=work.asynchronous), out)


def _slices(out: torch.Tensor, inp: torch.Tensor, world: int, who: str) -> torch.Tensor:
    """``inp`` as ``(world, s)`` rank slices, zero-padded (see [Note: reduce-scatter layout])."""
    n = inp.numel()
    s = -(-n // world)
    if out.numel() != s:
        raise ValueError(
            f"{who}: out has {out.numel()} elements, expected ceil(inp.numel() / world_size) = "
            f"ceil({n} / {world}) = {s}"
        )
    if not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous ({out.shape=} {out.stride()=})")
    flat = inp.reshape(-1)
    if n == world * s:
        return flat.view(world, s)
    padded = torch.zeros(world * s, dtype=inp.dtype, device=inp.device)
    padded[:n] = flat
    return padded.view(world, s)


def quantized_reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    topology,
    bits: int = 4,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """qgZ: ``out`` receives this rank's slice of the MEAN of every rank's ``inp``.

    Hop 1, inside the node: quantize with the swizzled layout, all-to-all, so local rank
    ``l`` holds every local peer's chunks for the ranks ``(node, l)`` of every node; fused
    dequantize-sum-requantize. Hop 2, across nodes among ranks with the same local rank:
    all-to-all, dequantize, sum, divide by the world size. One node is one hop; one rank per
    node skips hop 1. Any ``inp`` size (see [Note: reduce-scatter layout]); the group size is
    :func:`effective_group_size` of ``group_size`` and the slice.
    """
    quantized_reduce_scatter_hops(out, inp, topology=topology, bits=bits, group_size=group_size).work.wait()
    return out


class Hops(NamedTuple):
    """:func:`quantized_reduce_scatter_hops`' result."""

    work: Work
    """``wait()`` runs the second hop and writes ``out``."""
    held_bytes: int
    """Bytes the second hop holds from the first's end to its own (the intra-node sum's
    codes and scales, their received copy, the fp32 sum of a slice); ``out`` not included."""


def quantized_reduce_scatter_hops(
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    topology,
    bits: int = 4,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Hops:
    """:func:`quantized_reduce_scatter` in two parts: the call runs hop 1 (the checks over
    ``topology.world``, the quantization and the intra-node exchange); ``wait()`` runs hop 2
    over ``topology.inter`` only and writes ``out``. Booked as one call (hop 2 adds its bytes
    as the rest of it).

    [Note: qgZ's hops pipelined]
    The two parts use disjoint communicators, so the ``wait()`` of one reduction may run on
    one thread while the next reduction's hop 1 runs on another (every rank issuing each
    communicator's calls in the same order): the overlapped reductions put the intra-node hop
    of unit k+1 beside the inter-node hop of unit k (:mod:`zpp.zero.reduce.overlap`). The
    bits are those of the call waited at once. The work is not adopted by the transport (the
    part at ``wait()`` may run on another thread than the call)."""
    world = topology.world
    W, R, N = world.world_size, topology.ranks_per_node, topology.nodes
    x = _slices(out, inp, W, "quantized_reduce_scatter")
    world.check_agree("quantized_reduce_scatter", (inp.numel(),), ("inp numel",))
    s = x.shape[1]
    group_size = effective_group_size(group_size, s)
    chunk = zq.reduce_scatter_chunk(inp.numel(), W, group_size)
    if chunk != s:  # pad every slice to whole groups
        x = torch.nn.functional.pad(x, (0, chunk - s))
    name, logical = "quantized_reduce_scatter", inp.numel() * inp.element_size()
    with world.counters.collective(name, logical):
        if s == 0:
            return Hops(Work(name), 0)
        q = zq.swizzle_quantize(x, nodes=N, ranks_per_node=R, bits=bits, group_size=group_size)
        if R > 1:
            q = _exchange(topology.intra, q, (R, N * chunk))
            if N == 1:
                mean = zq.dequantize_sum(q, divisor=float(W), dtype=out.dtype)
                out.view(-1).copy_(mean[:s])
                return Hops(Work(name), 0)
            q = zq.requantize_sum(q)
        else:
            q = q._replace(shape=torch.Size((N * chunk,)))

    def inter_node_hop() -> None:
        with world.counters.collective(name, 0, continued=True):
            recv = _exchange(topology.inter, q, (N, chunk))
            mean = zq.dequantize_sum(recv, divisor=float(W), dtype=out.dtype)
            out.view(-1).copy_(mean[:s])

    codes = q.data.numel() * q.data.element_size() + q.scales.numel() * q.scales.element_size()
    return Hops(Work(name, inter_node_hop, asynchronous=False), 2 * codes + 4 * chunk)


def _exchange(t: Transport, q: zq.QuantizedTensor, shape) -> zq.QuantizedTensor:
    """All-to-all of a quantized buffer split ``t.world_size`` ways (payload and scales);
    the result holds the received slices along dim 0."""
    data = torch.empty_like(q.data)
    scales = torch.empty_like(q.scales)
    t.all_to_all(data, q.data)
    t.all_to_all(scales, q.scales)
    return q._replace(data=data, scales=scales, shape=torch.Size(shape))


def hierarchical_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, *, topology) -> torch.Tensor:
    """The plain counterpart of :func:`quantized_reduce_scatter`: the same two all-to-all
    hops and layout in full precision (fp32 sums), so the inter-node bytes are ``1/R`` of a
    direct reduce-scatter's. ``out`` receives this rank's slice of the MEAN."""
    world = topology.world
    W, R, N = world.world_size, topology.ranks_per_node, topology.nodes
    x = _slices(out, inp, W, "hierarchical_reduce_scatter")
    world.check_agree("hierarchical_reduce_scatter", (inp.numel(),), ("inp numel",))
    s = x.shape[1]
    with world.counters.collective("hierarchical_reduce_scatter", inp.numel() * inp.element_size()):
        if s == 0:
            return out
        # (node, local, s) -> (local, node, s): part l goes to local rank l
        part = x.float().view(N, R, s).transpose(0, 1).contiguous()
        if R > 1:
            recv = torch.empty_like(part)
            topology.intra.all_to_all(recv, part)
            part = _ordered_sum(recv.view(R, N * s))
        recv = torch.empty(N * s, dtype=torch.float32, device=inp.device)
        topology.inter.all_to_all(recv, part.view(-1).contiguous())
        total = _ordered_sum(recv.view(N, s)) / float(W)
        out.view(-1).copy_(total)
    return out


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    acc = parts[0].clone()
    for j in range(1, parts.shape[0]):
        acc += parts[j]
    return acc


def quantized_all_reduce(
    t: torch.Tensor,
    *,
    topology,
    bits: int = 8,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """``t`` (contiguous, any size, fp32/fp16/bf16) replaced in place by the mean over
    ``topology.world`` of every rank's ``t``, approximately: :func:`quantized_reduce_scatter`
    gives this rank its slice of the mean ([Note: reduce-scatter layout]), and
    :func:`quantized_all_gather` of the slices, quantized once more, rebuilds the whole.

    [Note: quantized all-reduce error]
    Per element, the error is the reduce-scatter's (qgZ's two-stage bound) plus half a
    quantization step of the slice group of the mean it was gathered from: at most
    ``absmax(mean group + its first error) / (2**bits - 2)``. Every rank ends with the same
    values (the all-gather is exact in what it sends). Bytes per rank on the wire: about
    ``2 (W-1)/W * n * bits/8`` plus one fp32 scale per group and hop, against ``2 (W-1)/W * 4n``
    for the fp32 all-reduce; booked as ``quantized_all_reduce`` with the logical bytes of
    ``t``.
    """
    world = topology.world
    if not t.is_contiguous():
        raise ValueError(f"quantized_all_reduce: t must be contiguous ({t.shape=} {t.stride()=})")
    n, W = t.numel(), world.world_size
    if W == 1 or n == 0:
        return t
    s = -(-n // W)
    part = torch.empty(s, dtype=torch.float32, device=t.device)
    full = torch.empty(W * s, dtype=torch.float32, device=t.device)
    with world.counters.collective("quantized_all_reduce", n * t.element_size()):
        quantized_reduce_scatter(part, t, topology=topology, bits=bits, group_size=group_size)
        quantized_all_gather(full, part, transport=world, bits=bits, group_size=group_size)
    t.view(-1).copy_(full[:n])
    return t
