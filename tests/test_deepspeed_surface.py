"""The DeepSpeed module surface a script reaches with ``import zpp as deepspeed`` (issue 10):
names, signatures and return values of DeepSpeed 0.19, checked against what DeepSpeed's own
sources define; imports zpp cannot honour fail with an ImportError saying what to use.

* ``import zpp`` and ``zpp --help`` import no torch;
* ``add_config_arguments``: DeepSpeed's group, flags, dests, defaults and help, plus ``--zpp_config``;
* accelerator: CPU object (device names, seeds, streams, memory from the kernel's counters),
  the choice by ``ZPP_ACCELERATOR`` / ``DS_ACCELERATOR``, CUDA naming (the rest on a GPU);
* ``zpp.utils.logger`` / ``log_dist`` (rank filter from the launcher's variables);
* ``zpp.runtime.config`` constants (DeepSpeed's values; zpp's subset equals the engine's);
* ``zpp.ops.adam``: FusedAdam / DeepSpeedCPUAdam against a plain-torch transcription of
  DeepSpeed's Adam update (AdamW and L2 modes, parameter groups, AMSGrad), the refusals,
  and the rebuild the engine does (``type(opt)(params, **opt.defaults)``);
* ``zpp.moe.utils.split_params_into_different_moe_groups_for_optimizer`` passes groups through;
* every refused module and name raises with its explanation;
* a 2-rank script in DeepSpeed's shape (argparse + add_config_arguments, the moe helper,
  get_accelerator, FusedAdam passed to initialize) trains exactly like the same engine
  with the config's AdamW.
"""
import argparse
import importlib
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

import zpp
from tests.dist import run_world
from zpp import unsupported
from zpp.accelerator import real_accelerator as ra
from zpp.ops.adam import FusedAdam

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- cheap imports
@pytest.mark.parametrize("code", [
    "import zpp",
    "import zpp, argparse; zpp.add_config_arguments(argparse.ArgumentParser())",
    "import runpy, sys\nsys.argv = ['zpp', '--help']\ntry:\n    runpy.run_module('zpp', run_name='__main__')\n"
    "except SystemExit:\n    pass",
])
def test_no_torch_at_import_or_help(code):
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


def test_lazy_attributes():
    assert zpp.initialize is importlib.import_module("zpp.zero").initialize
    assert zpp.get_accelerator is ra.get_accelerator
    assert zpp.DeepSpeedEngine is importlib.import_module("zpp.zero").ZeroEngine
    assert zpp.runtime.config.LAMB_OPTIMIZER == "lamb"  # deepspeed.runtime.config.X after `import deepspeed`
    assert zpp.utils.logging.logger is zpp.logger
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        zpp.no_such_thing


# ---------------------------------------------------------------------- arguments
def test_add_config_arguments():
    parser = argparse.ArgumentParser()
    assert zpp.add_config_arguments(parser) is parser
    group = next(g for g in parser._action_groups if g.title == "DeepSpeed")
    assert group.description == "DeepSpeed configurations"
    actions = {a.dest: a for a in group._group_actions}
    assert set(actions) == {"deepspeed", "deepspeed_config", "deepscale", "deepscale_config", "zpp_config"}
    # DeepSpeed's own definitions (deepspeed/__init__.py, _add_core_arguments)
    assert actions["deepspeed"].option_strings == ["--deepspeed"] and actions["deepspeed"].default is False
    assert actions["deepspeed"].help == "Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)"
    assert actions["deepspeed_config"].default is None and actions["deepspeed_config"].type is str
    assert actions["deepspeed_config"].help == "DeepSpeed json configuration file."
    assert actions["deepscale_config"].help == "Deprecated DeepSpeed json configuration file."
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--zpp_config", "z.json"])
    assert (args.deepspeed, args.deepspeed_config, args.zpp_config, args.deepscale) == (True, "ds.json", "z.json",
                                                                                        False)
    assert parser.parse_args([]).deepspeed_config is None


