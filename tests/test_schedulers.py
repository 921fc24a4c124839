"""The learning-rate schedules against DeepSpeed 0.19.8's sequences, step for step.

``CASES`` are DeepSpeed "scheduler" sections; :func:`expected` writes out, from DeepSpeed's
formulas (independently of zpp's code), the lr (and OneCycle's first beta) each optimizer
step runs at when DeepSpeed's engine drives the schedule: step 0 at the value the constructor
writes, step ``i`` at the schedule's value for ``last_batch_iteration = i - 1`` (see [Note:
which lr a step uses] in zpp/zero/schedule_base.py). :func:`engine_sequence` records what a
real ``zpp.initialize`` engine's optimizer runs at. ``DEEPSPEED_MEASURED`` holds numbers read
from real DeepSpeed (perf/ds_schedules_check.py, which runs ``CASES`` through both and writes
perf/results/ds_schedules_check.json); DeepSpeed itself is not needed here.
"""
from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch
from torch import nn

import zpp.zero as zz
from tests.dist import run_world
from zpp.zero.config import from_deepspeed
from zpp.zero.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 30
TOL = 1e-12
# name, optimizer lr, scheduler section
CASES = [
    ("WarmupLR-log", 0.01, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}}),
    ("WarmupLR-linear", 0.01, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0005, "warmup_max_lr": 0.02, "warmup_num_steps": 7, "warmup_type": "linear"}}),
    ("WarmupLR-max-from-optimizer", 0.003, {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}),
    ("WarmupLR-resumed-iteration", 0.004, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "last_batch_iteration": 3}}),
    ("WarmupDecayLR-log", 0.01, {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3, "warmup_num_steps": 6, "total_num_steps": 20}}),
    ("WarmupDecayLR-linear", 0.01, {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 25}}),
    ("WarmupCosineLR-log", 0.01, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}}),
    ("WarmupCosineLR-linear", 0.02, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 24, "warmup_num_steps": 6, "warmup_type": "linear"}}),
    ("OneCycle-momentum-decay", 0.01, {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 5, "decay_step_size": 3,
        "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}}),
    ("OneCycle-stairs", 0.01, {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 8, "cycle_second_step_size": 4,
        "cycle_first_stair_count": 4, "cycle_second_stair_count": 2, "cycle_momentum": False,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}),
    ("LRRangeTest-continuous", 0.01, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0}}),
    ("LRRangeTest-staircase", 0.01, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 0.5,
        "lr_range_test_staircase": True}}),
]
ADAM_BETAS = (0.9, 0.999)  # the optimizer's own betas (torch's AdamW defaults)
#: Read from DeepSpeed 0.19.8 (engine.get_lr() and the group's betas before each step; see the
#: module docstring): the first steps of some cases, lr or (lr, first beta).
DEEPSPEED_MEASURED = {
    "WarmupLR-log": [0.001, 0.001, 0.0048760890226605385, 0.007143455750373869, 0.008752178045321076,
                     0.010000000000000002, 0.010000000000000002],
    "WarmupLR-resumed-iteration": [0.004, 0.006989700043360187, 0.007781512503836435, 0.008450980400142567],
    "WarmupDecayLR-log": [0.0001, 0.0001, 0.0019955787554492535],
    "WarmupCosineLR-log": [0.0, 0.001, 0.0048760890226605385, 0.007143455750373868, 0.008752178045321076, 0.01,
                           0.009896201103485576, 0.009589340923802354],
    "OneCycle-momentum-decay": list(zip(
        [0.001, 0.002800000000000002, 0.0046, 0.006400000000000001, 0.008199999999999999, 0.010000000000000002,
         0.008199999999999999, 0.006400000000000001, 0.0046, 0.002800000000000002, 0.001, 0.0008571428571428571,
         0.00075, 0.0006666666666666666],
        [0.8, 0.88, 0.8600000000000001, 0.8400000000000001, 0.8200000000000001, 0.8, 0.8200000000000001,
         0.8400000000000001, 0.8600000000000001, 0.88, 0.9, 0.9030000000000001, 0.9059999999999999, 0.909])),
    "OneCycle-stairs": [0.002, 0.002, 0.006500000000000001, 0.006500000000000001, 0.011000000000000001,
                        0.011000000000000001, 0.015500000000000002, 0.015500000000000002, 0.020000000000000004,
                        0.011000000000000001, 0.011000000000000001, 0.002],
    "LRRangeTest-continuous": [0.001, 0.0014, 0.0018000000000000002, 0.0022, 0.0026000000000000003],
}


