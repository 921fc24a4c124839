"""Configuration: DeepSpeed translation, typed validation, and the errors initialize raises."""
import json
import math

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from zpp.zero.config import TrainConfig, ZeroConfig, ZppConfig, as_config, from_deepspeed
from zpp.zero.schedulers import WarmupDecayLR, WarmupLR


def test_translation(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                              "zero_quantized_gradients": True, "reduce_bucket_size": 1000,
                              "stage3_prefetch_bucket_size": 0, "overlap_comm": False,
                              "stage3_max_reuse_distance": 0},
        "zpp": {"weight_bits": 4, "gradient_bits": 8, "transport": "torch"},
        "wall_clock_breakdown": False,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for cfg in (from_deepspeed(ds), from_deepspeed(str(path))):
        assert cfg.precision == "bf16" and cfg.gradient_accumulation_steps == 2
        assert cfg.optimizer.type == "adamw"  # DeepSpeed's Adam is AdamW unless adam_w_mode=false
        assert cfg.optimizer.params == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0}
        z = cfg.zero
        assert (z.stage, z.quantized_weights, z.hpz_partition_size, z.quantized_gradients) == (3, True, 2, True)
        assert z.reduce_bucket_size == 1000 and z.prefetch_bucket_size == 0
        assert (cfg.zpp.weight_bits, cfg.zpp.gradient_bits) == (4, 8)
    plain = from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert plain.optimizer.type == "adam"


@pytest.mark.parametrize("ds,exc,words", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, ValueError,
     ["device='nvme' needs nvme_path"]),
    ({"zero_optimization": {"overlap_comm": "yes"}}, ValueError, ["overlap_comm='yes'"]),
    ({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 1}}, NotImplementedError, ["OneBitAdam", "stage 1"]),
    ({"bogus": 1, "also_bogus": 2}, ValueError, ["also_bogus", "bogus"]),
    ({"zero_optimization": {"stage": 3, "nonsense": 1}}, ValueError, ["nonsense"]),
    ({"zero_optimization": {"stage": 5}}, ValueError, ["stage=5"]),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, ValueError,
     ["quantized_weights=True", "stage=2"]),
    ({"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}}, ValueError, ["hpz_partition_size=2"]),
    ({"zero_optimization": {"stage": 3}, "zpp": {"weight_bits": 2}}, ValueError, ["weight_bits=2"]),
    ({"zpp": {"gradient_bits": 16}}, ValueError, ["gradient_bits=16"]),
    ({"zpp": {"colour": "red"}}, ValueError, ["colour"]),
    ({"gradient_accumulation_steps": 0}, ValueError, ["gradient_accumulation_steps=0"]),
    ({"gradient_clipping": -1}, ValueError, ["gradient_clipping=-1"]),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, ValueError, ["betas"]),
    ({"scheduler": {"type": "OneCycle"}}, ValueError, ["OneCycle", "cycle_min_lr", "cycle_max_lr"]),
    ({"scheduler": {"type": "Cosine"}}, ValueError, ["Cosine"]),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ValueError, ["total_num_steps"]),
])
def test_errors(ds, exc, words):
    """What zpp.initialize raises (it translates through as_config)."""
    with pytest.raises(exc) as e:
        as_config(ds)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_typed_config_validates():
    with pytest.raises(ValueError, match="hpz_partition_size=0"):
        ZeroConfig(stage=3, hpz_partition_size=0)
    with pytest.raises(ValueError, match="weight_group_size=3"):
        ZppConfig(weight_group_size=3)
    with pytest.raises(ValueError, match="precision='fp8'"):
        TrainConfig(precision="fp8")
    # precision="fp16" and fp16.enabled are one switch
    assert TrainConfig(precision="fp16").fp16 == zz.Fp16Config(enabled=True)
    assert TrainConfig(fp16=zz.Fp16Config(enabled=True, hysteresis=3)).precision == "fp16"
    with pytest.raises(ValueError, match="fp16.enabled=True and precision='bf16'"):
        TrainConfig(precision="bf16", fp16=zz.Fp16Config(enabled=True))
    with pytest.raises(TypeError):
        ZeroConfig(3)  # keyword-only
    cfg = TrainConfig(train_micro_batch_size_per_gpu=2, train_batch_size=10, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="train_batch_size=10"):
        cfg.with_world(4)


