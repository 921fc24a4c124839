"""``import deepspeed`` gives zpp, for code you do not edit (the Hugging Face Trainer,
accelerate, Lightning, a library's own DeepSpeed path)::

    zpp run torchrun --nproc-per-node 2 train.py      # any command; its Python processes see zpp
    zpp run accelerate launch --config_file ds.yaml train.py
    zpp run python train_lightning.py
    export PYTHONPATH=$(zpp run --path)${PYTHONPATH:+:$PYTHONPATH}   # the same by hand (batch scripts)

In a Python process of your own: ``zpp.as_deepspeed.install()`` before anything imports
``deepspeed``.

[Note: deepspeed as zpp]
The front-ends decide whether DeepSpeed is there before importing it: transformers and
accelerate ask ``importlib.util.find_spec("deepspeed")`` and ``importlib.metadata`` for the
distribution and compare its version (``>=0.9.3``), Lightning requires ``>=0.16.0``. A module
alias alone fails those checks, and a distribution that claims to be DeepSpeed must never
appear by accident. So the switch is a folder, :func:`shim_path`, that only ``zpp run`` (or
:func:`install`) puts first on the path. It holds

* ``deepspeed-<DEEPSPEED_VERSION>+zpp.<zpp version>.dist-info``: the distribution the checks
  find (the local version label says it is zpp; it compares as DeepSpeed 0.19.8, whose
  behaviour zpp matches);
* ``deepspeed/__init__.py``: two lines calling :func:`become_deepspeed`, which turns that
  module into a forwarder to :mod:`zpp` (``deepspeed.initialize is zpp.initialize``,
  ``deepspeed.DeepSpeedEngine is zpp.zero.ZeroEngine``) with DeepSpeed's version
  attributes, and makes every ``deepspeed.X`` submodule the module ``zpp.X`` itself (the
  same object, so ``isinstance`` and module state hold). A module zpp refuses raises its
  ``ImportError`` naming the alternative (:mod:`zpp.unsupported`).

Outside ``zpp run`` nothing changes: ``import deepspeed`` is whatever is installed, or fails.
Inside it, a real DeepSpeed that is also installed is shadowed, and rank 0 says so once.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from pathlib import Path

import zpp
from zpp import compat

__all__ = ["DEEPSPEED_VERSION", "ENV", "become_deepspeed", "distribution_version", "environ", "install",
           "shadowed", "shim_path"]

#: The DeepSpeed release whose behaviour zpp matches (its config keys, engine methods and
#: schedules are checked against it).
DEEPSPEED_VERSION = "0.19.8"
#: Set to "1" in the environment of a command under ``zpp run``.
ENV = "ZPP_AS_DEEPSPEED"
_SHIM = Path(__file__).resolve().parent / "_deepspeed_shim"


def distribution_version() -> str:
    """The version the ``deepspeed`` distribution reports: DeepSpeed's, labelled as zpp's."""
    return f"{DEEPSPEED_VERSION}+zpp.{zpp.__version__}"


def shim_path() -> str:
    """The folder that, first on the path, makes ``deepspeed`` mean zpp."""
    return str(_SHIM)


def environ(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (Default: ``os.environ``) with :func:`shim_path` first on ``PYTHONPATH`` and
    :data:`ENV` set: the environment ``zpp run`` gives its command."""
    env = dict(os.environ if env is None else env)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != shim_path()]
    env["PYTHONPATH"] = os.pathsep.join([shim_path(), *rest])
    env[ENV] = "1"
    return env


def install() -> None:
    """Make ``import deepspeed`` give zpp in this process (idempotent). Raises
    ``RuntimeError`` if another ``deepspeed`` was imported already."""
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not getattr(loaded, "__zpp__", False):
        raise RuntimeError(f"zpp.as_deepspeed.install(): deepspeed was imported already from "
                           f"{getattr(loaded, '__file__', '?')}; call install() before anything imports it")
    if shim_path() not in sys.path:
        sys.path.insert(0, shim_path())
        importlib.invalidate_caches()


def shadowed() -> list[tuple[str, str]]:
    """``(version, location)`` of every other ``deepspeed`` distribution on the path."""
    out = []
    for dist in importlib.metadata.distributions(name="deepspeed"):
        where = str(dist.locate_file(""))
        if Path(where).resolve() != _SHIM:
            out.append((dist.version, where))
    return out


def _deepspeed_target(fullname: str) -> str | None:
    """``deepspeed.X`` -> the module zpp gives for it (``zpp.X``, resolved to where it lives)."""
    if not fullname.startswith("deepspeed."):
        return None
    return compat.real_name("zpp." + fullname[len("deepspeed."):])


def become_deepspeed(name: str) -> None:
    """Turn the module ``name`` (the shim's ``deepspeed``) into zpp under DeepSpeed's name."""
    module = sys.modules[name]
    major, minor, patch = (int(x) for x in DEEPSPEED_VERSION.split("."))
    module.__dict__.update(
        __zpp__=True, __version__=distribution_version(), __version_major__=major, __version_minor__=minor,
        __version_patch__=patch, __git_hash__=None, __git_branch__=None, __path__=[],
        __getattr__=lambda attr: getattr(zpp, attr), __dir__=lambda: dir(zpp),
    )
    compat.install("deepspeed", _deepspeed_target)
    others = shadowed()
    if others:
        from zpp.log import process_rank

        if process_rank() in (0, -1):
            shown = "; ".join(f"DeepSpeed {v} in {w}" for v, w in others)
            print(f"zpp: `import deepspeed` gives zpp {zpp.__version__} (standing in for DeepSpeed "
                  f"{DEEPSPEED_VERSION}: zpp run); not used: {shown}", file=sys.stderr, flush=True)
