"""DeepSpeed's ``deepspeed.runtime.lr_schedules`` names that scripts import: the five schedules
(:mod:`zpp.zero.schedulers`, :mod:`zpp.zero.onecycle`), the schedule and parameter-name
constants, and the command-line helpers: :func:`add_tuning_arguments` (DeepSpeed's flags and
defaults), :func:`parse_arguments`, :func:`get_config_from_args` (a "scheduler" section from
those flags) and :func:`get_lr_from_config`.
"""
from __future__ import annotations

import argparse
from typing import Any

from zpp.zero.schedule_base import set_lrs as update_lr, torch_optimizer as get_torch_optimizer
from zpp.zero.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "add_tuning_arguments", "get_config_from_args", "get_lr_from_config", "get_torch_optimizer",
           "parse_arguments", "update_lr", *[n for n in dir() if n.isupper() and not n.startswith("_")]]

# DeepSpeed's flags: name, type (bool: a store_true switch), default, what it sets.
_FLAGS = (
    (LR_SCHEDULE, str, None, "the schedule, one of " + ", ".join(VALID_LR_SCHEDULES)),
    (LR_RANGE_TEST_MIN_LR, float, 0.001, "LRRangeTest: first lr"),
    (LR_RANGE_TEST_STEP_RATE, float, 1.0, "LRRangeTest: lr increase per step size"),
    (LR_RANGE_TEST_STEP_SIZE, int, 1000, "LRRangeTest: steps per increase"),
    (LR_RANGE_TEST_STAIRCASE, bool, False, "LRRangeTest: increase in stairs"),
    (CYCLE_FIRST_STEP_SIZE, int, 1000, "OneCycle: steps of the rising half"),
    (CYCLE_FIRST_STAIR_COUNT, int, -1, "OneCycle: stairs of the rising half"),
    (CYCLE_SECOND_STEP_SIZE, int, -1, "OneCycle: steps of the falling half"),
    (CYCLE_SECOND_STAIR_COUNT, int, -1, "OneCycle: stairs of the falling half"),
    (DECAY_STEP_SIZE, int, 1000, "OneCycle: steps per decay interval after the cycle"),
    (CYCLE_MIN_LR, float, 0.01, "OneCycle: lowest lr"),
    (CYCLE_MAX_LR, float, 0.1, "OneCycle: highest lr"),
    (DECAY_LR_RATE, float, 0.0, "OneCycle: lr decay rate after the cycle"),
    ("cycle_momentum", bool, False, "OneCycle: cycle the momentum too"),
    (CYCLE_MIN_MOM, float, 0.8, "OneCycle: lowest momentum"),
    (CYCLE_MAX_MOM, float, 0.9, "OneCycle: highest momentum"),
    (DECAY_MOM_RATE, float, 0.0, "OneCycle: momentum decay rate after the cycle"),
    (WARMUP_MIN_LR, float, 0, "WarmupLR: first lr"),
    (WARMUP_MAX_LR, float, 0.001, "WarmupLR: lr after the warm-up"),
    (WARMUP_NUM_STEPS, int, 1000, "WarmupLR: warm-up steps"),
    (WARMUP_TYPE, str, WARMUP_LOG_RATE, "WarmupLR: warm-up curve, log or linear"),
    (WARMUP_MIN_RATIO, float, 0.01, "WarmupCosineLR: first lr as a fraction of the optimizer's"),
    (COS_MIN_RATIO, float, 0.01, "WarmupCosineLR: last lr as a fraction of the optimizer's"),
)
# The flags get_config_from_args copies into each schedule's params (as DeepSpeed does).
_WARMUP_FLAGS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)
_PARAMS_FROM_FLAGS = {
    LR_RANGE_TEST: (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE),
    ONE_CYCLE: (CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
                DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM,
                DECAY_MOM_RATE),
    WARMUP_COSINE_LR: (WARMUP_NUM_STEPS, WARMUP_TYPE, WARMUP_MIN_RATIO, COS_MIN_RATIO),
    WARMUP_LR: _WARMUP_FLAGS, WARMUP_DECAY_LR: _WARMUP_FLAGS,
}


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's schedule flags (``--lr_schedule``, ``--warmup_num_steps``...) to
    ``parser``, in a group "Convergence Tuning", with DeepSpeed's defaults."""
    group = parser.add_argument_group("Convergence Tuning", "learning-rate schedule settings")
    for name, kind, default, what in _FLAGS:
        if kind is bool:
            group.add_argument(f"--{name}", default=default, action="store_true", help=what)
        else:
            group.add_argument(f"--{name}", type=kind, default=default, help=what)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The schedule flags of ``sys.argv`` and the arguments that are not."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def get_config_from_args(args: Any) -> tuple[dict | None, str | None]:
    """A "scheduler" section (``{"type", "params"}``) from the flags, and None; or None and
    why not."""
    kind = getattr(args, LR_SCHEDULE, None)
    if kind is None:
        return None, f"--{LR_SCHEDULE} is not on the command line"
    if kind not in VALID_LR_SCHEDULES:
        return None, f"--{LR_SCHEDULE}={kind} is not one of {VALID_LR_SCHEDULES}"
    params = {n: getattr(args, n) for n in _PARAMS_FROM_FLAGS[kind] if getattr(args, n, None) is not None}
    return {"type": kind, "params": params}, None


def get_lr_from_config(config: dict) -> tuple[Any, str]:
    """The lr a "scheduler" section names (its maximum; LRRangeTest's first) and "", or None
    and why not (WarmupCosineLR names a ratio, not an lr)."""
    if "type" not in config:
        return None, "the scheduler section has no type"
    if "params" not in config:
        return None, "the scheduler section has no params"
    kind, params = config["type"], config["params"]
    if kind not in VALID_LR_SCHEDULES:
        return None, f"scheduler type {kind} is not one of {VALID_LR_SCHEDULES}"
    if kind == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer's lr by a ratio; its params name no lr"
    name = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(kind, WARMUP_MAX_LR)
    return params[name], ""
