"""DeepSpeed's op builders (``deepspeed.ops.op_builder``), answered for zpp.

DeepSpeed compiles its C++/CUDA ops with these builders and scripts ask them what is
available (``FusedAdamBuilder().is_compatible()``, ``deepspeed.ops.__compatible_ops__``).
zpp builds nothing ahead of time: its kernels compile at first use (:mod:`zpp.quant`). The
builders here answer the question for zpp:

* ``FusedAdamBuilder`` / ``CPUAdamBuilder``: compatible; what they stand for is
  :mod:`zpp.ops.adam` (``FusedAdam``, ``DeepSpeedCPUAdam`` over torch's fused Adam), which
  ``load()`` returns. It is a Python module with the optimizer classes, not DeepSpeed's
  kernel entry points (``multi_tensor_adam``, ``adam_update``): code that calls those gets
  an ``AttributeError`` naming the module.
* every other op DeepSpeed names (transformer kernels, sparse attention, async I/O, LAMB,
  ...): not compatible; ``load()`` raises ``NotImplementedError`` saying what zpp offers
  instead (:mod:`zpp.unsupported`).
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["ALL_OPS", "OpBuilder", "get_default_compute_capabilities"]


class OpBuilder:
    """One of DeepSpeed's ops, as zpp has it (see the module docstring)."""

    NAME = ""
    """DeepSpeed's op name (the key of ``deepspeed.ops.__compatible_ops__``)."""
    MODULE: str | None = None
    """zpp's module for the op, or None: zpp does not have it."""
    WHY = ""
    """What zpp offers instead, when it does not have it."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.MODULE is not None

    def load(self, verbose: bool = True) -> ModuleType:
        if self.MODULE is None:
            raise NotImplementedError(f"deepspeed.ops.op_builder.{type(self).__name__} ({self.NAME}): {self.WHY}")
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        return self.load(verbose)

    def builder(self):
        raise NotImplementedError(f"deepspeed.ops.op_builder.{type(self).__name__}: zpp builds no extensions "
                                  "ahead of time; its kernels compile at first use")


def _builder(cls_name: str, name: str, module: str | None = None, why: str = "") -> type:
    return type(cls_name, (OpBuilder,), {"NAME": name, "MODULE": module, "WHY": why, "__module__": __name__,
                                         "__doc__": f"DeepSpeed's ``{name}`` op ({'in zpp' if module else why})."})


_ADAM = "zpp.ops.adam"
_NONE = "not in zpp"
_SPECS = [
    ("FusedAdamBuilder", "fused_adam", _ADAM, ""),
    ("CPUAdamBuilder", "cpu_adam", _ADAM, ""),
    ("FusedLambBuilder", "fused_lamb", None, "zpp.optim.OneBitLamb (freeze_step past the end is exact LAMB)"),
    ("CPUAdagradBuilder", "cpu_adagrad", None, "torch.optim.Adagrad"),
    ("CPULionBuilder", "cpu_lion", None, "pass any torch optimizer to zpp.initialize(optimizer=...)"),
    ("FusedLionBuilder", "fused_lion", None, "pass any torch optimizer to zpp.initialize(optimizer=...)"),
    ("TransformerBuilder", "transformer", None, "the model's own layers"),
    ("StochasticTransformerBuilder", "stochastic_transformer", None, "the model's own layers"),
    ("InferenceBuilder", "transformer_inference", None, "zpp trains; run the trained module as it is"),
    ("SparseAttnBuilder", "sparse_attn", None, "torch.nn.functional.scaled_dot_product_attention"),
    ("AsyncIOBuilder", "async_io", None, "DeepSpeed's async I/O op is not in zpp; its NVMe tier "
     "(offload_optimizer.device nvme) does its own I/O (zpp.zero.nvme)"),
    ("GDSBuilder", "gds", None, "GPUDirect Storage is not in zpp; its NVMe tier reads and writes through host buffers"),
    ("QuantizerBuilder", "quantizer", None, "zpp.quant (the communication quantizers)"),
    ("RandomLTDBuilder", "random_ltd", None, _NONE),
    ("SpatialInferenceBuilder", "spatial_inference", None, _NONE),
    ("EvoformerAttnBuilder", "evoformer_attn", None, _NONE),
    ("FPQuantizerBuilder", "fp_quantizer", None, "zpp.quant"),
    ("RaggedOpsBuilder", "ragged_device_ops", None, _NONE),
    ("RaggedUtilsBuilder", "ragged_ops", None, _NONE),
]
for _cls, _name, _module, _why in _SPECS:
    globals()[_cls] = _builder(_cls, _name, _module, _why or _NONE)
    __all__.append(_cls)

#: op name -> builder class, as DeepSpeed's ``op_builder.all_ops.ALL_OPS``.
ALL_OPS = {globals()[c].NAME: globals()[c] for c, *_ in _SPECS}


def get_default_compute_capabilities() -> str:
    """DeepSpeed's default CUDA architectures for its builds; zpp's kernels compile for the
    device they run on."""
    return "8.0;9.0"
