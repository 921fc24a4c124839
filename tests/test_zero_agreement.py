"""Every rank runs the same resolved config (zpp.zero.agreement, issue 12 point 6).

* canonical form and digest: equal configs give equal digests; any changed field changes
  the digest, and ``differing_keys`` names exactly the changed keys;
* ``check_same_config`` on real gloo worlds of 2 and 4 ranks: one rank with another ``lr``
  and one with ``zero_quantized_weights`` on: every rank raises the same ``ValueError``
  naming both keys, their values and the ranks; no abort, no hang (the world still runs a
  collective afterwards); equal configs pass with two all-gathers of 32 bytes per rank.
"""
import dataclasses
import json

import pytest
import torch

from tests.dist import run_world
from zpp.zero.agreement import canonical, canonical_json, check_same_config, config_digest, differing_keys
from zpp.zero.config import TrainConfig
from zpp.zero.deepspeed_config import from_deepspeed

BASE = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
    "zpp": {"weight_bits": 8, "gradient_group_size": 1024},
}


def _with(**changes):
    ds = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        d = ds
        *head, last = path.split("__")
        for k in head:
            d = d[k]
        d[last] = value
    return from_deepspeed(ds)


def test_canonical_form_and_digest():
    a, b = from_deepspeed(BASE), from_deepspeed(json.loads(json.dumps(BASE)))
    assert a is not b and canonical_json(a) == canonical_json(b) and config_digest(a) == config_digest(b)
    assert len(config_digest(a)) == 32
    form = canonical(a)
    assert form["optimizer"]["params"]["betas"] == [0.9, 0.95] and form["zero"]["hpz_partition_size"] == 2
    assert json.loads(canonical_json(a)) == form
    changes = {
        "optimizer__params__lr": (2e-3, "optimizer.params.lr"),
        "optimizer__params__betas": ([0.9, 0.999], "optimizer.params.betas"),
        "zero_optimization__stage": (2, None),  # stage 2 without the stage-3 switches: below
        "zpp__weight_bits": (4, "zpp.weight_bits"),
        "zpp__gradient_group_size": (2048, "zpp.gradient_group_size"),
        "bf16__enabled": (False, "precision"),
        "gradient_accumulation_steps": (4, "gradient_accumulation_steps"),
        "scheduler__params__warmup_num_steps": (20, "scheduler.params.warmup_num_steps"),
    }
    for path, (value, key) in changes.items():
        if key is None:
            continue
        other = _with(**{path: value})
        assert config_digest(other) != config_digest(a), path
        assert differing_keys(canonical(a), canonical(other)) == [key], path
    s2 = from_deepspeed({**BASE, "zero_optimization": {"stage": 2}})
    assert differing_keys(canonical(a), canonical(s2)) == [
        "zero.hpz_partition_size", "zero.quantized_gradients", "zero.stage"]
    # a key present in one form only, and 1 vs 1.0 vs True, differ
    assert differing_keys({"a": 1}, {"a": 1, "b": None}) == ["b"]
    assert differing_keys({"a": 1}, {"a": 1.0}) == ["a"] and differing_keys({"a": 1}, {"a": True}) == ["a"]
    # every field is in the form: a field added to a dataclass cannot be left out of the check
    leaves = set(json.loads(canonical_json(TrainConfig())).keys())
    assert leaves == {f.name for f in dataclasses.fields(TrainConfig)}


def _agree(t, variant):
    """Each rank builds its config; ``variant`` says which ranks differ and how."""
    ds = json.loads(json.dumps(BASE))
    ds["zero_optimization"] = {"stage": 3}
    W = t.world_size
    if variant == "differ":
        if t.rank == 1:
            ds["optimizer"]["params"]["lr"] = 5e-4
        if t.rank == W - 1:
            ds["zero_optimization"]["zero_quantized_weights"] = True
    cfg = from_deepspeed(ds)
    before = t.counters.snapshot()
    try:
        check_same_config(t, cfg)
        outcome = None
    except ValueError as e:
        outcome = str(e)
    after = t.counters.snapshot()
    sent = {op: after[op].logical_bytes - (before[op].logical_bytes if op in before else 0) for op in after}
    probe = torch.tensor([float(t.rank)])
    t.all_reduce(probe)  # the world survived: no abort, nothing left in flight
    return outcome, sent, probe.item()


@pytest.mark.parametrize("world", [2, 4])
def test_check_same_config_on_a_world(world):
    results = run_world(_agree, world, args=("differ",), ranks_per_node=2, timeout=90)
    messages = [r[0] for r in results]
    assert all(m is not None and m == messages[0] for m in messages), messages  # same error, every rank
    msg = messages[0]
    assert "optimizer.params.lr" in msg and "zero.quantized_weights" in msg and "2 keys" in msg, msg
    assert "0.0005 on ranks [1]" in msg and "0.001 on ranks [" in msg, msg
    assert f"true on ranks [{world - 1}]" in msg, msg
    assert all(r[2] == sum(range(world)) for r in results)  # the all-reduce after the error
    ok = run_world(_agree, world, args=("same",), ranks_per_node=2, timeout=90)
    assert all(r[0] is None for r in ok)
    # equal configs: one all-gather of a 32-byte digest per rank (world * 32 bytes received)
    assert all(r[1]["all_gather"] == world * 32 for r in ok), [r[1] for r in ok]
