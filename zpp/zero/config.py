"""The engine's typed configuration.

One source of truth: :class:`TrainConfig` (with :class:`ZeroConfig`, :class:`ZppConfig`,
:class:`OuterConfig` (in :mod:`zpp.zero.outer_config`), :class:`OptimizerConfig`,
:class:`SchedulerConfig` (in :mod:`zpp.zero.optim_config`), :class:`MonitorConfig` (in
:mod:`zpp.zero.monitor`), :class:`Fp16Config`, :class:`OffloadConfig`,
:class:`ActivationCheckpointingConfig`), frozen and validated at
construction (every field type-checked; errors name the field and the value, see
[Note: strict types] in :mod:`zpp.zero.checks`). A DeepSpeed-style dict or JSON file is
translated into it once, at the edge, by :func:`zpp.zero.deepspeed_config.from_deepspeed`;
nothing below reads dicts.

[Note: engine support]
A few fields are parsed and validated before the engine acts on them (``ENGINE_PENDING``):
:func:`as_config`, the entry of :func:`zpp.initialize`, refuses a config that asks for one of
them with ``NotImplementedError`` naming it, so nothing is silently ignored. The engine
removes an entry from ``ENGINE_PENDING`` when it implements that field.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from zpp.zero.leaf_modules import DEFAULT_LEAF_MODULE_CLASSES
from zpp.zero.checks import (
    check_bool,
    check_choice,
    check_int,
    check_int_or_auto,
    check_number,
    check_str,
    check_str_tuple,
    fail,
)
from zpp.zero.optim_config import (  # noqa: F401 - re-exported: part of the typed config
    ONEBIT_OPTIMIZERS,
    OPTIMIZER_PARAM_CHECKS,
    OPTIMIZER_PARAMS,
    OPTIMIZERS,
    SCHEDULER_PARAM_CHECKS,
    SCHEDULERS,
    OptimizerConfig,
    SchedulerConfig,
)
from zpp.zero.monitor import MonitorConfig  # noqa: F401 - re-exported: part of the typed config
from zpp.zero.offload_config import OFFLOAD_DEVICES, AioConfig, OffloadConfig  # noqa: F401 - re-exported
from zpp.zero.outer_config import OUTER_COMPRESSIONS, OUTER_METHODS, OuterConfig  # noqa: F401 - re-exported

STAGES = (0, 1, 2, 3)
QUANT_BITS = (4, 8)
#: The code widths without a plan, and without ``zpp.weight_bits`` / ``zpp.gradient_bits``.
DEFAULT_WEIGHT_BITS = 8
DEFAULT_GRADIENT_BITS = 4
#: qwZ elements per fp32 scale
DEFAULT_WEIGHT_GROUP_SIZE = 2048
#: qgZ elements per fp32 scale: int4 gradients in groups of 2048 cost 1.2-1.7% of the loss at
#: equal tokens against DDP on a 0.8M GPT, groups of 128 0.1-0.3% for 6% more qgZ bytes
#: (perf/BENCHMARKS.md, "The loss cost of ZeRO++'s quantizers"); DeepSpeed's qgZ groups one
#: row of a gradient (the smaller dimension), about the hidden size
DEFAULT_GRADIENT_GROUP_SIZE = 128
#: ``stage3_prefetch_bucket_size`` (DeepSpeed's default)
DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000
NONFINITE = ("skip", "raise")
@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LeafModuleConfig:
    """Stage 3: modules gathered whole, nothing inside them on its own (DeepSpeed's
    ``zero_optimization.leaf_module``; see :mod:`zpp.zero.leaf_modules`). Applied at
    :func:`zpp.initialize` by setting the modules' ``_z3_leaf`` flag."""

    classes: tuple[str, ...] = DEFAULT_LEAF_MODULE_CLASSES
    """Class names (``Name`` or ``module.Name``) (Default: DeepSpeed's, the Mixtral and Qwen
    mixture-of-experts blocks)."""
    names: tuple[str, ...] = ()
    """Module names as ``named_modules()`` gives them (Default: none)."""
    name_suffixes: tuple[str, ...] = ()
    """Ends of module names (Default: none)."""

    def __post_init__(self) -> None:
        for name in ("classes", "names", "name_suffixes"):
            value = getattr(self, name)
            object.__setattr__(self, name, () if value == () else check_str_tuple("LeafModuleConfig", name, value))


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
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
    overlap_comm: bool | None = None
    """Run each unit's gradient reduction on a communication thread while the backward goes
    on, waited for at the end of the backward, bit for bit the synchronous result; None: on
    at stage 3, off below, as DeepSpeed's default. See [Note: overlapped reductions] in
    :mod:`zpp.zero.reduce.overlap` (Default: None)."""
    allgather_bucket_size: int = 500_000_000
    """Stages 1-2: caps the unit size as well; the unit is ``min`` of both bucket sizes
    (Default: 5e8)."""
    sub_group_size: int = 1_000_000_000
    """With the optimizer state on NVMe: the most elements of one unit at stages 0-2 (and of
    stage 3's buckets of small parameters), so the state streams in pieces of this size
    (DeepSpeed's tile of the offloaded optimizer step) (Default: 1e9)."""
    prefetch_bucket_size: int | Literal["auto"] = DEFAULT_PREFETCH_BUCKET_SIZE
    """Stage 3: elements of parameter gathers started ahead of use (in the order recorded
    on the first pass) that may be in flight or waiting at once, counted before each start
    (DeepSpeed's rule); 0 turns prefetch off; "auto" chooses it at the end of the second pass
    with grad (run in line and timed) from that pass's measured gathers and compute (twice
    the smallest window that hides as much of the link as an unbounded one): on the 25M
    benchmark GPT 2-12 units held ahead instead of the whole model at the same step within
    the noise, on a 29.5M GPT-2 no memory saved and 1.06x the step (perf/BENCHMARKS.md),
    hence not the default. See [Note: stage 3
    prefetch] in :mod:`zpp.zero.prefetch` and [Note: the prefetch window from the measured
    link] in :mod:`zpp.zero.prefetch_depth` (Default: 5e7, DeepSpeed's)."""
    max_live_parameters: int = 1_000_000_000
    """Stage 3: no gather is started ahead while the units gathered and those started would
    hold more elements than this (DeepSpeed's ``stage3_max_live_parameters``; a gather at its
    point of use always runs) (Default: 1e9, DeepSpeed's)."""
    param_persistence_threshold: int = 100_000
    """Stage 3: a parameter with fewer elements than this is not partitioned but stays whole
    on every rank (DeepSpeed's ``stage3_param_persistence_threshold``; see [Note: persistent
    parameters] in :mod:`zpp.zero.planning`); 0 partitions every parameter (Default: 1e5,
    DeepSpeed's)."""
    offload_optimizer: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    """Where the optimizer states and the optimizer step live (stages 1-3)
    (Default: device "none")."""
    offload_param: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    """Where the partitioned parameters live between uses (stage 3) (Default: device "none")."""
    gather_16bit_weights_on_model_save: bool = False
    """Stage 3: ``engine.save_16bit_model()`` and the front-ends' model export gather the
    whole model (``engine.zero_gather_16bit_weights_on_model_save()``) (Default: False)."""
    leaf_module: LeafModuleConfig = dataclasses.field(default_factory=LeafModuleConfig)
    """Stage 3: the modules gathered whole (Default: DeepSpeed's MoE blocks)."""

    @property
    def overlaps_reductions(self) -> bool:
        """``overlap_comm``, its default resolved (on at stage 3)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def __post_init__(self) -> None:
        w = "ZeroConfig"
        check_choice(w, "stage", self.stage, STAGES)
        for name in ("quantized_weights", "quantized_gradients", "gather_16bit_weights_on_model_save"):
            check_bool(w, name, getattr(self, name))
        if self.overlap_comm is not None:
            check_bool(w, "overlap_comm", self.overlap_comm)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "hpz_partition_size", "sub_group_size"):
            check_int(w, name, getattr(self, name), lo=1)
        check_int_or_auto(w, "prefetch_bucket_size", self.prefetch_bucket_size)
        for name in ("param_persistence_threshold", "max_live_parameters"):
            check_int(w, name, getattr(self, name), lo=0)
        for name in ("offload_optimizer", "offload_param"):
            if not isinstance(getattr(self, name), OffloadConfig):
                raise fail(w, name, getattr(self, name), "an OffloadConfig")
        if not isinstance(self.leaf_module, LeafModuleConfig):
            raise fail(w, "leaf_module", self.leaf_module, "a LeafModuleConfig")
        h = self.hpz_partition_size
        if self.stage < 3:
            on = [f"{n}={getattr(self, n)!r}" for n in ("quantized_weights", "quantized_gradients")
                  if getattr(self, n)]
            if h > 1:
                on.append(f"hpz_partition_size={h}")
            if self.offload_param.device != "none":
                on.append(f"offload_param.device={self.offload_param.device!r}")
            if on:
                raise ValueError(f"ZeroConfig: {', '.join(on)} need stage=3, got stage={self.stage}")
        if self.stage == 0 and self.offload_optimizer.device != "none":
            raise ValueError(f"ZeroConfig: offload_optimizer.device={self.offload_optimizer.device!r} needs "
                             "stage >= 1, got stage=0")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
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
    tune_plan: str | None = None
    """A plan file written by ``zpp tune`` for this job; None: ``$ZPP_TUNE_FILE``, else no
    plan. :func:`zpp.initialize` applies it: its backend when neither ``transport`` nor
    ``$ZPP_COMM_BACKEND`` names one, and its compression per message size to the qwZ
    gathers and qgZ reductions (see [Note: the plan in the engine] in
    :mod:`zpp.zero.plan_bits`) (Default: None)."""
    weight_bits: int | None = None
    """qwZ code width, 8 or 4; None: the tune plan's choice for each gather size, else 8. Set
    and contradicted by the plan: ``ValueError`` at initialize (Default: None)."""
    gradient_bits: int | None = None
    """qgZ code width, 4 or 8; None: the tune plan's choice for each reduce-scatter size,
    else 4. Set and contradicted by the plan: ``ValueError`` at initialize (Default: None)."""
    weight_group_size: int = DEFAULT_WEIGHT_GROUP_SIZE
    """qwZ elements per fp32 scale, and the weight deltas' (``weight_delta_bits``); capped at
    the shard size (Default: 2048)."""
    weight_delta_bits: int | None = None
    """Stage 3 with hpZ: keep the node's secondary copy of the weights across optimizer steps
    and refresh it with the weights' change, block-quantized to this width (4 or 8) with
    error feedback, instead of gathering every unit over the world again after each step
    (:mod:`zpp.zero.gather.delta`). Int4 deltas cross the node link in half the bytes of
    qwZ's int8 weights; None: off (Default: None)."""
    gradient_group_size: int = DEFAULT_GRADIENT_GROUP_SIZE
    """qgZ elements per fp32 scale, in both hops; capped at the shard size. Int4 codes in
    groups of 128 are 4.25 bits per entry (2048: 4.02) and cost 0.1-0.3% of the loss where
    groups of 2048 cost 1.2-1.7% (see ``DEFAULT_GRADIENT_GROUP_SIZE``) (Default: 128)."""
    unit_min_numel: int | None = None
    """Stage 3, size-based units: a module becomes a unit (gathered and released as one)
    once its subtree holds this many parameters not yet in a unit; smaller children join
    their ancestor's unit (like FSDP's size-based wrapping); 0: every module holding
    parameters. None: the model's transformer blocks (see [Note: stage 3 units] in
    :mod:`zpp.zero.planning`) (Default: None)."""
    unit_classes: tuple[str, ...] = ()
    """Stage 3: class names (``type(module).__name__``, e.g. "GPT2Block") of modules that
    each become one unit, their whole subtree gathered and released together, like FSDP2's
    ``fully_shard`` per block; wins over ``unit_min_numel``. A list is stored as a tuple
    (Default: ())."""
    prefetch: bool = True
    """Stage 3: start the next units' all-gathers (asynchronous transport ops) while the
    current module runs, following the gather order recorded on the first pass, up to
    ``zero_optimization.stage3_prefetch_bucket_size`` elements; False gathers each unit at
    its point of use only (Default: True)."""
    check_parameters: bool = True
    """At initialize, compare every rank's parameters with rank 0's (one small all-gather of
    checksums) and act on ``parameter_mismatch`` where they differ; False: no check
    (Default: True)."""
    parameter_mismatch: Literal["broadcast", "raise"] = "broadcast"
    """What a parameter that differs from rank 0's gets: "broadcast": rank 0's value, logged
    once (DeepSpeed broadcasts the model at initialize, and unseeded scripts rely on it);
    "raise": a ValueError on every rank naming it (Default: "broadcast")."""
    check_metadata: bool | None = None
    """Set the transport's per-call metadata check; None leaves it as it is (Default: None)."""
    reshard_after_forward: bool = True
    """Stage 3: release each module's gathered parameters after its forward and gather them
    again for its backward (ZeRO-3), or keep them until its gradients are reduced (one
    gather per pass, more memory) (Default: True)."""
    weight_gather: str | None = None
    """Stage 3: the forward weight gather by name (see :mod:`zpp.zero.gather`); None: "qwz"
    with ``zero_quantized_weights``, else "plain" (Default: None)."""
    hierarchical_gather: bool | None = None
    """Run the weight all-gathers in two hops, inter-node among the ranks of equal local rank,
    then inside the node (:func:`zpp.comm.collectives.hierarchical_all_gather_async`): each
    node's link then carries the other nodes' shards once per rank of the node instead of
    once per ring pass, with the same result. None: on where the engine builds the node
    topology anyway (hpZ or qgZ chosen); True: always (the topology is built for it)
    (Default: None)."""
    pipeline_reductions: bool = True
    """With ``overlap_comm``: a reduction in two parts over disjoint communicators (qgZ's
    intra-node and inter-node hops) runs its second part on a second communication thread,
    beside the next reduction's first, with the same bits (see [Note: overlapped
    reductions] in :mod:`zpp.zero.reduce.overlap`); False: one thread runs each reduction
    whole (Default: True)."""
    gradient_reduce: str | None = None
    """The gradient reduction by name (see :mod:`zpp.zero.reduce`); None: from the stage,
    ``zero_quantized_gradients`` and the optimizer (Default: None)."""
    nonfinite: Literal["skip", "raise"] = "skip"
    """A step whose gradients hold NaN or Inf on any rank: "skip" it on every rank (counted
    and logged, ``was_step_applied()`` false, as DeepSpeed's fp16 overflow) or "raise" an
    error on every rank (Default: "skip")."""
    outer: OuterConfig | None = None
    """The hierarchical mode: ZeRO inside each node, (streaming, compressed) DiLoCo across
    nodes (:class:`OuterConfig`, given as a dict); None: one ZeRO world over every rank
    (Default: None)."""

    def __post_init__(self) -> None:
        w = "ZppConfig"
        for name in ("weight_bits", "gradient_bits", "weight_delta_bits"):
            if getattr(self, name) is not None:
                check_choice(w, name, getattr(self, name), QUANT_BITS)
        if self.tune_plan is not None:
            check_str(w, "tune_plan", self.tune_plan)
        for name in ("weight_group_size", "gradient_group_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2 or v % 2:
                raise fail(w, name, v, "a positive even integer")
        if self.unit_min_numel is not None:
            check_int(w, "unit_min_numel", self.unit_min_numel, lo=0)
        object.__setattr__(self, "unit_classes", check_str_tuple(w, "unit_classes", self.unit_classes))
        for name in ("prefetch", "check_parameters", "reshard_after_forward", "pipeline_reductions"):
            check_bool(w, name, getattr(self, name))
        for name in ("weight_gather", "gradient_reduce"):
            if getattr(self, name) is not None:
                check_str(w, name, getattr(self, name))
        for name in ("check_metadata", "hierarchical_gather"):
            if getattr(self, name) is not None:
                check_bool(w, name, getattr(self, name))
        if self.transport is not None:
            check_str(w, "transport", self.transport)
        if self.timeout_s is not None:
            check_number(w, "timeout_s", self.timeout_s, lo=0, lo_open=True)
        check_choice(w, "nonfinite", self.nonfinite, NONFINITE)
        check_choice(w, "parameter_mismatch", self.parameter_mismatch, ("broadcast", "raise"))
        if self.outer is not None and not isinstance(self.outer, OuterConfig):
            object.__setattr__(self, "outer", OuterConfig.from_mapping(w, self.outer))


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Fp16Config:
    """fp16 mixed precision with DeepSpeed's loss scaling (its ``"fp16"`` section, its
    defaults)."""

    enabled: bool = False
    """Train with fp16 parameters and fp32 master weights (Default: False)."""
    auto_cast: bool = False
    """Cast floating-point inputs of the forward to fp16 (Default: False)."""
    loss_scale: float = 0.0
    """A static loss scale; 0 selects dynamic loss scaling (Default: 0)."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2**initial_scale_power`` (Default: 16)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles (Default: 1000)."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves (DeepSpeed's delayed shift)
    (Default: 2)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow (Default: False)."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this (Default: 1)."""

    def __post_init__(self) -> None:
        w = "Fp16Config"
        for name in ("enabled", "auto_cast", "consecutive_hysteresis"):
            check_bool(w, name, getattr(self, name))
        check_number(w, "loss_scale", self.loss_scale, lo=0)
        check_int(w, "initial_scale_power", self.initial_scale_power, lo=0)
        check_int(w, "loss_scale_window", self.loss_scale_window, lo=1)
        check_int(w, "hysteresis", self.hysteresis, lo=1)
        check_number(w, "min_loss_scale", self.min_loss_scale, lo=0)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``"activation_checkpointing"`` section, with its defaults."""

    partition_activations: bool = False
    """Partition the checkpointed activations across model-parallel ranks (Default: False)."""
    cpu_checkpointing: bool = False
    """Keep the checkpointed activations in host memory (Default: False)."""
    contiguous_memory_optimization: bool = False
    """Copy checkpointed activations into one contiguous buffer (Default: False)."""
    number_checkpoints: int | None = None
    """Number of checkpoints in the model, for the contiguous buffer (Default: None)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint boundary (Default: False)."""
    profile: bool = False
    """Time the checkpointed forward and backward (Default: False)."""

    def __post_init__(self) -> None:
        w = "ActivationCheckpointingConfig"
        for f in dataclasses.fields(self):
            if f.name != "number_checkpoints":
                check_bool(w, f.name, getattr(self, f.name))
        if self.number_checkpoints is not None:
            check_int(w, "number_checkpoints", self.number_checkpoints, lo=1)

    @property
    def enabled(self) -> bool:
        """Whether any field asks for something (differs from its default)."""
        return self != ActivationCheckpointingConfig()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """Everything :func:`zpp.initialize` needs to build an engine."""

    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank per micro-step; informational and for the batch check (Default: None)."""
    train_batch_size: int | None = None
    """Global batch; must equal micro * accumulation * world when all are given (Default: None)."""
    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step; ``backward`` scales the loss by its inverse. None: from
    ``train_batch_size / (train_micro_batch_size_per_gpu * world_size)`` when both are given,
    else 1, as DeepSpeed derives it (see :meth:`with_world`) (Default: None)."""
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm before the step; 0 turns it off (Default: 0).
    With a 1-bit optimizer the averaged gradient never exists outside the optimizer, so the
    norm clipped is ``sqrt(mean over ranks of ||local gradient||^2)``, an upper bound of the
    averaged gradient's norm (see [Note: 1-bit optimizers] in :mod:`zpp.zero.engine`)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype during training: "bf16" / "fp16" cast the model to bfloat16 / float16
    and keep fp32 master weights (Default: "fp32"). "fp16" and ``fp16.enabled`` are the
    same switch: either sets the other, and ``fp16`` holds its loss scaling."""
    fp16: Fp16Config = dataclasses.field(default_factory=Fp16Config)
    """fp16 mixed precision and its loss scaling (Default: off)."""
    steps_per_print: int = 0
    """Rank 0 prints step and learning rate every this many optimizer steps; 0: never
    (Default: 0)."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build; None means one is passed to initialize (Default: None)."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule; None: constant (Default: None)."""
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    """ZeRO stage and ZeRO++ switches."""
    activation_checkpointing: ActivationCheckpointingConfig = dataclasses.field(
        default_factory=ActivationCheckpointingConfig)
    """DeepSpeed's activation checkpointing options (Default: all off)."""
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    """DeepSpeed's ``aio`` section: the NVMe tier's reads and writes (Default: DeepSpeed's)."""
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    """DeepSpeed's monitors: the tensorboard, csv_monitor, wandb and comet sections
    (Default: all off)."""
    zpp: ZppConfig = dataclasses.field(default_factory=ZppConfig)
    """zpp's own knobs."""

    def __post_init__(self) -> None:
        w = "TrainConfig"
        for name in ("train_micro_batch_size_per_gpu", "train_batch_size"):
            if getattr(self, name) is not None:
                check_int(w, name, getattr(self, name), lo=1)
        if self.gradient_accumulation_steps is not None:
            check_int(w, "gradient_accumulation_steps", self.gradient_accumulation_steps, lo=1)
        check_number(w, "gradient_clipping", self.gradient_clipping, lo=0)
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"TrainConfig: precision={self.precision!r} must be 'fp32', 'bf16' or 'fp16'")
        check_int(w, "steps_per_print", self.steps_per_print, lo=0)
        for name, cls in (("fp16", Fp16Config), ("zero", ZeroConfig), ("zpp", ZppConfig),
                          ("activation_checkpointing", ActivationCheckpointingConfig), ("monitor", MonitorConfig),
                          ("aio", AioConfig)):
            if not isinstance(getattr(self, name), cls):
                raise fail(w, name, getattr(self, name), f"a {cls.__name__}")
        for name, cls in (("optimizer", OptimizerConfig), ("scheduler", SchedulerConfig)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), cls):
                raise fail(w, name, getattr(self, name), f"a {cls.__name__} or None")
        if self.fp16.enabled and self.precision == "bf16":
            raise ValueError("TrainConfig: fp16.enabled=True and precision='bf16': choose one (DeepSpeed "
                             "refuses both too)")
        if self.fp16.enabled:  # one switch, two spellings (see the precision field)
            object.__setattr__(self, "precision", "fp16")
        elif self.precision == "fp16":
            object.__setattr__(self, "fp16", dataclasses.replace(self.fp16, enabled=True))
        if self.optimizer is not None and self.optimizer.onebit and self.zero.stage >= 1:
            name = ONEBIT_OPTIMIZERS[self.optimizer.type]
            raise NotImplementedError(
                f"TrainConfig: optimizer {name} with ZeRO stage {self.zero.stage} is not implemented: the "
                "1-bit optimizers compress the momentum with error feedback, which needs the full momentum "
                "(and the error buffers) on every rank, while ZeRO stage >= 1 shards the optimizer state. "
                "Keeping ZeRO's memory saving would need a sharded compressed momentum exchange, which zpp "
                "does not implement; use zero_optimization.stage=0 (plain data parallel)")
        if self.optimizer is not None and self.optimizer.onebit and self.zpp.outer is not None:
            raise NotImplementedError(
                f"TrainConfig: optimizer {ONEBIT_OPTIMIZERS[self.optimizer.type]} with zpp.outer is not "
                "implemented: the hierarchical mode's inner optimizer runs inside a node, where the link is "
                "fast and 1-bit compression buys nothing; use Adam/AdamW and set zpp.outer.compression for "
                "the slow link")
        if self.zero.offload_param.device == "nvme" and self.zpp.outer is not None:
            raise NotImplementedError(
                "TrainConfig: zero_optimization.offload_param.device='nvme' with zpp.outer is not implemented: "
                "the outer sync reads every unit's weights at each period, which the parameter tier keeps on "
                "disk; use offload_optimizer.device='nvme' (the optimizer state, 8 of the 16 bytes per "
                "parameter) with the hierarchical mode")
        if self.zpp.weight_delta_bits is not None and (self.zero.stage < 3 or self.zero.hpz_partition_size <= 1):
            raise ValueError(
                f"TrainConfig: zpp.weight_delta_bits={self.zpp.weight_delta_bits} refreshes hpZ's node copy of the "
                f"weights and needs zero_optimization.stage=3 with zero_hpz_partition_size > 1, got "
                f"stage={self.zero.stage}, zero_hpz_partition_size={self.zero.hpz_partition_size}")

    def with_world(self, world_size: int) -> TrainConfig:
        """The config with the batch sizes resolved for ``world_size`` as DeepSpeed resolves
        them (``train_batch_size = micro * gas * world_size``; any two given determine the
        third, one given alone means ``gas = 1``); ValueError naming the three values when
        they contradict each other or do not divide."""
        total, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        where = (f"train_batch_size={total}, train_micro_batch_size_per_gpu={micro}, "
                 f"gradient_accumulation_steps={gas}, world_size={world_size}")
        if total is not None and micro is not None and gas is None:
            gas, rest = divmod(total, micro * world_size)
            if rest or gas < 1:
                raise ValueError(f"TrainConfig: {where}: train_batch_size must be a positive multiple of "
                                 "micro * world_size")
        elif total is not None and gas is not None and micro is None:
            micro, rest = divmod(total, gas * world_size)
            if rest or micro < 1:
                raise ValueError(f"TrainConfig: {where}: train_batch_size must be a positive multiple of "
                                 "gradient_accumulation_steps * world_size")
        elif total is not None and micro is None:
            gas = 1
            micro, rest = divmod(total, world_size)
            if rest or micro < 1:
                raise ValueError(f"TrainConfig: {where}: train_batch_size must be a positive multiple of world_size")
        gas = 1 if gas is None else gas
        if micro is not None and total is None:
            total = micro * gas * world_size
        if total is not None and total != micro * gas * world_size:
            raise ValueError(
                f"TrainConfig: train_batch_size={total} != train_micro_batch_size_per_gpu * "
                f"gradient_accumulation_steps * world_size = {micro} * {gas} * {world_size} = "
                f"{micro * gas * world_size}")
        return dataclasses.replace(self, train_batch_size=total, train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=gas)


