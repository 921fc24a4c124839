"""DeepSpeed's ZeRO-3 parameter attributes on zpp's partitioned parameters (see [Note: ZeRO-3
parameter attributes] in zpp/zero/param_attrs.py), the leaf-module flag the planner honours,
and the places libraries reach them: the Hugging Face Trainer's parameter count, Lightning's
DeepSpeed model summary. Each rank's ``ds_tensor`` is compared with the full parameter it
is part of, so a wrong offset or a stale view fails.
"""
from __future__ import annotations

import pytest
import torch

import zpp.zero as zz
from tests.dist import _free_port, run_world
from zpp.utils import get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name, z3_leaf_module
from zpp.zero.param_attrs import ZeroParamStatus

S = ZeroParamStatus


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _under_init(t):
    torch.manual_seed(t.rank)  # each rank initializes the elements it keeps: any seeds give one model
    with zz.Init(transport=t):
        model = _net()
    out = []
    weight = model[0].weight
    weight.all_gather()  # DeepSpeed's two-call gather, then partition()
    gathered = (weight.ds_status, weight.numel(), weight.detach().clone())
    with torch.no_grad():
        weight.add_(1.0)  # dropped at partition(), as DeepSpeed drops it
    weight.partition()
    out.append({"two_calls": (*gathered, weight.ds_status, weight.numel())})
    with pytest.raises(NotImplementedError, match="modifier_rank"):
        weight.partition(has_been_updated=True)
    for name, p in model.named_parameters():
        before = (p.ds_status, p.numel(), p.ds_numel, tuple(p.ds_shape), p.partition_numel(), p.padding_size())
        with zz.GatheredParameters([p]):
            inside = (p.ds_status, tuple(p.shape))
            full = p.detach().clone().reshape(-1)
        out.append({"name": name, "before": before, "inside": inside, "after": p.ds_status, "id": p.ds_id,
                    "part": p.ds_tensor.clone(), "full": full, "summary": p.ds_summary()["ds_numel"]})
    return out


def test_attributes_under_init():
    r0, r1 = run_world(_under_init, 2, timeout=120)
    (first, *r0), (_, *r1) = r0, r1
    status, numel, values, after, after_numel = first["two_calls"]
    assert (status, numel, after, after_numel) == (S.AVAILABLE, 70, S.NOT_AVAILABLE, 0)
    assert torch.equal(values.reshape(-1), r0[0]["full"])  # the same values the block reads: the change dropped
    ids = [e["id"] for e in r0]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) == 4, ids  # construction order, unique
    for a, b in zip(r0, r1, strict=True):
        n = a["full"].numel()
        half = -(-n // 2)
        # empty placeholder, full numel and shape, this rank's ceil(n/2) slice, zero padding on the last rank
        assert a["before"][:3] == (S.NOT_AVAILABLE, 0, n) and a["before"][4:] == (half, 0), a
        assert b["before"][4:] == (half, 2 * half - n), b
        assert a["inside"] == (S.AVAILABLE, a["before"][3]) and a["after"] is S.NOT_AVAILABLE
        assert torch.equal(a["full"], b["full"])  # one model on both ranks
        joined = torch.cat([a["part"], b["part"][:n - half]])
        assert torch.equal(joined, a["full"]), a["name"]  # the partitions are the parameter's slices
        assert a["summary"] == n


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _engine_attrs(t, leaf: str):
    torch.manual_seed(0)
    model = _Model()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    if leaf == "call":
        set_z3_leaf_modules(model, [_Block])
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20},
           "zpp": {"unit_min_numel": 0}}  # every module holding parameters is a unit: up and down apart
    if leaf == "config":
        cfg["zero_optimization"]["leaf_module"] = {"name_suffixes": ["0"], "names": ["blocks.1", "nothing"]}
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    seen = {}

    def hook(m, args):  # runs after the engine's pre-hook gathered the unit
        seen.setdefault("in_forward", m.weight.ds_status)

    model.blocks[0].up.register_forward_pre_hook(hook)
    attrs = {n: (p.ds_status, p.ds_numel, tuple(p.ds_shape), p.ds_persist, p.ds_tensor.clone())
             for n, p in model.named_parameters()}
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    after = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}  # the same views, stepped
    with zz.GatheredParameters(list(model.parameters())):
        stepped = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    units = sorted(tuple(sorted(u.names)) for u in engine.units)
    engine.close()
    return {"want": want, "attrs": attrs, "seen": seen, "after": after, "stepped": stepped, "units": units}


