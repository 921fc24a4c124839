"""``zpp tune --job`` (zpp/tune/job.py) and its trial runs (zpp/zero/trial.py): a user's
training script, unchanged, tuned on 4 local ranks as 2 nodes x 2; the tuned config runs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zpp.bench.launch import free_port
from zpp.tune import cost, job
from zpp.zero.trial import apply

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import argparse, sys, torch
    sys.path.insert(0, {root!r})
    import zpp
    from tests.gpt import GPT, GPTConfig, CharCorpus

    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--loss-log", default=None)
    p.add_argument("--mbs", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32))
    engine, *_ = zpp.initialize(args=args, model=model, model_parameters=model.parameters())
    # the micro-batch the script uses is the config's (zpp tune sets both)
    assert args.mbs == engine.train_micro_batch_size_per_gpu(), (args.mbs, engine.train_micro_batch_size_per_gpu())
    data = CharCorpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(engine.world.rank)
    for _ in range(args.steps):
        x, y = data.batch(args.mbs, 32, g)
        loss = engine(x, y)
        if args.loss_log:  # this rank's loss per step, one file per run of zpp tune
            import os
            run = os.path.basename(os.environ.get("ZPP_TUNE_TRIAL", "job"))
            with open(os.path.join(args.loss_log, f"{{run}}.rank{{engine.job_world.rank}}"), "a") as f:
                f.write(repr(loss.item()) + "\\n")
        engine.backward(loss)
        engine.step()
    if engine.world.rank == 0:
        print("DONE stage", engine.train_config.zero.stage, "loss", round(loss.item(), 4))
""")


def test_apply_replaces_sections_and_merges_zpp():
    job_cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "overlap_comm": True},
               "zpp": {"timeout_s": 60}, "optimizer": {"type": "Adam"}}
    out = apply(job_cfg, {"overrides": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                                         "zpp": {"weight_bits": 4}}})
    # the mode's switches replace the job's; the job's other keys stay
    assert out["zero_optimization"] == {"stage": 3, "zero_quantized_weights": True, "overlap_comm": True}
    assert out["zpp"] == {"timeout_s": 60, "weight_bits": 4}
    assert out["optimizer"] == {"type": "Adam"} and job_cfg["zero_optimization"]["stage"] == 2  # a copy


def test_links_from_probe_by_hand():
    # 2 nodes x 2: the world probe puts (W - 1) x 1 MiB on each node's link (the ring), the intra
    # probe (R - 1) x 1 MiB on each rank's
    m = {"world": 4, "ranks_per_node": 2, "nodes": 2, "probe_bytes": 1 << 20, "probe_world_s": 0.5,
         "probe_intra_s": 0.01}
    intra, inter = job.links_from_probe(m)
    assert inter.bandwidth == pytest.approx(3 * (1 << 20) * cost.WIRE_OVERHEAD / 0.5) and inter.shared
    assert intra.bandwidth == pytest.approx((1 << 20) / 0.01) and not intra.shared


def test_loss_race_rules_by_hand():
    assert job.loss_window(50) == 10 and job.loss_window(400) == 20 and job.loss_window(3) == 1
    curve = [3.0, 2.0, 2.5, 1.0, 1.5]
    assert job.steps_to(curve, 2.25, 2) == 3   # (2.0 + 2.5) / 2 = 2.25 at step 3; (3 + 2) / 2 = 2.5 above
    assert job.steps_to(curve, 1.0, 2) is None  # the lowest window is (1.0 + 1.5) / 2
    assert job.steps_to([3.0, None, 1.0, 1.0], 1.0, 2) == 4  # a window with a missing loss does not count
    assert job.mean_step_s({"step_times": [1.0, 3.0], "step_s": 1.0}) == 2.0


def test_outer_period_by_hand():
    from zpp.tune.outer import period
    # delay = ceil(1.25 t / s) = ceil(1.25 x 0.3 / 0.1) = 4; H = max(ceil(1.25 x 4 x 3), 5, min) = 15
    assert period(0.1, 0.3, 4) == (4, 15)
    assert period(1.0, 0.01, 4) == (1, 2)        # a fast link: delay 1, H = delay + 1
    assert period(1.0, 0.01, 4, min_sync_every=5) == (1, 5)
    with pytest.raises(ValueError, match="step_s"):
        period(0.0, 0.3, 4)


