"""DeepSpeed modules and names zpp does not offer, each with what zpp offers instead.

A DeepSpeed script that runs with ``import zpp as deepspeed`` may import more than zpp has
(``deepspeed.ops.transformer``, ``deepspeed.inference``...). Those imports fail at the
import line with an ``ImportError`` that names the module and says what to use instead,
rather than a bare ``ModuleNotFoundError`` or a crash later:

    >>> import zpp.ops.transformer
    ImportError: zpp.ops.transformer (deepspeed.ops.transformer): DeepSpeed's fused transformer ...

A few classes that scripts (and libraries' shared code) import whether or not they use them,
to subclass or to test ``isinstance`` against, import cleanly and refuse at construction
(:func:`refused_class`): ``deepspeed.pipe.PipelineModule`` / ``LayerSpec``,
``deepspeed.moe.layer.MoE``, DeepSpeed's fp16 and ZeRO optimizer wrappers. An instance is
never made, so ``isinstance(engine.optimizer, FP16_Optimizer)`` is False, as it is in
DeepSpeed for an optimizer that is not one.

:class:`UnsupportedFinder`, appended to ``sys.meta_path`` by ``import zpp``, raises it for
every module in ``MODULES`` (and its submodules); it is consulted only after the real
modules were not found, so it never shadows one. ``zpp.<name>`` attribute access to a
name in ``NAMES`` (``deepspeed.PipelineModule``) raises ``AttributeError`` with the same
kind of message, and ``from zpp import <name>`` an ``ImportError``.
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["MODULES", "NAMES", "UnsupportedFinder", "explain", "install", "refused_class"]

_DP = "zpp is data-parallel (ZeRO stages 0-3 with ZeRO++ and the 1-bit optimizers)"
#: DeepSpeed module (relative to the package) -> why zpp lacks it and what it offers instead.
MODULES: dict[str, str] = {
    "runtime.pipe": f"pipeline parallelism is not in zpp; {_DP}; see torch.distributed.pipelining",
    "inference": "DeepSpeed's inference engine is not in zpp; zpp trains (run the trained module as it is)",
    "model_implementations": "DeepSpeed's inference model implementations are not in zpp",
    "module_inject": "kernel injection and AutoTP are not in zpp; the model runs its own layers",
    "ops.transformer": "DeepSpeed's fused transformer kernels are not in zpp; use the model's own layers "
                       "(torch.nn.TransformerEncoderLayer, Hugging Face models)",
    "ops.sparse_attention": "sparse attention kernels are not in zpp; use "
                            "torch.nn.functional.scaled_dot_product_attention",
    "ops.lamb": "FusedLamb is not in zpp; zpp.optim.OneBitLamb (freeze_step past the end is exact LAMB), or "
                "optimizer.type OneBitLamb in the config",
    "ops.adagrad": "DeepSpeedCPUAdagrad is not in zpp; use torch.optim.Adagrad",
    "ops.lion": "Lion is not in zpp; pass any torch optimizer to zpp.initialize(optimizer=...)",
    "ops.aio": "DeepSpeed's async I/O op is not in zpp; zpp's NVMe tier (offload_optimizer.device nvme) does its own "
               "I/O (zpp.zero.nvme)",
    "ops.deepspeed4science": "DeepSpeed4Science kernels are not in zpp",
    "moe.sharded_moe": "zpp has no MoE layers or expert parallelism",
    "moe.experts": "zpp has no MoE layers or expert parallelism",
    "compression": "compression training is not in zpp; zpp compresses communication only (zpp.quant, ZeRO++)",
    "runtime.activation_checkpointing": "zpp's activation checkpointing is zpp.checkpointing "
                                        "(deepspeed.checkpointing's names)",
    "runtime.fp16.onebit": "DeepSpeed's 1-bit optimizers are zpp.optim.OneBitAdam / ZeroOneAdam / OneBitLamb, or "
                           "optimizer.type in the config",
    "runtime.fp16.loss_scaler": "zpp's loss scaling is zpp.zero.LossScaler (the config's \"fp16\" section)",
    "profiling": "the flops profiler is not in zpp; use torch.profiler",
    "monitor": "DeepSpeed's monitor classes are not importable from zpp; the config's tensorboard, csv_monitor, "
               "wandb and comet sections work (zpp.zero.monitor), and engine.monitor.write_events(events) logs "
               "a script's own events",
    "sequence": "sequence parallelism is not in zpp",
    "autotuning": "DeepSpeed's autotuner is not in zpp; `zpp tune` tunes the collectives",
    "elasticity": "elastic training is not in zpp; its checkpoints load at any world size",
    "launcher": "zpp has no launcher of its own for training; use torchrun or mpiexec",
    "nebula": "Nebula checkpointing is not in zpp; zpp writes its checkpoints itself",
}
#: Names of DeepSpeed's top-level package zpp does not offer -> why, and what instead.
NAMES: dict[str, str] = {
    "PipelineEngine": MODULES["runtime.pipe"],
    "init_inference": MODULES["inference"],
    "InferenceEngine": MODULES["inference"],
    "DeepSpeedInferenceConfig": MODULES["inference"],
    "DeepSpeedTransformerLayer": MODULES["ops.transformer"],
    "DeepSpeedTransformerConfig": MODULES["ops.transformer"],
    "DeepSpeedHybridEngine": "DeepSpeed-Chat's hybrid engine is not in zpp",
    "OnDevice": "OnDevice is not in zpp; build the model on the device, or partitioned under zpp.zero.Init",
    "replace_transformer_layer": MODULES["module_inject"],
    "revert_transformer_layer": MODULES["module_inject"],
    "add_tuning_arguments": "DeepSpeed's lr-range-test arguments are not in zpp",
}


PIPE = f"pipeline parallelism is not in zpp; {_DP}; see torch.distributed.pipelining"
MOE = "zpp has no MoE layers or expert parallelism; zpp.moe.utils passes parameter groups through"
FP16_WRAPPERS = ("DeepSpeed's fp16 optimizer wrappers are not in zpp: fp16 is the config's \"fp16\" section, with "
                 "fp32 master weights in the engine; pass a torch optimizer or the config's optimizer")
ZERO_OPTIMIZERS = ("DeepSpeed's ZeRO optimizer classes are not in zpp: ZeRO is zpp.initialize's engine "
                   "(zpp.zero.ZeroEngine), whose engine.optimizer is a torch optimizer over the fp32 master shards")


def refused_class(name: str, module: str, why: str, base: type = object) -> type:
    """A class named ``name`` that imports and subclasses like DeepSpeed's, and whose
    construction raises ``NotImplementedError`` naming it and what zpp offers instead."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{module}.{name}: {why}")

    return type(name, (base,), {"__init__": __init__, "__module__": module,
                                "__doc__": f"DeepSpeed's ``{name}``, refused by zpp: {why}."})


