"""DeepSpeed's ``deepspeed.ops`` names that zpp offers: :mod:`zpp.ops.adam` (``FusedAdam``,
``DeepSpeedCPUAdam`` over torch's Adam). Other ops modules raise an ``ImportError`` saying
what to use instead (:mod:`zpp.unsupported`)."""
from zpp.ops import adam

__all__ = ["adam"]


def __getattr__(name: str):
    from zpp.unsupported import missing_attribute

    raise missing_attribute(__name__, name)