def test_outer_times_by_hand():
    import dataclasses
    # 2 nodes x 1 rank, one unit of 8000 elements, 4 fragments in fp32: a fragment is 2000
    # elements; its all-reduce over 2 nodes sends 8000 bytes on the node link in 2 ring steps
    m = dataclasses.replace(cost.MODES["outer-int4"], outer=cost.OuterSpec(10, 4, "none", 1))
    c = cost.Cluster(2, 1, cost.LINKS["loopback"], cost.Link("x", 1e6, 1e-3, True))
    inner, sync = cost.outer_times(m, [cost.UnitShape(8000)], c, cost.Profile(1.0))
    assert inner == pytest.approx(1.0)  # one rank per node: nothing to reduce inside it
    assert sync == pytest.approx(2 * 1e-3 + 8000 * cost.WIRE_OVERHEAD / 1e6)
    with pytest.raises(ValueError, match="zero2"):
        cost.outer_times(cost.MODES["zero2"], [cost.UnitShape(8000)], c, cost.Profile(1.0))


def _profile(step_s=2.0):
    """A ZeRO-3 profile of 2 nodes x 2: 4 blocks of 250k elements, a 1 MB/s link between nodes."""
    return {"world": 4, "ranks_per_node": 2, "nodes": 2, "probe_bytes": 1 << 20,
            "probe_world_s": 3 * (1 << 20) * cost.WIRE_OVERHEAD / 1e6, "probe_intra_s": (1 << 20) / 1e9,
            "units": [[250_000, False]] * 4, "gather_trace": [[i, "forward"] for i in range(4)]
            + [[i, "backward"] for i in reversed(range(4))], "step_s": step_s, "step_times": [step_s] * 3,
            "inter_bytes": 0.0, "peak_rss_bytes": 1e9, "overrides": {}}


class _FakeJob:
    """Runs nothing: each mode's step time and loss curve as given (the curve cut at the last
    step); with a budget the last step as the trial decides it, after 5 timed steps (2
    untimed) at ``first_s`` (default: the step time)."""

    def __init__(self, step_s: dict, curves: dict, first_s: dict | None = None):
        self.step_s, self.curves, self.first_s, self.calls = step_s, curves, first_s or {}, []

    def __call__(self, mode, *, end=4, tag="", budget=None, micro_batch=None):
        self.calls.append((mode, end, tag, budget))
        s = self.step_s[mode.name]
        first = self.first_s.get(mode.name, s)
        if budget is not None:
            end = min(budget[1], max(end, math.ceil(budget[0] / first)))
        times = [first] * 5 + [s] * (end - 7)
        return {"step_s": s, "step_times": times[:end - 2], "inter_bytes": 0.0, "peak_rss_bytes": 1e9, "end": end,
                "loss_curve": [self.curves[mode.name](k) for k in range(1, end + 1)]}


@pytest.mark.parametrize("outer_slope, first_s, outer_wins, steps", [
    (0.012, 0.5, True, 100), (0.002, 0.5, False, 100), (0.002, 3.0, False, 50)])
