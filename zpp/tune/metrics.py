"""What ``zpp tune --job`` reads off a trial run's metrics (the JSON of [Note: tune trials] in
zpp/zero/trial.py): its mean step, and the samples one unit of micro-batch makes per step."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["mean_step_s", "samples_per_micro_batch"]


def mean_step_s(m: Mapping[str, Any]) -> float:
    """A run's mean timed step (the syncs' stalls count, unlike the median's)."""
    t = m["step_times"]
    return sum(t) / len(t) if t else m["step_s"]


def samples_per_micro_batch(m: Mapping[str, Any]) -> int:
    """Samples per optimizer step for each sample of micro-batch: the backward passes per step
    times the data-parallel ranks."""
    return round(float(m.get("micro_steps", 1.0))) * int(m["world"])