def explain(fullname: str) -> str | None:
    """The message for the zpp module or name ``fullname`` (e.g. "zpp.ops.transformer.inference"),
    or None if zpp does not refuse it. A name inside :mod:`zpp.compat` is explained under the
    name users import (``zpp.compat.ops.transformer`` as ``zpp.ops.transformer``)."""
    from zpp.compat import public_name

    fullname = public_name(fullname)
    if not fullname.startswith("zpp."):
        return None
    rel = fullname[len("zpp."):]
    for mod, why in MODULES.items():
        if rel == mod or rel.startswith(mod + "."):
            return f"{fullname} (deepspeed.{rel}): {why}"
    if rel in NAMES:
        return f"{fullname} (deepspeed.{rel}): {NAMES[rel]}"
    return None


class UnsupportedFinder(importlib.abc.MetaPathFinder):
    """Raises the ``ImportError`` of :func:`explain` for a refused module."""

    def find_spec(self, fullname, path=None, target=None):
        why = explain(fullname)
        if why is not None:
            raise ImportError(why, name=fullname)
        return None


def install() -> None:
    """Append one :class:`UnsupportedFinder` to ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, UnsupportedFinder) for f in sys.meta_path):
        sys.meta_path.append(UnsupportedFinder())


def missing_attribute(module: str, name: str) -> AttributeError:
    """The ``AttributeError`` for ``module.name``, explained when zpp refuses it."""
    why = explain(f"{module}.{name}")
    if why is not None:
        return AttributeError(why)
    from zpp.compat import public_name

    return AttributeError(f"module {public_name(module)!r} has no attribute {name!r}")


def markdown() -> str:
    """The README's table of refused modules and names (generated; a test keeps it equal)."""
    rows = ["| DeepSpeed | zpp says |", "|---|---|"]
    rows += [f"| `deepspeed.{m}` | {why} |" for m, why in sorted(MODULES.items())]
    rows += [f"| `deepspeed.{n}` | {why} |" for n, why in sorted(NAMES.items())]
    return "\n".join(rows) + "\n"
