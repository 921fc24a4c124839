"""The training thread's waits on the link include its metadata checks ([Note: metadata
check] in zpp/comm/transport.py; phase ``metadata`` of LinkWaits), on a real 2-rank gloo world.

* A check that blocks outside any wait (rank 1 comes late) is booked under ``metadata`` on the
  rank that waited, once; inside a wait it is that wait's (``norm`` here), not booked twice.
* Checks on another thread (the reduction thread's) are not the training thread's wait.
* With the check off nothing blocks and nothing is booked.
* An engine's step: the prefetched gathers' checks appear under ``metadata`` (on by default)
  and vanish with ``"zpp": {"check_metadata": false}``; the waits never exceed the step.
"""
from __future__ import annotations

import threading
import time

import pytest

import zpp.zero as zz
from tests.dist import run_world
from tests.test_zero_overlap import _model
from tests.test_zero_engine import _batches, train_steps
from zpp.zero.reduce.overlap import LinkWaits

LATE_S = 0.4


def _late_check(t, late: int) -> None:
    if t.rank == late:
        time.sleep(LATE_S)
    t.check_agree("test", [7])


def _booking(t):
    clock = LinkWaits()
    out = {}
    with clock.waiting("reduce", "first"):  # the training thread is the one of the first wait
        pass
    clock.take()
    _late_check(t, late=1)  # outside any wait
    out["outside"] = clock.take()
    with clock.waiting("norm", "inside"):
        _late_check(t, late=1)
    out["inside"] = clock.take()
    other = threading.Thread(target=_late_check, args=(t, 1))  # as the reduction thread would
    other.start()
    other.join()
    out["other_thread"] = clock.take()
    t.check_metadata = False
    t0 = time.perf_counter()
    _late_check(t, late=1)  # no check: nothing to wait for
    out["off_s"] = time.perf_counter() - t0
    out["off"] = clock.take()
    return out


@pytest.mark.timeout(90)
def test_metadata_checks_are_booked_once_on_the_training_thread():
    r0, r1 = run_world(_booking, 2, timeout=60)
    assert r0["outside"]["metadata"] >= 0.8 * LATE_S, r0  # rank 0 waited for the late rank
    assert r1["outside"]["metadata"] < 0.5 * LATE_S, r1  # the late rank did not wait
    assert r0["inside"]["norm"] >= 0.8 * LATE_S and r0["inside"]["metadata"] < 0.1, r0
    assert r0["other_thread"].get("metadata", 0.0) < 0.1, r0
    assert r0["off"]["metadata"] == 0.0 and r0["off_s"] < 0.1, r0


def _engine_waits(t, check: bool):
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zpp": {"check_metadata": check}}
    engine, _, _, _ = zz.initialize(model=_model(2), config=cfg, transport=t)
    try:
        train_steps(engine, _batches("gpt", t.rank, 1))
        engine.link_waits()
        t0 = time.perf_counter()
        train_steps(engine, _batches("gpt", t.rank, 3))
        wall = time.perf_counter() - t0
        return engine.link_waits(), wall
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_an_engines_gather_starts_book_their_checks():
    for check in (True, False):
        for waits, wall in run_world(_engine_waits, 2, args=(check,), timeout=100):
            assert set(waits) <= set(LinkWaits.PHASES) and sum(waits.values()) <= wall, (check, waits, wall)
            if check:
                assert waits["metadata"] > 0, waits
            else:
                assert waits.get("metadata", 0.0) == 0.0, waits