@pytest.mark.parametrize("given, world, want", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 4, (32, 4, 2)),  # gas derived
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),  # micro derived
    (dict(train_batch_size=32), 4, (32, 8, 1)),
    (dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2), 2, (12, 3, 2)),
    (dict(train_micro_batch_size_per_gpu=3), 2, (6, 3, 1)),
    (dict(), 4, (None, None, 1)),
])
def test_batch_sizes_resolve_as_deepspeed(given, world, want):
    c = TrainConfig(**given).with_world(world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == want


@pytest.mark.parametrize("given, world, match", [
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4), 4, "multiple of micro"),
    (dict(train_batch_size=30, gradient_accumulation_steps=4), 4, "multiple of gradient_accumulation_steps"),
    (dict(train_batch_size=6), 4, "multiple of world_size"),
])
def test_batch_sizes_that_do_not_divide(given, world, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**given).with_world(world)


def test_schedulers():
    """DeepSpeed's sequences (see [Note: which lr a step uses]): the lr written before step
    ``i`` is the schedule at iteration ``i - 1``; tests/test_schedulers.py has the rest."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[:2] == [0.0, 0.0] and lrs[6] == pytest.approx(0.5) and lrs[11:] == [1.0, 1.0]
    s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=100)  # "log" is DeepSpeed's default
    for _ in range(10):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(math.log(10) / math.log(100))
    d = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(16):
        d.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    for _ in range(10):
        d.step()
    assert opt.param_groups[0]["lr"] == 0.0


def _world_errors(t):
    """Errors that need a world: every rank must raise the same one."""
    seen = {}
    base = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

    def attempt(name, model, cfg):
        try:
            zz.initialize(model=model, config=cfg, transport=t)
            seen[name] = None
        except (ValueError, NotImplementedError, TypeError) as e:
            seen[name] = f"{type(e).__name__}: {e}"

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    if t.rank == t.world_size - 1:
        with torch.no_grad():
            m[1].bias[0] += 1.0
    attempt("mismatch", m, {**base, "zpp": {"parameter_mismatch": "raise"}})  # the default broadcasts
    torch.manual_seed(0)
    good = torch.nn.Linear(3, 5)
    attempt("hpz_not_divide", good, {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})
    attempt("hpz_not_node", good, {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    attempt("batch", good, {**base, "train_batch_size": 3, "train_micro_batch_size_per_gpu": 1})
    # no optimizer anywhere: an engine for evaluation (DeepSpeed's too), which refuses to train
    torch.manual_seed(0)
    ev, ev_opt, _, ev_sched = zz.initialize(model=torch.nn.Linear(3, 5), config={"zero_optimization": {"stage": 3}},
                                            transport=t)
    out = ev(torch.ones(2, 3))
    try:
        ev.backward(out.sum())
        seen["no_optimizer"] = None
    except RuntimeError as e:
        seen["no_optimizer"] = (ev_opt, ev_sched, tuple(out.shape), str(e))
    ev.close()
    attempt("fp64", torch.nn.Linear(2, 2).double(), base)
    attempt("ok", good, {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2,
                                                       "zero_quantized_gradients": True}})
    # no transport given: zpp.comm.get_transport(config.zpp.transport) supplies the world
    # (on a fresh model: "ok" left `good` partitioned by its stage-3 engine)
    torch.manual_seed(0)
    engine, opt, _, sched = zz.initialize(model=torch.nn.Linear(3, 5), config={**base, "zero_optimization": {"stage": 2}})
    seen["registry"] = (type(engine.world).__name__, engine.world.world_size, sched is None,
                        opt is engine.optimizer)
    return seen


def test_world_errors():
    results = run_world(_world_errors, 4, ranks_per_node=2, timeout=120)
    assert all(r == results[0] for r in results)  # the same error on every rank
    r = results[0]
    assert "'1.bias'" in r["mismatch"] and "ranks [3]" in r["mismatch"], r["mismatch"]
    assert "zero_hpz_partition_size=3" in r["hpz_not_divide"]
    assert "zero_hpz_partition_size=4" in r["hpz_not_node"] and "(2)" in r["hpz_not_node"]
    assert "train_batch_size=3" in r["batch"]
    assert r["no_optimizer"][:3] == (None, None, (2, 5)) and "without an optimizer" in r["no_optimizer"][3]
    assert r["fp64"].startswith("TypeError") and "torch.float64" in r["fp64"]
    assert r["ok"] is None
    assert r["registry"] == ("TorchTransport", 4, True, True)


def test_prefetch_switch():
    assert ZppConfig().prefetch is True
    cfg = from_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000},
                          "zpp": {"prefetch": False}})
    assert cfg.zpp.prefetch is False and cfg.zero.prefetch_bucket_size == 1000
    with pytest.raises(ValueError, match="prefetch='yes'"):
        ZppConfig(prefetch="yes")
    with pytest.raises(ValueError, match="prefetch_bucket_size=-1"):
        from_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}})


def test_prefetch_window_keys():
    """DeepSpeed's 5e7 unless set; "auto" measures it; max_live_parameters bounds it."""
    z = from_deepspeed({"zero_optimization": {"stage": 3}}).zero
    assert (z.prefetch_bucket_size, z.max_live_parameters) == (50_000_000, 1_000_000_000)
    z = from_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                              "stage3_max_live_parameters": 3e7}}).zero
    assert (z.prefetch_bucket_size, z.max_live_parameters) == ("auto", 30_000_000)
    assert from_deepspeed({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 5e7}}).zero.prefetch_bucket_size \
        == 50_000_000
    for bad in ("sometimes", True, 1.5, -3):
        with pytest.raises(ValueError, match=f"stage3_prefetch_bucket_size={bad!r}.*or \"auto\""):
            from_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": bad}})
        with pytest.raises(ValueError, match=f"prefetch_bucket_size={bad!r}.*or \"auto\""):
            ZeroConfig(stage=3, prefetch_bucket_size=bad)
    with pytest.raises(ValueError, match="stage3_max_live_parameters=-1"):
        from_deepspeed({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}})


