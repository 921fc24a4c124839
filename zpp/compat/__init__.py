"""DeepSpeed's module tree, as zpp: the compatibility layer.

Everything a DeepSpeed script (or the Hugging Face Trainer, accelerate, Lightning) imports by
DeepSpeed's paths lives here, over zpp's own layers (zpp.zero, zpp.comm, zpp.optim,
zpp.quant, zpp.tune), which import nothing from it:

* ``accelerator``, ``runtime`` (config, lr_schedules, zero.partition_parameters...), ``ops``
  (adam, op_builder), ``moe``, ``utils``, ``checkpoint``, ``pipe``, ``checkpointing``,
  ``arguments``, ``git_version_info``: DeepSpeed's names, each a thin layer over zpp;
* ``unsupported``: what zpp refuses, with what to use instead;
* ``as_deepspeed`` and ``run_command`` (``zpp run``): ``import deepspeed`` giving zpp.

[Note: compat aliases]
Each of these modules is also importable one level up, as DeepSpeed's path with ``zpp`` for
``deepspeed`` (``zpp.runtime.zero.config`` is ``zpp.compat.runtime.zero.config``, the same
module object, so ``isinstance`` checks, module state and pickled references hold under
either name). :class:`ModuleAlias`, put first on ``sys.meta_path`` by ``import zpp``, maps
one prefix onto another: here ``zpp.<name>`` -> ``zpp.compat.<name>`` for :data:`NAMES`;
:mod:`zpp.compat.as_deepspeed` uses it again for ``deepspeed.<name>`` -> ``zpp.<name>``.
Being first matters: the path finder would otherwise load a second copy of a submodule
(``zpp.runtime.zero``) from its parent's ``__path__``.

Importing this package imports nothing but the standard library.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

__all__ = ["NAMES", "ModuleAlias", "install", "public_name", "real_name"]

#: The modules of this package that are also ``zpp.<name>`` (see [Note: compat aliases]).
NAMES = ("accelerator", "arguments", "as_deepspeed", "checkpoint", "checkpointing", "git_version_info", "moe",
         "ops", "pipe", "run_command", "runtime", "unsupported", "utils")
_PUBLIC = "zpp."
_REAL = "zpp.compat."


def real_name(fullname: str) -> str:
    """``zpp.runtime.config`` -> ``zpp.compat.runtime.config``; any other name unchanged."""
    if fullname.startswith(_PUBLIC) and fullname.split(".")[1] in NAMES:
        return _REAL + fullname[len(_PUBLIC):]
    return fullname


def public_name(fullname: str) -> str:
    """``zpp.compat.runtime.config`` -> ``zpp.runtime.config`` (the name users import)."""
    if fullname.startswith(_REAL):
        return _PUBLIC + fullname[len(_REAL):]
    return fullname


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the target module itself (imported under its own name)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec  # the import system set it to the alias's; the target keeps its own

    def get_code(self, fullname):
        """The target's code (``python -m <alias>`` runs it as ``__main__``)."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class ModuleAlias(importlib.abc.MetaPathFinder):
    """``<prefix>X`` imports as the module ``resolve(<prefix>X)``: one object under two names.

    ``resolve`` returns the target's name, or None where the name is not an alias."""

    def __init__(self, key: str, resolve) -> None:
        self.key = key
        self.resolve = resolve

    def find_spec(self, fullname, path=None, target=None):
        real = self.resolve(fullname)
        if real is None or real == fullname:
            return None
        found = importlib.util.find_spec(real)  # a module zpp refuses raises its ImportError here
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real),
                                              is_package=found.submodule_search_locations is not None)


def install(key: str, resolve) -> None:
    """Put one :class:`ModuleAlias` named ``key`` first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, ModuleAlias) and f.key == key for f in sys.meta_path):
        sys.meta_path.insert(0, ModuleAlias(key, resolve))
