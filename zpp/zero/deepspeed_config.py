"""The DeepSpeed edge: a DeepSpeed config (a dict, or a JSON file) translated into
:class:`~zpp.zero.config.TrainConfig`.

    cfg = from_deepspeed("ds_config.json")     # or a dict

See [Note: DeepSpeed keys] in :mod:`zpp.zero.deepspeed_keys` for what happens to each key;
the table itself, its value checks and the README tables generated from it live there.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from zpp.log import log_dist_once
from zpp.zero.checks import check_mapping, from_section
from zpp.zero.config import (
    OPTIMIZER_PARAM_CHECKS, OPTIMIZER_PARAMS, SCHEDULER_PARAM_CHECKS, SCHEDULERS,
    ActivationCheckpointingConfig, AioConfig, Fp16Config, MonitorConfig, OffloadConfig, OptimizerConfig,
    SchedulerConfig, LeafModuleConfig, TrainConfig, ZeroConfig, ZppConfig,
)

from zpp.zero.deepspeed_keys import (
    KEYS, MONITOR_SECTIONS, OFFLOAD_SECTIONS as _OFF, REFUSED_OPTIMIZERS, TOP_ALIASES, WHERE,
    ZERO as _ZERO, ZERO_ALIASES, DsKey, keys_markdown,
)

__all__ = ["KEYS", "DsKey", "from_args", "from_deepspeed", "keys_markdown", "translate"]


# ---------------------------------------------------------------------- translation
def _load(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            try:
                config = json.load(f, object_pairs_hook=_no_duplicates)
            except json.JSONDecodeError as e:
                raise ValueError(f"{WHERE}: {os.fspath(config)!r} is not valid JSON: {e}") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"{WHERE}: expected a dict or a JSON path, got {type(config).__name__}")
    return config


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"{WHERE}: key {k!r} appears twice in one JSON object")
        seen[k] = v
    return seen


def _resolve_aliases(d: Mapping[str, Any], aliases: dict[str, str], prefix: str) -> tuple[dict, dict]:
    """``d`` with aliases renamed to their key, and key -> the name the user wrote."""
    out, shown = {}, {}
    for k, v in d.items():
        key = aliases.get(k, k)
        if key in out:
            raise ValueError(f"{WHERE}: {prefix}{shown[key]} and {prefix}{k} are the same key; give one")
        out[key], shown[key] = v, k
    return out, shown


def _walk(prefix: str, d: Mapping[str, Any], notes: list[str], shown: Mapping[str, str] | None = None,
          shown_prefix: str | None = None) -> None:
    """Type-check every key of section ``prefix`` (recursively), refuse what is refused and
    note what is accepted; see [Note: DeepSpeed keys]."""
    shown = shown or {}
    shown_prefix = prefix if shown_prefix is None else shown_prefix

    def path(k):
        return f"{prefix}.{k}" if prefix else k

    def name(k):
        n = shown.get(k, k)
        return f"{shown_prefix}.{n}" if shown_prefix else n

    unknown = sorted(shown.get(k, k) for k in d if path(k) not in KEYS)
    if unknown:
        where = f" in {shown_prefix!r}" if shown_prefix else ""
        raise ValueError(f"{WHERE}: unknown keys{where}: {unknown}")
    for k, v in d.items():
        spec = KEYS[path(k)]
        if v is None:
            if spec.nullable:
                continue
            raise ValueError(f"{WHERE}: {name(k)}=None is not a value DeepSpeed reads as absent; "
                             f"omit the key, or give a value")
        checked = spec.check(name(k), v)
        if spec.status == "refused" and not spec.off(checked):
            raise NotImplementedError(f"{WHERE}: zpp does not implement {name(k)}={v!r} ({spec.note}); "
                                      f"accepted: {spec.off_text}")
        if spec.status == "accepted":
            notes.append(f"{WHERE}: {name(k)}={v!r} accepted: {spec.note}")
        if spec.section and isinstance(v, Mapping) and path(k) != "zpp":
            _walk(path(k), v, notes, shown_prefix=name(k))


def translate(config: Mapping[str, Any] | str | os.PathLike) -> tuple[TrainConfig, list[str]]:
    """The :class:`TrainConfig` of a DeepSpeed config, and the notes on accepted keys (what
    each maps to), without logging them. See [Note: DeepSpeed keys]."""
    raw = _load(config)
    top, top_shown = _resolve_aliases(raw, TOP_ALIASES, "")
    notes: list[str] = []
    zero_raw = top.get(_ZERO, {})
    if isinstance(zero_raw, bool):  # DeepSpeed's deprecated form
        notes.append(f"{WHERE}: zero_optimization={zero_raw} is DeepSpeed's deprecated form of stage "
                     f"{int(zero_raw)}")
        zero_raw = {"stage": int(zero_raw)}
        if zero_raw["stage"] and top.get("allgather_size") is not None:
            zero_raw["allgather_bucket_size"] = top["allgather_size"]
    elif "allgather_size" in top:
        raise ValueError(f"{WHERE}: allgather_size={top['allgather_size']!r} is read only with the deprecated "
                         "\"zero_optimization\": true; use zero_optimization.allgather_bucket_size")
    elif zero_raw is None:
        raise ValueError(f"{WHERE}: zero_optimization=None: DeepSpeed fails on it too (TypeError); omit the "
                         'key for stage 0, or give {"stage": N, ...}')
    zero_raw = check_mapping(WHERE, _ZERO, zero_raw)
    zero, zero_shown = _resolve_aliases(zero_raw, ZERO_ALIASES, "zero_optimization.")
    _walk("", {k: v for k, v in top.items() if k != _ZERO}, notes, shown=top_shown)
    _walk(_ZERO, zero, notes, shown=zero_shown)

    kw: dict[str, Any] = {}
    for k in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
              "steps_per_print"):
        if top.get(k) is not None:
            kw[k] = KEYS[k].check(k, top[k])
    if "gradient_clipping" in top:
        kw["gradient_clipping"] = top["gradient_clipping"]
    bf16 = top.get("bf16") or {}
    if bf16.get("enabled", False):
        kw["precision"] = "bf16"
    kw["fp16"] = _fp16(top.get("fp16", {}))
    if top.get("optimizer") is not None:
        kw["optimizer"] = _optimizer(top["optimizer"], notes)
    if top.get("scheduler") is not None:
        kw["scheduler"] = _scheduler(top["scheduler"])
    kw["zero"] = _zero(zero, notes)
    ac = top.get("activation_checkpointing", {})
    kw["activation_checkpointing"] = ActivationCheckpointingConfig(
        **{k: KEYS[f"activation_checkpointing.{k}"].check(f"activation_checkpointing.{k}", v)
           if v is not None else None for k, v in ac.items()})
    aio_fields = {f.name for f in dataclasses.fields(AioConfig)}  # the rest are accepted keys, checked
    kw["aio"] = AioConfig(**{k: KEYS[f"aio.{k}"].check(f"aio.{k}", v) for k, v in (top.get("aio") or {}).items()
                             if k in aio_fields})
    kw["monitor"] = _monitor(top)
    kw["zpp"] = _zpp(top.get("zpp", {}))
    return TrainConfig(**kw), notes


def from_deepspeed(config: Mapping[str, Any] | str | os.PathLike) -> TrainConfig:
    """Translate a DeepSpeed config (dict or path to a JSON file) into a :class:`TrainConfig`;
    each accepted key is logged once per process, on rank 0. See [Note: DeepSpeed keys]."""
    cfg, notes = translate(config)
    for note in notes:
        log_dist_once(note, ranks=[0])
    return cfg


def from_args(args: Any = None, config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None = None
              ) -> TrainConfig:
    """The config of ``zpp.initialize(args=..., config=...)``, as DeepSpeed resolves it, then
    through :func:`zpp.zero.config.as_config`.

    ``args.deepspeed_config`` (from :func:`zpp.add_config_arguments`; the deprecated
    ``args.deepscale_config`` too) names the config when ``config`` is None; both given is a
    ``ValueError``, as in DeepSpeed. ``args.zpp_config`` names a JSON file of zpp's own keys
    (the ``"zpp"`` section), merged in; a key set to another value in both is a
    ``ValueError``. With neither, the config is all defaults.
    """
    from zpp.zero.config import as_config

    ds_path = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        if ds_path is not None:
            raise ValueError(f"zpp.initialize: args.deepscale_config={old!r} and args.deepspeed_config={ds_path!r}: "
                             "give one (deepscale_config is the deprecated name)")
        ds_path = old
    if ds_path is not None:
        if config is not None:
            raise ValueError(f"zpp.initialize: a config is given both as args.deepspeed_config={ds_path!r} and as "
                             "config=; give one (DeepSpeed refuses both too)")
        config = ds_path
    zpp_path = getattr(args, "zpp_config", None)
    if zpp_path is None:
        return as_config(config)
    extra = dict(check_mapping(WHERE, f"--zpp_config {zpp_path}", _load(zpp_path)))
    if isinstance(config, TrainConfig):
        base = {f.name: getattr(config.zpp, f.name) for f in dataclasses.fields(ZppConfig)}
        clash = sorted(k for k, v in extra.items() if k in base and base[k] != v and
                       base[k] != getattr(ZppConfig(), k, None))
        if clash:
            raise ValueError(f"zpp.initialize: --zpp_config {zpp_path} and the config set zpp keys {clash} "
                             "differently; give each once")
        return as_config(dataclasses.replace(config, zpp=_zpp({**base, **extra})))
    raw = dict(_load(config)) if config is not None else {}
    section = dict(check_mapping(WHERE, "zpp", raw.get("zpp") or {}))
    clash = sorted(k for k, v in extra.items() if k in section and section[k] != v)
    if clash:
        raise ValueError(f"zpp.initialize: --zpp_config {zpp_path} and the config's \"zpp\" section set {clash} "
                         "differently; give each once")
    raw["zpp"] = {**section, **extra}
    return as_config(raw)


def deepspeed_dict(args: Any = None, config: Any = None) -> dict[str, Any]:
    """The DeepSpeed config ``initialize`` was given, as a plain dict (a copy; the file
    ``args.deepspeed_config`` or ``config`` names, read): DeepSpeed's ``engine.config``,
    which front-ends read (``engine.config.get("zero_optimization")``). Empty for a
    :class:`TrainConfig` or no config. Only for reading: zpp runs on the typed config."""
    config = config if config is not None else getattr(args, "deepspeed_config", None) or getattr(
        args, "deepscale_config", None)
    if config is None or isinstance(config, TrainConfig):
        return {}
    return json.loads(json.dumps(_load(config), default=str))


def _fp16(sec: Mapping[str, Any]) -> Fp16Config:
    return Fp16Config(**{k: KEYS[f"fp16.{k}"].check(f"fp16.{k}", v) for k, v in sec.items()
                         if k != "fp16_master_weights_and_grads"})


def _offload(zero: Mapping[str, Any], dev: str, stage: int, notes: list[str]) -> OffloadConfig:
    sec = dict(zero.get(dev) or {})
    legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[dev]
    if zero.get(legacy):
        if sec.get("device", "none") not in ("none", "cpu"):
            raise ValueError(f"{WHERE}: zero_optimization.{legacy}=True and zero_optimization.{dev}.device="
                             f"{sec['device']!r} disagree; give one")
        sec["device"] = "cpu"
    if zero.get("cpu_offload_use_pin_memory") is not None and "pin_memory" not in sec:
        sec["pin_memory"] = zero["cpu_offload_use_pin_memory"]
    device = sec.get("device", "none")
    if dev == "offload_param" and device != "none" and stage < 3:
        notes.append(f"{WHERE}: zero_optimization.offload_param.device={device!r} ignored at stage {stage} (it "
                     "needs stage 3), as DeepSpeed ignores it")
        device = "none"
    kw = {"device": device, "pin_memory": sec.get("pin_memory", False)}
    kw.update({k: sec[k] for k in ("nvme_path", "buffer_count") if sec.get(k) is not None})
    return OffloadConfig(**kw)


def _zero(zero: Mapping[str, Any], notes: list[str]) -> ZeroConfig:
    zkw: dict[str, Any] = {}
    for ds, ours in (("stage", "stage"),
                     ("zero_quantized_weights", "quantized_weights"),
                     ("zero_quantized_gradients", "quantized_gradients"),
                     ("zero_hpz_partition_size", "hpz_partition_size"),
                     ("reduce_bucket_size", "reduce_bucket_size"),
                     ("overlap_comm", "overlap_comm"),
                     ("allgather_bucket_size", "allgather_bucket_size"),
                     ("sub_group_size", "sub_group_size"),
                     ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                     ("stage3_max_live_parameters", "max_live_parameters"),
                     ("stage3_param_persistence_threshold", "param_persistence_threshold"),
                     ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"),
                     ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save")):
        key = KEYS[f"{_ZERO}.{ds}"]
        if ds in zero and not (zero[ds] is None and key.nullable):
            zkw[ours] = key.check(f"{_ZERO}.{ds}", zero[ds])
    stage = zkw.get("stage", 0)
    if not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"{WHERE}: zero_optimization.stage={stage!r} must be one of [0, 1, 2, 3]")
    for dev in _OFF:
        zkw[dev] = _offload(zero, dev, stage, notes)
    leaf = zero.get("leaf_module") or {}
    zkw["leaf_module"] = LeafModuleConfig(**{k: KEYS[f"{_ZERO}.leaf_module.{k}"].check(f"{_ZERO}.leaf_module.{k}", v)
                                             for k, v in leaf.items()})
    return ZeroConfig(**zkw)


def _optimizer(opt: Mapping[str, Any], notes: list[str]) -> OptimizerConfig:
    if "type" not in opt:
        raise ValueError(f"{WHERE}: optimizer has no \"type\" (DeepSpeed would ignore the section and expect "
                         "an optimizer passed to initialize); give a type or drop the section")
    given = opt["type"]
    kind = given.lower()
    params = dict(opt.get("params") or {})
    if kind in REFUSED_OPTIMIZERS:
        raise NotImplementedError(f"{WHERE}: zpp does not implement optimizer.type={given!r}; zpp builds "
                                  "Adam, AdamW, SGD, OneBitAdam, ZeroOneAdam, OneBitLamb, or pass any torch "
                                  "optimizer to initialize(optimizer=...)")
    if kind not in OPTIMIZER_PARAMS:
        raise ValueError(f"{WHERE}: optimizer.type={given!r} is not an optimizer DeepSpeed or zpp knows; zpp "
                         f"builds {sorted(OPTIMIZER_PARAMS)}")
    for k in ("max_grad_norm", "torch_adam", "adam_w_mode", "bias_correction"):
        if k in params and (k != "bias_correction" or kind in ("adam", "adamw")):
            _walk("optimizer.params", {k: params[k]}, notes)
    params.pop("max_grad_norm", None)
    if kind in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false; "AdamW" always does.
        kind = "adamw" if kind == "adamw" or adam_w_mode else "adam"
        params.pop("torch_adam", None)
        params.pop("bias_correction", None)
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's default, not torch AdamW's 0.01
    allowed = OPTIMIZER_PARAMS[kind]
    bad = sorted(set(params) - allowed)
    if bad:
        raise ValueError(f"{WHERE}: optimizer.type={given!r} has unknown params {bad}; allowed {sorted(allowed)}")
    params = {k: OPTIMIZER_PARAM_CHECKS[k](WHERE, f"optimizer.params.{k}", v) for k, v in params.items()}
    return OptimizerConfig(type=kind, params=params)


def _scheduler(sch: Mapping[str, Any]) -> SchedulerConfig:
    if "type" not in sch:
        raise ValueError(f"{WHERE}: scheduler has no \"type\"; give one of {list(SCHEDULERS)} or drop the section")
    kind = sch["type"]
    if kind not in SCHEDULERS:
        raise ValueError(f"{WHERE}: scheduler.type={kind!r} must be one of {list(SCHEDULERS)} (DeepSpeed also "
                         "takes torch.optim.lr_scheduler's names; give zpp such a scheduler as "
                         "initialize(lr_scheduler=...))")
    params = dict(sch.get("params") or {})
    for k, v in params.items():
        if k in SCHEDULER_PARAM_CHECKS:
            params[k] = SCHEDULER_PARAM_CHECKS[k](WHERE, f"scheduler.params.{k}", v)
    return SchedulerConfig(type=kind, params=params)


def _monitor(top: Mapping[str, Any]) -> MonitorConfig:
    return MonitorConfig(**{
        name: cls(**{k: KEYS[f"{name}.{k}"].check(f"{name}.{k}", v) for k, v in top[name].items() if v is not None})
        for name, cls in MONITOR_SECTIONS.items() if name in top})


def _zpp(sec: Mapping[str, Any]) -> ZppConfig:
    return from_section(ZppConfig, WHERE, "zpp", sec)
