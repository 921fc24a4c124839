"""What the three 1-bit optimizers share: the fused fp32 buffer, the transport choice and
the checkpointed state. Each optimizer module only writes its update rule.

[Note: flat buffer]
Every parameter of every group, in group order, is laid out once in one fp32 buffer
(``FlatParams.master``); optimizer state (momentum, variance, ...) uses the same layout, so
one group is one contiguous slice and one parameter is one contiguous view. Each step:

1. ``sync_from_params``: fp32 parameters are copied into the buffer (the parameter is the
   truth); for bf16/fp16 parameters the fp32 buffer is the truth (a master copy) and only
   elements that changed outside the optimizer (``p != master.to(p.dtype)``) are taken
   from the parameter.
2. ``gather_grads``: every ``.grad`` is copied (as fp32) into one flat gradient buffer; a
   parameter without ``.grad`` contributes zeros, so every rank always communicates the
   same number of elements. (Parameters with ``requires_grad=False`` when the optimizer is
   built are not in the buffer and never touched.)
3. the algorithm updates ``master`` (and its state) with elementwise ops on group slices;
   only the flat buffer goes on the wire (one full-precision all-reduce or one 1-bit
   all-reduce per step).
4. ``write_params``: the new values are copied back (rounded to the parameter's dtype).

[Note: non-finite gradients]
Between steps 2 and 3 every rank checks its flat gradient for NaN and Inf and the ranks
agree with one 4-byte all-reduce (:func:`zpp.comm.nonfinite.any_rank_nonfinite`) *before*
any exchange of the gradient or momentum: a rank with a NaN never enters the 1-bit
exchange alone (its compressor would fail, and the error-feedback buffers of every rank
would take the NaN). If any rank's gradient is not finite, every rank skips the step:
nothing is communicated further, no state changes (moments, error-feedback buffers, step
and phase counters, parameters), ``overflow`` is True and ``skipped_steps`` counts it;
with ``nonfinite="raise"`` every rank then raises
:class:`~zpp.comm.nonfinite.NonFiniteGradientError`. ``nonfinite=None`` leaves the check
to the caller (the zpp engine checks every step itself, folding the flag into a
collective it runs anyway, and never calls ``step`` with non-finite gradients).

[Note: per-rank state]
The 1-bit all-reduce keeps a worker and a server error buffer that differ on every rank
(:class:`zpp.comm.onebit.OneBitAllReduce`), and 0/1 Adam's local steps make momentum and
parameters differ between synchronisations. So **every rank must save and load its own**
``state_dict()``; the dict records ``rank`` and ``world_size``. Loading a state saved by
another rank or at another world size restores everything replicated and resets the error
buffers (with a warning), as a fresh start of error feedback.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch

from zpp.comm.nonfinite import NonFiniteGradientError, any_rank_nonfinite, has_nonfinite
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.transport import Transport

__all__ = [
    "COMM_BACKENDS",
    "FlatParams",
    "FusedOneBitOptimizer",
    "adam_moments",
    "adamw_apply",
    "bias_corrections",
    "check_step",
    "resolve_transport",
    "segment_max",
    "segment_norms",
]

#: DeepSpeed's ``comm_backend_name`` values -> zpp transport registry names.
COMM_BACKENDS = {"torch": "torch", "nccl": "torch", "gloo": "torch", "mpi": "mpi"}
#: ``nonfinite=`` choices of the 1-bit optimizers; see [Note: non-finite gradients].
NONFINITE = ("skip", "raise", None)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_transport(transport: Transport | None, comm_backend_name: str, who: str) -> Transport:
    """``transport`` if given, else the world transport named by ``comm_backend_name``."""
    key = comm_backend_name.lower() if isinstance(comm_backend_name, str) else comm_backend_name
    if key not in COMM_BACKENDS:
        raise ValueError(
            f"{who}: comm_backend_name={comm_backend_name!r} is not one of {sorted(COMM_BACKENDS)}"
        )
    if transport is not None:
        if not isinstance(transport, Transport):
            raise TypeError(f"{who}: transport must be a zpp Transport, got {type(transport).__name__}")
        return transport
    from zpp.comm.registry import get_transport  # the registry owns process-group setup

    return get_transport(COMM_BACKENDS[key])


class FlatParams:
    """All parameters of an optimizer in one fp32 buffer; see [Note: flat buffer]."""

    def __init__(self, param_groups: list[dict], who: str) -> None:
        # Parameters that do not require grad at construction are left alone (never decayed).
        trained = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
        self.params: list[torch.Tensor] = [p for ps in trained for p in ps]
        if not self.params:
            raise ValueError(f"{who}: no parameter requires grad")
        device = self.params[0].device
        for i, p in enumerate(self.params):
            if p.dtype not in _PARAM_DTYPES:
                raise NotImplementedError(
                    f"{who}: parameter {i} has dtype {p.dtype}; supported: {list(_PARAM_DTYPES)}"
                )
            if p.device != device:
                raise ValueError(f"{who}: parameters on several devices ({device} and {p.device} at {i})")
        self.device = device
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        # (element slice, parameter index range) of each group
        self.group_slices: list[slice] = []
        self.group_params: list[range] = []
        first = 0
        for ps in trained:
            k = len(ps)
            self.group_params.append(range(first, first + k))
            self.group_slices.append(slice(self.offsets[first], self.offsets[first + k]))
            first += k
        self.master = torch.empty(self.numel, dtype=torch.float32, device=device)
        for p, v in zip(self.params, self.views(self.master)):
            v.copy_(p.detach().reshape(-1))
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.sizes_t = torch.tensor(self.sizes, device=device)

    def views(self, flat: torch.Tensor, params: Iterable[int] | None = None) -> list[torch.Tensor]:
        """One 1-D view of ``flat`` per parameter (all, or the indices ``params``)."""
        idx = range(len(self.params)) if params is None else params
        return [flat[self.offsets[i]:self.offsets[i + 1]] for i in idx]

    def segments(self, t: torch.Tensor, group: int) -> list[torch.Tensor]:
        """One view per parameter of ``group`` into ``t``, a tensor shaped like the group's slice."""
        base = self.group_slices[group].start
        return [t[self.offsets[i] - base:self.offsets[i + 1] - base] for i in self.group_params[group]]

    def rms(self, t: torch.Tensor, group: int | None = None) -> torch.Tensor:
        """Root mean square of each parameter's segment of ``t`` (0 for an empty one): ``t`` is
        shaped like the whole buffer, or like the slice of ``group``."""
        segs = self.views(t) if group is None else self.segments(t, group)
        sizes = self.sizes_t if group is None else self.sizes_t[self.group_params[group].start:self.group_params[group].stop]
        return segment_norms(segs) / sizes.clamp_min(1).sqrt()

    def per_element(self, per_param: torch.Tensor, group: int) -> torch.Tensor:
        """Expand one value per parameter of ``group`` to that group's elements."""
        r = self.group_params[group]
        return torch.repeat_interleave(per_param, self.sizes_t[r.start:r.stop])

    def sync_from_params(self) -> None:
        for p, v in zip(self.params, self.views(self.master)):
            src = p.detach().reshape(-1)
            if p.dtype == torch.float32:
                v.copy_(src)
            else:  # keep the master's extra bits unless the parameter was changed outside
                changed = src != v.to(p.dtype)
                if bool(changed.any()):
                    v.copy_(torch.where(changed, src.float(), v))

    def gather_grads(self) -> torch.Tensor:
        for p, v in zip(self.params, self.views(self.grad)):
            if p.grad is None:
                v.zero_()
            elif p.grad.is_sparse:
                raise NotImplementedError("1-bit optimizers: sparse gradients are not supported")
            else:
                v.copy_(p.grad.detach().reshape(-1))
        return self.grad

    def write_params(self) -> None:
        for p, v in zip(self.params, self.views(self.master)):
            p.detach().copy_(v.view(p.shape))


