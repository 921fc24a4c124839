"""DeepSpeed's config objects as scripts build them (``deepspeed.runtime.zero.config.
DeepSpeedZeroConfig``, ``deepspeed.runtime.config.DeepSpeedConfig``) and the config values
DeepSpeed reads that a strict reader could refuse (``0``/``1`` for booleans,
``gradient_allreduce_op``), each against what DeepSpeed 0.19.8 gives for the same input.
"""
from __future__ import annotations

import json
import logging
import sys

import pytest

import zpp.zero as zz
from zpp.runtime.config import DeepSpeedConfig
from zpp.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    ZeroStageEnum,
)


def test_zero_config_defaults_are_deepspeeds():
    z = DeepSpeedZeroConfig()
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size) == (0, 5e8, 5e8, 5e7)
    assert (z.param_persistence_threshold, z.max_live_parameters, z.model_persistence_threshold) == (
        100_000, 1_000_000_000, sys.maxsize)
    assert z.offload_param is None and z.offload_optimizer is None and z.contiguous_gradients is True
    assert z.zero_hpz_partition_size == 1 and not z.zero_quantized_weights and not z.zero_quantized_gradients
    assert "MixtralSparseMoeBlock" in z.leaf_module.classes[0] and z.leaf_module.names == []
    # overlap_comm: on by default at stage 3 only, as DeepSpeed's validator sets it
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert DeepSpeedZeroConfig(stage=3, overlap_comm=False).overlap_comm is False
    assert ZeroStageEnum.weights == 3 and DeepSpeedZeroConfig(stage=ZeroStageEnum.gradients).stage == 2


def test_zero_config_aliases_and_deprecated_fields(caplog):
    z = DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345, stage3_max_live_parameters=7,
                            param_persistence_threshold=3)
    assert (z.prefetch_bucket_size, z.max_live_parameters, z.param_persistence_threshold) == (12345, 7, 3)
    assert z.model_fields_set == {"prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold"}
    with caplog.at_level(logging.WARNING, logger="zpp"):
        old = DeepSpeedZeroConfig(cpu_offload=True, cpu_offload_param=True,
                                  stage3_gather_fp16_weights_on_model_save=True)
    assert isinstance(old.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert old.offload_optimizer.device == "cpu"
    assert isinstance(old.offload_param, DeepSpeedZeroOffloadParamConfig) and old.offload_param.device == "cpu"
    assert old.gather_16bit_weights_on_model_save is True
    assert "cpu_offload is deprecated" in caplog.text
    assert DeepSpeedZeroConfig(cpu_offload=False).offload_optimizer is None
    with pytest.raises(ValueError, match="stage3_prefetch_bucket_size.*prefetch_bucket_size"):
        DeepSpeedZeroConfig(stage3_prefetch_bucket_size=1, prefetch_bucket_size=2)
    with pytest.raises(ValueError, match="cpu_offload.*offload_optimizer"):
        DeepSpeedZeroConfig(cpu_offload=True, offload_optimizer={"device": "cpu"})


def test_zero_config_sections_and_checks():
    z = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={"device": "cpu", "pipeline_read": True},
                            leaf_module={"classes": "MyMoE"})
    assert z.offload_param.device == "none" and z.offload_param.buffer_count == 5 and z.offload_param.pin_memory
    assert z.offload_optimizer.pipeline is True and z.offload_optimizer.buffer_count == 4
    assert z.leaf_module.classes == ["MyMoE"]  # a single string is a one-element list
    assert DeepSpeedZeroOffloadOptimizerConfig().pipeline is False
    assert DeepSpeedZeroConfig(reduce_bucket_size="auto").reduce_bucket_size == 5e8  # "auto" dropped, as DeepSpeed
    with pytest.raises(ValueError, match="reduce_bucket_size='auto'"):
        DeepSpeedZeroConfig(strict=True, reduce_bucket_size="auto")
    with pytest.raises(ValueError, match="unknown field 'stage_3'"):
        DeepSpeedZeroConfig(stage_3=True)
    with pytest.raises(ValueError, match="stage=4"):
        DeepSpeedZeroConfig(stage=4)
    with pytest.raises(ValueError, match="overlap_comm='yes'"):
        DeepSpeedZeroConfig(overlap_comm="yes")
    with pytest.raises(ValueError, match="offload_param.device='disk'"):
        DeepSpeedZeroConfig(offload_param={"device": "disk"})
    with pytest.raises(ValueError, match="compute_grad_norm"):
        DeepSpeedZeroConfig(stage=3, compute_grad_norm=False)
    assert DeepSpeedZeroConfig(stage=2) == DeepSpeedZeroConfig(**{"stage": 2.0})  # 2.0: an integral JSON number
    assert DeepSpeedZeroConfig(stage=2).model_dump()["stage"] == 2


