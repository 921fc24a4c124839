"""ZeRO-Offload (offload_optimizer / offload_param device "cpu"; see [Note: offload] in
zpp/zero/offload.py): on a CPU job accepted, logged, and training is unchanged; on a CUDA job
the masters, gradients and optimizer state live on the host (and the parameter shards too
with offload_param) and training gives the losses of the same run without offload."""
import logging

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import _batches, train_steps

OFFLOADS = {"none": {}, "optimizer": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "both": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                     "offload_param": {"device": "cpu", "pin_memory": True}}}


def _train(t, device, stage):
    out = {}
    batches = [(x.to(device), y.to(device)) for x, y in _batches("gpt", t.rank, 6)]
    for name, off in OFFLOADS.items():
        if stage < 3 and name == "both":
            continue
        torch.manual_seed(1234)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).to(device)
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **off}}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        losses = train_steps(engine, batches)
        u = engine.units[0]
        out[name] = (losses, u.flat.master.device.type, u.flat.shard.device.type, engine.offload.active)
        engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_on_a_cpu_job_is_accepted_and_changes_nothing(stage):
    for r in run_world(_train, 2, args=("cpu", stage), timeout=120):
        base = r["none"][0]
        for name, (losses, master_dev, shard_dev, active) in r.items():
            assert losses == base, name  # nothing moved: bit-identical
            assert (master_dev, shard_dev, active) == ("cpu", "cpu", False)


def test_offload_plan(caplog):
    from zpp.zero.deepspeed_config import from_deepspeed
    from zpp.zero.offload import Offload

    both = from_deepspeed({"zero_optimization": {"stage": 3, **OFFLOADS["both"]}})
    log = logging.getLogger("zpp.zero")
    log.addHandler(caplog.handler)  # the "zpp" logger does not propagate to the root's handlers
    try:
        with caplog.at_level(logging.INFO, logger="zpp.zero"):
            assert Offload.from_config(both, torch.device("cpu")) == Offload()
    finally:
        log.removeHandler(caplog.handler)
    assert "in host memory already" in caplog.text
    assert Offload.from_config(both, torch.device("cuda", 0)) == Offload(optimizer=True, params=True, pin_memory=True)
    opt = from_deepspeed({"zero_optimization": {"stage": 2, **OFFLOADS["optimizer"]}})
    assert Offload.from_config(opt, torch.device("cuda", 0)) == Offload(optimizer=True, pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_on_cuda_keeps_the_losses(stage):
    for r in run_world(_train, 1, args=("cuda", stage), timeout=120, backend="torch"):
        base = r["none"][0]
        for name, (losses, master_dev, shard_dev, active) in r.items():
            torch.testing.assert_close(losses, base, rtol=1e-5, atol=0)
            if name != "none":
                assert active and master_dev == "cpu"
            if name == "both":
                assert shard_dev == "cpu"