def segment_norms(segs: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each segment (0 for an empty one), as one fp32 tensor."""
    return torch.stack([s.norm() for s in segs])


def segment_max(segs: list[torch.Tensor], empty: float) -> torch.Tensor:
    """Max of each segment (``empty`` for an empty one), as one fp32 tensor."""
    return torch.stack([s.amax() if s.numel() else s.new_tensor(empty) for s in segs])


def adam_moments(m: torch.Tensor, v: torch.Tensor | None, grad: torch.Tensor, group: dict) -> None:
    """Adam's moments in place: ``m = beta1 m + (1 - beta1) g`` and, unless ``v`` is None,
    ``v = beta2 v + (1 - beta2) g^2``."""
    beta1, beta2 = group["betas"]
    m.lerp_(grad, 1.0 - beta1)
    if v is not None:
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def adamw_apply(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict, bc1: float, bc2_sqrt: float) -> None:
    """``x -= lr * (m / bc1) / (sqrt(v) / bc2_sqrt + eps)`` after decoupled weight decay
    ``x *= 1 - lr * weight_decay``; the op order of ``torch.optim.AdamW``."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd:
        x.mul_(1.0 - lr * wd)
    denom = (v.sqrt() / bc2_sqrt).add_(group["eps"])
    x.addcdiv_(m, denom, value=-lr / bc1)


def check_step(who: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{who}: {name}={value!r} must be an integer >= {minimum}")
    return value


def bias_corrections(group: dict, step: int, var_steps: int | None = None) -> tuple[float, float]:
    """Adam's ``1 - beta1**step`` and ``sqrt(1 - beta2**var_steps)`` (1.0 each when off)."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    beta1, beta2 = group["betas"]
    var_steps = step if var_steps is None else var_steps
    return 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** var_steps) if var_steps else 1.0


class FusedOneBitOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers: flat buffers, communication, step loop, checkpoints.

    The constructor takes the Adam hyperparameters every subclass shares (they become the
    param-group defaults, with ``group_defaults``) and creates Adam's two moments,
    ``buffers["exp_avg"]`` and ``buffers["exp_avg_sq"]``. A subclass adds its own named fp32
    ``buffers`` (or None until created) and ``scalars`` (ints/floats/lists that
    :meth:`state_dict` saves) and implements :meth:`_update`.
    """

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        transport: Transport | None,
        comm_backend_name: str,
        cuda_aware: bool,
        amsgrad: bool,
        nonfinite: str | None = "skip",
        **group_defaults,
    ) -> None:
        who = type(self).__name__
        if nonfinite not in NONFINITE:
            raise ValueError(f"{who}: nonfinite={nonfinite!r} must be one of {NONFINITE}")
        if amsgrad:
            raise NotImplementedError(f"{who}: amsgrad=True is not supported by the 1-bit optimizers")
        self._layout_fixed = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, **group_defaults)
        super().__init__(params, defaults)
        self.transport = resolve_transport(transport, comm_backend_name, who)
        self.comm_backend_name = comm_backend_name
        #: accepted for DeepSpeed config compatibility; zpp's transports choose staging.
        self.cuda_aware = bool(cuda_aware)
        self.flat = FlatParams(self.param_groups, who)
        self._layout_fixed = True
        for i, (g, sl) in enumerate(zip(self.param_groups, self.flat.group_slices)):
            mask = g.get("exp_avg_mask")
            if mask is not None and mask.numel() != sl.stop - sl.start:
                raise ValueError(f"{who}: exp_avg_mask of parameter group {i} has {mask.numel()} elements, its "
                                 f"parameters {sl.stop - sl.start}")
        self.step_count = 0  # completed optimizer steps
        #: what a step with NaN or Inf in some rank's gradient does; see [Note: non-finite gradients]
        self.nonfinite = nonfinite
        #: whether the latest step() was skipped for non-finite gradients (DeepSpeed's name)
        self.overflow = False
        #: steps skipped for non-finite gradients
        self.skipped_steps = 0
        n, dev = self.flat.numel, self.flat.device
        self.buffers: dict[str, torch.Tensor | None] = {
            "exp_avg": torch.zeros(n, dtype=torch.float32, device=dev),
            "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=dev),
        }
        self.scalars: dict[str, object] = {}
        self.compressor: OneBitAllReduce | None = None

    # ------------------------------------------------------------------ torch.optim API
    def add_param_group(self, param_group: dict) -> None:
        if self._layout_fixed:
            raise NotImplementedError(
                f"{type(self).__name__}: parameters are fused into one buffer at construction; "
                "add_param_group afterwards is not supported"
            )
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        who = type(self).__name__
        if not 0.0 <= g["lr"]:
            raise ValueError(f"{who}: lr={g['lr']!r} must be >= 0")
        if not 0.0 <= g["eps"]:
            raise ValueError(f"{who}: eps={g['eps']!r} must be >= 0")
        if not 0.0 <= g["weight_decay"]:
            raise ValueError(f"{who}: weight_decay={g['weight_decay']!r} must be >= 0")
        b = g["betas"]
        if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
            raise ValueError(f"{who}: betas={b!r} must be two numbers in [0, 1)")
        mask = g.get("exp_avg_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"{who}: exp_avg_mask must be a tensor, got {type(mask).__name__}")

    def mask_momentum(self, m: torch.Tensor) -> None:
        """Multiply each group's slice of the averaged momentum ``m`` by the group's
        ``exp_avg_mask`` (DeepSpeed's: rows a model never trains, such as BERT's position
        embeddings past the sequence length, keep an exact zero momentum instead of the
        compression error). A no-op for groups without one."""
        for _, g, sl in self.groups():
            mask = g.get("exp_avg_mask")
            if mask is None:
                continue
            m[sl].mul_(mask.reshape(-1).to(device=m.device, dtype=m.dtype))

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step: communicates, then updates every parameter (on every rank)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flat.sync_from_params()
        grad = self.flat.gather_grads()
        self.overflow = self.nonfinite is not None and any_rank_nonfinite(
            self.transport, has_nonfinite(grad), grad.device)
        if self.overflow:  # see [Note: non-finite gradients]
            self._skip()
            return loss
        self.step_count += 1
        self._update(grad, self.step_count)
        self.flat.write_params()
        return loss

    def _update(self, grad: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    def _skip(self) -> None:
        self.skipped_steps += 1
        who, step = type(self).__name__, self.step_count + 1
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"{who}: step {step}: gradients hold NaN or Inf on some rank; the step was not applied on any "
                "rank (nonfinite='raise'; 'skip' skips such steps)")
        if self.transport.rank == 0:
            from zpp.log import logger

            logger.warning(f"[zpp] {who}: skipping step {step}: gradients hold NaN or Inf on some rank "
                           f"(skipped so far: {self.skipped_steps})")

    def groups(self) -> list[tuple[int, dict, slice]]:
        """(index, param group, its slice of the flat buffer) of every non-empty group."""
        return [(i, g, sl) for i, (g, sl) in enumerate(zip(self.param_groups, self.flat.group_slices))
                if sl.stop > sl.start]

    # ------------------------------------------------------------------ communication
    def average(self, x: torch.Tensor) -> torch.Tensor:
        """Full-precision mean over ranks, in place."""
        self.transport.all_reduce(x, op="mean")
        return x

    def compress_average(self, x: torch.Tensor) -> torch.Tensor:
        """1-bit error-feedback mean over ranks, in place (exact with a single rank)."""
        if self.transport.world_size == 1:
            return x
        if self.compressor is None:
            self.compressor = OneBitAllReduce(self.flat.numel, self.transport, device=self.flat.device)
        return self.compressor(x)

    def reset_compression_error(self) -> None:
        """Forget the error-feedback buffers (a fresh OneBitAllReduce on next use)."""
        self.compressor = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's state (copies); see [Note: per-rank state]: save one per rank."""
        groups = []
        for g, r in zip(self.param_groups, self.flat.group_params):
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(r)})
        return {
            "algorithm": type(self).__name__,
            "rank": self.transport.rank,
            "world_size": self.transport.world_size,
            "numel": self.flat.numel,
            "step": self.step_count,
            "skipped_steps": self.skipped_steps,
            "param_groups": groups,
            "master": self.flat.master.clone(),
            "buffers": {k: (None if v is None else v.clone()) for k, v in self.buffers.items()},
            "scalars": _copy_scalars(self.scalars),
            "onebit": None if self.compressor is None else self.compressor.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` of the same optimizer class over the same parameters."""
        who = type(self).__name__
        sd = state_dict
        if sd.get("algorithm") != who:
            raise ValueError(f"{who}.load_state_dict: state is for algorithm={sd.get('algorithm')!r}")
        if sd.get("numel") != self.flat.numel:
            raise ValueError(f"{who}.load_state_dict: state has numel={sd.get('numel')}, optimizer has {self.flat.numel}")
        saved_groups = sd["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(r) for r in self.flat.group_params]:
            raise ValueError(
                f"{who}.load_state_dict: group sizes {[len(g['params']) for g in saved_groups]} differ from "
                f"{[len(r) for r in self.flat.group_params]}"
            )
        for g, saved in zip(self.param_groups, saved_groups):
            # the exp_avg_mask of the training script wins over a saved one (as DeepSpeed's)
            g.update({k: v for k, v in saved.items() if k not in ("params", "exp_avg_mask")})
        dev = self.flat.device
        self.flat.master.copy_(sd["master"])
        self.buffers = {k: (None if v is None else v.to(dev, torch.float32).clone()) for k, v in sd["buffers"].items()}
        self.scalars = _copy_scalars(sd["scalars"])
        self.step_count = int(sd["step"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.compressor = None
        if sd["onebit"] is not None and self.transport.world_size > 1:
            same = (sd["rank"], sd["world_size"]) == (self.transport.rank, self.transport.world_size)
            if same:
                self.compressor = OneBitAllReduce(self.flat.numel, self.transport, device=dev)
                self.compressor.load_state_dict(sd["onebit"])
            else:
                warnings.warn(
                    f"{who}.load_state_dict: state saved by rank {sd['rank']} of {sd['world_size']}, loaded on "
                    f"rank {self.transport.rank} of {self.transport.world_size}: the 1-bit error-feedback "
                    "buffers are reset (each rank should load its own state_dict)",
                    stacklevel=2,
                )
        # Parameters are not touched (as with torch optimizers): load the model's own
        # state_dict too; for bf16/fp16 the loaded fp32 master is kept wherever it agrees
        # with the parameter (see [Note: flat buffer]).


def _copy_scalars(scalars: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in scalars.items()}