def test_deepspeed_config_object(tmp_path):
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 5,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100}, "bf16": {"enabled": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    for given in (cfg, str(path)):
        c = DeepSpeedConfig(given)
        # one process: world 1, so micro = 8 / (2 * 1)
        assert (c.world_size, c.train_batch_size, c.gradient_accumulation_steps, c.train_micro_batch_size_per_gpu) \
            == (1, 8, 2, 4)
        assert c.zero_optimization_stage == 3 and c.zero_enabled and c.zero_config.prefetch_bucket_size == 100
        assert c.bfloat16_enabled and not c.fp16_enabled and c.steps_per_print == 5
        assert (c.optimizer_name, c.optimizer_params) == ("adam", {"lr": 1e-3})
        assert (c.scheduler_name, c.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 3})
        assert c.train_config.zero.stage == 3 and c.gradient_allreduce_op == "mean"
    with pytest.raises(ValueError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1})
    # DeepSpeed's batch resolution on the object's own values: two of three given, AssertionError on a mismatch
    c = DeepSpeedConfig(cfg)
    c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps = 12, 3, None
    c._configure_train_batch_size()
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (12, 3, 4)
    c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps = 12, 5, 2
    with pytest.raises(AssertionError, match="train_batch_size=12"):
        c._configure_train_batch_size()
    c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps = None, None, 2
    with pytest.raises(AssertionError, match="alone sets no batch"):
        c._configure_train_batch_size()
    with pytest.raises(NotImplementedError, match="mpu"):
        DeepSpeedConfig(cfg, mpu=object())
    with pytest.raises(ValueError, match="nothing.json"):
        DeepSpeedConfig(str(tmp_path / "nothing.json"))


def test_booleans_as_zero_and_one_as_deepspeed_reads_them():
    cfg = zz.from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": 1,
                                                   "stage3_gather_16bit_weights_on_model_save": 0},
                             "fp16": {"enabled": 1, "auto_cast": 0}})
    assert cfg.zero.quantized_weights is True and cfg.zero.gather_16bit_weights_on_model_save is False
    assert cfg.precision == "fp16" and cfg.fp16.auto_cast is False
    # only 0 and 1: other numbers and the strings stay errors naming the key
    with pytest.raises(ValueError, match="zero_quantized_weights=2"):
        zz.from_deepspeed({"zero_optimization": {"zero_quantized_weights": 2}})
    with pytest.raises(ValueError, match="zero_quantized_weights='true'"):
        zz.from_deepspeed({"zero_optimization": {"zero_quantized_weights": "true"}})
    # the typed config stays strict
    with pytest.raises(ValueError, match="quantized_weights=1"):
        zz.ZeroConfig(stage=3, quantized_weights=1)


def test_gradient_allreduce_op():
    for value in ("mean", "MEAN", "Mean"):
        zz.from_deepspeed({"gradient_allreduce_op": value})  # zpp averages: DeepSpeed's default
    with pytest.raises(NotImplementedError, match="gradient_allreduce_op='sum'.*world size"):
        zz.from_deepspeed({"gradient_allreduce_op": "sum"})
    with pytest.raises(ValueError, match="gradient_allreduce_op='max'"):
        zz.from_deepspeed({"gradient_allreduce_op": "max"})
