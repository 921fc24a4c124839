"""DeepSpeed's ``deepspeed.ops`` names that zpp offers: :mod:`zpp.ops.adam` (``FusedAdam``,
``DeepSpeedCPUAdam`` over torch's Adam) and :mod:`zpp.ops.op_builder` (which ops zpp has);
``__compatible_ops__`` maps each of DeepSpeed's op names to whether zpp has it. Other ops
modules raise an ``ImportError`` saying what to use instead (:mod:`zpp.unsupported`)."""
from zpp.compat.ops import adam, op_builder

__compatible_ops__ = {name: builder().is_compatible() for name, builder in op_builder.ALL_OPS.items()}

__all__ = ["__compatible_ops__", "adam", "op_builder"]


def __getattr__(name: str):
    from zpp.compat.unsupported import missing_attribute

    raise missing_attribute(__name__, name)
