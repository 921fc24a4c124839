"""Parameter access while sharded: every read of a partitioned parameter is seen.

[Note: parameter access]
With sharded parameters a parameter's ``.data`` is empty between uses. The engine gathers
whole units before a module's forward (:mod:`zpp.zero.hooks`), which covers every read
inside the module that planned the unit; a transformer block as one unit covers
``nn.MultiheadAttention`` reading ``out_proj.weight`` directly (see
:mod:`zpp.zero.planning`). Reads elsewhere (a tied embedding used through ``F.linear`` in
the parent's forward, a sibling's weight, a parameter read in the training loop) are caught
here:

* While a unit is SHARDED its parameters' class is swapped to an intercepting subclass of
  their own class (``nn.Parameter``, usually); :meth:`~zpp.zero.unit.Unit` swaps it back
  when the unit is gathered. So a gathered parameter costs nothing extra, and a sharded
  one runs ``__torch_function__`` for each torch function it is passed to.
* Every torch function a sharded parameter is passed to calls the owner's
  :meth:`AccessOwner.on_access` first, with the kind of access: ``"read"`` (any function
  that uses the values), ``"data"`` (the ``.data`` attribute: a tensor of the values, read or
  written later), ``"shape"`` (``shape``, ``size()``, ``numel()``...). Metadata
  (``.grad``, ``dtype``, hooks, ``data_ptr``...) passes through, and so does a move that
  returns the tensor itself (``.cpu()`` on the CPU, ``.to()`` its own dtype and device:
  ``module.cpu()`` at the end of a Lightning ``fit``). The engine gathers the
  unit (inside a forward or backward) or raises a ``RuntimeError`` naming the parameter
  (outside them; a shape read there just sees the empty tensor), so no computation ever
  sees an empty tensor. ``on_access`` may return a callback run after the function
  (:mod:`zpp.zero.init` partitions a parameter again right after an in-place
  initialization).

Why interception and not only larger units: blocks cover reads inside a block; they cannot
cover a weight shared between the root's forward and a child (GPT's tied ``lm_head``), a
model that reads a sibling's weight, or a read in the training loop, which must be an
error rather than an empty tensor (DeepSpeed intercepts access for the same reason; FSDP2
covers intra-block reads with blocks and leaves the rest to the user). Measured overhead
of the interception when nothing is read out of place: none on the gathered path (the
class swap is a pointer store per parameter per gather); see perf/BENCHMARKS.md for the
step times before and after.
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from zpp.zero.param_attrs import ZeroParamStatus, set_status

_PASSTHROUGH = frozenset({
    "__get__", "__set__", "__delete__", "data_ptr", "stride", "storage_offset", "is_contiguous",
    "element_size", "__hash__", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "__repr__", "__format__", "get_device", "is_floating_point", "is_complex", "untyped_storage",
    "_has_compatible_shallow_copy_type",
})
_SHAPE = frozenset({"size", "dim", "numel", "nelement", "__len__"})
#: moves that return the tensor itself when it is where and what they ask already (Lightning
#: calls ``module.cpu()`` at the end of ``fit``; DeepSpeed's partitioned parameters allow it)
_MOVES = frozenset({"cpu", "to", "cuda", "float", "half", "bfloat16", "double", "type"})
_SHAPE_PROPERTIES = frozenset({"shape", "ndim"})


class AccessOwner(abc.ABC):
    """What an engine does when a sharded parameter of its own is read."""

    @abc.abstractmethod
    def on_access(self, param: torch.nn.Parameter, what: str, kind: str) -> Callable[[], None] | None:
        """``param`` (sharded) is about to be accessed by ``what``; ``kind`` is "read",
        "data" or "shape" (see [Note: parameter access]). Gather it or raise; optionally
        return a callback to run once ``what`` returned."""


_OWNERS: dict[int, AccessOwner] = {}
_INTERCEPTING: dict[type, type] = {}


def register(params, owner: AccessOwner) -> None:
    """Route reads of ``params`` (while sharded) to ``owner``."""
    for p in params:
        _OWNERS[id(p)] = owner


def owned(param) -> bool:
    """Whether an engine routes the reads of ``param``."""
    return id(param) in _OWNERS


def owner_of(param) -> AccessOwner | None:
    """The engine's owner object of ``param`` (None: no engine holds it)."""
    return _OWNERS.get(id(param))


def unregister(params) -> None:
    """Stop routing ``params``; they get their own class back."""
    for p in params:
        _OWNERS.pop(id(p), None)
        base = _base_class(type(p))
        if base is not type(p):
            p.__class__ = base


def mark_sharded(params) -> None:
    """The parameters' data is empty now: intercept their reads."""
    for p in params:
        cls = type(p)
        if cls not in _INTERCEPTING.values():
            p.__class__ = _intercepting(cls)
    set_status(params, ZeroParamStatus.NOT_AVAILABLE)


def mark_gathered(params) -> None:
    """The parameters hold their full data: plain class again."""
    for p in params:
        base = _base_class(type(p))
        if base is not type(p):
            p.__class__ = base
    set_status(params, ZeroParamStatus.AVAILABLE)


def _base_class(cls: type) -> type:
    return cls.__bases__[0] if cls in _INTERCEPTING.values() else cls


def _intercepting(cls: type) -> type:
    sub = _INTERCEPTING.get(cls)
    if sub is None:
        sub = type(f"Sharded{cls.__name__}", (cls,), {"__torch_function__": classmethod(_torch_function),
                                                         "__module__": __name__})
        _INTERCEPTING[cls] = sub
    return sub


def _kind(func) -> str | None:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        prop = _property_name(func)
        return "shape" if prop in _SHAPE_PROPERTIES else "data" if prop == "data" else None
    if name in _PASSTHROUGH:
        return None
    return "shape" if name in _SHAPE else "read"


def _torch_function(cls, func, types, args=(), kwargs=None):
    kind = _kind(func)
    if kind is not None and getattr(func, "__name__", "") in _MOVES and args:
        with torch._C.DisableTorchFunctionSubclass():  # a move to where it is already: itself, nothing read
            out = func(*args, **(kwargs or {}))
        if out is args[0]:
            return out
    after = []
    if kind is not None:
        for p in _params_in(args, kwargs):
            owner = _OWNERS.get(id(p))
            if owner is not None and type(p) in _INTERCEPTING.values():
                done = owner.on_access(p, _describe(func), kind)
                if done is not None:
                    after.append(done)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    for done in after:
        done()
    return out


def _property_name(func: Any) -> str:
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _describe(func: Any) -> str:
    if getattr(func, "__name__", "") == "__get__":
        return f"Tensor.{_property_name(func)}"
    mod = getattr(func, "__module__", None) or ""
    return f"{mod}.{func.__name__}" if mod and not mod.startswith("torch._C") else getattr(func, "__name__", repr(func))


def _params_in(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.nn.Parameter):
                    yield b
