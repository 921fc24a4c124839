"""zpp tune --job's micro-batch search (zpp/tune/microbatch.py): DeepSpeed's autotuning keys,
the sizes tried, the command's argument, the metric and where the search stops."""
from __future__ import annotations

import pytest

from zpp.tune import microbatch as mb


def test_the_search_needs_an_argument_for_the_micro_batch():
    assert mb.from_autotuning({}) is None
    assert mb.from_autotuning({"arg_mappings": {"gradient_accumulation_steps": "--gas"}}) is None
    s = mb.from_autotuning({"arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}})
    assert (s.argument, s.lo, s.hi, s.count, s.max_batch) == ("--per_device_train_batch_size", 1, 1024, 3, None)


@pytest.mark.parametrize("at, message", [
    ({"arg_mappings": ["--mbs"]}, "autotuning.arg_mappings"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "mbs"}}, "must be an option"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, "min_train_micro_batch_size_per_gpu": 0},
     "min_train_micro_batch_size_per_gpu=0"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, "max_train_micro_batch_size_per_gpu": 2,
      "min_train_micro_batch_size_per_gpu": 4}, "max_train_micro_batch_size_per_gpu=2 is below"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, "num_tuning_micro_batch_sizes": True},
     "num_tuning_micro_batch_sizes=True"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, "max_train_batch_size": "8"},
     "max_train_batch_size='8'"),
])
def test_bad_keys_name_the_key_and_value(at, message):
    with pytest.raises(ValueError, match=message):
        mb.from_autotuning(at)


def test_sizes_double_within_the_bounds():
    s = mb.MicroBatchSearch(argument="--mbs", count=3)
    assert s.sizes(2, 4) == [4, 8, 16]
    assert mb.MicroBatchSearch(argument="--mbs", hi=10).sizes(2, 4) == [4, 8]
    assert mb.MicroBatchSearch(argument="--mbs", lo=12).sizes(2, 4) == [12, 24, 48]
    # at most 40 samples per optimizer step with 4 samples per unit of micro-batch: 8 (32), not 16 (64)
    assert mb.MicroBatchSearch(argument="--mbs", max_batch=40).sizes(2, 4) == [4, 8]


def test_the_argument_is_set_in_the_command():
    assert mb.with_argument(["python", "t.py", "--mbs", "2", "--x"], "--mbs", 8) == ["python", "t.py", "--mbs", "8",
                                                                                      "--x"]
    assert mb.with_argument(["python", "t.py", "--mbs=2"], "--mbs", 8) == ["python", "t.py", "--mbs=8"]
    assert mb.with_argument(["python", "t.py"], "--mbs", 8) == ["python", "t.py", "--mbs", "8"]
    assert mb.with_argument(["python", "t.py", "--mbsx", "1"], "--mbs", 8) == ["python", "t.py", "--mbsx", "1",
                                                                                "--mbs", "8"]


def _metrics(step_s, peak=1e9):
    return {"step_s": step_s, "step_times": [step_s] * 3, "world": 4, "micro_steps": 2.0, "peak_rss_bytes": peak}


def test_search_keeps_the_highest_throughput():
    # samples per second = micro-batch x 2 backward passes x 4 ranks / step: 2 -> 16 / 1.0 = 16,
    # 4 -> 32 / 1.6 = 20, 8 -> 64 / 3.6 = 17.8, 16 -> 128 / 8 = 16
    steps = {4: 1.6, 8: 3.6, 16: 8.0}
    ran = []

    def run(size):
        ran.append(size)
        return _metrics(steps[size])
    out = mb.search(run, mb.MicroBatchSearch(argument="--mbs"), mine=2, first=_metrics(1.0), memory_gb=None)
    assert ran == [4, 8, 16] and out["chosen"] == 4 and out["stopped"] is None
    assert [r["throughput"] for r in out["tried"]] == pytest.approx([16.0, 20.0, 64 / 3.6, 16.0])
    assert "micro-batch 4: 20.0 samples/s" in out["why"]


def test_search_stops_at_a_failed_run_and_over_the_memory_cap():
    def failing(size):
        return {"error": "the job exited with status 1"} if size == 8 else _metrics(1.5, peak=2e9)
    out = mb.search(failing, mb.MicroBatchSearch(argument="--mbs"), mine=2, first=_metrics(1.0), memory_gb=None)
    assert [r["micro_batch"] for r in out["tried"]] == [2, 4, 8] and out["chosen"] == 4
    assert "micro-batch 8 failed" in out["stopped"]

    def heavy(size):
        return _metrics(0.5 * size / 2, peak=size * 1e9)  # throughput grows with the size, and so does memory
    out = mb.search(heavy, mb.MicroBatchSearch(argument="--mbs"), mine=2, first=_metrics(1.0, peak=2e9),
                    memory_gb=5.0)
    # 4 fits (4 GB); 8 (8 GB) is over the cap and not chosen though faster
    assert out["chosen"] == 4 and out["tried"][-1]["over_memory"] and "over --memory-gb=5" in out["stopped"]