# ---------------------------------------------------------------------- accelerator
def test_cpu_accelerator():
    a = ra.CpuAccelerator()
    assert (a.device_name(), a.device_name(3), a.current_device_name()) == ("cpu", "cpu", "cpu")
    assert a.device(1) == torch.device("cpu") and isinstance(a.current_device(), int)
    assert a.communication_backend_name() == "gloo" and a.is_available() and a.is_bf16_supported()
    assert isinstance(a.is_fp16_supported(), bool) and torch.bfloat16 in a.supported_dtypes()
    assert a.is_synchronized_device() and a.use_host_timers() and a.resolves_data_dependency()
    assert a.set_device(0) is None and a.synchronize() is None and a.empty_cache() is None
    assert a.Stream is None and a.Event is None and a.current_stream() is None
    with a.stream(None):
        pass
    a.manual_seed(7)
    x = torch.rand(3)
    a.manual_seed_all(7)
    assert torch.equal(x, torch.rand(3)) and a.initial_seed() == 7
    assert a.random() is torch.random and a.default_generator(0) is torch.default_generator
    state = a.get_rng_state()
    y = torch.rand(2)
    a.set_rng_state(state)
    assert torch.equal(y, torch.rand(2))
    t = torch.ones(2)
    assert a.pin_memory(t) is t and a.on_accelerator(t) and a.amp() is torch.cpu.amp
    assert a.FloatTensor([1, 2]).dtype == torch.float32 and a.LongTensor([1]).dtype == torch.int64
    assert a.lazy_call(lambda: 5) == 5 and a.range_push("x") is None and a.range_pop() is None
    fused = a.create_op_builder("FusedAdamBuilder")  # zpp's FusedAdam: torch's fused Adam, nothing to build
    assert fused.is_compatible() and fused.load().FusedAdam is FusedAdam
    assert not a.create_op_builder("SparseAttnBuilder").is_compatible()
    with pytest.raises(NotImplementedError, match="scaled_dot_product_attention"):
        a.get_op_builder("SparseAttnBuilder")().load()
    with pytest.raises(ValueError, match="NoSuchBuilder"):
        a.get_op_builder("NoSuchBuilder")


def test_cpu_accelerator_memory():
    """memory_allocated is the resident set; the peak follows an allocation and resets."""
    a = ra.CpuAccelerator()
    a.reset_peak_memory_stats()
    base = a.memory_allocated()
    assert 0 < base <= a.max_memory_allocated() < a.total_memory()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert a.memory_allocated() - base >= 60 * 2**20
    peak = a.max_memory_allocated()
    del big
    assert peak - base >= 60 * 2**20 and a.max_memory_allocated() >= peak - 2**20
    a.reset_peak_memory_stats()
    assert a.max_memory_allocated() < peak - 32 * 2**20  # back near the current resident set
    assert a.memory_stats()["allocated_bytes.all.peak"] >= a.memory_stats()["allocated_bytes.all.current"] - 2**20


def test_cuda_accelerator_names():
    c = ra.CudaAccelerator()
    assert (c.device_name(), c.device_name(2)) == ("cuda", "cuda:2")
    assert c.device(1) == torch.device("cuda", 1) and c.communication_backend_name() == "nccl"
    assert not c.is_synchronized_device() and not c.use_host_timers()
    assert c.on_accelerator(torch.zeros(1)) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_accelerator_on_gpu():
    c = ra.CudaAccelerator()
    c.set_device(0)
    assert c.current_device() == 0 and c.current_device_name() == "cuda:0" and c.device_count() >= 1
    t = c.FloatTensor([1.0, 2.0])
    assert t.device.type == "cuda" and c.on_accelerator(t)
    s = c.Stream()
    with c.stream(s):
        u = t * 2
    c.synchronize()
    assert u.tolist() == [2.0, 4.0] and c.memory_allocated() > 0 and c.pin_memory(torch.ones(2)).is_pinned()


