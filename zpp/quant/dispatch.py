"""Which kernel implementation serves a tensor.

CUDA tensors go to :mod:`zpp.quant.cuda` (cupy RawModule kernels); CPU tensors to the
fused host kernels of :mod:`zpp.quant.cpu` when they build on this machine, else to
:mod:`zpp.quant.reference`. ``ZPP_QUANT_IMPL=reference|cpu|cuda`` forces one. Every time a
fast path is unavailable and the reference serves instead, it is counted: see
:func:`fallback_counts`; it is never silent.
"""
from __future__ import annotations

import collections
import os
import warnings

import torch

from zpp.quant import reference

_fallbacks: collections.Counter[str] = collections.Counter()
_warned: set[str] = set()
_IMPLS = ("reference", "cpu", "cuda")


def _load(name: str):
    if name == "reference":
        return reference
    if name == "cpu":
        from zpp.quant import cpu

        return cpu.kernels()
    if name == "cuda":
        from zpp.quant import cuda

        return cuda.kernels()
    raise ValueError(f"ZPP_QUANT_IMPL={name!r} is not one of {_IMPLS}")


def kernels_for(device: torch.device):
    """The kernel module for tensors on ``device`` (cached by the loaders themselves)."""
    forced = os.environ.get("ZPP_QUANT_IMPL")
    if forced:
        return _load(forced)
    want = "cuda" if device.type == "cuda" else "cpu"
    try:
        return _load(want)
    except (ImportError, OSError, RuntimeError) as exc:
        _fall_back(want, f"the {want} kernels are unavailable ({exc})")
        return reference


def kernel(device: torch.device, name: str):
    """Function ``name`` of the kernels for ``device``. An implementation that lacks it
    falls back to the reference for that function alone, counted as ``"<impl>.<name>"``."""
    k = kernels_for(device)
    fn = getattr(k, name, None)
    if fn is not None:
        return fn
    _fall_back(f"{getattr(k, 'NAME', '?')}.{name}", f"the {getattr(k, 'NAME', '?')} kernels have no {name}")
    return getattr(reference, name)


def _fall_back(key: str, why: str) -> None:
    """Count a fallback to the reference under ``key``; warn the first time."""
    _fallbacks[key] += 1
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"zpp.quant: {why}; using the plain-torch reference (counted in "
                      f"zpp.quant.fallback_counts())", RuntimeWarning, stacklevel=4)


def fallback_counts() -> dict[str, int]:
    """How many quantization calls fell back to the reference, per wanted implementation."""
    return dict(_fallbacks)