def test_choose_races_the_hierarchical_mode_by_time_to_the_target(outer_slope, first_s, outer_wins, steps):
    # zero2 is the fastest ZeRO mode measured (2 s a step); its loss falls 0.01 a step; the
    # target after 50 steps is the mean of its last 10 losses, 3 - 0.01 x 45.5 = 2.545, reached at
    # step 50: 100 s. The hierarchical run steps in 0.5 s, so the budget of 110 s holds 220 steps:
    # it runs 2N = 100. Losing 0.012 a step its window mean 3 - 0.012 (k - 4.5) is at the target
    # from k = 43 (21.5 s); at 0.002 a step never. With its first steps at 3 s the trial stops at
    # max(N, ceil(110 / 3)) = 50 steps, which then took less than 100 s: a race cut short.
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0, "outer-int4": 0.5},
                      {"zero2": lambda k: 3.0 - 0.01 * k, "outer-int4": lambda k: 3.0 - outer_slope * k},
                      {"outer-int4": first_s})
    rep = job.choose(_profile(12.0), ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None,
                     loss_steps=50)
    rows = {r["mode"]: r for r in rep["candidates"]}
    assert rep["race"]["target_loss"] == pytest.approx(2.545) and rep["race"]["window"] == 10
    ref, out = rows["zero2"], rows["outer-int4"]
    assert (ref["steps_to_target"], ref["time_to_target_s"]) == (50, pytest.approx(100.0))
    # the hierarchical run: at least N steps, at most 2N, in 1.1x the reference's time to the target
    assert [(m.name, end, tag, budget) for m, end, tag, budget in runner.calls] == [
        ("zero2", 4, "", None), ("zero2", 50, "-loss", None), ("outer-int4", 50, "", (pytest.approx(110.0), 100))]
    assert out["race_steps"] == steps == len(out["loss_curve"])
    # its H and delay: the period rule on the cost model's times for the measured links (an
    # inner step of 11.23 s hides a 0.13 s fragment sync in one step: delay 1, H the floor of 5)
    assert out["pred_inner_step_s"] == pytest.approx(11.2276, rel=1e-4)
    # (0.13213 s while a quantized all-gather sent its codes and scales as two calls: one latency more)
    assert out["pred_sync_s"] == pytest.approx(0.132084, rel=1e-4)
    assert (out["outer"]["delay"], out["outer"]["sync_every"]) == (1, 5) and "sync_every_capped" not in out
    if outer_wins:
        assert (out["steps_to_target"], out["time_to_target_s"]) == (43, pytest.approx(21.5))
        assert not out["race_short"]
        assert rep["winner"] == "outer-int4" and rep["winner_sections"]["zpp"]["outer"] == out["outer"]
        assert rep["winner_sections"]["zero_optimization"] == {"stage": 2}
        assert "outer-int4 wins" in rep["why"]
    else:
        assert out["steps_to_target"] is None and out["time_to_target_s"] is None
        assert rep["winner"] == "zero2" and "zpp" not in rep["winner_sections"]
        assert f"outer-int4 not in its {steps} steps" in rep["why"]
        # 50 steps: 5 x 3 s + 43 x 0.5 s timed = 0.760 s a step, 38.0 s in all against the reference's 100
        assert out["race_short"] == (steps == 50)
        assert ("(38.0 s: the race was cut short by its first steps' time)" in rep["why"]) == (steps == 50)
    assert "race_steps" in job.format_report(rep)


def test_choose_gives_a_tie_to_the_zero_mode():
    # the hierarchical run learns as the reference does (0.01 a step) in 1.9 s steps: the target
    # at step 50, 95 s against zero2's 100 s: sooner, but not 1.1x sooner, so zero2 stays the
    # winner (its steps are the job's optimizer on the averaged gradient); at 1.8 s (90 s) it wins
    for step_s, wins in ((1.9, False), (1.8, True)):
        runner = _FakeJob({"zero2": 2.0, "zero3": 3.0, "outer-int4": step_s},
                          {"zero2": lambda k: 3.0 - 0.01 * k, "outer-int4": lambda k: 3.0 - 0.01 * k})
        rep = job.choose(_profile(12.0), ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None,
                         loss_steps=50)
        out = {r["mode"]: r for r in rep["candidates"]}["outer-int4"]
        assert out["time_to_target_s"] == pytest.approx(50 * step_s)
        assert rep["winner"] == ("outer-int4" if wins else "zero2"), rep["why"]
        assert ("a tie: outer-int4 is not 1.1x sooner" in rep["why"]) == (not wins)
        assert ("zpp" in rep["winner_sections"]) == wins


def test_choose_takes_the_compute_from_the_profiles_link_waits():
    # the profile's mean step (3 x 12 s) less the 11.5 s a step its ranks waited on the link:
    # 0.5 s of compute, not what the time rule's inversion of a link-bound step would leave
    prof = {**_profile(12.0), "link_wait_s": 11.5, "link_waits": {"reduce": 11.5}}
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0}, {"zero2": lambda k: 3.0, "zero3": lambda k: 3.0})
    rep = job.choose(prof, ["zero2", "zero3"], runner, confirm=2, memory_gb=None)
    assert rep["compute_s"] == pytest.approx(0.5) and rep["compute_source"] == "step less its link waits"
    rep = job.choose(_profile(12.0), ["zero2", "zero3"], runner, confirm=2, memory_gb=None)
    assert rep["compute_source"] == "the cost model's step inverted" and rep["compute_s"] > 5