# ---------------------------------------------------------------------- strict types (issue 12)
@pytest.mark.parametrize("ds,exc,words", [
    ({"bf16": {"enabled": "false"}}, ValueError, ["bf16.enabled='false'", "not a boolean"]),
    ({"bfloat16": {"enabled": "true"}}, ValueError, ["bfloat16.enabled='true'"]),
    ({"fp16": {"enabled": 2}}, ValueError, ["fp16.enabled=2"]),  # 0 and 1 are DeepSpeed's booleans too
    ({"gradient_clipping": True}, ValueError, ["gradient_clipping=True"]),
    ({"gradient_clipping": "1.0"}, ValueError, ["gradient_clipping='1.0'"]),
    ({"zero_optimization": None}, ValueError, ["zero_optimization=None", "TypeError"]),
    ({"fp16": None}, ValueError, ["fp16=None"]),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, ValueError, ["optimizer.params.betas=[0.9]"]),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, ValueError, ["optimizer.params.betas"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, ValueError, ["optimizer.params.lr='1e-3'"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, ValueError, ["optimizer.params.lr='auto'",
                                                                               "Hugging Face"]),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2.5}}}, ValueError,
     ["optimizer.params.freeze_step=2.5"]),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": "false"}}}, ValueError, ["adam_w_mode='false'"]),
    ({"optimizer": {"params": {"lr": 1e-3}}}, ValueError, ["optimizer has no \"type\""]),
    ({"train_batch_size": "auto"}, ValueError, ["train_batch_size='auto'", "Hugging Face"]),
    ({"train_micro_batch_size_per_gpu": 2.5}, ValueError, ["train_micro_batch_size_per_gpu=2.5"]),
    ({"zero_optimization": {"stage": "3"}}, ValueError, ["zero_optimization.stage='3'"]),
    ({"zero_optimization": {"stage": True}}, ValueError, ["zero_optimization.stage=True"]),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, ValueError, ["reduce_bucket_size=1.5"]),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": "true"}}, ValueError,
     ["zero_quantized_weights='true'"]),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, ValueError, ["zero_hpz_partition_size=0"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, ValueError,
     ["offload_optimizer.device='gpu'"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"bogus": 1}}}, ValueError, ["bogus"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, ValueError, ["needs stage >= 1"]),
    ({"zero_optimization": {"stage": 3, "param_persistence_threshold": 10,
                            "stage3_param_persistence_threshold": 20}}, ValueError, ["same key"]),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, ValueError, ["same key"]),
    ({"allgather_size": 100}, ValueError, ["allgather_size=100"]),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ValueError, ["fp16.loss_scale_window=0"]),
    ({"fp16": {"enabled": True, "fused_mode": True}}, ValueError, ["fused_mode"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ValueError, ["fp16.enabled=True", "bf16"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}}, ValueError,
     ["scheduler.params.warmup_num_steps='10'"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, ValueError, ["warmup_type='cosine'"]),
    ({"tensorboard": {"enabled": "false"}}, ValueError, ["tensorboard.enabled='false'"]),
    ({"activation_checkpointing": {"cpu_checkpointing": "no"}}, ValueError,
     ["activation_checkpointing.cpu_checkpointing='no'"]),
    ({"zpp": {"prefetch": "false"}}, ValueError, ["zpp.prefetch='false'"]),
    ({"zpp": {"unit_classes": "Block"}}, ValueError, ["zpp.unit_classes='Block'"]),
    ({"zpp": {"nonfinite": "ignore"}}, ValueError, ["zpp.nonfinite='ignore'"]),
    ({"zpp": {"check_parameters": 1}}, ValueError, ["zpp.check_parameters=1"]),
    # refused: DeepSpeed features zpp does not implement, named with the value
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, NotImplementedError, ["optimizer.type='Lamb'"]),
    ({"optimizer": {"type": "RMSprop"}}, NotImplementedError, ["RMSprop"]),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, NotImplementedError,
     ["optimizer.params.bias_correction=False"]),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, NotImplementedError, ["amp="]),
    ({"sparse_gradients": True}, NotImplementedError, ["sparse_gradients=True"]),
    ({"communication_data_type": "bf16"}, NotImplementedError, ["communication_data_type='bf16'"]),
    ({"zero_optimization": {"stage": 3, "leaf_module": {"classes": [3]}}}, ValueError,
     ["zero_optimization.leaf_module.classes=[3]"]),
    ({"checkpoint": {"tag_validation": "Fail"}}, NotImplementedError, ["checkpoint.tag_validation='Fail'"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, NotImplementedError,
     ["offload_optimizer.ratio=0.5"]),
])
def test_strict_types(ds, exc, words):
    """Every value is type-checked and each error names the key and the value."""
    with pytest.raises(exc) as e:
        as_config(ds)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_duplicate_json_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="'train_batch_size' appears twice"):
        from_deepspeed(str(path))
    path.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match="not valid JSON"):
        from_deepspeed(str(path))


