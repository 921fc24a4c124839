"""DeepSpeed's ``deepspeed.moe.utils`` helper for parameter groups. zpp has no MoE layers or
expert parallelism: ``zpp.moe.layer.MoE`` imports, and building one raises
``NotImplementedError`` saying so."""
from zpp.compat.moe import utils

__all__ = ["utils"]


def __getattr__(name: str):
    from zpp.compat.unsupported import missing_attribute

    raise missing_attribute(__name__, name)
