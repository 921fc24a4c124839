"""zpp.checkpointing, DeepSpeed's deepspeed.checkpointing: configure from a config section or
arguments, the same results as no checkpointing (gradients equal), profiling logs, the RNG
tracker. Training at stage 3 with it is in test_zero_anymodel (functional_tied_ckpt_deepspeed)."""
import logging

import pytest
import torch

import zpp.checkpointing as ckpt
from zpp.zero import activation_checkpointing


@pytest.fixture(autouse=True)
def _fresh():
    ckpt.reset()
    yield
    ckpt.reset()


def _grads(fn, use_ckpt):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    y = fn(block, x) if use_ckpt else block(x)
    y.square().sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("fn", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_checkpoint_gives_the_gradients_of_no_checkpoint(fn):
    ref = _grads(fn, False)
    got = _grads(fn, True)  # dropout inside: the re-run restores the RNG state
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_configure_from_a_config_and_arguments(caplog):
    assert not ckpt.is_configured()
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True,
                                                                        "cpu_checkpointing": True}},
                   profile=True)
    assert ckpt.is_configured()
    s = activation_checkpointing._settings  # one object behind both names
    assert s.cpu_checkpointing and s.profile and s.partition_activations
    log = logging.getLogger("zpp.checkpointing")
    log.addHandler(caplog.handler)  # the "zpp" logger does not propagate to the root's handlers
    try:
        with caplog.at_level(logging.INFO, logger="zpp.checkpointing"):
            ref = _grads(ckpt.checkpoint, False)
            got = _grads(ckpt.checkpoint, True)  # cpu_checkpointing on a CPU job: already in host memory
    finally:
        log.removeHandler(caplog.handler)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    text = caplog.text
    assert "forward" in text and "recompute" in text  # profile: both phases timed
    with pytest.raises(NotImplementedError, match="mpu_"):
        ckpt.configure(object())
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": "yes"}})


def test_rng_tracker_forks_its_own_stream():
    ckpt.model_parallel_cuda_manual_seed(123)
    tracker = ckpt.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advances
    ckpt.model_parallel_cuda_manual_seed(123)
    with ckpt.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)  # and is reproducible from the seed
    with pytest.raises(ValueError, match="not added"):
        with tracker.fork("other"):
            pass