# ---------------------------------------------------------------------- every key in the table
from zpp.zero import deepspeed_config as dsc  # noqa: E402
from zpp.zero.deepspeed_keys import STATUSES  # noqa: E402
from zpp.zero.config import ENGINE_PENDING, check_engine_support  # noqa: E402

# A value for every accepted key; the test below fails when the table grows a key this lacks.
ACCEPTED_SAMPLES = {
    "optimizer.params.torch_adam": True, "optimizer.legacy_fusion": False,
    "autotuning": {"enabled": True}, "autotuning.enabled": True, "autotuning.start_profile_step": 2,
    "autotuning.end_profile_step": 5, "autotuning.metric": "latency", "autotuning.tuner_num_trials": 3,
    "autotuning.results_dir": "autotuning_results",
    **{f"autotuning.{k}": v for k, v in (
        ("exps_dir", "autotuning_exps"), ("overwrite", True), ("fast", True), ("max_train_batch_size", 64),
        ("mp_size", 1), ("num_tuning_micro_batch_sizes", 3), ("tuner_type", "model_based"),
        ("tuner_early_stopping", 5), ("arg_mappings", {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}),
        ("min_train_micro_batch_size_per_gpu", 1), ("max_train_micro_batch_size_per_gpu", 8),
        ("model_info", {"num_params": 1000}), ("model_info_path", "info.json"), ("metric_path", "metrics.json"))},
    "bf16.immediate_grad_update": True, "bf16.check_grad_overflow": True,
    "zero_optimization.offload_param.buffer_size": 1e8, "zero_optimization.offload_param.max_in_cpu": 1e9,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": True,
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.allgather_partitions": True,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.stage3_max_reuse_distance": 1e9, "zero_optimization.stage3_model_persistence_threshold": 10**9,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_allgather_sequential": False, "zero_optimization.memory_efficient_linear": False,
    "zero_optimization.round_robin_gradients": True,
    "aio.use_gds": False, "aio.intra_op_parallelism": 2, "aio.io_backend": "aio",
    "zero_optimization.override_module_apply": True, "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.elastic_checkpoint": True,
    "optimizer.params.max_grad_norm": 1.0, "wall_clock_breakdown": True, "memory_breakdown": False,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": True,
}
# A value asking for something, for every refused key.
REFUSED_SAMPLES = {
    "optimizer.params.bias_correction": False,
    "fp16.fp16_master_weights_and_grads": True, "bf16.bf16_master_weights_and_grads": True,
    "bf16.bf16_optimizer_states": True, "zero_optimization.offload_optimizer.ratio": 0.3,
    "zero_optimization.offload_optimizer.super_offload": True, "zero_optimization.load_from_fp32_weights": False,
    "zero_optimization.ignore_unused_parameters": False, "zero_optimization.legacy_stage1": True,
    "zero_optimization.zero_quantized_nontrainable_weights": True, "zero_optimization.mics_shard_size": 2,
    "zero_optimization.mics_hierarchical_params_gather": True, "zero_optimization.zeropp_loco_param": {"err_beta": 0.8},
    "zero_optimization.zenflow": {"topk_ratio": 0.1}, "zero_optimization.pipeline_loading_checkpoint": True,
    "zero_optimization.enable_sanity_checks": True,
    "communication_data_type": "fp16", "gradient_allreduce_op": "sum", "sparse_gradients": True, "disable_allgather": True, "dump_state": True,
    "graph_harvesting": True, "dataloader_drop_last": True, "checkpoint.tag_validation": "FAIL",
    "checkpoint.load_universal": True, "checkpoint.use_node_local_storage": True,
    "checkpoint.parallel_write": {"pipeline_stage": True}, "checkpoint.writer": {"type": "fast"},
    "data_types.grad_accum_dtype": "bf16", "sequence_parallel_size": 2,
    **{k: {"enabled": True} for k in (
        "amp", "torch_autocast", "flops_profiler", "comms_logger",
        "sparse_attention", "pipeline", "compression_training", "data_efficiency", "curriculum_learning",
        "elasticity", "eigenvalue", "progressive_layer_drop", "quantize_training", "nebula",
        "hybrid_engine", "compile", "tensor_parallel", "weight_quantization", "timers")},
}
_BASE = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


