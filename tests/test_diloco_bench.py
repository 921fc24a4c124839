"""perf/diloco_bench.py's arithmetic (the run itself needs ranks and minutes: see its
docstring): the windowed loss, the target taken from DDP's last step of the same seed, the
time to reach it, and the plot of two runs side by side."""
from __future__ import annotations

import json

import pytest

from tests.perf_module import perf_module


@pytest.fixture(scope="module")
def bench():
    with perf_module("diloco_bench") as mod:
        yield mod


def _row(variant, seed, losses, step_s):
    return {"variant": variant, "seed": seed, "loss_curve": losses,
            "time_curve": [step_s * (i + 1) for i in range(len(losses))], "step_s": step_s,
            "inter_bytes": 1.0, "bytes_source": "counters"}


def test_windowed(bench):
    assert bench.windowed([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert bench.windowed([1.0, 2.0, 3.0], 5) == [1.0, 1.5, 2.0]


def test_summarize_time_to_target(bench, capsys):
    ddp = _row("ddp", 0, [5.0, 4.0, 3.0, 2.0], 1.0)          # target: mean(3, 2) = 2.5, reached at step 4
    fast = _row("diloco", 0, [5.0, 3.0, 2.0, 1.0], 0.1)       # windowed 5, 4, 2.5, 1.5: step 3, 0.3 s
    never = _row("onebitadam", 0, [5.0, 5.0, 5.0, 5.0], 0.5)
    other_seed = _row("ddp", 1, [9.0, 9.0], 1.0)
    ddp["eth_tx_bytes_per_node"], fast["eth_tx_bytes_per_node"] = [900.0, 1000.0], [20.0, 10.0]
    rows = [fast, never, ddp, other_seed]  # DDP after the others, as a --variants order may put it
    bench.summarize(rows, window=2)
    assert fast["eth_over_ddp"] == pytest.approx(20.0 / 1000.0) and "eth_over_ddp" not in never
    assert ddp["target_loss"] == 2.5 and ddp["time_to_target_s"] == 4.0 and ddp["steps_to_target"] == 4
    assert fast["steps_to_target"] == 3 and fast["time_to_target_s"] == pytest.approx(0.3)
    assert fast["ddp_over_this"] == pytest.approx(4.0 / 0.3) and fast["final_over_ddp"] == pytest.approx(1.5 / 2.5)
    assert never["time_to_target_s"] is None and "ddp_over_this" not in never
    assert other_seed["target_loss"] == 9.0  # its own seed's DDP
    bench.print_rows(rows)
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:5] == ["diloco", "0", "0.100", "1", "20"]  # eth: the busiest node
    assert out[2].split()[4] == "-"  # no link counters outside zpp cluster


def test_plot_side_by_side(bench, tmp_path):
    rows = [_row("ddp", 0, [5.0, 4.0, 3.0], 1.0), _row("diloco", 0, [5.0, 3.0, 2.0], 0.1)]
    bench.summarize(rows, window=1)
    runs = []
    for label in ("100mbit", "10mbit"):
        p = tmp_path / f"{label}.json"
        p.write_text(json.dumps({"args": {"window": 1, "label": label}, "rows": rows}))
        runs.append(str(p))
    png = tmp_path / "both.png"
    bench.main(["--plot", *runs, "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_targets_from_an_earlier_run(bench, tmp_path):
    earlier = {"rows": [_row("ddp", 0, [5.0, 4.0, 3.0, 2.0], 1.0), _row("diloco", 0, [5.0, 1.0, 1.0, 1.0], 0.1),
                        _row("ddp", 1, [9.0, 8.0], 1.0)]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    refs = bench.with_targets_from(str(path), [0])
    assert [(r["variant"], r["seed"], r["from"]) for r in refs] == [("ddp", 0, str(path))]
    longer = _row("zero3-zeropp", 0, [5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0], 0.5)  # more steps than DDP's 4
    rows = refs + [longer]
    bench.summarize(rows, window=2)
    assert longer["target_loss"] == 2.5 and longer["steps_to_target"] == 7  # windowed 2.25 at step 7
    assert longer["ddp_over_this"] == pytest.approx(4.0 / 3.5)
    with pytest.raises(ValueError, match=r"no DDP row for seed\(s\) \[2\]"):
        bench.with_targets_from(str(path), [0, 2])
    # another data order's run is not the target: its DDP row must be of the same order
    with pytest.raises(ValueError, match=r"no DDP row for seed\(s\) \[0\]"):
        bench.with_targets_from(str(path), [0], data_order=1)
    with pytest.raises(SystemExit):
        bench.main(["--variants", "ddp,diloco", "--target-from", str(path)])


def test_every_variant_gets_its_own_config(bench):
    """Each zpp variant's config says what its name says (a misplaced branch once ran
    zero3-zeropp as the hierarchical mode)."""
    args = bench.parser().parse_args([])
    zero = {n: bench.engine_config(n, args, 2) for n in bench.VARIANTS + bench.EXTRA_VARIANTS if n != "ddp"}
    for name, cfg in zero.items():
        z, zpp = cfg["zero_optimization"], cfg["zpp"]
        assert ("outer" in zpp) == (name == "diloco"), name
        if name.startswith("zero3"):
            assert z["stage"] == 3, name
            assert z.get("zero_quantized_weights", False) == ("zeropp" in name or "qwz" in name), name
            assert z.get("zero_quantized_gradients", False) == ("zeropp" in name or "qgz" in name), name
            assert z.get("zero_hpz_partition_size", 1) == (2 if "zeropp" in name else 1), name
    assert zero["zero3-zeropp"]["zpp"] == {"check_metadata": False}  # the engine's defaults
    assert zero["zero3-zeropp-gg2048"]["zpp"]["gradient_group_size"] == 2048
    assert zero["zero3-qgz-gg128"]["zpp"]["gradient_group_size"] == 128
    assert zero["zero3-zeropp-w4-g128"]["zpp"] == {"check_metadata": False, "weight_bits": 4, "weight_group_size": 128}
    assert zero["zero3-zeropp-delta4"]["zpp"] == {"check_metadata": False, "weight_delta_bits": 4}
    assert zero["onebitadam"]["zero_optimization"] == {"stage": 0}
    with pytest.raises(ValueError, match="'ddp'"):
        bench.engine_config("ddp", args, 2)


def test_data_order_draws_other_batches_from_the_same_seed(bench):
    # order 0 is every earlier run's stream (1000 * seed + rank); other orders are new streams
    # that collide with no seed's and rank's
    assert bench.data_seed(3, 1) == bench.data_seed(3, 1, 0) == 3001
    seeds = {bench.data_seed(s, r, o) for s in range(1, 6) for r in range(8) for o in range(3)}
    assert len(seeds) == 5 * 8 * 3
    with pytest.raises(ValueError, match="--data-order -1"):
        bench.data_seed(1, 0, -1)
    args = bench.parser().parse_args(["--data-order", "2"])
    assert args.data_order == 2 and bench.parser().parse_args([]).data_order == 0


def test_the_held_out_loss_is_of_text_never_trained_on(bench):
    import argparse

    import torch

    train, held = bench.corpora()
    assert len(train.data) == bench.TRAIN_BYTES and 0 < len(held.data) <= bench.HELD_OUT_BYTES
    # the held-out bytes are the ones after the training bytes in the same walk
    from tests.gpt import CharCorpus

    longer = CharCorpus(max_bytes=bench.TRAIN_BYTES + bench.HELD_OUT_BYTES)
    assert torch.equal(longer.data[:bench.TRAIN_BYTES], train.data)
    assert torch.equal(longer.data[bench.TRAIN_BYTES:], held.data)
    args = argparse.Namespace(batch=2, block=8, eval_batches=3)
    seen = []

    def net(x, y):  # records what it is asked; the "loss" is the mean target byte
        seen.append(x.clone())
        return y.float().mean()
    first = bench.evaluate(net, held, args)
    again = bench.evaluate(net, held, args)
    assert first == again and len(seen) == 6 and all(torch.equal(a, b) for a, b in zip(seen[:3], seen[3:]))
    g = torch.Generator().manual_seed(bench.EVAL_SEED)
    expect = sum(float(held.batch(2, 8, g)[1].float().mean()) for _ in range(3)) / 3
    assert first == expect


def test_study_table_has_both_ratios(tmp_path):
    """perf/diloco_study.py --table: one line per run beside its DDP, the held-out ratio where
    the run took it, '> steps' where it never reached DDP's loss."""
    with perf_module("diloco_study") as study:
        ddp = {"variant": "ddp", "size": "4x64", "seed": 1, "params": 212352, "final_loss": 2.5, "inter_bytes": 4000.0}
        held = {"variant": "diloco", "size": "4x64", "seed": 1, "params": 212352, "setting": "defaults", "steps": 600,
                "final_over_ddp": 1.0156, "eval_over_ddp": 1.0114, "steps_to_target": 432, "inter_bytes": 100.0,
                "at_10mbit": {"ddp_over_this": 24.5}}
        old = {**held, "setting": "old", "steps_to_target": None, "at_10mbit": {}}
        del old["eval_over_ddp"]
        path = tmp_path / "s.json"
        path.write_text(json.dumps({"rows": [ddp, held, old]}))
        lines = study.table([str(path)]).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 10
    assert lines[2] == "| 4x64 (212,352) | 1 | defaults | 2.5000 | 1.0156 | 1.0114 | 432 | 1/40 | 24 |"
    assert lines[3] == "| 4x64 (212,352) | 1 | old | 2.5000 | 1.0156 | - | > 600 | 1/40 | - |"


def test_study_plot(tmp_path):
    """perf/diloco_study.py --table JSON --png PNG: the runs' ratios and 10 Mbit speed-ups
    drawn into a PNG; --png alone is refused (there is nothing to plot)."""
    with perf_module("diloco_study") as study:
        ddp = {"variant": "ddp", "size": "4x64", "seed": 1, "params": 212352, "final_loss": 2.5, "inter_bytes": 4000.0}
        run = {"variant": "diloco", "size": "4x64", "seed": 1, "params": 212352, "setting": "defaults", "steps": 600,
               "final_over_ddp": 1.0156, "eval_over_ddp": 1.0114, "steps_to_target": 432, "inter_bytes": 100.0,
               "at_10mbit": {"ddp_over_this": 24.5}, "outer": {"sync_every": 5}}
        path, png = tmp_path / "s.json", tmp_path / "s.png"
        path.write_text(json.dumps({"args": {"world": 2, "ranks_per_node": 1, "batch": 8}, "rows": [ddp, run]}))
        study.main(["--table", str(path), "--png", str(png)])
        with pytest.raises(SystemExit):
            study.main(["--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
