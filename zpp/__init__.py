"""zpp: communication-optimized collectives for PyTorch (ZeRO++ and 1-bit optimizers).

A DeepSpeed training script runs with one changed import::

    import zpp as deepspeed
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, config="ds_config.json")

Attributes are imported on first use, so ``import zpp`` (and ``zpp --help``) does not import
torch. DeepSpeed modules zpp does not offer raise an ``ImportError`` saying what to use
instead (:mod:`zpp.unsupported`).

DeepSpeed's module tree (``zpp.runtime``, ``zpp.accelerator``, ``zpp.ops``...) is one layer,
:mod:`zpp.compat`, over zpp's own (``zpp.zero``, ``zpp.comm``, ``zpp.optim``, ``zpp.quant``,
``zpp.tune``); each of its modules is importable under both names, as one module object
([Note: compat aliases]).
"""
from zpp import compat as _compat

_compat.install("zpp", _compat.real_name)
from zpp.compat import unsupported as _unsupported  # noqa: E402  (after the alias: it names zpp.X modules)

__version__ = "0.1.0"

#: name -> "module:attribute" (or "module" for a submodule), imported on first access.
_LAZY = {
    "initialize": "zpp.zero:initialize",
    "init_distributed": "zpp.comm.dist:init_distributed",
    "DeepSpeedEngine": "zpp.zero:ZeroEngine",
    "add_config_arguments": "zpp.compat.arguments:add_config_arguments",
    "get_accelerator": "zpp.compat.accelerator:get_accelerator",
    "logger": "zpp.log:logger",
    "log_dist": "zpp.log:log_dist",
    "DeepSpeedConfig": "zpp.compat.runtime.config:DeepSpeedConfig",
    "PipelineModule": "zpp.compat.pipe:PipelineModule",  # imports; building one is refused (zpp.unsupported)
    **{m: f"zpp.{m}" for m in ("comm", "compat", "optim", "quant", "zero")},
    **{m: f"zpp.compat.{m}" for m in ("accelerator", "checkpoint", "checkpointing", "moe", "ops", "pipe", "runtime",
                                      "utils")},
}
__all__ = ["__version__", *_LAZY]
# the rest of zpp.compat's modules by their public names (not in __all__: star-imports stay lean)
_LAZY.update({m: f"zpp.compat.{m}" for m in _compat.NAMES if m not in _LAZY})

_unsupported.install()


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise _unsupported.missing_attribute(__name__, name)
    import importlib

    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
