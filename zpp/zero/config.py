"""The engine's typed configuration, and the translation of a DeepSpeed config into it.

One source of truth: :class:`TrainConfig` (with :class:`ZeroConfig`, :class:`ZppConfig`,
:class:`OptimizerConfig`, :class:`SchedulerConfig`). A DeepSpeed-style dict or JSON file is
translated into it once, at the edge, by :func:`from_deepspeed`; nothing below reads dicts.

[Note: DeepSpeed keys]
Every key of a DeepSpeed config falls in one of three sets:

* understood: translated into a field below (see ``_TOP_KEYS`` / ``_ZERO_KEYS``);
* known but not implemented: accepted only when the value asks for nothing (DeepSpeed's
  default, or a value that describes what zpp does anyway, e.g. ``overlap_comm: false``);
  any other value raises ``NotImplementedError`` naming the key and the value;
* unknown: ``ValueError`` listing every unknown key.

Nothing is silently ignored.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

STAGES = (0, 1, 2, 3)
QUANT_BITS = (4, 8)
#: The 1-bit optimizers of :mod:`zpp.optim` (lower-case ``type`` -> their class name there).
ONEBIT_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
OPTIMIZERS = ("adam", "adamw", "sgd", *ONEBIT_OPTIMIZERS)
# Each optimizer's own keyword arguments (for the 1-bit ones: their constructors' names, less
# ``params`` and ``transport``; the engine passes its own transport).
_ONEBIT_COMMON = {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "cuda_aware",
                  "comm_backend_name"}
OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    "adam": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "adamw": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "sgd": frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "onebitadam": frozenset(_ONEBIT_COMMON | {"freeze_step"}),
    "zerooneadam": frozenset(_ONEBIT_COMMON | {"var_freeze_step", "var_update_scaler", "local_step_scaler",
                                               "local_step_clipper"}),
    "onebitlamb": frozenset(_ONEBIT_COMMON | {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
                                              "factor_min", "factor_threshold"}),
}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


@dataclasses.dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """What ZeRO shards and which ZeRO++ compressions are on."""

    stage: int = 0
    """0: data parallel; 1: shard optimizer states; 2: and gradients; 3: and parameters
    (Default: 0)."""
    quantized_weights: bool = False
    """qwZ: quantize weights for the forward all-gather (stage 3 only) (Default: False)."""
    hpz_partition_size: int = 1
    """hpZ: keep a secondary weight shard over this many ranks (the ranks of one node) so
    the backward all-gather stays inside the node; 1 turns it off (stage 3 only)
    (Default: 1)."""
    quantized_gradients: bool = False
    """qgZ: quantized two-hop reduce-scatter of gradients (stage 3 only) (Default: False)."""
    reduce_bucket_size: int = 500_000_000
    """Stages 0-2: elements per communication unit (gradient reduction and parameter
    all-gather run once per unit) (Default: 5e8)."""
    allgather_bucket_size: int = 500_000_000
    """Stages 1-2: caps the unit size as well; the unit is ``min`` of both bucket sizes
    (Default: 5e8)."""
    prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of parameter gathers started ahead of use (in the order recorded
    on the first pass) that may be in flight or waiting at once; 0 turns prefetch off. See
    [Note: stage 3 prefetch] in :mod:`zpp.zero.prefetch` (Default: 5e7)."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ZeroConfig: stage={self.stage!r} must be one of {STAGES}")
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ZeroConfig: {name}={v!r} must be a positive integer")
        if isinstance(self.prefetch_bucket_size, bool) or not isinstance(self.prefetch_bucket_size, int) \
                or self.prefetch_bucket_size < 0:
            raise ValueError(f"ZeroConfig: prefetch_bucket_size={self.prefetch_bucket_size!r} must be >= 0")
        h = self.hpz_partition_size
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"ZeroConfig: hpz_partition_size={h!r} must be a positive integer")
        if self.stage < 3:
            on = [f"{n}={getattr(self, n)!r}" for n in ("quantized_weights", "quantized_gradients")
                  if getattr(self, n)]
            if h > 1:
                on.append(f"hpz_partition_size={h}")
            if on:
                raise ValueError(f"ZeroConfig: {', '.join(on)} need stage=3, got stage={self.stage}")


@dataclasses.dataclass(kw_only=True, slots=True)
class ZppConfig:
    """zpp's own knobs (the ``"zpp"`` section of a DeepSpeed-style config)."""

    transport: str | None = None
    """Name given to ``zpp.comm.get_transport`` when no transport is passed; None leaves the
    choice to [Note: which transport] in :mod:`zpp.comm.registry` (``$ZPP_COMM_BACKEND``, the
    tune plan, the launcher, else "torch") (Default: None)."""
    timeout_s: float | None = None
    """Seconds the rendezvous and every collective wait for a silent peer before raising
    ``TimeoutError``; None: ``$ZPP_TIMEOUT_S``, else 300 (see :mod:`zpp.comm.timeout`)
    (Default: None)."""
    weight_bits: int = 8
    """qwZ code width, 8 or 4 (Default: 8)."""
    gradient_bits: int = 4
    """qgZ code width, 4 or 8 (Default: 4)."""
    weight_group_size: int = 2048
    """qwZ elements per fp32 scale; capped at the shard size (Default: 2048)."""
    gradient_group_size: int = 2048
    """qgZ elements per fp32 scale; capped at the shard size (Default: 2048)."""
    unit_min_numel: int = 0
    """Stage 3: a module becomes a unit (gathered and released as one) once its subtree
    holds this many parameters not yet in a unit; smaller children join their ancestor's
    unit (like FSDP's size-based wrapping). 0: every module holding parameters is a unit
    (Default: 0)."""
    prefetch: bool = True
    """Stage 3: start the next units' all-gathers (asynchronous transport ops) while the
    current module runs, following the gather order recorded on the first pass, up to
    ``zero_optimization.stage3_prefetch_bucket_size`` elements; False gathers each unit at
    its point of use only (Default: True)."""
    check_parameters: bool = True
    """At initialize, check that every rank holds the same parameters (one small
    all-gather of checksums) (Default: True)."""
    check_metadata: bool | None = None
    """Set the transport's per-call metadata check; None leaves it as it is (Default: None)."""

    def __post_init__(self) -> None:
        for name in ("weight_bits", "gradient_bits"):
            v = getattr(self, name)
            if v not in QUANT_BITS or isinstance(v, bool):
                raise ValueError(f"ZppConfig: {name}={v!r} must be one of {QUANT_BITS}")
        for name in ("weight_group_size", "gradient_group_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2 or v % 2:
                raise ValueError(f"ZppConfig: {name}={v!r} must be a positive even integer")
        u = self.unit_min_numel
        if isinstance(u, bool) or not isinstance(u, int) or u < 0:
            raise ValueError(f"ZppConfig: unit_min_numel={u!r} must be an integer >= 0")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"ZppConfig: prefetch={self.prefetch!r} must be true or false")
        if self.transport is not None and (not isinstance(self.transport, str) or not self.transport):
            raise ValueError(f"ZppConfig: transport={self.transport!r} must be a transport name or null")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"ZppConfig: timeout_s={t!r} must be a number of seconds > 0 or null")


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer the engine builds over its fp32 master shards."""

    type: Literal["adam", "adamw", "sgd", "onebitadam", "zerooneadam", "onebitlamb"]
    """Lower-case optimizer name; DeepSpeed's "Adam" with ``adam_w_mode`` (its default)
    becomes "adamw". The 1-bit ones are built from :mod:`zpp.optim` on the engine's
    transport and do their own communication (ZeRO stage 0 only; see [Note: 1-bit
    optimizers] in :mod:`zpp.zero.engine`)."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, eps, weight_decay, momentum,
    freeze_step...); see ``OPTIMIZER_PARAMS``."""

    @property
    def onebit(self) -> bool:
        """Whether this is one of the 1-bit optimizers of :mod:`zpp.optim`."""
        return self.type in ONEBIT_OPTIMIZERS

    def __post_init__(self) -> None:
        if self.type not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig: type={self.type!r} must be one of {OPTIMIZERS}")
        allowed = OPTIMIZER_PARAMS[self.type]
        bad = sorted(set(self.params) - allowed)
        if bad:
            raise ValueError(f"OptimizerConfig: type={self.type!r} has unknown params {bad}; allowed {sorted(allowed)}")
        lr = self.params.get("lr", 1e-3)
        if not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"OptimizerConfig: params.lr={lr!r} must be a non-negative number")


@dataclasses.dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """A learning-rate schedule with DeepSpeed's names and parameters."""

    type: Literal["WarmupLR", "WarmupDecayLR"]
    """Schedule name."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type ("log"/"linear"),
    total_num_steps (WarmupDecayLR), last_batch_iteration."""

    def __post_init__(self) -> None:
        if self.type not in SCHEDULERS:
            raise ValueError(f"SchedulerConfig: type={self.type!r} must be one of {SCHEDULERS}")
        allowed = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
        if self.type == "WarmupDecayLR":
            allowed.add("total_num_steps")
            if "total_num_steps" not in self.params:
                raise ValueError("SchedulerConfig: WarmupDecayLR needs params.total_num_steps")
        bad = sorted(set(self.params) - allowed)
        if bad:
            raise ValueError(f"SchedulerConfig: type={self.type!r} has unknown params {bad}; allowed {sorted(allowed)}")
        wt = self.params.get("warmup_type", "log")
        if wt not in ("log", "linear"):
            raise ValueError(f"SchedulerConfig: params.warmup_type={wt!r} must be 'log' or 'linear'")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything :func:`zpp.initialize` needs to build an engine."""

    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank per micro-step; informational and for the batch check (Default: None)."""
    train_batch_size: int | None = None
    """Global batch; must equal micro * accumulation * world when all are given (Default: None)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; ``backward`` scales the loss by its inverse (Default: 1)."""
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm before the step; 0 turns it off (Default: 0).
    With a 1-bit optimizer the averaged gradient never exists outside the optimizer, so the
    norm clipped is ``sqrt(mean over ranks of ||local gradient||^2)``, an upper bound of the
    averaged gradient's norm (see [Note: 1-bit optimizers] in :mod:`zpp.zero.engine`)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Parameter dtype during training: "bf16" casts the model to bfloat16 and keeps fp32
    master weights (Default: "fp32")."""
    steps_per_print: int = 0
    """Rank 0 prints step and learning rate every this many optimizer steps; 0: never
    (Default: 0)."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build; None means one is passed to initialize (Default: None)."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule; None: constant (Default: None)."""
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    """ZeRO stage and ZeRO++ switches."""
    zpp: ZppConfig = dataclasses.field(default_factory=ZppConfig)
    """zpp's own knobs."""

    def __post_init__(self) -> None:
        for name in ("train_micro_batch_size_per_gpu", "train_batch_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"TrainConfig: {name}={v!r} must be a positive integer")
        g = self.gradient_accumulation_steps
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"TrainConfig: gradient_accumulation_steps={g!r} must be a positive integer")
        c = self.gradient_clipping
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
            raise ValueError(f"TrainConfig: gradient_clipping={c!r} must be a number >= 0")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig: precision={self.precision!r} must be 'fp32' or 'bf16'")
        s = self.steps_per_print
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"TrainConfig: steps_per_print={s!r} must be an integer >= 0")
        if self.optimizer is not None and self.optimizer.onebit and self.zero.stage >= 1:
            name = ONEBIT_OPTIMIZERS[self.optimizer.type]
            raise NotImplementedError(
                f"TrainConfig: optimizer {name} with ZeRO stage {self.zero.stage} is not implemented: the "
                "1-bit optimizers compress the momentum with error feedback, which needs the full momentum "
                "(and the error buffers) on every rank, while ZeRO stage >= 1 shards the optimizer state. "
                "Keeping ZeRO's memory saving would need a sharded compressed momentum exchange, which zpp "
                "does not implement; use zero_optimization.stage=0 (plain data parallel)")

    def check_world(self, world_size: int) -> None:
        """The batch-size identity of DeepSpeed, once the world size is known."""
        micro, total = self.train_micro_batch_size_per_gpu, self.train_batch_size
        if micro is not None and total is not None:
            want = micro * self.gradient_accumulation_steps * world_size
            if total != want:
                raise ValueError(
                    f"TrainConfig: train_batch_size={total} != train_micro_batch_size_per_gpu * "
                    f"gradient_accumulation_steps * world_size = {micro} * "
                    f"{self.gradient_accumulation_steps} * {world_size} = {want}"
                )


