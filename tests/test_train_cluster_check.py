"""perf/train_cluster.py's issue-25 checks on synthetic rows: the weight-delta rows are judged
by their own unshaped step and by plain ZeRO++'s, and a miss says MISS."""
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parent.parent / "perf"
sys.path.insert(0, str(PERF))

import train_cluster  # noqa: E402


def _lines(slow_steps, unshaped_steps, rate_bits=1e8):
    rows = {k: {"step_s": v} for k, v in slow_steps.items()}
    unshaped = {k: {"step_s": v} for k, v in unshaped_steps.items()}
    util = train_cluster.utilization(rows, unshaped)
    return train_cluster.check(rows, slow=True, util=util, rate_bits=rate_bits, unshaped=unshaped)


def test_weight_delta_rows_are_judged_against_both_unshaped_steps():
    lines = _lines({"zero3-zeropp": 2.36, "zero3-zeropp-delta4": 1.90},
                   {"zero3-zeropp": 1.65, "zero3-zeropp-delta4": 1.77})
    assert "ZeRO++ compute utilization: 0.70 (target >= 0.8) MISS" in lines
    assert "ZeRO++ with weight deltas compute utilization: 0.93 (target >= 0.8) ok" in lines
    assert "ZeRO++ with weight deltas: ZeRO++'s unshaped step / its step: 0.87 (target >= 0.8) ok" in lines
    # a delta row that is fast only against its own slow unshaped step misses the stricter measure
    lines = _lines({"zero3-zeropp": 2.36, "zero3-zeropp-delta4": 2.20},
                   {"zero3-zeropp": 1.50, "zero3-zeropp-delta4": 2.00})
    assert "ZeRO++ with weight deltas compute utilization: 0.91 (target >= 0.8) ok" in lines
    assert "ZeRO++ with weight deltas: ZeRO++'s unshaped step / its step: 0.68 (target >= 0.8) MISS" in lines
    # at 1 Gbit the 100 Mbit bars are not judged
    assert not any("weight deltas" in line for line in _lines({"zero3-zeropp-delta4": 1.7},
                                                              {"zero3-zeropp-delta4": 1.6}, rate_bits=1e9))