class _WaitingJob(_FakeJob):
    """As _FakeJob, its runs' training threads waiting ``meta_s`` seconds a step in metadata checks."""

    def __init__(self, step_s, meta_s):
        super().__init__(step_s, {n: (lambda k: 3.0) for n in step_s})
        self.meta_s = meta_s

    def __call__(self, mode, **kw):
        return {**super().__call__(mode, **kw), "link_waits": {"metadata": self.meta_s[mode.name]}}


def test_the_report_advises_the_metadata_check_off_where_the_winner_waited_in_it():
    # zero2 wins at 2 s a step; its thread waited 0.2 s in metadata checks (10%): advised, with
    # both numbers; at 0.05 s (2.5%) not. The tuned sections keep the job's setting either way.
    prof = {**_profile(3.0), "link_wait_s": 1.0, "link_waits": {"reduce": 0.6, "metadata": 0.4}}
    for meta, advised in ((0.2, True), (0.05, False)):
        rep = job.choose(prof, ["zero2", "zero3"], _WaitingJob({"zero2": 2.0}, {"zero2": meta}), confirm=2,
                         memory_gb=None)
        rows = {r["mode"]: r for r in rep["candidates"]}
        assert rep["winner"] == "zero2" and rows["zero2"]["measured_metadata_s"] == meta
        assert rows["zero3"]["measured_metadata_s"] == 0.4  # the profile's own
        text = job.format_report(rep)
        assert (f"waited {meta:.3f} s of its 2.000 s step in the per-call metadata check" in text) is advised, text
        assert "check_metadata" not in json.dumps(rep["winner_sections"])


def test_choose_skips_the_race_on_one_node():
    prof = {**_profile(3.0), "world": 2, "nodes": 1, "probe_world_s": 0.0}
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0}, {"zero2": lambda k: 3.0 - 0.01 * k})
    rep = job.choose(prof, ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None, loss_steps=20)
    rows = {r["mode"]: r for r in rep["candidates"]}
    assert "one node" in rows["outer-int4"]["skipped"] and rep["winner"] == "zero2"
    # zero2 confirmed (zero3 is the profile), and no reference run for a race that cannot be
    assert [(m.name, tag) for m, _, tag, _ in runner.calls] == [("zero2", "")]
    assert "no loss race: one node" in rep["why"]
    # no hierarchical candidate named: no race either
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0}, {"zero2": lambda k: 3.0 - 0.01 * k})
    rep = job.choose(_profile(3.0), ["zero2", "zero3"], runner, confirm=2, memory_gb=None, loss_steps=20)
    assert [(m.name, tag) for m, _, tag, _ in runner.calls] == [("zero2", "")]
    assert "no hierarchical candidate" in rep["why"]


def test_choose_caps_the_period_at_half_the_race():
    # a 3 s profiled step of 2 nodes x 2 is all communication by the cost model (compute 0): the
    # inner step is its 4.5 ms inside the node and the period rule asks H = 147 for the 0.13 s
    # syncs; a race of 50 steps gives it H = 25 (every fragment syncs twice) and says so
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0, "outer-int4": 0.5},
                      {"zero2": lambda k: 3.0 - 0.01 * k, "outer-int4": lambda k: 3.0 - 0.01 * k})
    rep = job.choose(_profile(3.0), ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None,
                     loss_steps=50)
    out = {r["mode"]: r for r in rep["candidates"]}["outer-int4"]
    assert rep["compute_s"] == 0.0 and out["pred_inner_step_s"] == pytest.approx(4.5e-3, rel=1e-3)
    assert (out["outer"]["delay"], out["outer"]["sync_every"]) == (24, 25) and "H=25" in out["sync_every_capped"]
    # one rank a node: no inner communication either, an inner step of 0 s: H = N // 2 too
    one = {**_profile(3.0), "world": 2, "ranks_per_node": 1, "probe_intra_s": 0.0,
           "probe_world_s": (1 << 20) * cost.WIRE_OVERHEAD / 1e6}
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0, "outer-int4": 0.5},
                      {"zero2": lambda k: 3.0 - 0.01 * k, "outer-int4": lambda k: 3.0 - 0.01 * k})
    rep = job.choose(one, ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None, loss_steps=40)
    out = {r["mode"]: r for r in rep["candidates"]}["outer-int4"]
    assert out["pred_inner_step_s"] == 0.0 and (out["outer"]["delay"], out["outer"]["sync_every"]) == (19, 20)
    assert "race_steps" in out