def _nest(path, value, base=None):
    """``base`` (a deep copy) with ``value`` at the dotted ``path``."""
    out = json.loads(json.dumps(base or _BASE))
    d = out
    *head, last = path.split(".")
    for k in head:
        d = d.setdefault(k, {})
    d[last] = value
    return out


def test_table_samples_cover_every_key():
    by_status = {s: {k.path for k in dsc.KEYS.values() if k.status == s} for s in STATUSES}
    assert by_status["accepted"] == set(ACCEPTED_SAMPLES)
    assert by_status["refused"] == set(REFUSED_SAMPLES)


@pytest.mark.parametrize("path", sorted(ACCEPTED_SAMPLES))
def test_accepted_key_is_noted(path):
    ds = _nest(path, ACCEPTED_SAMPLES[path])
    if path.startswith("zero_optimization.offload_"):
        ds = _nest(path.rsplit(".", 1)[0] + ".device", "none", ds)
    cfg, notes = dsc.translate(ds)
    shown = f"{path}={ACCEPTED_SAMPLES[path]!r} accepted: {dsc.KEYS[path].note}"
    assert [n for n in notes if shown in n], (shown, notes)
    assert cfg == dsc.translate(_BASE)[0]  # a speed or memory knob: the typed config is unchanged


@pytest.mark.parametrize("path", sorted(REFUSED_SAMPLES))
def test_refused_key_names_itself(path):
    with pytest.raises(NotImplementedError) as e:
        from_deepspeed(_nest(path, REFUSED_SAMPLES[path]))
    assert f"{path}={REFUSED_SAMPLES[path]!r}" in str(e.value), str(e.value)


