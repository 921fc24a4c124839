"""The prefetch window's model (zpp.zero.prefetch_depth, [Note: the prefetch window from the
measured link]) on passes whose prefetched time is worked out by hand."""
import pytest

from zpp.zero.prefetch_depth import HEADROOM, Measured, ahead, choose_window, peak_ahead, simulate

N = 1000


def _pass(*gc):
    return [Measured(unit=i, numel=N, gather_s=g, compute_s=c) for i, (g, c) in enumerate(gc)]


def test_a_link_slower_than_compute_needs_one_gather_ahead():
    steps = _pass((2, 1), (2, 1), (2, 1), (2, 1))
    assert simulate(steps, 0) == 12  # every gather in line: 4 x (2 + 1)
    # the link never idles once gather 1 is queued behind gather 0: 4 x 2 + the last compute
    assert simulate(steps, ahead(1, N)) == simulate(steps, 4 * N) == 9
    assert choose_window(steps) == ahead(1 * HEADROOM, N)


def test_a_long_compute_then_large_gathers_needs_a_deeper_window():
    steps = _pass((1, 3), (1, 0.1), (3, 0.1), (3, 0.1))
    # unbounded: the link runs 1, 2, 3 back to back from t=1 (ends 2, 5, 8); the last compute ends 8.1
    assert simulate(steps, 4 * N) == pytest.approx(8.1)
    # one ahead: gather 2 starts only when entry 1 is served (t=4), gather 3 at 7.1
    assert simulate(steps, ahead(1, N)) == simulate(steps, N) == pytest.approx(10.1)
    assert simulate(steps, ahead(2, N)) == pytest.approx(8.1)
    assert choose_window(steps) == ahead(2 * HEADROOM, N)
    assert choose_window(steps, limit=2 * N) == 2 * N  # stage3_max_live_parameters caps it


def test_the_window_counts_before_each_start():
    # DeepSpeed's rule: a window of one element still starts one gather; N + 1 starts two
    assert (ahead(0, N), ahead(1, N), ahead(2, N)) == (0, 1, N + 1)
    steps = _pass((1, 0), (1, 0), (1, 0))
    assert simulate(steps, 0) == 3
    # a window below one gather lets one run ahead, as does a window of exactly one gather
    assert simulate(_pass((1, 2), (1, 2), (1, 2)), 1) == simulate(_pass((1, 2), (1, 2), (1, 2)), N) == 7


def test_a_unit_is_not_started_while_it_is_running():
    # the same unit twice in a row (its forward, then its backward): the second waits in line
    steps = [Measured(0, N, 1, 1), Measured(0, N, 1, 1)]
    assert simulate(steps, 10 * N) == 4


def test_a_unit_still_gathered_is_not_started():
    # unit 2 is still gathered after entry 0 (an enclosing unit, released later and gathered
    # again at entry 1): the prefetcher cannot start it, and neither does the model
    free = [Measured(1, N, 1, 1, frozenset({1})), Measured(2, N, 1, 1, frozenset({2}))]
    held = [Measured(1, N, 1, 1, frozenset({1, 2})), Measured(2, N, 1, 1, frozenset({2}))]
    assert simulate(free, 10 * N) == 3 and simulate(held, 10 * N) == 4


def test_peak_ahead_follows_the_rule_by_hand():
    # sizes 4, 1, 1, 3, 2 (x N), the forward then the backward in reverse, nothing held;
    # after serving an entry the walk starts the next ones while fewer than the window are
    # started, stopping at the unit just served or one already started
    sizes = [4, 1, 1, 3, 2]
    order = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0]
    steps = [Measured(unit=i, numel=sizes[i] * N, gather_s=1, compute_s=1) for i in order]
    assert peak_ahead(steps, 0) == 0
    # window 1 element: one entry ahead at a time (counted before each start): the forward's
    # units 1..4, none past the repeated unit 4, then the backward's 3, 2, 1 and 0 (4N)
    assert peak_ahead(steps, 1) == 4 * N
    # window 2N: after entry 0 units 1, 2 (2N: stop); after entry 1 (1N left) unit 3 -> 4N;
    # in the backward after entry 7 (unit 1 left, 1N) unit 0 -> 5N
    assert peak_ahead(steps, 2 * N) == 5 * N
    # unbounded: the forward's units 1..4 (7N); after the repeated unit 4 the backward's 3, 2,
    # 1, 0 (9N)
    assert peak_ahead(steps, 100 * N) == 9 * N
    # the times do not change it
    slow = [Measured(s.unit, s.numel, 10.0, 0.0) for s in steps]
    assert [peak_ahead(slow, w) for w in (1, 2 * N, 100 * N)] == [4 * N, 5 * N, 9 * N]


def test_bad_values():
    assert choose_window([]) == 0
    with pytest.raises(ValueError, match="window=-1"):
        simulate(_pass((1, 1)), -1)
    with pytest.raises(ValueError, match="limit=-2"):
        choose_window(_pass((1, 1)), limit=-2)