@pytest.mark.parametrize("last, message", [(math.inf, "diverged"), (None, "gave no loss for its last 10 steps")])
def test_choose_reports_a_reference_without_a_target(last, message):
    runner = _FakeJob({"zero2": 2.0, "zero3": 3.0, "outer-int4": 0.5},
                      {"zero2": lambda k: last if k == 50 else 3.0 - 0.01 * k, "outer-int4": lambda k: 3.0})
    rep = job.choose(_profile(12.0), ["zero2", "zero3", "outer-int4"], runner, confirm=2, memory_gb=None,
                     loss_steps=50)
    assert message in rep["race"]["error"] and rep["winner"] == "zero2"
    assert [tag for _, _, tag, _ in runner.calls] == ["", "-loss"]  # the hierarchical mode was not run


def test_loss_candidates_need_loss_steps(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--job", "--candidates", "zero2,outer-int4", "--",
                        "python", "x.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'outer-int4' changes what a step learns" in r.stderr and "--loss-steps" in r.stderr
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--job", "--loss-steps", "-3", "--", "python", "x.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--loss-steps=-3" in r.stderr
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--job", "--loss-steps", "20", "--candidates",
                        "outer-int4", "--", "python", "x.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs a ZeRO mode to race against" in r.stderr


def _job(tmp_path, zero: dict, autotuning: dict) -> tuple[Path, Path]:
    """SCRIPT as the job's train.py and its DeepSpeed config (AdamW, micro-batch 2)."""
    script, ds = tmp_path / "train.py", tmp_path / "ds.json"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3}}, "zero_optimization": zero, "autotuning": autotuning}))
    return script, ds


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_job_end_to_end(tmp_path):
    script, ds = _job(tmp_path, {"stage": 1, "stage3_param_persistence_threshold": 0},
                      {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "tuner_num_trials": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "zpp", "tune", "--job", "--config", str(ds), "--candidates",
           "zero2,zero3,zero3-zeropp", "--job-timeout", "240", "--",
           sys.executable, str(script), "--deepspeed_config", str(ds)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / job.DEFAULT_REPORT).read_text())
    tuned = json.loads((tmp_path / job.DEFAULT_OUT).read_text())
    assert rep["nodes"] == 2 and rep["ranks_per_node"] == 2
    rows = {c["mode"]: c for c in rep["candidates"]}
    assert set(rows) == {"zero2", "zero3", "zero3-zeropp"}
    ran = [c for c in rows.values() if "measured_step_s" in c]
    # the profile (ZeRO-3) and the two best predicted ran; the winner is the fastest of them
    assert rep["profile"]["step_s"] == rows["zero3"]["measured_step_s"]
    assert rep["profile"]["overrides"] == {"zero_optimization": {"stage": 3}}
    assert 2 <= len(ran) <= 3
    assert rep["winner"] == min(ran, key=lambda c: c["measured_step_s"])["mode"]
    for c in ran:  # bytes: the cost model on the profile's units is exact
        assert c["measured_inter_bytes"] == c["pred_inter_bytes"], c
    assert rows["zero3-zeropp"]["pred_inter_bytes"] < rows["zero3"]["pred_inter_bytes"] / 4
    # the tuned config is the job's, with the winner's sections, and the job runs on it unchanged
    want = cost.MODES[rep["winner"]].config(2)["zero_optimization"]
    assert tuned["zero_optimization"] == {**want, "stage3_param_persistence_threshold": 0}
    assert tuned["optimizer"]["type"] == "AdamW" and "autotuning" not in tuned
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                          f"--master-port={free_port()}", str(script), "--deepspeed_config",
                          str(tmp_path / job.DEFAULT_OUT), "--steps", "3"], cwd=tmp_path,
                         env={**env, "ZPP_RANKS_PER_NODE": "2"}, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"DONE stage {want['stage']}" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_job_searches_the_micro_batch_through_arg_mappings(tmp_path):
    # DeepSpeed's autotuning keys: the script's --mbs carries train_micro_batch_size_per_gpu; the
    # winner runs at 2 (the job's), 4 and 8 (max 8); the script checks that its argument and the
    # engine's config agree at every size, and the tuned config runs with the chosen one
    script, ds = _job(tmp_path, {"stage": 2}, {
        "start_profile_step": 2, "end_profile_step": 4, "tuner_num_trials": 1,
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}, "max_train_micro_batch_size_per_gpu": 8})
    cfg = json.loads(ds.read_text())
    ds.write_text(json.dumps({**cfg, "train_batch_size": 8}))  # 2 x 1 x 4 ranks: it must follow the micro-batch
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "zpp", "tune", "--job", "--config", str(ds), "--candidates", "zero2,zero3",
           "--job-timeout", "240", "--", sys.executable, str(script), "--deepspeed_config", str(ds), "--mbs", "2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / job.DEFAULT_REPORT).read_text())
    m = rep["micro_batch"]
    assert [t["micro_batch"] for t in m["tried"]] == [2, 4, 8] and m["argument"] == "--mbs"
    assert m["job_micro_batch"] == 2 and m["chosen"] == max(m["tried"], key=lambda t: t["throughput"])["micro_batch"]
    for t in m["tried"]:  # samples per second: micro-batch x 1 backward pass x 4 ranks / mean step
        assert t["throughput"] == pytest.approx(t["micro_batch"] * 4 / t["step_s"], rel=0.5)
    tuned = json.loads((tmp_path / job.DEFAULT_OUT).read_text())
    assert tuned["train_micro_batch_size_per_gpu"] == m["chosen"] and tuned["train_batch_size"] == 4 * m["chosen"]
    if m["chosen"] != 2:
        assert f"# run the job with --mbs {m['chosen']}" in r.stdout
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                          f"--master-port={free_port()}", str(script), "--deepspeed_config",
                          str(tmp_path / job.DEFAULT_OUT), "--steps", "3", "--mbs", str(m["chosen"])], cwd=tmp_path,
                         env={**env, "ZPP_RANKS_PER_NODE": "2"}, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DONE stage" in run.stdout


