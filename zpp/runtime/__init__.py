"""DeepSpeed's ``deepspeed.runtime`` names that scripts read: :mod:`zpp.runtime.config`
(optimizer-name constants) and :mod:`zpp.runtime.lr_schedules`."""
from zpp.runtime import config

__all__ = ["config"]


def __getattr__(name: str):
    if name == "lr_schedules":
        import importlib

        return importlib.import_module("zpp.runtime.lr_schedules")
    from zpp.unsupported import missing_attribute

    raise missing_attribute(__name__, name)