# ---------------------------------------------------------------------- DeepSpeed's formulas
def _warm(t, w, kind):
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def _at(kind, p, lr0, t):
    """(lr, first beta or None) of schedule ``kind`` at ``last_batch_iteration = t`` (t = -1:
    what the constructor writes)."""
    w = max(2, p.get("warmup_num_steps", 1000))
    wt = p.get("warmup_type", "log")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo = p.get("warmup_min_lr", 0.0)
        hi = p.get("warmup_max_lr", lr0 if kind == "WarmupLR" else 0.001)
        if t < 0:
            return lo, None
        if t < w:
            g = _warm(t, w, wt)
        elif kind == "WarmupLR":
            g = 1.0
        else:
            total = p["total_num_steps"]
            g = max(0.0, (total - t) / max(1, total - w))
        return lo + (hi - lo) * g, None
    if kind == "WarmupCosineLR":
        if t < 0:
            return 0.0, None
        if t < w:
            lo = p.get("warmup_min_ratio", 0.0)
            return lr0 * (lo + (1 - lo) * _warm(t, w, wt)), None
        floor = p.get("cos_min_ratio", 0.0001)
        progress = min(1.0, (t - w + 1) / max(1, p["total_num_steps"] - w))
        return lr0 * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2), None
    if kind == "LRRangeTest":
        lo, size = p.get("lr_range_test_min_lr", 1e-3), p.get("lr_range_test_step_size", 2000)
        k = (t + 1) / size
        if p.get("lr_range_test_staircase", False):
            k = math.floor(k)
        return lo * (1 + p.get("lr_range_test_step_rate", 1.0) * k), None
    assert kind == "OneCycle"
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    mlo, mhi = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    moms = p.get("cycle_momentum", True)
    if t < 0:
        return lo, (mlo if moms else None)
    first = p.get("cycle_first_step_size", 2000)
    second = p.get("cycle_second_step_size", first)
    n1 = p.get("cycle_first_stair_count", 0)
    n2 = p.get("cycle_second_stair_count", n1)
    size = first + second
    if t < size:
        c = (t + 1) % size  # steps into the cycle
        if c <= first:
            scale = math.floor(c * n1 / first) / n1 if n1 > 0 else c / first
        else:
            scale = math.floor((size - c) * n2 / second) / n2 if n2 > 0 else (size - c) / second
        return lo + (hi - lo) * scale, (mhi - (mhi - mlo) * scale if moms else None)
    every = p.get("decay_step_size", 0)
    k = (t - size + 1) / every if every else 0.0
    lr = lo / (1 + p.get("decay_lr_rate", 0.0) * k)
    return lr, (mhi * (1 + p.get("decay_mom_rate", 0.0) * k) if moms else None)


def expected(case, steps=STEPS):
    """[(lr, first beta or None)] that optimizer steps 0.. run at under DeepSpeed's engine."""
    _, lr0, sch = case
    p = sch["params"]
    start = p.get("last_batch_iteration", -1)
    out = []
    for i in range(steps):
        if i == 0 and start != -1:  # built mid-run: the constructor writes nothing
            lr, beta = lr0, (ADAM_BETAS[0] if cycles_momentum(case) else None)
        else:
            lr, beta = _at(sch["type"], p, lr0, start + i)
        out.append((lr, beta))
    return out


# ---------------------------------------------------------------------- zpp's engine
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


def ds_config(case):
    _, lr0, sch = case
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": lr0, "torch_adam": True}}, "scheduler": sch}


def cycles_momentum(case):
    return case[2]["type"] == "OneCycle" and case[2]["params"].get("cycle_momentum", True)


def _beta(engine, case):
    return engine.optimizer.param_groups[0]["betas"][0] if cycles_momentum(case) else None


def run_steps(engine, case, steps, seed=0):
    """Train ``steps`` steps; [(lr, first beta or None)] each ran at."""
    g = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(steps):
        seen.append((engine.get_lr()[0], _beta(engine, case)))
        engine.backward(engine(torch.randn(2, 4, generator=g)))
        engine.step()
    return seen


def engine_sequence(t, case, steps=STEPS):
    """What a zpp engine built from ``case``'s DeepSpeed config runs each step at."""
    torch.manual_seed(0)
    engine, *_ = zz.initialize(model=Tiny(), config=ds_config(case), transport=t)
    seen = run_steps(engine, case, steps)
    engine.close()
    return seen


def engine_sequences(t, steps=STEPS):
    """{case name: engine_sequence} for every case (a world function; perf/ds_schedules_check.py
    runs it too)."""
    return {case[0]: engine_sequence(t, case, steps) for case in CASES}


