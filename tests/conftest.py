"""Test-session rules shared by every file.

* ``@pytest.mark.cluster``: the test builds an emulated cluster (network namespaces and tc
  qdiscs, machine-wide state). It runs only with ``ZPP_TEST_CLUSTER=1`` in the environment
  (``.ci/run`` sets it), as root with iproute2, and when no zpp cluster is up already (the
  tests would replace it); otherwise it is skipped with a message that says so. The tests
  create and remove only zpp's own namespaces (``zpp-sw``, ``zpp-n<i>``).
* Every test's pytest timeout is handed to :mod:`tests.dist`, so that a world started with
  ``run_world(timeout=...)`` must end (or be killed with its diagnostics) before pytest
  kills the test; see :func:`tests.dist.run_world`.
* The run ends with the skipped tests counted by reason, one line each (``-q`` would show
  only "N skipped": most are GPU-only or opt-in cluster cases, and a newcomer should see so).
"""
from __future__ import annotations

import collections
import os
import time

import pytest

from tests import dist

CLUSTER_ENV = "ZPP_TEST_CLUSTER"


def cluster_skip_reason() -> str | None:
    """Why the cluster tests cannot run here (None when they can)."""
    if os.environ.get(CLUSTER_ENV) != "1":
        return (f"builds network namespaces and tc qdiscs on this machine; set {CLUSTER_ENV}=1 to run it "
                "(needs root and iproute2; .ci/run sets it)")
    from zpp.cluster import netns

    missing = netns.missing_prerequisites()
    if missing:
        return f"{CLUSTER_ENV}=1 but this machine lacks " + "; ".join(missing)
    owned = netns.owned_namespaces()
    if owned:
        return (f"a zpp cluster is up ({', '.join(owned)}); the cluster tests build their own and would "
                "replace it: run `zpp cluster down` first")
    return None


_cluster_reason: list[str | None] = []


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cluster")]
    if not marked:
        return
    if not _cluster_reason:
        _cluster_reason.append(cluster_skip_reason())
    reason = _cluster_reason[0]
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _test_timeout(item) -> float | None:
    """pytest-timeout's limit for ``item``: its marker, else ``--timeout``, else the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            try:
                value = item.config.getini("timeout")
            except ValueError:  # pytest-timeout not installed
                value = None
    try:
        value = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return value if value and value > 0 else None


@pytest.fixture(autouse=True)
def _world_deadline(request):
    """Tell run_world when pytest will kill this test."""
    limit = _test_timeout(request.node)
    dist.TEST_LIMIT = limit
    dist.TEST_DEADLINE = time.monotonic() + limit if limit else None
    try:
        yield
    finally:
        dist.TEST_DEADLINE = dist.TEST_LIMIT = None


def skip_reason(report) -> str:
    """The reason a skipped test's report gives, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    counts = collections.Counter(skip_reason(r) for r in skipped)
    terminalreporter.write_line(f"{len(skipped)} skipped, by reason:")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"  {n:5d}  {reason}")