def test_micro_batch_search_is_skipped_without_a_mapping():
    runner = _FakeJob({"zero2": 2.0}, {"zero2": lambda k: 3.0})
    rep = {"winner": "zero2", "winner_sections": {"zero_optimization": {"stage": 2}}}
    out = job._micro_batch(runner, rep, {"micro_batch": 2, "world": 4}, {}, None, memory_gb=None)
    assert "no autotuning.arg_mappings" in out["skipped"] and runner.calls == []
    s = job.from_autotuning({"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}})
    out = job._micro_batch(runner, rep, {"micro_batch": "auto", "world": 4}, {}, s, memory_gb=None)
    assert "not known" in out["skipped"]
    # the config keys: a number replaced, "auto" kept for the front-end, train_batch_size following
    prof = {"micro_steps": 2.0, "world": 4}
    assert job._micro_batch_keys({"train_micro_batch_size_per_gpu": 2}, prof, 8) == {
        "train_micro_batch_size_per_gpu": 8}
    assert job._micro_batch_keys({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 16}, prof, 8) == {
        "train_batch_size": 64}


def test_job_needs_a_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--job"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--job needs the job's command after --" in r.stderr
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--", "python", "x.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "goes with --job" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_job_loss_race_end_to_end(tmp_path):
    # the same job, raced: the reference (the fastest ZeRO mode) for 30 steps, then the
    # hierarchical mode; every loss in the report is the mean of the ranks' own losses
    script, ds = _job(tmp_path, {"stage": 2}, {"start_profile_step": 2, "end_profile_step": 4, "tuner_num_trials": 1})
    logs = tmp_path / "losses"
    logs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "zpp", "tune", "--job", "--config", str(ds), "--candidates",
           "zero2,zero3,outer-int4", "--loss-steps", "30", "--job-timeout", "240", "--",
           sys.executable, str(script), "--deepspeed_config", str(ds), "--steps", "200", "--loss-log", str(logs)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / job.DEFAULT_REPORT).read_text())
    rows = {c["mode"]: c for c in rep["candidates"]}
    race = rep["race"]
    ref, out = rows[race["reference"]], rows["outer-int4"]
    assert race["reference"] in ("zero2", "zero3") and race["window"] == 6

    def ranks_mean(run):
        per_rank = [[float(x) for x in (logs / f"{run}.trial.json.rank{q}").read_text().split()] for q in range(4)]
        return [sum(v) / 4 for v in zip(*per_rank, strict=True)]
    assert ref["loss_curve"] == pytest.approx(ranks_mean(race["reference"] + "-loss"), rel=1e-9)
    assert len(ref["loss_curve"]) == 30 and ref["loss_curve"][-1] < ref["loss_curve"][0]
    assert race["target_loss"] == pytest.approx(sum(ref["loss_curve"][-6:]) / 6)
    assert out["outer"]["sync_every"] >= 5 and 1 <= out["outer"]["delay"] < out["outer"]["sync_every"]
    assert 30 <= len(out["loss_curve"]) == out["race_steps"] <= 60
    assert out["loss_curve"] == pytest.approx(ranks_mean("outer-int4"), rel=1e-9)
    assert out["steps_to_target"] == job.steps_to(out["loss_curve"], race["target_loss"], 6)
    # the hierarchical run's syncs crossed the nodes: it counted inter-node bytes, far fewer than ZeRO's
    assert 0 < out["measured_inter_bytes"] < ref["measured_inter_bytes"] / 5
    assert out["measured_syncs"] > 0 and out["measured_sync_bytes"] == pytest.approx(out["pred_sync_bytes"], rel=1e-3)
    wins = out["time_to_target_s"] is not None and out["time_to_target_s"] * job.WIN_MARGIN <= ref["time_to_target_s"]
    assert rep["winner"] == ("outer-int4" if wins else race["reference"])
    tuned = json.loads((tmp_path / job.DEFAULT_OUT).read_text())
    if rep["winner"] == "outer-int4":
        assert tuned["zpp"]["outer"] == out["outer"] and tuned["zero_optimization"]["stage"] == 2
    else:
        assert "outer" not in tuned.get("zpp", {})
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                          f"--master-port={free_port()}", str(script), "--deepspeed_config",
                          str(tmp_path / job.DEFAULT_OUT), "--steps", "12"], cwd=tmp_path,
                         env={**env, "ZPP_RANKS_PER_NODE": "2"}, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DONE stage" in run.stdout and "terminate called" not in run.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_job_drives_a_hugging_face_trainer_script(tmp_path):
    # the Trainer's road: `zpp run` makes its `import deepspeed` zpp, accelerate sets the
    # accumulation boundary (2 micro-batches per optimizer step) and calls engine.backward /
    # engine.step; the trials count optimizer steps and the cost model's bytes hold for them
    script = ROOT / "tests" / "frontends" / "hf_trainer.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [sys.executable, "-m", "zpp", "tune", "--job", "--nprocs", "2", "--ranks-per-node", "1",
           "--candidates", "zero2,zero3,outer-int4", "--loss-steps", "12", "--job-timeout", "240", "--",
           "zpp", "run", sys.executable, str(script), "--stage", "2", "--gas", "2", "--steps", "60", "--out", "r.json"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / job.DEFAULT_REPORT).read_text())
    assert rep["micro_steps"] == 2 and rep["profile"]["micro_steps"] == 2.0
    rows = {c["mode"]: c for c in rep["candidates"]}
    ran = [c for c in rows.values() if "measured_inter_bytes" in c]
    assert {"zero3", "outer-int4"} <= {c["mode"] for c in ran}
    for c in ran:  # per optimizer step of two backward passes, exactly
        if c["mode"] == "outer-int4":  # the window holds whole fragment syncs, not whole periods: per sync
            assert c["measured_syncs"] >= 4
            assert c["measured_sync_bytes"] == pytest.approx(c["pred_sync_bytes"], rel=1e-3), c
        else:
            assert c["measured_inter_bytes"] == c["pred_inter_bytes"], c
    ref = rows[rep["race"]["reference"]]
    assert len(ref["loss_curve"]) == 12 and all(x is not None and math.isfinite(x) for x in ref["loss_curve"])
    assert len(rows["outer-int4"]["loss_curve"]) == rows["outer-int4"]["race_steps"] >= 12
    assert (rep["winner"] == "outer-int4") == ("outer" in json.loads((tmp_path / job.DEFAULT_OUT).read_text())
                                                .get("zpp", {}))


