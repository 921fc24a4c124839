"""Configuration: DeepSpeed translation, typed validation, and the errors initialize raises."""
import json

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from zpp.zero.config import TrainConfig, ZeroConfig, ZppConfig, from_deepspeed
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
    ({"fp16": {"enabled": True}}, NotImplementedError, ["fp16"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, NotImplementedError, ["offload_optimizer"]),
    ({"zero_optimization": {"overlap_comm": True}}, NotImplementedError, ["overlap_comm"]),
    ({"activation_checkpointing": {"partition_activations": True}}, NotImplementedError, ["activation_checkpointing"]),
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
    ({"scheduler": {"type": "OneCycle"}}, ValueError, ["OneCycle"]),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ValueError, ["total_num_steps"]),
])
def test_errors(ds, exc, words):
    with pytest.raises(exc) as e:
        from_deepspeed(ds)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_typed_config_validates():
    with pytest.raises(ValueError, match="hpz_partition_size=0"):
        ZeroConfig(stage=3, hpz_partition_size=0)
    with pytest.raises(ValueError, match="weight_group_size=3"):
        ZppConfig(weight_group_size=3)
    with pytest.raises(ValueError, match="precision='fp16'"):
        TrainConfig(precision="fp16")
    with pytest.raises(TypeError):
        ZeroConfig(3)  # keyword-only
    cfg = TrainConfig(train_micro_batch_size_per_gpu=2, train_batch_size=10, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="train_batch_size=10"):
        cfg.check_world(4)


def test_schedulers():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.5) and lrs[10:] == [1.0, 1.0, 1.0]
    s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=100)  # "log" is DeepSpeed's default
    for _ in range(9):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(torch.log(torch.tensor(10.0)).item() / torch.log(torch.tensor(100.0)).item())
    d = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    for _ in range(15):
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
    attempt("mismatch", m, base)
    torch.manual_seed(0)
    good = torch.nn.Linear(3, 5)
    attempt("hpz_not_divide", good, {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})
    attempt("hpz_not_node", good, {**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    attempt("batch", good, {**base, "train_batch_size": 3, "train_micro_batch_size_per_gpu": 1})
    attempt("no_optimizer", good, {})
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
    assert "no optimizer" in r["no_optimizer"]
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