def _engines(t):
    out = engine_sequences(t)
    # resume: the schedule's state from mid-warm-up into a fresh engine continues the sequence
    case = CASES[0]
    torch.manual_seed(0)
    a, *_ = zz.initialize(model=Tiny(), config=ds_config(case), transport=t)
    head = run_steps(a, case, 3)
    state = a.lr_scheduler.state_dict()
    torch.manual_seed(0)
    b, *_ = zz.initialize(model=Tiny(), config=ds_config(case), transport=t)
    b.lr_scheduler.load_state_dict(state)
    out["resumed"] = (head, state, run_steps(b, case, 6, seed=1))
    a.close()
    b.close()
    return out


@pytest.fixture(scope="module")
def engines():
    return run_world(_engines, 1, timeout=120)[0]


def _close(got, want):
    assert len(got) == len(want)
    for i, ((lr, beta), (wlr, wbeta)) in enumerate(zip(got, want)):
        assert abs(lr - wlr) <= TOL, (i, lr, wlr)
        assert (beta is None) == (wbeta is None) and (beta is None or abs(beta - wbeta) <= TOL), (i, beta, wbeta)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_engine_runs_deepspeeds_sequence(engines, case):
    _close(engines[case[0]], expected(case))
    measured = DEEPSPEED_MEASURED.get(case[0], [])
    got = engines[case[0]][:len(measured)]
    if measured and isinstance(measured[0], tuple):
        _close(got, measured)
    else:
        assert [lr for lr, _ in got] == pytest.approx(measured, abs=TOL, rel=0)


def test_warmup_min_lr_runs_two_steps(engines):
    """The known difference this file pins: DeepSpeed's engine runs steps 0 and 1 at
    warmup_min_lr (the constructor's value, then iteration 0's), the warm-up's second
    value on step 2."""
    seq = [lr for lr, _ in engines["WarmupLR-log"]]
    assert seq[0] == seq[1] == 0.001 and seq[2] == pytest.approx(0.001 + 0.009 * math.log(2) / math.log(5))


@pytest.mark.timeout(180)
def test_resume_continues_the_sequence(engines):
    head, state, tail = engines["resumed"]
    assert state == {"last_batch_iteration": 2}
    _close(head + tail, expected(CASES[0], 9))


# ---------------------------------------------------------------------- the classes alone
def _opt(*lrs, cls=torch.optim.AdamW):
    ps = [nn.Parameter(torch.zeros(1)) for _ in lrs]
    return cls([{"params": [p], "lr": lr} for p, lr in zip(ps, lrs)], lr=lrs[0])


def _lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def test_per_group_values():
    opt = _opt(0.1, 0.2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_num_steps=4, warmup_type="linear")  # max: each group's lr
    assert _lrs(opt) == s.get_last_lr() == [0.0, 0.01]
    s.step(2)
    assert _lrs(opt) == pytest.approx([0.05, 0.01 + 0.19 / 2])
    c = WarmupCosineLR(opt := _opt(0.1, 0.4), total_num_steps=10, warmup_num_steps=2, warmup_min_ratio=0.5)
    assert _lrs(opt) == [0.0, 0.0]
    c.step()
    assert _lrs(opt) == pytest.approx([0.05, 0.2])
    c.step(20)
    assert _lrs(opt) == pytest.approx([0.1 * 0.0001, 0.4 * 0.0001])
    r = LRRangeTest(opt := _opt(0.1, 0.4), lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=2)
    r.step()
    assert _lrs(opt) == pytest.approx([1.5e-3, 3e-3])
    o = OneCycle(opt := _opt(0.1, 0.4), [1e-3, 1e-2], [1e-2, 1e-1], cycle_first_step_size=2, cycle_min_mom=[0.8, 0.7])
    assert _lrs(opt) == [1e-3, 1e-2] and [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    o.step()
    assert _lrs(opt) == pytest.approx([5.5e-3, 5.5e-2])
    assert [b for pair in o.get_mom() for b in pair] == pytest.approx([0.85, 0.99, 0.8, 0.99])


def test_state_dict_and_built_mid_run():
    opt = _opt(0.5)
    s = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=4, warmup_max_lr=1.0, warmup_type="linear")
    for _ in range(3):
        s.step()
    assert s.state_dict() == {"last_batch_iteration": 2}
    opt2 = _opt(0.5)
    s2 = WarmupDecayLR(opt2, total_num_steps=10, warmup_num_steps=4, warmup_max_lr=1.0, warmup_type="linear")
    s2.load_state_dict(s.state_dict())  # writes iteration 2's lr, as the restored optimizer would hold
    assert _lrs(opt2) == _lrs(opt) == [0.5] and s2.get_last_lr() == [0.5]
    s.step()
    s2.step()
    assert _lrs(opt2) == _lrs(opt) == [0.75]
    # built with last_batch_iteration: nothing written until step() (DeepSpeed's behaviour)
    opt3 = _opt(0.25)
    s3 = WarmupLR(opt3, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear", last_batch_iteration=1)
    assert _lrs(opt3) == [0.25]
    with pytest.raises(RuntimeError, match="call step"):
        s3.get_last_lr()
    s3.step()
    assert _lrs(opt3) == [0.5] and s3.get_last_lr() == [0.5]
    # OneCycle restored to -1 writes the start values (its min momentum), not iteration 0's
    o = OneCycle(opt4 := _opt(0.1), 0.01, 0.1, cycle_first_step_size=4)
    o.step()
    o.load_state_dict({"last_batch_iteration": -1})
    assert _lrs(opt4) == [0.01] and opt4.param_groups[0]["betas"] == (0.8, 0.99)


def test_onecycle_without_betas(caplog):
    opt = _opt(0.1, cls=torch.optim.SGD)
    with caplog.at_level(logging.WARNING, logger="zpp.zero"):
        o = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    assert "cycle_momentum is off" in caplog.text and o.get_mom() is None
    o.step()
    assert "betas" not in opt.param_groups[0] and _lrs(opt) == pytest.approx([0.055])


def test_short_total_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="zpp.zero"):
        WarmupDecayLR(_opt(0.1), total_num_steps=3, warmup_num_steps=5)
        WarmupCosineLR(_opt(0.1), total_num_steps=3, warmup_num_steps=5)
    assert caplog.text.count("total_num_steps=3 is less than warmup_num_steps=5") == 2