TRIAL_SCRIPT = textwrap.dedent("""
    import argparse, json, sys, time, torch
    sys.path.insert(0, {root!r})
    import zpp

    p = argparse.ArgumentParser()
    p.add_argument("--backward", choices=["engine", "prescaled", "torch"], default="engine")
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    engine, *_ = zpp.initialize(model=model, config={{
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {{"type": "SGD", "params": {{"lr": 0.05}}}}, "zero_optimization": {{"stage": 2}}}})
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    mine = []
    for step in range(100):
        micro = []
        for m in range(2):
            x = torch.randn(4, 8, generator=g)
            loss = ((engine(x) - x @ w) ** 2).mean()
            micro.append(loss.item())
            if a.backward == "engine":
                engine.backward(loss)  # the engine divides by the 2 accumulation steps
            elif a.backward == "prescaled":  # the Hugging Face Trainer's way
                engine.backward(loss / 2, scale_wrt_gas=False)
            else:
                (loss / 2).backward()
            engine.step()
        mine.append(sum(micro) / 2)
        with open("mine.json", "w") as f:
            json.dump(mine, f)
        time.sleep(a.sleep)
    print("the trial did not stop the job")
""")


def _trial(tmp_path, spec, *args):
    (tmp_path / "t.py").write_text(TRIAL_SCRIPT.format(root=str(ROOT)))
    (tmp_path / "trial.json").write_text(json.dumps({"overrides": {"zero_optimization": {"stage": 2}},
                                                     "out": str(tmp_path / "m.json"), **spec}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZPP_TUNE_TRIAL": str(tmp_path / "trial.json")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "t.py", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "did not stop" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((tmp_path / "m.json").read_text())


@pytest.mark.parametrize("backward", ["engine", "prescaled"])
def test_trial_counts_optimizer_steps_and_their_losses(tmp_path, backward):
    # one process, 2 micro-batches a step: the trial stops the job at its 6th optimizer step (12
    # backward passes), times steps 3-6, and a step's loss is the mean of its two micro-batches'
    # losses whether the engine divides by the accumulation steps or the job did (scale_wrt_gas=False)
    m = _trial(tmp_path, {"start": 2, "end": 6}, "--backward", backward)
    mine = json.loads((tmp_path / "mine.json").read_text())
    assert m["end"] == 6 and len(m["step_times"]) == 4 and m["micro_steps"] == 2.0 and m["backward_seen"]
    assert len(mine) == 5 and len(m["loss_curve"]) == 6  # the job's own record ends before the 6th step's end
    assert m["loss_curve"][:5] == pytest.approx(mine, rel=1e-6)
    assert m["outer_syncs"] is None and m["world"] == 1
    # one rank: nothing to wait for on a link, and every phase reported
    assert set(m["link_waits"]) == {"forward_gather", "backward_gather", "exact_gather", "reduce", "norm", "publish",
                                    "metadata"}
    assert m["link_wait_s"] == pytest.approx(sum(m["link_waits"].values())) and m["link_wait_s"] >= 0


def test_trial_without_engine_backward_has_no_losses(tmp_path):
    m = _trial(tmp_path, {"start": 2, "end": 5}, "--backward", "torch")
    assert m["loss_curve"] == [None] * 5 and not m["backward_seen"]
    assert m["micro_steps"] == 2.0  # the config's accumulation steps, the backward passes unseen


def test_trial_budget_fixes_the_last_step_from_the_first_timed_steps(tmp_path):
    # steps of about 30 ms and 0.6 s to fill: after 5 timed steps (at step 7) the trial ends at
    # min(max_end, max(end, 7, ceil(0.6 / their mean))), about 20 (8 once steps take 75 ms)
    m = _trial(tmp_path, {"start": 2, "end": 8, "budget_s": 0.6, "max_end": 40}, "--sleep", "0.03")
    first = m["step_times"][:5]
    want = min(40, max(8, 7, math.ceil(0.6 / (sum(first) / 5))))
    assert 8 < want < 40  # the budget decided it, not a bound
    assert m["end"] == want == len(m["loss_curve"]) and len(m["step_times"]) == want - 2
