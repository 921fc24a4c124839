"""A job under a memory cap (issue 24; opt-in, root: ``ZPP_TEST_MEMCAP=1``, which ``.ci/run``
sets): the same GPT at stage 3 on 2 gloo ranks, built under ``zpp.zero.Init``, run by
perf/train_bench.py inside a memory cgroup (tests/memcap.py) that holds the whole job, the
launcher and both ranks included.

Without a cap, the run with both NVMe tiers (parameters and optimizer state,
``zero3-infinity-lean``) equals the in-memory run (``zero3``) loss for loss and peaks well
below it. With the cap set between the two peaks, the in-memory run is killed by the kernel's
memcg OOM killer, and the NVMe run trains every step with the in-memory run's losses. The
cap is derived from this machine's two free peaks, so the test holds on any host; the
headline run, a model whose 16 bytes per parameter are twice the cap, is perf/nvme_cap.py's
(perf/BENCHMARKS.md, "Under a memory cap at twice the model state").
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import memcap

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.memcap, pytest.mark.slow, pytest.mark.timeout(900)]

# 4 x 768 GPT: 28.6M parameters, 16 Psi = 437 MiB; 1 warm-up and 3 measured steps
MODEL = ["--n-layer", "4", "--n-embd", "768", "--n-head", "12", "--block", "128", "--batch", "2",
         "--steps", "3", "--warmup", "1", "--ranks-per-node", "2", "--init"]
RUN_TIMEOUT_S = 240


def _run(variant: str, cap: int | None, tmp: Path) -> dict:
    out = tmp / f"{variant}-{'cap' if cap else 'free'}.json"
    cmd = [sys.executable, str(ROOT / "perf" / "train_bench.py"), "--world", "2", "--variants", variant,
           "--nvme-path", str(tmp / "nvme"), "--json", str(out), *MODEL]
    # glibc returns freed blocks above 128 KiB to the kernel: the setting the README gives for a capped job
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    with memcap.Cgroup(f"zpp-test-cap-{os.getpid()}-{variant}-{'cap' if cap else 'free'}", cap) as cg:
        proc = cg.run(cmd, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
        rec = {"rc": proc.returncode, "peak": cg.peak(), "hits": cg.failcnt(), "oom_kills": cg.oom_kills(),
               "stderr": proc.stderr[-3000:]}
    if proc.returncode == 0:
        row = json.loads(out.read_text())["rows"][0]
        assert "error" not in row, f"{variant}: {row.get('error')}"
        rec.update(losses=row["losses"], params=row["params"])
    return rec


def _same_losses(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == 4, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-6 * abs(y), (a, b)


def test_a_job_over_its_cap_trains_with_both_nvme_tiers_and_in_memory_is_killed(tmp_path):
    reason = memcap.skip_reason()
    if reason:
        pytest.skip(reason)
    memory = _run("zero3", None, tmp_path)
    assert memory["rc"] == 0, memory["stderr"]
    nvme = _run("zero3-infinity-lean", None, tmp_path)
    assert nvme["rc"] == 0, nvme["stderr"]
    _same_losses(nvme["losses"], memory["losses"])
    mib = 2 ** 20
    # the NVMe tiers take the model state out of memory: the job holds at least 6 of its 16
    # bytes per parameter (both ranks together) less
    saved = memory["peak"] - nvme["peak"]
    assert saved >= 12 * memory["params"] / 2, (
        f"the NVMe job peaked at {nvme['peak'] / mib:.0f} MiB, the in-memory one at {memory['peak'] / mib:.0f} MiB: "
        f"{saved / mib:.0f} MiB saved, less than 6 Psi = {6 * memory['params'] / mib:.0f} MiB")
    cap = (memory["peak"] + nvme["peak"]) // 2

    killed = _run("zero3", cap, tmp_path)
    assert killed["rc"] != 0, f"the in-memory job trained under a cap of {cap / mib:.0f} MiB"
    # the kernel's memcg OOM killer ended it (where the kernel does not count kills: the limit was hit)
    assert killed["oom_kills"] if killed["oom_kills"] is not None else killed["hits"] > 0, killed
    capped = _run("zero3-infinity-lean", cap, tmp_path)
    assert capped["rc"] == 0, f"cap {cap / mib:.0f} MiB: {capped}"
    assert capped["peak"] <= cap
    _same_losses(capped["losses"], memory["losses"])