@pytest.mark.parametrize("leaf", ["none", "call", "config"])
def test_attributes_in_a_stage3_engine(leaf):
    r0, r1 = run_world(_engine_attrs, 2, args=(leaf,), timeout=120)
    for name, full in r0["want"].items():
        a, b = r0["attrs"][name], r1["attrs"][name]
        persistent = full.numel() < 20  # the biases and head.weight (8, 16, 2, 16 elements) stay whole
        assert a[:4] == (S.AVAILABLE if persistent else S.NOT_AVAILABLE, full.numel(), tuple(full.shape),
                         persistent), (name, a[:4])
        # the two ranks' parts of a parameter are its elements, in order (zpp shards whole units,
        # so one rank may hold all of them and the other none)
        assert a[4].numel() + b[4].numel() == full.numel(), name
        assert torch.equal(torch.cat([a[4], b[4]]), full.reshape(-1)), name
        assert torch.equal(torch.cat([r0["after"][name], r1["after"][name]]), r0["stepped"][name]), name
    assert r0["seen"] == {"in_forward": S.AVAILABLE}
    block_units = [u for u in r0["units"] if "blocks.0.up.weight" in u or "blocks.0.down.weight" in u]
    # a leaf module is one unit, gathered whole
    want = [("blocks.0.down.weight", "blocks.0.up.weight")] if leaf != "none" else [("blocks.0.down.weight",),
                                                                                     ("blocks.0.up.weight",)]
    assert block_units == want, r0["units"]


def test_leaf_module_flags():
    model = _Model()
    assert set_z3_leaf_modules(model, ["_Block"]) == list(model.blocks)
    assert get_z3_leaf_modules(model) == list(model.blocks) and not z3_leaf_module(model.emb)
    found, missing = set_z3_leaf_modules_by_name(model, ["head", "nothing"], raise_if_not_found=False)
    assert found == [model.head] and missing == ["nothing"]
    with pytest.raises(ValueError, match="_Other"):
        set_z3_leaf_modules(model, ["_Other"])
    with pytest.raises(TypeError, match="3"):
        set_z3_leaf_modules(model, [3])


def _library_counts(t):
    from zpp import as_deepspeed

    as_deepspeed.install()  # as under `zpp run`: transformers checks that deepspeed is installed
    from pytorch_lightning.utilities.model_summary.model_summary_deepspeed import DeepSpeedLayerSummary
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.trainer_pt_utils import get_model_param_count

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    registered = HfDeepSpeedConfig(cfg)  # transformers' is_deepspeed_zero3_enabled() is true while it lives
    with zz.Init(transport=t):
        model = _Model()
    out = {"hf": get_model_param_count(model), "local": sum(p.numel() for p in model.parameters())}
    summary = DeepSpeedLayerSummary(model.blocks[0])
    out["lightning"] = (summary.num_parameters, summary.average_shard_parameters)
    del registered
    return out


def test_libraries_count_partitioned_parameters():
    total = sum(p.numel() for p in _Model().parameters())
    block = [p.numel() for p in _Block().parameters()]
    r0, r1 = run_world(_library_counts, 2, timeout=120)
    assert r0["hf"] == r1["hf"] == total  # the Trainer's count: ds_numel, not the empty placeholders
    assert r0["local"] == r1["local"] == 0
    # Lightning's DeepSpeed summary: the block's parameters, and this rank's slices of them
    assert r0["lightning"] == r1["lightning"] == (sum(block), sum(-(-n // 2) for n in block))


def test_init_initializes_distributed():
    """As DeepSpeed's: entering zpp.zero.Init makes the world (here a launcher's world of one)."""
    import os
    import subprocess
    import sys

    code = ("import torch, torch.distributed as dist, zpp.zero as zz\n"
            "assert not dist.is_initialized()\n"
            "with zz.Init():\n"
            "    print(dist.is_initialized(), dist.get_world_size())\n")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.split() == ["True", "1"], (res.stdout, res.stderr[-2000:])