def test_accelerator_choice():
    cuda = torch.cuda.is_available()
    assert ra._choose({}) == ("cuda" if cuda else "cpu")
    assert ra._choose({"ZPP_ACCELERATOR": "cpu", "DS_ACCELERATOR": "cuda"}) == "cpu"  # zpp's variable first
    assert ra._choose({"DS_ACCELERATOR": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu'.*zpp's accelerators are"):
        ra._choose({"DS_ACCELERATOR": "xpu"})
    if not cuda:
        with pytest.raises(ValueError, match="ZPP_ACCELERATOR='cuda' but torch.cuda.is_available"):
            ra._choose({"ZPP_ACCELERATOR": "cuda"})
    acc = zpp.get_accelerator()
    assert acc is zpp.accelerator.get_accelerator() and acc._name == ("cuda" if cuda else "cpu")
    try:
        mine = ra.CpuAccelerator()
        ra.set_accelerator(mine)
        assert zpp.get_accelerator() is mine
        with pytest.raises(TypeError):
            ra.set_accelerator("cpu")
    finally:
        ra.set_accelerator(None)


# ---------------------------------------------------------------------- logging
def test_logger_and_log_dist(monkeypatch):
    from zpp.utils import log_dist, logger
    from zpp.utils.logging import logger as same

    assert logger is same and logger.name == "zpp" and not logger.propagate
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logger.addHandler(handler)
    try:
        for rank in ("0", "3"):
            monkeypatch.setenv("RANK", rank)
            log_dist("only on 0", ranks=[0])
            log_dist("on every rank", ranks=[-1])
            log_dist("no ranks given")
        monkeypatch.delenv("RANK")
        for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
            monkeypatch.delenv(var, raising=False)
        log_dist("a lone process logs")
        logger.warning_once("once")
        logger.warning_once("once")
    finally:
        logger.removeHandler(handler)
    assert seen == ["[Rank 0] only on 0", "[Rank 0] on every rank", "[Rank 3] on every rank",
                    "[Rank -1] a lone process logs", "once"]


# ---------------------------------------------------------------------- runtime.config
def test_runtime_config_constants():
    from zpp.runtime import config as rc
    from zpp.zero.config import OPTIMIZERS

    assert (rc.ADAM_OPTIMIZER, rc.ADAMW_OPTIMIZER, rc.LAMB_OPTIMIZER, rc.ONEBIT_ADAM_OPTIMIZER,
            rc.ZERO_ONE_ADAM_OPTIMIZER, rc.ONEBIT_LAMB_OPTIMIZER) == (
        "adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb")
    assert rc.DEEPSPEED_OPTIMIZERS == ["adagrad", "adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam",
                                       "muadam", "muadamw", "musgd", "lion", "muon"]
    assert sorted(rc.ZPP_OPTIMIZERS) == sorted(OPTIMIZERS)
    assert (rc.ADAM_W_MODE, rc.ADAM_W_MODE_DEFAULT, rc.TORCH_ADAM_PARAM) == ("adam_w_mode", True, "torch_adam")
    from zpp.runtime.lr_schedules import VALID_LR_SCHEDULES, OneCycle, WarmupLR

    assert WarmupLR is importlib.import_module("zpp.zero.schedulers").WarmupLR
    assert OneCycle is importlib.import_module("zpp.zero.onecycle").OneCycle
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


# ---------------------------------------------------------------------- ops.adam
def _reference_adam(params, grads_per_step, *, lr, betas, eps, wd, adamw, amsgrad=False):
    """DeepSpeed's Adam update (csrc multi_tensor_adam / cpu_adam), transcribed in plain torch."""
    b1, b2 = betas
    p = [x.detach().clone().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    vmax = [torch.zeros_like(x) for x in p]
    for step, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            if not adamw and wd:
                g = g + wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            vmax[i] = torch.maximum(vmax[i], v[i])
            denom = (vmax[i] if amsgrad else v[i]).sqrt() / math.sqrt(1 - b2 ** step) + eps
            update = (m[i] / (1 - b1 ** step)) / denom
            if adamw and wd:
                update = update + wd * p[i]
            p[i] = p[i] - lr * update
    return p


@pytest.mark.parametrize("cls", ["FusedAdam", "DeepSpeedCPUAdam"])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_deepspeeds_update(cls, adamw, amsgrad):
    from zpp.ops import adam as zadam

    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(37, generator=g)), torch.nn.Parameter(torch.randn(4, 5, generator=g))]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]
    hp = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    want = _reference_adam(params, grads, lr=0.05, betas=(0.8, 0.95), eps=1e-6, wd=0.1, adamw=adamw,
                           amsgrad=amsgrad)
    mode = {"adam_w_mode": adamw} if cls == "FusedAdam" else {"adamw_mode": adamw}
    opt = getattr(zadam, cls)(params, **hp, **mode)
    assert opt.adam_w_mode is adamw and opt.defaults["fused"] is True  # torch's fused CPU kernel
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    for p, w in zip(params, want):
        assert torch.allclose(p.double(), w, rtol=1e-5, atol=1e-6), (p - w).abs().max()
    rebuilt = type(opt)([torch.nn.Parameter(p.detach().clone()) for p in params], **opt.defaults)
    assert rebuilt.adam_w_mode is adamw and rebuilt.defaults == opt.defaults