# ---------------------------------------------------------------------- DeepSpeed edge
# Known DeepSpeed keys zpp does not implement, with a test for the values that ask for
# nothing (see [Note: DeepSpeed keys]).
def _absent_or(*ok):
    return lambda v: v in ok


def _disabled(v) -> bool:
    """No feature asked for: false/None, ``{"enabled": false, ...}``, or a section whose
    values are all false/empty."""
    if v is False or v is None:
        return True
    if isinstance(v, Mapping):
        return not v["enabled"] if "enabled" in v else not any(v.values())
    return False


def _device_none(v) -> bool:
    return v is None or (isinstance(v, Mapping) and v.get("device", "none") in ("none", None))


_TOP_UNIMPLEMENTED = {
    "amp": _disabled, "activation_checkpointing": _disabled, "flops_profiler": _disabled,
    "tensorboard": _disabled, "wandb": _disabled, "csv_monitor": _disabled, "comet": _disabled,
    "comms_logger": _disabled, "sparse_attention": _disabled, "pipeline": _disabled,
    "compression_training": _disabled, "data_efficiency": _disabled,
    "curriculum_learning": _disabled, "elasticity": _disabled, "autotuning": _disabled,
    "eigenvalue": _disabled, "progressive_layer_drop": _disabled, "quantize_training": _disabled,
    "aio": _disabled, "nebula": _disabled, "hybrid_engine": _disabled,
    "wall_clock_breakdown": _absent_or(False), "memory_breakdown": _absent_or(False),
    "dump_state": _absent_or(False), "prescale_gradients": _absent_or(False),
    "gradient_predivide_factor": _absent_or(1, 1.0), "sparse_gradients": _absent_or(False),
    "communication_data_type": _absent_or(None, "fp32", "float32"),
    "zero_allow_untested_optimizer": lambda v: True,  # a permission, not a behaviour
    "zero_force_ds_cpu_optimizer": _absent_or(False), "disable_allgather": _absent_or(False),
    "checkpoint": lambda v: v is None or v == {},
    "data_types": lambda v: v is None or v == {} or v.get("grad_accum_dtype") in (None, "fp32"),
    "dataloader_drop_last": _absent_or(False),
}
_ZERO_UNIMPLEMENTED = {
    "offload_optimizer": _device_none, "offload_param": _device_none,
    "overlap_comm": _absent_or(False), "contiguous_gradients": _absent_or(True, False),
    "reduce_scatter": _absent_or(True), "allgather_partitions": _absent_or(True),
    "stage3_max_live_parameters": lambda v: True if isinstance(v, (int, float)) and v >= 0 else False,
    # zpp releases every module's parameters after use: reuse distance 0.
    "stage3_max_reuse_distance": _absent_or(0),
    "stage3_param_persistence_threshold": _absent_or(0),
    "stage3_gather_16bit_weights_on_model_save": _absent_or(False),
    "stage3_gather_fp16_weights_on_model_save": _absent_or(False),
    "sub_group_size": lambda v: isinstance(v, (int, float)) and v >= 1,
    "round_robin_gradients": _absent_or(False), "elastic_checkpoint": _absent_or(False),
    "ignore_unused_parameters": _absent_or(True), "zero_quantized_nontrainable_weights": _absent_or(False),
    "mics_shard_size": _absent_or(-1), "mics_hierarchical_params_gather": _absent_or(False),
    "use_multi_rank_bucket_allreduce": _absent_or(True), "memory_efficient_linear": _absent_or(True),
    "load_from_fp32_weights": _absent_or(True), "cpu_offload": _absent_or(False),
    "zero_hpz_partition_size_auto": _absent_or(False), "stage3_module_granularity_threshold": _absent_or(0),
    "log_trace_cache_warnings": _absent_or(False),
}
_TOP_KEYS = {
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "bf16", "fp16", "zero_optimization",
    "steps_per_print", "zpp",
}
_ZERO_KEYS = {
    "stage", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients",
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
}