def test_accepted_keys_logged_once():
    import logging

    from zpp.utils.logging import logger

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        ds = {**_BASE, "wall_clock_breakdown": True, "steps_per_print": 10,
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": False,
                                    "round_robin_gradients": True, "stage3_max_reuse_distance": 123456}}
        for _ in range(3):
            from_deepspeed(ds)
    finally:
        logger.removeHandler(handler)
    for key in ("wall_clock_breakdown=True", "contiguous_gradients=False",
                "round_robin_gradients=True", "stage3_max_reuse_distance=123456"):
        assert sum(key in m for m in seen) == 1, (key, seen)


def test_implemented_keys_change_the_config():
    """Each implemented leaf key lands in the typed config (a non-default value changes it)."""
    values = {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0, "steps_per_print": 10, "optimizer.params.adam_w_mode": False,
        "fp16.enabled": True, "fp16.auto_cast": True, "fp16.loss_scale": 128.0, "fp16.initial_scale_power": 12,
        "fp16.loss_scale_window": 100, "fp16.hysteresis": 4, "fp16.consecutive_hysteresis": True,
        "fp16.min_loss_scale": 0.5, "bf16.enabled": True, "zero_optimization.stage": 3,
        "zero_optimization.zero_quantized_weights": True, "zero_optimization.zero_hpz_partition_size": 2,
        "zero_optimization.zero_quantized_gradients": True, "zero_optimization.reduce_bucket_size": 1000,
        "zero_optimization.overlap_comm": False, "zero_optimization.allgather_bucket_size": 1000, "zero_optimization.stage3_prefetch_bucket_size": 0,
        "zero_optimization.stage3_max_live_parameters": 1000,
        "zero_optimization.stage3_param_persistence_threshold": 1e4,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
        "zero_optimization.stage3_gather_fp16_weights_on_model_save": True,
        "zero_optimization.offload_optimizer.device": "cpu", "zero_optimization.offload_optimizer.pin_memory": True,
        "zero_optimization.offload_param.device": "cpu", "zero_optimization.offload_param.pin_memory": True,
        "zero_optimization.offload_optimizer.nvme_path": "/nvme", "zero_optimization.offload_optimizer.buffer_count": 3,
        "zero_optimization.offload_param.nvme_path": "/nvme", "zero_optimization.offload_param.buffer_count": 5,
        "zero_optimization.sub_group_size": 1000,
        **{f"aio.{k}": v for k, v in (("block_size", 8192), ("queue_depth", 4), ("thread_count", 2),
                                      ("single_submit", True), ("overlap_events", False))},
        "zero_optimization.cpu_offload": True, "zero_optimization.cpu_offload_param": True,
        "zero_optimization.cpu_offload_use_pin_memory": True,
        "zero_optimization.leaf_module.classes": ["Block"], "zero_optimization.leaf_module.names": "blocks.0",
        "zero_optimization.leaf_module.name_suffixes": ["experts"],
        **{f"activation_checkpointing.{k}": True for k in (
            "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary", "profile")},
        "activation_checkpointing.number_checkpoints": 4,
        **{f"{sec}.{k}": v for sec in ("tensorboard", "csv_monitor") for k, v in (
            ("enabled", True), ("output_path", "runs"), ("job_name", "j1"))},
        "wandb.enabled": True, "wandb.group": "g", "wandb.team": "t", "wandb.project": "p",
        "comet.enabled": True, "comet.samples_log_interval": 10, "comet.project": "p", "comet.workspace": "w",
        "comet.api_key": "k", "comet.experiment_name": "n", "comet.experiment_key": "x" * 32,
        "comet.online": False, "comet.mode": "create",
    }
    leaves = {k.path for k in dsc.KEYS.values() if k.status == "implemented" and not k.section
              and k.path not in ("optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params",
                                 "allgather_size")}
    assert leaves == set(values)
    base = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    plain = dsc.translate(base)[0]
    for path, value in values.items():
        ds = _nest(path, value, base)
        if path == "zero_optimization.stage":
            ds = _nest(path, 1, base)
        if path == "bf16.enabled":
            ds.pop("fp16", None)
        cfg = dsc.translate(ds)[0]
        assert cfg != plain, path


