"""DeepSpeed's ``zero_optimization`` section as an object (``deepspeed.runtime.zero.config``):

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    z = DeepSpeedZeroConfig(**ds_config["zero_optimization"])
    z.stage, z.prefetch_bucket_size, z.offload_optimizer.device, z.overlap_comm

Scripts and libraries build these to read a config the way DeepSpeed reads it: every field
of DeepSpeed 0.19.8's model with its default, the ``stage3_`` aliases next to the field
names, the deprecated fields mapped to their replacements (with a warning), ``"auto"``
values dropped (as DeepSpeed does unless ``strict=True``), ``overlap_comm`` true by default
at stage 3 only. Values are checked with zpp's checks of the same keys
(:mod:`zpp.zero.deepspeed_keys`: an unknown field, a wrong type or an alias given with its
field is a ``ValueError`` naming it). The object only reads the section: what zpp does not
run is refused by :func:`zpp.initialize`, not here.
"""
from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Callable
from typing import Any

from zpp.zero.leaf_modules import DEFAULT_LEAF_MODULE_CLASSES
from zpp.zero.checks import check_bool, check_int, check_number, check_str
from zpp.zero.deepspeed_keys import KEYS, ZERO_ALIASES

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroLeafModuleConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum", "ZeroStageEnum"]

_log = logging.getLogger("zpp")


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's ZeRO stages."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _Section:
    """A config section with DeepSpeed's fields, defaults, aliases and deprecated names."""

    PATH = ""
    FIELDS: dict[str, Any] = {}
    """field -> default (a callable makes a fresh default)."""
    ALIASES: dict[str, str] = {}
    """alias -> field."""
    DEPRECATED: dict[str, tuple[str | None, Callable[[Any], Any]]] = {}
    """deprecated name -> (field it sets, or None: only warned about; value conversion)."""
    NESTED: dict[str, type] = {}

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        given: dict[str, Any] = {}
        written: dict[str, str] = {}
        for key, value in data.items():
            name = self.ALIASES.get(key, key)
            if name not in self.FIELDS and name not in self.DEPRECATED:
                known = sorted({*self.FIELDS, *self.ALIASES, *self.DEPRECATED})
                raise ValueError(f"{type(self).__name__}: unknown field {key!r}; the fields are {known}")
            if name in given:
                raise ValueError(f"{type(self).__name__}: {written[name]!r} and {key!r} name the same field; give one")
            given[name], written[name] = value, key
        for name, default in self.FIELDS.items():
            value = given[name] if name in given else (default() if callable(default) else default)
            object.__setattr__(self, name, self._check(name, value) if name in given else value)
        for old, (new, convert) in self.DEPRECATED.items():
            if old not in given:
                continue
            _log.warning("%s: %s is deprecated%s", type(self).__name__, old, f"; use {new}" if new else "")
            if new is not None:
                if new in given:
                    raise ValueError(f"{type(self).__name__}: the deprecated {old!r} and its replacement {new!r} "
                                     "were both given")
                object.__setattr__(self, new, convert(self._check(old, given[old])))
        self.model_fields_set = frozenset(given)
        self._validate()

    def _check(self, name: str, value: Any) -> Any:
        if name in self.NESTED:
            if value is None or isinstance(value, self.NESTED[name]):
                return value
            if not isinstance(value, dict):
                raise ValueError(f"{type(self).__name__}: {name}={value!r} must be a mapping or null")
            return self.NESTED[name](**value)
        path = f"{self.PATH}.{self._key_of(name)}"
        if path in KEYS:
            return KEYS[path].check(path, value)
        default = self.FIELDS.get(name)
        where = type(self).__name__
        if isinstance(default, bool):
            return check_bool(where, name, value)
        if isinstance(default, int):
            return check_int(where, name, value, lenient=True)
        if isinstance(default, float):
            return check_number(where, name, value)
        if isinstance(default, str):
            return check_str(where, name, value)
        return value

    def _key_of(self, name: str) -> str:
        return name

    def _validate(self) -> None:
        pass

    def model_dump(self) -> dict[str, Any]:
        return {k: (v.model_dump() if isinstance(v, _Section) else v) for k, v in vars(self).items()
                if k in self.FIELDS}

    dict = model_dump

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.model_dump().items())})"