def test_adam_defaults_groups_and_refusals():
    from zpp.ops.adam import DeepSpeedCPUAdam, FusedAdam

    lin = torch.nn.Linear(3, 2)
    opt = FusedAdam(lin.parameters())
    assert opt.defaults["weight_decay"] == 0.0 and opt.defaults["lr"] == 1e-3 and opt.adam_w_mode  # DeepSpeed's
    groups = [{"params": [lin.weight], "weight_decay": 0.1}, {"params": [lin.bias], "weight_decay": 0.0, "lr": 0.5}]
    opt = FusedAdam(groups, lr=0.01)
    assert [gr["lr"] for gr in opt.param_groups] == [0.01, 0.5]
    lin(torch.ones(1, 3)).sum().backward()
    opt.zero_grad()
    assert lin.weight.grad is None  # set_grad_none=True
    opt = FusedAdam(lin.parameters(), set_grad_none=False)
    lin(torch.ones(1, 3)).sum().backward()
    opt.zero_grad()
    assert lin.weight.grad is not None and not lin.weight.grad.any()
    assert FusedAdam(lin.parameters(), foreach=True).defaults["fused"] is None  # explicit choice wins
    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        FusedAdam(lin.parameters(), bias_correction=False)
    with pytest.raises(ValueError, match="adam_w_mode='yes'"):
        FusedAdam(lin.parameters(), adam_w_mode="yes")
    bf = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(NotImplementedError, match="fp32_optimizer_states=True"):
        DeepSpeedCPUAdam(bf)
    cpu = DeepSpeedCPUAdam(bf, fp32_optimizer_states=False)
    bf[0].grad = torch.ones(3, dtype=torch.bfloat16)
    cpu.step()
    assert cpu.state[bf[0]]["exp_avg"].dtype == torch.bfloat16 and bf[0].ne(0).all()
    ids = [DeepSpeedCPUAdam(lin.parameters()).opt_id for _ in range(2)]
    assert ids[1] == ids[0] + 1


# ---------------------------------------------------------------------- moe.utils
def test_moe_split_passes_groups_through():
    from zpp.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    lin = torch.nn.Linear(3, 2)
    group = {"params": [p for p in lin.parameters()], "name": "parameters"}
    out = split(group)
    assert out == [group] and out[0]["params"] == list(lin.parameters())
    two = ({"params": [lin.weight], "name": "a"}, {"params": [lin.bias], "name": "b", "weight_decay": 0.0})
    assert split(two) == list(two) and split(list(two), max_group_size=None) == list(two)
    gen = {"params": (p for p in lin.parameters()), "name": "gen"}
    assert split(gen)[0]["params"] == list(lin.parameters())  # a generator is kept usable
    with pytest.raises(ValueError, match="Unknown param group type"):
        split(lin.weight)
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # DeepSpeed's mark of an expert parameter
    with pytest.raises(NotImplementedError, match="1 expert parameters"):
        split({"params": [lin.weight, expert], "name": "moe"})


# ---------------------------------------------------------------------- refused imports
@pytest.mark.parametrize("module", sorted(unsupported.MODULES))
def test_refused_module_says_what_instead(module):
    with pytest.raises(ImportError) as e:
        importlib.import_module(f"zpp.{module}")
    assert f"deepspeed.{module}" in str(e.value) and unsupported.MODULES[module] in str(e.value)
    assert not isinstance(e.value, ModuleNotFoundError)


@pytest.mark.parametrize("name", sorted(unsupported.NAMES))
def test_refused_name_says_what_instead(name):
    with pytest.raises(AttributeError, match=f"deepspeed.{name}"):
        getattr(zpp, name)
    assert not hasattr(zpp, name)
    with pytest.raises(ImportError, match=unsupported.NAMES[name][:30].replace("(", r"\(").replace(".", r"\.")):
        exec(f"from zpp import {name}", {})


def test_refused_submodules_and_attributes():
    # classes that shared code imports (to subclass, or for isinstance) import, and refuse when built
    from zpp.moe.layer import MoE
    from zpp.pipe import LayerSpec, PipelineModule
    from zpp.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from zpp.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class Stack(PipelineModule):  # a definition, as a script that supports both makes
        pass

    for cls, words in ((Stack, "pipeline parallelism"), (LayerSpec, "pipeline parallelism"), (MoE, "no MoE layers"),
                       (FP16_UnfusedOptimizer, "fp16 optimizer wrappers"),
                       (DeepSpeedZeroOptimizer_Stage3, "zpp.zero.ZeroEngine")):
        with pytest.raises(NotImplementedError, match=words):
            cls(torch.nn.Linear(2, 2))
    assert zpp.PipelineModule is PipelineModule
    with pytest.raises(ImportError, match="1-bit optimizers are zpp.optim"):
        importlib.import_module("zpp.runtime.fp16.onebit.adam")
    with pytest.raises(ImportError, match=r"\(deepspeed\.ops\.transformer\)"):  # the parent explains
        importlib.import_module("zpp.ops.transformer.inference")
    assert "deepspeed.ops.transformer.inference" in unsupported.explain("zpp.ops.transformer.inference")
    with pytest.raises(ModuleNotFoundError):  # an unknown name stays an ordinary error
        importlib.import_module("zpp.not_a_deepspeed_module")