def test_translation_of_new_sections():
    cfg = from_deepspeed({
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1e-5},
        "zero_optimization": {"stage": 3, "param_persistence_threshold": 1e4, "cpu_offload": True,
                              "cpu_offload_use_pin_memory": True, "offload_param": {"device": "cpu"}},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True,
                                     "number_checkpoints": None},
        "zpp": {"unit_classes": ["Block", "Embedding"], "nonfinite": "raise"},
    })
    assert cfg.fp16 == zz.Fp16Config(enabled=True, min_loss_scale=1e-5)  # the rest: DeepSpeed's defaults
    assert cfg.precision == "fp16"
    assert as_config({"fp16": {"enabled": True, "auto_cast": False}, "zpp": {"nonfinite": "raise"}}).precision == "fp16"
    z = cfg.zero
    assert z.param_persistence_threshold == 10_000 and isinstance(z.param_persistence_threshold, int)
    assert z.offload_optimizer == zz.OffloadConfig(device="cpu", pin_memory=True)
    assert z.offload_param == zz.OffloadConfig(device="cpu", pin_memory=True)
    assert cfg.activation_checkpointing.cpu_checkpointing and cfg.activation_checkpointing.enabled
    assert cfg.zpp.unit_classes == ("Block", "Embedding") and cfg.zpp.nonfinite == "raise"
    assert ZeroConfig().param_persistence_threshold == 100_000  # DeepSpeed's default
    assert zz.Fp16Config() == zz.Fp16Config(enabled=False, auto_cast=False, loss_scale=0, initial_scale_power=16,
                                            loss_scale_window=1000, hysteresis=2, consecutive_hysteresis=False,
                                            min_loss_scale=1)
    # deprecated forms DeepSpeed still reads
    old = from_deepspeed({"zero_optimization": True, "allgather_size": 1000, "bfloat16": {"enabled": True}})
    assert (old.zero.stage, old.zero.allgather_bucket_size, old.precision) == (1, 1000, "bf16")
    assert from_deepspeed({"zero_optimization": False}).zero.stage == 0
    # null where DeepSpeed reads it as absent
    none = from_deepspeed({"train_batch_size": None, "bf16": None, "optimizer": None, "scheduler": None,
                           "zero_optimization": {"stage": 2, "overlap_comm": None, "offload_optimizer": None}})
    assert none == TrainConfig(zero=ZeroConfig(stage=2))


