"""``zpp tune --job`` (zpp/tune/job.py) and its trial runs (zpp/zero/trial.py): a user's
training script, unchanged, tuned on 4 local ranks as 2 nodes x 2; the tuned config runs."""
from __future__ import annotations

import json
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
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32))
    engine, *_ = zpp.initialize(args=args, model=model, model_parameters=model.parameters())
    data = CharCorpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(engine.world.rank)
    for _ in range(args.steps):
        x, y = data.batch(2, 32, g)
        loss = engine(x, y)
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_job_end_to_end(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3}}, "zero_optimization": {"stage": 1, "stage3_param_persistence_threshold": 0},
        "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "tuner_num_trials": 2}}))
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


def test_job_needs_a_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--job"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--job needs the job's command after --" in r.stderr
    r = subprocess.run([sys.executable, "-m", "zpp", "tune", "--", "python", "x.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "goes with --job" in r.stderr