# ---------------------------------------------------------------------- engine support
#: Fields the typed config holds but the engine does not act on yet (see
#: [Note: engine support]): name -> (asks for it?, what to say).
ENGINE_PENDING: dict[str, tuple[Callable[[TrainConfig], bool], str]] = {
}


def check_engine_support(config: TrainConfig) -> None:
    """Raise ``NotImplementedError`` naming every field of ``config`` that asks for something
    in ``ENGINE_PENDING`` (parsed, not run by the engine yet)."""
    asked = [(name, what) for name, (asks, what) in ENGINE_PENDING.items() if asks(config)]
    if asked:
        raise NotImplementedError(
            "zpp.initialize: the config asks for what zpp parses but its engine does not run yet: "
            + "; ".join(f"{name} ({what})" for name, what in asked))


def as_config(config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None) -> TrainConfig:
    """A :class:`TrainConfig` from any of the accepted forms (None: all defaults), refused
    with ``NotImplementedError`` if it asks for what the engine does not run yet (see
    [Note: engine support])."""
    if config is None:
        config = TrainConfig()
    elif not isinstance(config, TrainConfig):
        from zpp.zero.deepspeed_config import from_deepspeed

        config = from_deepspeed(config)
    check_engine_support(config)
    return config


def __getattr__(name: str):
    # from_deepspeed lived here before the DeepSpeed edge had its own module.
    if name == "from_deepspeed":
        from zpp.zero.deepspeed_config import from_deepspeed

        return from_deepspeed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