def test_offload_below_its_stage_is_ignored_as_deepspeed_does():
    """DeepSpeed-Chat's config with --offload at stage 2 (offload_param is stage 3's)."""
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
          "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 1e4,
                                "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                                "memory_efficient_linear": False},
          "bfloat16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
          "wall_clock_breakdown": False,
          "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                            "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
          "tensorboard": {"enabled": False, "output_path": "/tmp/x/ds_tensorboard_logs/", "job_name": "t"}}
    cfg, notes = dsc.translate(ds)
    assert cfg.zero.offload_param.device == "none" and cfg.zero.offload_optimizer.device == "cpu"
    assert any("offload_param.device='cpu' ignored at stage 2" in n for n in notes), notes
    assert cfg.precision == "bf16" and cfg.zero.prefetch_bucket_size == 30_000_000
    assert as_config(ds).zero.offload_optimizer.device == "cpu"  # the engine offloads (on a CUDA job)
    no_offload = _nest("zero_optimization.offload_optimizer.device", "none", _nest(
        "zero_optimization.offload_param.device", "none", ds))
    assert as_config(no_offload).zero.stage == 2


def test_engine_pending_is_refused_by_as_config(monkeypatch):
    # Every parsed field runs today; the refusal path is checked with a planted entry.
    assert ENGINE_PENDING == {}
    monkeypatch.setitem(ENGINE_PENDING, "fp16.auto_cast", (lambda c: c.fp16.auto_cast, "casting inputs"))
    cfg = from_deepspeed({"fp16": {"enabled": True, "auto_cast": True}})  # parsed and validated
    with pytest.raises(NotImplementedError, match=r"fp16\.auto_cast"):
        check_engine_support(cfg)
    with pytest.raises(NotImplementedError, match=r"fp16\.auto_cast"):
        as_config(cfg)  # a TrainConfig given directly is checked too
    check_engine_support(from_deepspeed({"fp16": {"enabled": True}}))  # asks for nothing pending


def test_configs_are_frozen():
    import dataclasses

    cfg = from_deepspeed({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    for obj, field in ((cfg, "gradient_clipping"), (cfg.zero, "stage"), (cfg.zpp, "prefetch"),
                       (cfg.fp16, "enabled"), (cfg.optimizer, "type"), (cfg.zero.offload_param, "device")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, getattr(obj, field))


def test_from_args(tmp_path):
    import argparse

    import zpp

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zpp": {"weight_bits": 4}}))
    zf = tmp_path / "zpp.json"
    zf.write_text(json.dumps({"gradient_bits": 8, "prefetch": False}))
    parser = zpp.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(ds), "--zpp_config", str(zf)])
    cfg = dsc.from_args(args)
    assert cfg.optimizer.type == "sgd" and (cfg.zpp.weight_bits, cfg.zpp.gradient_bits, cfg.zpp.prefetch) == (4, 8, False)
    with pytest.raises(ValueError, match="both as args.deepspeed_config"):
        dsc.from_args(args, config={"train_batch_size": 8})
    old = parser.parse_args(["--deepscale_config", str(ds)])
    assert dsc.from_args(old).optimizer.type == "sgd"
    zf.write_text(json.dumps({"weight_bits": 8}))
    with pytest.raises(ValueError, match=r"\['weight_bits'\]"):
        dsc.from_args(args)
    assert dsc.from_args(parser.parse_args([]), config=TrainConfig()) == TrainConfig()