# ---------------------------------------------------------------------- a script in DeepSpeed's shape
def _script(t, ds_path, use_fused):
    """The cifar10_deepspeed.py / bing_bert surface: argparse + add_config_arguments, the MoE
    helper, get_accelerator().device_name(local_rank), runtime.config constants, FusedAdam."""
    import zpp as deepspeed
    from zpp.accelerator import get_accelerator
    from zpp.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zpp.ops.adam import FusedAdam
    from zpp.utils.logging import logger  # noqa: F401  (bing_bert imports it)
    from zpp.zero.deepspeed_config import from_args

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser(description="CIFAR"))
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", ds_path])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    parameters = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in net.parameters()], "name": "parameters"})
    config = from_args(args)
    kw = {}
    if use_fused:
        config = from_args(argparse.Namespace(), config={**json.load(open(ds_path)), "optimizer": None})
        kw["optimizer"] = FusedAdam(net.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(model=net, model_parameters=parameters, config=config,
                                                   transport=t, **kw)
    device = get_accelerator().device_name(t.rank)
    uses_lamb = engine.train_config.optimizer is not None and engine.train_config.optimizer.type in (
        deepspeed.runtime.config.LAMB_OPTIMIZER, deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER)
    g = torch.Generator().manual_seed(10 + t.rank)
    losses = []
    for _ in range(5):
        x = torch.randn(4, 8, generator=g).to(device)
        y = torch.randint(0, 4, (4,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, uses_lamb, type(optimizer).__name__


def test_deepspeed_shaped_script_two_ranks(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2000, "wall_clock_breakdown": False,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    by_config = run_world(_script, 2, args=(str(path), False), timeout=120)
    by_fused = run_world(_script, 2, args=(str(path), True), timeout=120)
    assert all(not r[1] for r in by_config)
    assert by_fused[0][2] == "FusedAdam"
    for (a, _, _), (b, _, _) in zip(by_config, by_fused):
        assert len(a) == 5 and a[0] == b[0] and a[-1] < a[0]
        assert all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7) for x, y in zip(a, b)), (a, b)


def test_deepspeed_helper_modules():
    """The small DeepSpeed modules scripts and shared test code import: what each answers."""
    import zpp.git_version_info as gvi
    from zpp.accelerator import is_current_accelerator_supported
    from zpp.checkpoint.constants import OPTIMIZER_STATE_DICT
    from zpp.checkpoint.utils import get_model_ckpt_name_for_rank
    from zpp.ops import __compatible_ops__
    from zpp.runtime.precision_config import get_bfloat16_config, get_float16_config
    from zpp.runtime.utils import move_to_device
    from zpp.runtime.zero.partition_parameters import MultipleAllGatherHandles
    from zpp.utils.torch import required_torch_version

    assert is_current_accelerator_supported()
    assert __compatible_ops__["fused_adam"] and __compatible_ops__["cpu_adam"] and not __compatible_ops__["async_io"]
    assert set(gvi.installed_ops) == set(__compatible_ops__) and not any(gvi.installed_ops.values())
    assert gvi.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert get_model_ckpt_name_for_rank("ck", "00") == os.path.join("ck", "mp_rank_00_model_states.pt")
    assert OPTIMIZER_STATE_DICT == "optimizer_state_dict"
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # DeepSpeed's older name
    assert get_bfloat16_config({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}).enabled is False
    assert get_float16_config({"fp16": {"enabled": True}}).initial_scale_power == 16
    with pytest.raises(ValueError, match="enabled='yes'"):
        get_bfloat16_config({"bf16": {"enabled": "yes"}})
    have = torch.__version__.split("+")[0]
    assert required_torch_version(min_version=have) and required_torch_version(max_version=have)
    assert not required_torch_version(min_version="99.0") and not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()
    moved = move_to_device({"a": [torch.ones(1), (torch.zeros(1), "x")], "b": 3}, "meta")
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta and moved["a"][1][1] == "x" and moved["b"] == 3

    class Handle:
        def __init__(self):
            self.seen = []

        def wait(self, **kwargs):
            self.seen.append(kwargs)

    handles = [Handle(), Handle()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [[{"handle_dependency": False}]] * 2


def test_initialize_dist_init_required_false_needs_an_initialized_world():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="dist_init_required=False.*not initialized"):
        zpp.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1},
                       dist_init_required=False)