def _check_keys(section: str, d: Mapping[str, Any], known: set[str], unimplemented: dict) -> None:
    unknown = sorted(k for k in d if k not in known and k not in unimplemented)
    if unknown:
        where = f" in {section!r}" if section else ""
        raise ValueError(f"DeepSpeed config: unknown keys{where}: {unknown}")
    for k, ok in unimplemented.items():
        if k in d and not ok(d[k]):
            name = f"{section}.{k}" if section else k
            raise NotImplementedError(f"DeepSpeed config: zpp does not implement {name}={d[k]!r}")


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"DeepSpeed config: {name}={v!r} must be an integer")
    return int(v)


def from_deepspeed(config: Mapping[str, Any] | str | os.PathLike) -> TrainConfig:
    """Translate a DeepSpeed config (dict or path to a JSON file) into a :class:`TrainConfig`.
    See [Note: DeepSpeed keys] for what is accepted."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"DeepSpeed config: expected a dict or a JSON path, got {type(config).__name__}")
    _check_keys("", config, _TOP_KEYS, _TOP_UNIMPLEMENTED)
    kw: dict[str, Any] = {}
    for k in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
              "steps_per_print"):
        if k in config and config[k] is not None:
            kw[k] = _int(config[k], k)
    if "gradient_clipping" in config:
        kw["gradient_clipping"] = float(config["gradient_clipping"])

    bf16 = config.get("bf16", {}) or {}
    fp16 = config.get("fp16", {}) or {}
    for name, sec in (("bf16", bf16), ("fp16", fp16)):
        if not isinstance(sec, Mapping):
            raise ValueError(f"DeepSpeed config: {name}={sec!r} must be a dict")
    _check_keys("bf16", bf16, {"enabled"}, {"immediate_grad_update": _absent_or(False),
                                            "check_grad_overflow": _absent_or(False)})
    if fp16.get("enabled", False):
        raise NotImplementedError("DeepSpeed config: zpp does not implement fp16.enabled=True "
                                  "(fp16 needs loss scaling); use bf16")
    if bf16.get("enabled", False):
        kw["precision"] = "bf16"

    if "optimizer" in config and config["optimizer"] is not None:
        kw["optimizer"] = _optimizer(config["optimizer"])
    if "scheduler" in config and config["scheduler"] is not None:
        sch = config["scheduler"]
        _check_keys("scheduler", sch, {"type", "params"}, {})
        kw["scheduler"] = SchedulerConfig(type=sch.get("type"), params=dict(sch.get("params", {})))

    zero = config.get("zero_optimization", {}) or {}
    _check_keys("zero_optimization", zero, _ZERO_KEYS, _ZERO_UNIMPLEMENTED)
    zkw: dict[str, Any] = {}
    if "stage" in zero:
        zkw["stage"] = _int(zero["stage"], "zero_optimization.stage")
    for ds, ours in (("zero_quantized_weights", "quantized_weights"),
                     ("zero_quantized_gradients", "quantized_gradients")):
        if ds in zero:
            if not isinstance(zero[ds], bool):
                raise ValueError(f"DeepSpeed config: zero_optimization.{ds}={zero[ds]!r} must be true or false")
            zkw[ours] = zero[ds]
    for ds, ours in (("zero_hpz_partition_size", "hpz_partition_size"),
                     ("reduce_bucket_size", "reduce_bucket_size"),
                     ("allgather_bucket_size", "allgather_bucket_size"),
                     ("stage3_prefetch_bucket_size", "prefetch_bucket_size")):
        if ds in zero:
            zkw[ours] = _int(zero[ds], f"zero_optimization.{ds}")
    kw["zero"] = ZeroConfig(**zkw)

    z = config.get("zpp", {}) or {}
    fields = {f.name for f in dataclasses.fields(ZppConfig)}
    _check_keys("zpp", z, fields, {})
    kw["zpp"] = ZppConfig(**z)
    return TrainConfig(**kw)


def _optimizer(opt: Mapping[str, Any]) -> OptimizerConfig:
    _check_keys("optimizer", opt, {"type", "params"}, {})
    kind = str(opt.get("type", "")).lower()
    params = dict(opt.get("params", {}) or {})
    if kind == "adam":
        # DeepSpeed's Adam decouples weight decay unless adam_w_mode is false.
        if params.pop("adam_w_mode", True):
            kind = "adamw"
        params.pop("torch_adam", None)
    elif kind == "adamw":
        params.pop("adam_w_mode", None)
        params.pop("torch_adam", None)
    elif kind in ("lamb", "adagrad", "lion", "muadam"):
        raise NotImplementedError(f"DeepSpeed config: zpp's engine does not implement optimizer.type={opt.get('type')!r}")
    if kind in ("adam", "adamw"):
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's default, not torch AdamW's 0.01
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return OptimizerConfig(type=kind, params=params)


def as_config(config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None) -> TrainConfig:
    """A :class:`TrainConfig` from any of the accepted forms (None: all defaults)."""
    if config is None:
        return TrainConfig()
    if isinstance(config, TrainConfig):
        return config
    return from_deepspeed(config)