def _device(value: Any) -> str:
    return value.value if isinstance(value, OffloadDeviceEnum) else value


class DeepSpeedZeroOffloadParamConfig(_Section):
    """``zero_optimization.offload_param``."""

    PATH = "zero_optimization.offload_param"
    FIELDS = {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
              "max_in_cpu": 1_000_000_000, "pin_memory": True}

    def _check(self, name: str, value: Any) -> Any:
        return super()._check(name, _device(value) if name == "device" else value)


class DeepSpeedZeroOffloadOptimizerConfig(_Section):
    """``zero_optimization.offload_optimizer``; ``pipeline`` is ``pipeline_read or
    pipeline_write``."""

    PATH = "zero_optimization.offload_optimizer"
    FIELDS = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True, "pipeline_read": False,
              "pipeline_write": False, "fast_init": False, "ratio": 1.0, "super_offload": False,
              "cpuadam_cores_perc": 0.8}

    def _check(self, name: str, value: Any) -> Any:
        return super()._check(name, _device(value) if name == "device" else value)

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write


class DeepSpeedZeroLeafModuleConfig(_Section):
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers whole (DeepSpeed's defaults:
    the Mixtral and Qwen MoE blocks). A single string is read as a one-element list."""

    PATH = "zero_optimization.leaf_module"
    FIELDS = {"classes": lambda: list(DEFAULT_LEAF_MODULE_CLASSES), "names": list, "name_suffixes": list}

    def _check(self, name: str, value: Any) -> Any:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"DeepSpeedZeroLeafModuleConfig: {name}={value!r} must be a list of strings")
        return list(value)


def _offload_if(section: type) -> Callable[[Any], Any]:
    return lambda on: section(device="cpu") if on else None


class DeepSpeedZeroConfig(_Section):
    """``zero_optimization`` as DeepSpeed 0.19.8 reads it (see the module docstring)."""

    PATH = "zero_optimization"
    FIELDS = {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
        "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
        "overlap_comm": None, "compute_grad_norm": True, "load_from_fp32_weights": True,
        "elastic_checkpoint": False, "offload_param": None, "offload_optimizer": None, "zenflow": None,
        "sub_group_size": 1_000_000_000, "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000,
        "model_persistence_threshold": sys.maxsize, "max_live_parameters": 1_000_000_000,
        "max_reuse_distance": 1_000_000_000, "gather_16bit_weights_on_model_save": False,
        "module_granularity_threshold": 0, "use_all_reduce_for_fetch_params": False, "allgather_sequential": False,
        "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
        "parameter_alignment": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
        "memory_efficient_linear": True, "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "log_trace_cache_warnings": False, "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False, "leaf_module": DeepSpeedZeroLeafModuleConfig,
    }
    ALIASES = {alias: name for name, alias in ZERO_ALIASES.items()}
    DEPRECATED = {
        "cpu_offload": ("offload_optimizer", _offload_if(DeepSpeedZeroOffloadOptimizerConfig)),
        "cpu_offload_param": ("offload_param", _offload_if(DeepSpeedZeroOffloadParamConfig)),
        "cpu_offload_use_pin_memory": (None, bool),
        "stage3_gather_fp16_weights_on_model_save": ("gather_16bit_weights_on_model_save", bool),
    }
    NESTED = {"offload_param": DeepSpeedZeroOffloadParamConfig,
              "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "leaf_module": DeepSpeedZeroLeafModuleConfig}

    def _key_of(self, name: str) -> str:
        return ZERO_ALIASES.get(name, name)

    def _check(self, name: str, value: Any) -> Any:
        if name == "stage":
            return check_int(type(self).__name__, "stage", value, lo=0, hi=3, lenient=True)
        return super()._check(name, value)

    def _validate(self) -> None:
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == ZeroStageEnum.weights
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError(f"DeepSpeedZeroConfig: compute_grad_norm=False needs stage 1 or 2, not {self.stage}")
        if self.reduce_bucket_size <= 0:
            raise ValueError(f"DeepSpeedZeroConfig: reduce_bucket_size={self.reduce_bucket_size} must be > 0")
