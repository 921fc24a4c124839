"""The DeepSpeed config keys zpp knows, each with what zpp does with it, and the README
tables generated from them. The translation that applies them is
:mod:`zpp.zero.deepspeed_config`.

[Note: DeepSpeed keys]
Every key of a DeepSpeed config is in ``KEYS`` (by dotted path) with one status:

* ``implemented``: translated into a field of the typed config (the note names it);
* ``accepted``: a knob that only tunes DeepSpeed's speed or memory where zpp has an
  equivalent or needs none; any well-typed value is accepted and logged once per process
  (on rank 0), saying what it maps to;
* ``refused``: zpp does not implement it; the values that ask for nothing (DeepSpeed's
  default, ``"enabled": false``, ...) pass, any other raises ``NotImplementedError`` naming
  the key and the value.

A key that is not in ``KEYS`` raises ``ValueError`` listing every unknown key of its
section. Every value is type-checked before anything else (see [Note: strict types] in
:mod:`zpp.zero.checks`): ``"false"`` is not a boolean, ``true`` is not a number, ``betas``
has two entries; each error names the key and the value. ``null`` means "absent" only where
DeepSpeed reads it so (``nullable`` in the table); elsewhere it is refused, e.g.
``zero_optimization: null``, on which DeepSpeed itself fails with a ``TypeError``.

Aliases DeepSpeed accepts are accepted: ``bfloat16`` for ``bf16``; in ``zero_optimization``
the field names of DeepSpeed's config model next to their ``stage3_`` aliases
(``param_persistence_threshold`` for ``stage3_param_persistence_threshold``, ...); the
deprecated ``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory`` and the
boolean ``zero_optimization: true`` (stage 1, with the top-level ``allgather_size``).
Giving a key and its alias together is a ``ValueError``. Fields parsed here that the engine
does not run yet are refused later, by :func:`zpp.zero.config.as_config` (see
[Note: engine support] there). The README's "Coming from DeepSpeed" tables are generated
from ``KEYS`` (:func:`keys_markdown`; ``python tools/gen_readme.py`` rewrites them).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from zpp.zero.checks import (
    check_bool, check_choice, check_int, check_int_or_auto, check_mapping, check_number, check_str, check_str_tuple,
    fail,
)
from zpp.zero.config import ENGINE_PENDING, ActivationCheckpointingConfig, Fp16Config, OuterConfig, ZppConfig
from zpp.zero.offload_config import AioConfig
from zpp.zero.monitor import FIELD_CHECKS as _MONITOR_CHECKS, SECTIONS as MONITOR_SECTIONS, WRITERS as _WRITERS

__all__ = ["KEYS", "MONITOR_SECTIONS", "OFFLOAD_SECTIONS", "REFUSED_OPTIMIZERS", "STATUSES",
           "TOP_ALIASES", "WHERE", "ZERO", "ZERO_ALIASES", "DsKey", "keys_markdown"]

WHERE = "DeepSpeed config"
STATUSES = ("implemented", "accepted", "refused")


@dataclasses.dataclass(frozen=True, slots=True)
class DsKey:
    """One DeepSpeed config key and what zpp does with it (see [Note: DeepSpeed keys])."""

    path: str
    """Dotted path, e.g. "zero_optimization.overlap_comm"."""
    status: str
    """"implemented", "accepted" or "refused"."""
    note: str
    """implemented: the field it becomes; accepted: what zpp does instead; refused: why, and
    what zpp offers."""
    check: Callable[[str, Any], Any]
    """Type check ``(shown_path, value) -> value``; raises ``ValueError`` naming both."""
    off: Callable[[Any], bool] | None = None
    """refused: the (type-checked) values that ask for nothing."""
    nullable: bool = False
    """``null`` reads as absent (as DeepSpeed reads it)."""
    section: bool = False
    """A JSON object whose own keys are in ``KEYS`` under this path."""
    off_text: str = ""
    """refused: the accepted values, in words (for the README)."""


# ---------------------------------------------------------------------- value checks
def _bool(p, v):
    return check_bool(WHERE, p, v, lenient=True)


def _int(lo=None):
    return lambda p, v: check_int(WHERE, p, v, lo=lo, lenient=True)


def _int_or_auto(p, v):
    return check_int_or_auto(WHERE, p, v, lenient=True)


def _num(lo=None, lo_open=False, hi=None):
    return lambda p, v: check_number(WHERE, p, v, lo=lo, lo_open=lo_open, hi=hi)


def _steps_per_print(p, v):
    """An integer >= 0, or infinity (accelerate writes float("inf")): never print, as 0."""
    if isinstance(v, float) and v == math.inf:
        return 0
    return check_int(WHERE, p, v, lo=0, lenient=True)


def _choice(*choices):
    return lambda p, v: check_choice(WHERE, p, v, choices)


def _str(p, v):
    return check_str(WHERE, p, v)


def _str_list(p, v):
    """A list of strings; one string is a one-element list (as DeepSpeed coerces it)."""
    return check_str_tuple(WHERE, p, [v] if isinstance(v, str) else v)


def _dict(p, v):
    return check_mapping(WHERE, p, v)


def _anything(p, v):
    return v


def _allreduce_op(p, v):
    """"mean" or "sum", in any case, as DeepSpeed reads it."""
    if not isinstance(v, str) or v.lower() not in ("mean", "sum"):
        raise fail(WHERE, p, v, 'one of "mean", "sum"')
    return v.lower()


def _tag_mode(p, v):
    if not isinstance(v, str) or v.upper() not in ("WARN", "IGNORE", "FAIL"):
        raise fail(WHERE, p, v, 'one of "Warn", "Ignore", "Fail"')
    return v


def _enabled_section(p, v):
    """A refused section: a dict whose ``enabled`` (if any) is a boolean."""
    check_mapping(WHERE, p, v)
    if "enabled" in v:
        check_bool(WHERE, f"{p}.enabled", v["enabled"], lenient=True)
    return v


def _section_off(v) -> bool:
    """A refused section asks for nothing: ``enabled`` false, or no ``enabled`` and every
    value false or empty."""
    return not v["enabled"] if "enabled" in v else not any(v.values())


def _monitor_check(name):
    if name == "samples_log_interval":
        return _int(lo=0)
    return lambda p, v: _MONITOR_CHECKS[name](WHERE, p, v)


def _monitor_note(section):
    pkg = _WRITERS[section].package
    need = f"; needs the {pkg} package, else one warning and no {section} logs" if pkg else "; no package needed"
    return f"TrainConfig.monitor.{section} ({MONITOR_SECTIONS[section].__name__}, zpp.zero.monitor){need}"


def _is(*values):
    return lambda v: any(v == x and type(v) is type(x) for x in values)


# ---------------------------------------------------------------------- the table
def _impl(path, note, check, **kw):
    return DsKey(path, "implemented", note, check, **kw)


def _accept(path, note, check, **kw):
    return DsKey(path, "accepted", note, check, **kw)


def _refuse(path, note, check, off, off_text, **kw):
    return DsKey(path, "refused", note, check, off=off, off_text=off_text, **kw)


def _refuse_section(path, note):
    return _refuse(path, note, _enabled_section, _section_off, '"enabled": false')


def _refuse_flag(path, note, default=False, **kw):
    return _refuse(path, note, _bool, _is(default), "false" if default is False else "true", **kw)


_NVME_PARAMS = ("zpp reads each unit's shard ahead of use through buffer_count buffers sized to the unit "
                "(DeepSpeed's fixed buffer_size and its cache of max_in_cpu parameters do not apply)")
ZERO = _ZERO = "zero_optimization"
OFFLOAD_SECTIONS = _OFF = ("offload_optimizer", "offload_param")

_KEY_LIST: list[DsKey] = [
    # --- top level: batch, optimizer, precision
    _impl("train_batch_size", "TrainConfig.train_batch_size", _int(lo=1), nullable=True),
    _impl("train_micro_batch_size_per_gpu", "TrainConfig.train_micro_batch_size_per_gpu", _int(lo=1),
          nullable=True),
    _impl("gradient_accumulation_steps", "TrainConfig.gradient_accumulation_steps", _int(lo=1), nullable=True),
    _impl("gradient_clipping", "TrainConfig.gradient_clipping (a number; true is refused)", _num(lo=0)),
    _impl("steps_per_print", "TrainConfig.steps_per_print (0 or inf, which accelerate writes: never)",
          _steps_per_print, nullable=True),
    _impl("optimizer", "TrainConfig.optimizer", _dict, nullable=True, section=True),
    _impl("optimizer.type", "OptimizerConfig.type: Adam, AdamW, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb "
          "(case-insensitive)", _str),
    _impl("optimizer.params", "OptimizerConfig.params (each optimizer's own names, type-checked)", _dict,
          nullable=True),
    _impl("optimizer.params.adam_w_mode", 'Adam: true (default) gives "adamw", false "adam" (L2)', _bool),
    _accept("optimizer.params.torch_adam", "zpp's Adam is torch's", _bool),
    _refuse_flag("optimizer.params.bias_correction", "torch's Adam always corrects the bias (the 1-bit "
                 "optimizers take false)", default=True),
    _accept("optimizer.params.max_grad_norm", "ignored, as DeepSpeed ignores it: gradient_clipping clips",
            _num(lo=0)),
    _accept("optimizer.legacy_fusion", "zpp has one Adam", _bool),
    _impl("scheduler", "TrainConfig.scheduler", _dict, nullable=True, section=True),
    _impl("scheduler.type", "SchedulerConfig.type: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, "
          "LRRangeTest, DeepSpeed's lr sequences step for step (torch.optim.lr_scheduler names: pass the "
          "scheduler as lr_scheduler=)", _str),
    _impl("scheduler.params", "SchedulerConfig.params: each schedule's DeepSpeed names, type-checked; an unknown "
          "one is refused", _dict, nullable=True),
    _impl("fp16", "TrainConfig.fp16 (Fp16Config)", _dict, section=True),
    *[_impl(f"fp16.{f.name}", f"Fp16Config.{f.name}", chk) for f, chk in zip(
        dataclasses.fields(Fp16Config),
        (_bool, _bool, _num(lo=0), _int(lo=0), _int(lo=1), _int(lo=1), _bool, _num(lo=0)))],
    _refuse_flag("fp16.fp16_master_weights_and_grads", "zpp keeps fp32 master weights"),
    _impl("bf16", 'TrainConfig.precision ("bf16" when enabled); alias bfloat16', _dict, nullable=True, section=True),
    _impl("bf16.enabled", 'TrainConfig.precision="bf16"', _bool),
    _accept("bf16.immediate_grad_update", "zpp reduces gradients in fp32 buffers", _bool),
    _accept("bf16.check_grad_overflow", "zpp.nonfinite decides what a non-finite gradient does (skip by "
            "default)", _bool),
    _refuse_flag("bf16.bf16_master_weights_and_grads", "zpp keeps fp32 master weights"),
    _refuse_flag("bf16.bf16_optimizer_states", "zpp keeps fp32 optimizer states"),
    _impl("allgather_size", "ZeroConfig.allgather_bucket_size, with the deprecated zero_optimization: true only",
          _int(lo=1)),
    # --- zero_optimization
    _impl(_ZERO, "TrainConfig.zero (ZeroConfig); true/false: DeepSpeed's deprecated form (stage 1/0)",
          _anything, section=True),
    _impl(f"{_ZERO}.stage", "ZeroConfig.stage (0-3)", _int(lo=0)),
    _impl(f"{_ZERO}.zero_quantized_weights", "ZeroConfig.quantized_weights (qwZ)", _bool),
    _impl(f"{_ZERO}.zero_hpz_partition_size", "ZeroConfig.hpz_partition_size (hpZ)", _int(lo=1)),
    _impl(f"{_ZERO}.zero_quantized_gradients", "ZeroConfig.quantized_gradients (qgZ)", _bool),
    _impl(f"{_ZERO}.reduce_bucket_size", "ZeroConfig.reduce_bucket_size", _int(lo=1)),
    _impl(f"{_ZERO}.allgather_bucket_size", "ZeroConfig.allgather_bucket_size", _int(lo=1)),
    _impl(f"{_ZERO}.stage3_prefetch_bucket_size", 'ZeroConfig.prefetch_bucket_size (0: no prefetch; "auto": '
          "chosen from a timed pass's gathers and compute)", _int_or_auto),
    _impl(f"{_ZERO}.stage3_max_live_parameters", "ZeroConfig.max_live_parameters: no gather starts ahead past it",
          _int(lo=0)),
    _impl(f"{_ZERO}.stage3_param_persistence_threshold", "ZeroConfig.param_persistence_threshold", _int(lo=0)),
    *[x for dev in _OFF for x in (
        _impl(f"{_ZERO}.{dev}", f"ZeroConfig.{dev} (OffloadConfig)" + (
              "; ignored below stage 3, as DeepSpeed does" if dev == "offload_param" else "; needs stage >= 1"),
              _dict, nullable=True, section=True),
        _impl(f"{_ZERO}.{dev}.device", f'ZeroConfig.{dev}.device: "none", "cpu" or "nvme"',
              _choice("none", "cpu", "nvme")),
        _impl(f"{_ZERO}.{dev}.pin_memory", f"ZeroConfig.{dev}.pin_memory", _bool),
    )],
    *[x for dev in _OFF for x in (
        _impl(f"{_ZERO}.{dev}.nvme_path", "OffloadConfig.nvme_path: the swap files' folder", _str, nullable=True),
        _impl(f"{_ZERO}.{dev}.buffer_count", "OffloadConfig.buffer_count: host buffers the swapped "
              "state streams through (at least 2)", _int(lo=2)),
    )],
    _accept(f"{_ZERO}.offload_param.buffer_size", _NVME_PARAMS, _int(lo=0)),
    _accept(f"{_ZERO}.offload_param.max_in_cpu", _NVME_PARAMS, _int(lo=0)),
    *[_accept(f"{_ZERO}.offload_optimizer.{k}", "zpp always pipelines the swap's reads and writes", _bool)
      for k in ("pipeline_read", "pipeline_write")],
    _accept(f"{_ZERO}.offload_optimizer.fast_init", "zpp preallocates the swap file at initialize", _bool),
    _refuse(f"{_ZERO}.offload_optimizer.ratio", "partial optimizer offload", _num(lo=0, hi=1), _is(1, 1.0), "1"),
    _refuse_flag(f"{_ZERO}.offload_optimizer.super_offload", "Superchip offload"),
    _accept(f"{_ZERO}.offload_optimizer.convert_grad_on_cpu", "zpp converts where the states live", _bool),
    _accept(f"{_ZERO}.offload_optimizer.cpuadam_cores_perc", "torch's optimizer threads", _num(lo=0, hi=1)),
    _impl(f"{_ZERO}.cpu_offload", "deprecated: true is offload_optimizer.device cpu", _bool, nullable=True),
    _impl(f"{_ZERO}.cpu_offload_param", "deprecated: true is offload_param.device cpu", _bool, nullable=True),
    _impl(f"{_ZERO}.cpu_offload_use_pin_memory", "deprecated: the offloads' pin_memory", _bool, nullable=True),
    _impl(f"{_ZERO}.overlap_comm", "ZeroConfig.overlap_comm: gradient reductions on a communication thread "
          "during the backward (default: on at stage 3); the gathers' prefetch is zpp.prefetch", _bool,
          nullable=True),
    _accept(f"{_ZERO}.contiguous_gradients", "zpp's gradients live in flat per-unit buffers", _bool),
    _accept(f"{_ZERO}.reduce_scatter", "zpp reduce-scatters at stages 2-3, all-reduces below", _bool),
    _accept(f"{_ZERO}.allgather_partitions", "zpp all-gathers", _bool),
    _accept(f"{_ZERO}.use_multi_rank_bucket_allreduce", "zpp's buckets are per unit", _bool),
    _accept(f"{_ZERO}.stage3_max_reuse_distance", "zpp releases each unit after use (reuse distance 0)",
            _int(lo=0)),
    _accept(f"{_ZERO}.stage3_model_persistence_threshold", "zpp does not cap the persistent parameters",
            _int(lo=0)),
    _accept(f"{_ZERO}.stage3_module_granularity_threshold", "zpp.unit_min_numel groups small modules",
            _int()),
    _accept(f"{_ZERO}.stage3_use_all_reduce_for_fetch_params", "zpp all-gathers", _bool),
    _accept(f"{_ZERO}.stage3_allgather_sequential", "zpp gathers per unit", _bool),
    _accept(f"{_ZERO}.memory_efficient_linear", "zpp gathers per unit around any module", _bool),
    _accept(f"{_ZERO}.round_robin_gradients", "a CPU-offload copy schedule; zpp has its own", _bool),
    _impl(f"{_ZERO}.sub_group_size", "ZeroConfig.sub_group_size: with offload_optimizer nvme, the most elements "
          "of a bucketed unit (the swapped step's tile); otherwise each unit's shard steps as one tensor",
          _int(lo=1)),
    _accept(f"{_ZERO}.override_module_apply", "zpp does not patch Module.apply", _bool),
    _accept(f"{_ZERO}.log_trace_cache_warnings", "zpp logs prefetch fallbacks in engine.prefetch_stats", _bool),
    _accept(f"{_ZERO}.elastic_checkpoint", "zpp's checkpoints load at any world size", _bool),
    _impl(f"{_ZERO}.stage3_gather_16bit_weights_on_model_save", "ZeroConfig.gather_16bit_weights_on_model_save "
          "(engine.save_16bit_model, the front-ends' ZeRO-3 export)", _bool),
    _impl(f"{_ZERO}.stage3_gather_fp16_weights_on_model_save", "deprecated name of the above", _bool),
    _refuse_flag(f"{_ZERO}.load_from_fp32_weights", "zpp's checkpoints hold fp32 masters and load them",
                 default=True),
    _refuse_flag(f"{_ZERO}.ignore_unused_parameters", "zpp reduces unused parameters' gradients as zeros",
                 default=True),
    _refuse_flag(f"{_ZERO}.legacy_stage1", "old stage 1"),
    _refuse_flag(f"{_ZERO}.zero_quantized_nontrainable_weights", "quantized storage of frozen weights"),
    _refuse(f"{_ZERO}.mics_shard_size", "MiCS; hpZ (zero_hpz_partition_size) keeps gathers in the node",
            _int(), _is(-1), "-1"),
    _refuse_flag(f"{_ZERO}.mics_hierarchical_params_gather", "MiCS"),
    _refuse(f"{_ZERO}.zeropp_loco_param", "LoCo error feedback for qgZ", _anything, lambda v: v is None, "null",
            nullable=True),
    _refuse(f"{_ZERO}.zenflow", "ZenFlow", _anything, lambda v: v is None, "null", nullable=True),
    _refuse_flag(f"{_ZERO}.pipeline_loading_checkpoint", "pipeline parallelism"),
    _refuse_flag(f"{_ZERO}.enable_sanity_checks", "DeepSpeed's internal checks"),
    _impl(f"{_ZERO}.leaf_module", "ZeroConfig.leaf_module (LeafModuleConfig): modules stage 3 gathers whole",
          _dict, nullable=True, section=True),
    *[_impl(f"{_ZERO}.leaf_module.{k}", f"LeafModuleConfig.{k} (a string is a one-element list)", _str_list)
      for k in ("classes", "names", "name_suffixes")],
    # --- activation checkpointing
    _impl("activation_checkpointing", "TrainConfig.activation_checkpointing", _dict, section=True),
    *[_impl(f"activation_checkpointing.{f.name}", f"ActivationCheckpointingConfig.{f.name}",
            _int(lo=1) if f.name == "number_checkpoints" else _bool, nullable=f.name == "number_checkpoints")
      for f in dataclasses.fields(ActivationCheckpointingConfig)],
    _impl("zpp", "TrainConfig.zpp (ZppConfig): zpp's own keys", _dict, section=True),
    # --- monitors (zpp.zero.monitor)
    *[x for sec, cls in MONITOR_SECTIONS.items() for x in (
        _impl(sec, _monitor_note(sec), _dict, section=True),
        *[_impl(f"{sec}.{f.name}", f"{cls.__name__}.{f.name}", _monitor_check(f.name), nullable=f.default is None)
          for f in dataclasses.fields(cls)])],
    # --- top level: speed, memory and diagnostics knobs
    _accept("wall_clock_breakdown", "no timers (nor the monitors' elapsed_time_ms events); the transport counts "
            "bytes per op and level (engine.world.counters)", _bool),
    _accept("memory_breakdown", "no memory report; see zpp.accelerator.get_accelerator().memory_allocated()",
            _bool),
    _refuse("gradient_allreduce_op", "summed gradients; scale the loss by the world size instead",
            _allreduce_op, _is("mean"), '"mean" (the default: zpp averages over the ranks)'),
    _accept("prescale_gradients", "zpp computes the mean over ranks in its own reduction", _bool),
    _accept("gradient_predivide_factor", "zpp computes the mean over ranks in its own reduction",
            _num(lo=0, lo_open=True)),
    _accept("zero_allow_untested_optimizer", "a permission; zpp runs the optimizers it builds", _bool),
    _accept("zero_force_ds_cpu_optimizer", "zpp's optimizers are torch's", _bool),
    _impl("aio", "TrainConfig.aio (AioConfig): the NVMe tier's reads and writes", _dict, section=True),
    *[_impl(f"aio.{f.name}", f"AioConfig.{f.name}", _bool if f.type == "bool" else _int(lo=1))
      for f in dataclasses.fields(AioConfig)],
    _accept("aio.use_gds", "GPUDirect Storage: zpp's NVMe tier reads and writes through host buffers", _bool),
    _accept("aio.intra_op_parallelism", "zpp's I/O workers are aio.thread_count x aio.queue_depth", _int(lo=1)),
    _accept("aio.io_backend", "zpp's NVMe tier does its own pread/pwrite I/O", _anything),
    _refuse("communication_data_type", "zpp reduces gradients in fp32; compress with "
            "zero_quantized_gradients", _choice("fp32", "fp16", "bf16"), _is("fp32"), '"fp32"', nullable=True),
    _refuse_flag("sparse_gradients", "sparse gradients"),
    _refuse_flag("disable_allgather", "stage 1-2 without all-gather"),
    _refuse_flag("dump_state", "printing DeepSpeed's engine state"),
    _refuse_flag("graph_harvesting", "CUDA graph harvesting"),
    _refuse_flag("dataloader_drop_last", "dropping the last batch of training_data"),
    _impl("checkpoint", "a section: its keys are listed one by one", _dict, section=True),
    _refuse("checkpoint.tag_validation", "zpp does not compare the ranks' tags", _tag_mode,
            lambda v: v.upper() in ("WARN", "IGNORE"), '"Warn", "Ignore"'),
    _refuse_flag("checkpoint.load_universal", "zpp's own format reshards across world sizes and stages"),
    _refuse_flag("checkpoint.use_node_local_storage", "node-local checkpoints"),
    _refuse("checkpoint.parallel_write", "pipeline-parallel checkpoint writes", _dict,
            lambda v: not any(v.values()), "{}"),
    _refuse("checkpoint.writer", "DeepSpeed's checkpoint writers", _anything, lambda v: v is None, "null",
            nullable=True),
    _impl("data_types", "a section: its keys are listed one by one", _dict, section=True),
    _refuse("data_types.grad_accum_dtype", "zpp accumulates gradients in fp32 shards", _choice(
        "fp32", "fp16", "bf16"), _is("fp32"), '"fp32"', nullable=True),
    _refuse_section("amp", "Apex AMP; use bf16"),
    _refuse_section("torch_autocast", "DeepSpeed's autocast; use bf16 or torch.autocast in the script"),
    _refuse_section("flops_profiler", "use torch.profiler"),
    _refuse_section("comms_logger", "the transport counts bytes per op and level (engine.world.counters)"),
    _refuse_section("sparse_attention", "use torch.nn.functional.scaled_dot_product_attention"),
    _refuse_section("pipeline", "pipeline parallelism; zpp is data-parallel (ZeRO 0-3)"),
    _refuse_section("compression_training", "compression of the model; zpp compresses communication"),
    _refuse_section("data_efficiency", "data sampling and routing; do it in the data loader"),
    _refuse_section("curriculum_learning", "curriculum learning; do it in the data loader"),
    _refuse_section("elasticity", "zpp's checkpoints load at any world size: restart with the new size"),
    _accept("autotuning", "read by `zpp tune --job` (its keys below); a training run ignores it, as DeepSpeed's "
            "engine does outside `deepspeed --autotuning`", _dict, section=True),
    _accept("autotuning.enabled", "`zpp tune --job` tunes whether or not it is set", _bool),
    _accept("autotuning.start_profile_step", "`zpp tune --job`: untimed steps of each trial run", _int(lo=0)),
    _accept("autotuning.end_profile_step", "`zpp tune --job`: the trial run's last timed step", _int(lo=1)),
    _accept("autotuning.metric", "`zpp tune --job` ranks by step time (throughput and latency alike at a fixed batch)",
            _choice("throughput", "latency", "flops")),
    _accept("autotuning.tuner_num_trials", "`zpp tune --job`: at most this many candidates confirmed by a run",
            _int(lo=1)),
    _accept("autotuning.results_dir", "`zpp tune --job`: where its report goes", _str),
    *(_accept(f"autotuning.{k}", "`zpp tune --job`'s micro-batch search, with arg_mappings naming the script "
              "argument of train_micro_batch_size_per_gpu (zpp/tune/microbatch.py)", _anything)
      for k in ("arg_mappings", "max_train_batch_size", "num_tuning_micro_batch_sizes",
                "min_train_micro_batch_size_per_gpu", "max_train_micro_batch_size_per_gpu")),
    *(_accept(f"autotuning.{k}", "DeepSpeed's tuner and experiment files: zpp tune ranks the modes by its cost "
              "model and confirming runs", _anything)
      for k in ("exps_dir", "overwrite", "fast", "mp_size", "tuner_type", "tuner_early_stopping", "model_info",
                "model_info_path", "metric_path")),
    _refuse_section("eigenvalue", "eigenvalue computation"),
    _refuse_section("progressive_layer_drop", "progressive layer dropping"),
    _refuse_section("quantize_training", "quantization-aware training"),
    _refuse_section("nebula", "zpp writes its checkpoints itself"),
    _refuse_section("hybrid_engine", "DeepSpeed-Chat's generation engine"),
    _refuse_section("compile", "DeepCompile; torch.compile the module yourself"),
    _refuse_section("tensor_parallel", "tensor parallelism; zpp is data-parallel"),
    _refuse_section("weight_quantization", "inference weight quantization"),
    _refuse_section("timers", "DeepSpeed's throughput timers"),
    _refuse("sequence_parallel_size", "sequence parallelism", _int(lo=1), _is(1), "1"),
]
#: Every DeepSpeed key zpp knows, by dotted path (see [Note: DeepSpeed keys]).
KEYS: dict[str, DsKey] = {k.path: k for k in _KEY_LIST}
if len(KEYS) != len(_KEY_LIST):  # pragma: no cover - a table typo
    raise AssertionError("zpp.zero.deepspeed_config: a key is listed twice")

#: Other names DeepSpeed reads for a section (alias -> key).
TOP_ALIASES = {"bfloat16": "bf16"}
#: zero_optimization: the field names of DeepSpeed's config model (populate_by_name) -> alias.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
#: Optimizer names DeepSpeed knows that zpp does not build (lower case), and torch.optim's.
REFUSED_OPTIMIZERS = ("lamb", "adagrad", "lion", "muadam", "muadamw", "musgd", "muon", "adadelta", "adamax",
                      "asgd", "lbfgs", "nadam", "radam", "rmsprop", "rprop", "sparseadam")


# ---------------------------------------------------------------------- README tables
def keys_markdown() -> str:
    """The README's "Coming from DeepSpeed" key tables, generated from ``KEYS``,
    ``ENGINE_PENDING`` and :class:`ZppConfig`'s fields (a test keeps the README equal to it)."""
    out = []
    titles = {
        "implemented": "Implemented: translated into zpp's typed config",
        "accepted": "Accepted, logged once with what zpp does instead (speed or memory knobs zpp does not need)",
        "refused": "Refused with `NotImplementedError` unless the value asks for nothing",
    }
    for status in STATUSES:
        out += [f"**{titles[status]}**", ""]
        if status == "refused":
            out += ["| key | accepted values | why / what zpp offers |", "|---|---|---|"]
        else:
            out += ["| key | " + ("becomes" if status == "implemented" else "zpp instead") + " |", "|---|---|"]
        for k in sorted(KEYS.values(), key=lambda k: k.path):
            if k.status != status:
                continue
            if status == "refused":
                out.append(f"| `{k.path}` | {k.off_text.replace('|', '/')} | {k.note} |")
            else:
                out.append(f"| `{k.path}` | {k.note} |")
        out.append("")
    if ENGINE_PENDING:
        out += ["**Parsed, but refused by `zpp.initialize` until the engine runs them** (`ENGINE_PENDING`)", "",
                "| field | what |", "|---|---|"]
        out += [f"| `{name}` | {what} |" for name, (_, what) in ENGINE_PENDING.items()]
    else:
        out += ["Every key the tables above call implemented, the engine runs (`ENGINE_PENDING` is empty)."]
    out += ["", "**zpp's own keys** (section `\"zpp\"`, `ZppConfig`)", "", "| key | default |", "|---|---|"]
    for f in dataclasses.fields(ZppConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"| `zpp.{f.name}` | `{json.dumps(default)}` |")
    out += ["", "**The hierarchical mode** (`\"zpp\": {\"outer\": {...}}`, `OuterConfig`; `null` for the "
            "method's default)", "", "| key | default |", "|---|---|"]
    for f in dataclasses.fields(OuterConfig):
        out.append(f"| `zpp.outer.{f.name}` | `{json.dumps(f.default)}` |")
    aliases = ", ".join(f"`{a}` = `{k}`" for a, k in {**TOP_ALIASES, **{
        f"{_ZERO}.{a}": f"{_ZERO}.{k}" for a, k in ZERO_ALIASES.items()}}.items())
    out += ["", f"Aliases: {aliases}.", ""]
    return "\n".join(out)
