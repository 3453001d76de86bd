"""The capture policy (capture_plan.py): a step never runs a bucket whose CUDA graphs are not
captured yet (its first step there would run eagerly and its second capture: 250-350 ms on an
H100, every live session late), and which buckets are captured before ready and which later."""

from __future__ import annotations

import pytest

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.capture_plan import CapturePlan
from duplexserve.engine_bridge.moshi.row_buckets import bucket_sizes

SIZES = bucket_sizes(336)  # Hibiki-Zero 3B int8 on one H100: 1, 2, 3, 4, 6, ..., 256, 336


def test_the_default_captures_every_bucket_before_ready():
    assert ServerConfig().moshi_warm_rows == 0
    plan = CapturePlan(SIZES, ServerConfig().moshi_warm_rows)
    assert plan.before_ready == SIZES
    for size in plan.before_ready:
        plan.mark(size)
    assert plan.cold == [] and plan.next_idle() is None
    assert all(plan.fit(n) == n for n in SIZES)  # each step in its own bucket


def test_warm_rows_captures_the_small_buckets_and_the_largest_before_ready():
    plan = CapturePlan(SIZES, warm_rows=4)
    assert plan.before_ready == [1, 2, 3, 4, 336]
    for size in plan.before_ready:
        plan.mark(size)
    assert plan.cold == [n for n in SIZES if 4 < n < 336]


def test_a_step_runs_in_the_smallest_captured_bucket_that_holds_its_rows():
    plan = CapturePlan(SIZES, warm_rows=4)
    for size in plan.before_ready:
        plan.mark(size)
    # every bucket a ramp of 336 sessions walks through, up and down: never an uncaptured one
    for n in SIZES:
        assert plan.fit(n) in plan.captured and plan.fit(n) >= n
    assert plan.fit(3) == 3 and plan.fit(6) == 336 and plan.fit(128) == 336
    plan.mark(plan.next_idle())  # 6: captured while idle, smallest first
    plan.mark(plan.next_idle())  # 8
    assert plan.fit(6) == 6 and plan.fit(8) == 8 and plan.fit(12) == 336
    assert plan.next_idle() == 12


def test_the_idle_captures_go_smallest_first_until_none_is_left():
    plan = CapturePlan(SIZES, warm_rows=4)
    for size in plan.before_ready:
        plan.mark(size)
    order = []
    while (size := plan.next_idle()) is not None:
        order.append(size)
        plan.mark(size)
    assert order == [n for n in SIZES if 4 < n < 336] and plan.cold == []


def test_nothing_is_captured_without_graphs_and_every_bucket_runs_as_it_is():
    plan = CapturePlan(SIZES, warm_rows=4, graphed=False)
    assert plan.before_ready == [] and plan.cold == []
    assert all(plan.fit(n) == n for n in SIZES)


def test_no_captured_bucket_is_an_error_not_an_eager_step():
    plan = CapturePlan([1, 2, 4], warm_rows=1)
    plan.mark(1)
    with pytest.raises(RuntimeError, match="no captured bucket"):
        plan.fit(2)
