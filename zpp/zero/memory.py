"""Accounting of the model-state bytes a rank holds (what ZeRO's memory formulas count)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from zpp.zero.comm_api import WeightGather
from zpp.zero.modes.base import Mode
from zpp.zero.unit import Unit


def model_state_bytes(units: Sequence[Unit], optimizer: torch.optim.Optimizer, modes: Iterable[Mode] = (),
                      gathers: Iterable[WeightGather] = ()) -> dict[str, int]:
    """Bytes of model states this rank holds now, each storage counted once: parameter
    storage (full buffers without sharded parameters; shards, what the ``gathers`` keep,
    hpZ's secondary shards, and gathered or prefetched buffers with them), gradients
    (``.grad`` tensors and reduced fp32 shards), fp32 masters that do not alias the
    parameters, and optimizer state tensors (scalars such as ``step`` excluded); each mode
    adds its own (:meth:`~zpp.zero.modes.base.Mode.state_bytes`: for a 1-bit optimizer its
    fused fp32 parameter and gradient copies, moments and error-feedback buffers under
    ``"optimizer"``).

    With the hierarchical mode a key ``"outer"`` adds its state
    (:meth:`~zpp.zero.outer.OuterSync.state_bytes`): for each rank's shard of ``Ψ/R``
    elements (``R`` ranks per node, the ZeRO degree in this mode) the fp32 synced weights
    (``4Ψ/R``), with momentum the fp32 outer momentum (``4Ψ/R``), the averaged
    pseudo-gradients of the syncs in flight (at most the fragments started within ``delay``
    steps) and, with 1-bit compression, the error feedback (about ``4Ψ/R (1 + 1/N)``)."""
    seen: set[int] = set()

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None or t.numel() == 0:
            return 0
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return t.untyped_storage().nbytes()

    out = dict(params=0, grads=0, master=0, optimizer=0)
    gathers = list({id(g): g for g in gathers}.values())
    for u in units:
        f = u.flat
        out["params"] += nbytes(f.full) + nbytes(f.shard) + sum(nbytes(t) for g in gathers for t in g.kept(f))
    for u in units:
        f = u.flat
        if f.master is not None:
            out["master"] += nbytes(f.master)
        out["grads"] += nbytes(f.grad) + sum(nbytes(p.grad) for p in u.params)
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out["optimizer"] += nbytes(v)
    for m in modes:
        for k, v in m.state_bytes(nbytes).items():
            out[k] = out.get(k, 0) + v
    return out
