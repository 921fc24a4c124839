"""The test harness's own rules: a world's hard timeout fits inside pytest's (so a hung
world's diagnostics always reach the report), and the cluster tests are opt-in."""
import time

import pytest

from tests import conftest, dist
from tests.dist import WorldTimeout, run_world


def _hang(t):
    time.sleep(120)


@pytest.mark.timeout(40)
def test_world_timeout_must_fit_the_pytest_timeout():
    assert dist.TEST_LIMIT == 40 and dist.TEST_DEADLINE is not None  # set by tests/conftest.py
    with pytest.raises(ValueError, match="timeout=30 s does not fit the test's pytest timeout of 40 s"):
        run_world(_hang, 1, timeout=30)
    # a later world of a test gets at most what is left of the test's time
    assert dist.world_timeout(20) == 20
    saved = dist.TEST_DEADLINE
    try:
        dist.TEST_DEADLINE = time.monotonic() + dist.DIAGNOSTICS_S + 5
        assert 4 <= dist.world_timeout(25) <= 5
    finally:
        dist.TEST_DEADLINE = saved


@pytest.mark.timeout(40)
def test_hung_world_reports_before_pytest_kills_it():
    start = time.monotonic()
    with pytest.raises(WorldTimeout, match=r"hard timeout after 8 s; ranks \[0\] had not finished"):
        run_world(_hang, 1, timeout=8)
    assert time.monotonic() - start < 40 - dist.DIAGNOSTICS_S


def test_cluster_tests_are_opt_in(monkeypatch):
    monkeypatch.delenv(conftest.CLUSTER_ENV, raising=False)
    reason = conftest.cluster_skip_reason()
    assert reason is not None and f"set {conftest.CLUSTER_ENV}=1 to run it" in reason
