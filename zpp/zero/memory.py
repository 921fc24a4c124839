"""Accounting of the model-state bytes a rank holds (what ZeRO's memory formulas count)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zpp.optim._common import FusedOneBitOptimizer
from zpp.zero.outer.sync import OuterSync
from zpp.zero.unit import Unit


def model_state_bytes(units: Sequence[Unit], optimizer: torch.optim.Optimizer,
                      outer: OuterSync | None = None) -> dict[str, int]:
    """Bytes of model states this rank holds now, each storage counted once: parameter
    storage (full buffers without sharded parameters; shards, hpZ secondaries and gathered
    or prefetched buffers with them), gradients (``.grad`` tensors and reduced fp32 shards),
    fp32 masters that do not alias the parameters, and optimizer state tensors (scalars
    such as ``step`` excluded; for a 1-bit optimizer its fused fp32 parameter and gradient
    copies, moments and error-feedback buffers).

    With the hierarchical mode (``outer``) a key ``"outer"`` adds its state
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
    for u in units:
        f = u.flat
        out["params"] += nbytes(f.full) + nbytes(f.shard) + nbytes(f.secondary)
    for u in units:
        f = u.flat
        if f.master is not None:
            out["master"] += nbytes(f.master)
        out["grads"] += nbytes(f.grad) + sum(nbytes(p.grad) for p in u.params)
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out["optimizer"] += nbytes(v)
    if isinstance(optimizer, FusedOneBitOptimizer):
        o = optimizer
        owned = [o.flat.master, o.flat.grad, *o.buffers.values()]
        if o.compressor is not None:
            owned += [o.compressor.worker_error, o.compressor.server_error]
        out["optimizer"] += sum(nbytes(t) for t in owned)
    if outer is not None:
        out["outer"] = outer.state_bytes()
    return out
