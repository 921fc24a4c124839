"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules`` and friends).

    from deepspeed.utils import set_z3_leaf_modules
    set_z3_leaf_modules(model, [MixtralSparseMoeBlock])   # before initialize

A leaf module is gathered whole before its forward and nothing inside it is gathered on its
own: a mixture-of-experts block whose router picks different experts on each rank would
otherwise issue different gathers on different ranks. The flag is DeepSpeed's
(``module._z3_leaf``); zpp's planner makes each outermost leaf module one unit (see
[Note: stage 3 units] in :mod:`zpp.zero.planning`). The config's
``zero_optimization.leaf_module`` section (classes, names, name suffixes) sets the same flag
at ``initialize``.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "apply_leaf_module_config", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]


#: DeepSpeed 0.19.8's default ``zero_optimization.leaf_module.classes``: mixture-of-experts
#: blocks whose router sends each rank's tokens to different experts.
DEFAULT_LEAF_MODULE_CLASSES = ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                               "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                               "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock")


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed marks them during its forward)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _qualified(m: torch.nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _matches(m: torch.nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(m, spec)
    return type(m).__name__ == spec or _qualified(m) == spec


def _set_by_class(model: torch.nn.Module, classes: Iterable[type | str], flag: bool,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"set_z3_leaf_modules: leaf_module_classes must be classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"set_z3_leaf_modules: no module of {classes!r} in the model; its classes are {present}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Flag every module that is an instance of one of ``leaf_module_classes`` (classes, or
    names: the class name or its ``module.qualname``); returns them."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[type | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def _set_by(model: torch.nn.Module, wanted: Iterable[str], hit, what: str, flag: bool,
            raise_if_not_found: bool) -> tuple[list[torch.nn.Module], list[str]]:
    wanted = list(wanted)
    found, used = [], set()
    for name, m in model.named_modules():
        keys = [w for w in wanted if hit(name, w)]
        if keys:
            m._z3_leaf = flag
            found.append(m)
            used.update(keys)
    missing = [w for w in wanted if w not in used]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_{what}: no module matches {missing}")
    return found, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named (as ``named_modules()`` names them); returns them and the names
    that matched nothing."""
    return _set_by(model, module_names, lambda n, w: n == w, "by_name", flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules whose name ends with one of the suffixes."""
    return _set_by(model, module_name_suffixes, lambda n, w: n.endswith(w), "by_suffix", flag,
                   raise_if_not_found)


def apply_leaf_module_config(model: torch.nn.Module, classes: Iterable[str], names: Iterable[str] = (),
                             name_suffixes: Iterable[str] = ()) -> list[torch.nn.Module]:
    """Flag the modules a ``zero_optimization.leaf_module`` section names (what matches
    nothing is skipped: the default classes are absent from most models; names and suffixes
    that match nothing are logged); returns the flagged modules."""
    from zpp.log import log_dist_once

    found = {id(m): m for m in _set_by_class(model, classes, True, False)}
    for what, wanted in (("by_name", names), ("by_suffix", name_suffixes)):
        hit = (lambda n, w: n == w) if what == "by_name" else (lambda n, w: n.endswith(w))
        mods, missing = _set_by(model, wanted, hit, what, True, False)
        found.update((id(m), m) for m in mods)
        if missing:
            log_dist_once(f"zero_optimization.leaf_module: {missing} match no module name", ranks=[0])
    return list(found.values())