@pytest.mark.parametrize("build, words", [
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps=0"),
    (lambda o: WarmupLR(o, warmup_num_steps=2.5), "warmup_num_steps=2.5"),
    (lambda o: WarmupDecayLR(o, 10, warmup_num_steps=True), "warmup_num_steps=True"),
    (lambda o: WarmupCosineLR(o, 10, warmup_num_steps=-3), "warmup_num_steps=-3"),
    (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type='cosine'"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.1, 0.2]), "warmup_min_lr=[0.1, 0.2]"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size=0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size=0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-2), "cycle_second_step_size=-2"),
    (lambda o: OneCycle(o, 0.1, [1.0, 2.0]), "cycle_max_lr=[1.0, 2.0]"),
])
def test_errors_name_the_value(build, words):
    with pytest.raises(ValueError) as e:
        build(_opt(0.1))
    assert words in str(e.value)


# ---------------------------------------------------------------------- config and DeepSpeed's names
def test_config_accepts_every_type_and_checks_params():
    for _, _, sch in CASES:
        assert from_deepspeed({"scheduler": sch}).scheduler.params == sch["params"]
    for sch, words in [
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_max_lr": 0.1}}, ["warmup_max_lr"]),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "stair": 2}}, ["stair"]),
        ({"type": "WarmupCosineLR", "params": {}}, ["total_num_steps"]),
        ({"type": "OneCycle", "params": {"cycle_max_lr": 1}}, ["cycle_min_lr"]),
        ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": "yes"}}, ["lr_range_test_staircase='yes'"]),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": -1}}, ["cycle_max_lr=-1"]),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}},
         ["cycle_first_step_size=0"]),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "cos_min_ratio": "0.1"}}, ["cos_min_ratio='0.1'"]),
        ({"type": "StepLR", "params": {}}, ["StepLR", "lr_scheduler="]),
    ]:
        with pytest.raises(ValueError) as e:
            from_deepspeed({"scheduler": sch})
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def test_runtime_names():
    import zpp.runtime.lr_schedules as ls

    assert ls.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (ls.WARMUP_LR, ls.WARMUP_DECAY_LR, ls.WARMUP_COSINE_LR, ls.ONE_CYCLE, ls.LR_RANGE_TEST) == (
        "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
    assert ls.WarmupCosineLR is WarmupCosineLR and ls.OneCycle is OneCycle
    args, rest = ls.add_tuning_arguments(argparse.ArgumentParser()).parse_known_args(
        ["--lr_schedule", "WarmupLR", "--warmup_num_steps", "50", "--other"])
    assert rest == ["--other"] and (args.warmup_max_lr, args.cycle_second_step_size, args.warmup_type) == (
        0.001, -1, "log")
    cfg, why = ls.get_config_from_args(args)
    assert why is None and cfg == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 50, "warmup_type": "log"}}
    assert ls.get_lr_from_config(cfg) == (0.001, "")
    assert ls.get_config_from_args(argparse.Namespace(lr_schedule=None))[0] is None
