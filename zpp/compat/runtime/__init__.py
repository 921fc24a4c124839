"""DeepSpeed's ``deepspeed.runtime`` names that scripts read: :mod:`zpp.runtime.config`
(optimizer-name constants) and :mod:`zpp.runtime.lr_schedules`."""
from zpp.compat.runtime import config

__all__ = ["config"]


#: submodules imported on first attribute access (``deepspeed.runtime.zero.Init`` after ``import deepspeed``)
_LAZY = ("fp16", "lr_schedules", "precision_config", "utils", "zero")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    from zpp.compat.unsupported import missing_attribute

    raise missing_attribute(__name__, name)
