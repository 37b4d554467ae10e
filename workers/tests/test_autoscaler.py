"""The autoscaler's policy (pure): proposals from the averaged load, the delays that
keep bursts and lulls from moving the count, bounds, and counts set by hand."""

from __future__ import annotations

import pytest

from specd.workers.config import AutoscalingSpec
from specd.workers.pool.autoscaler import Autoscaler

POLICY = AutoscalingSpec(
    min_replicas=1,
    max_replicas=4,
    target_ongoing_requests=4,
    look_back_seconds=10,
    upscale_delay_seconds=5,
    downscale_delay_seconds=20,
)


def run(autoscaler: Autoscaler, loads: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Feed ``(time, ongoing)`` samples; -> ``(time, new count)`` of each change."""
    changes = []
    for now, ongoing in loads:
        change = autoscaler.observe(now, ongoing)
        if change is not None:
            assert change.old != change.new and change.new == autoscaler.replicas
            changes.append((now, change.new))
    return changes


def every_second(start: float, end: float, ongoing: int) -> list[tuple[float, int]]:
    return [(float(t), ongoing) for t in range(int(start), int(end))]


# a look-back shorter than a sample's spacing: the proposal follows each sample, so
# these cases show the delays alone
INSTANT = POLICY.model_copy(update={"look_back_seconds": 0.5})

CASES = {
    "steady at the target: no change": (1, every_second(0, 60, 4), []),
    "sustained load scales up after the delay": (1, every_second(0, 10, 12), [(5.0, 3)]),
    "a burst shorter than the delay starts nothing": (
        1,
        every_second(0, 4, 40) + every_second(4, 60, 0),
        [],
    ),
    "the count never passes maxReplicas": (1, every_second(0, 10, 100), [(5.0, 4)]),
    "the newest proposal is taken": (
        1,
        every_second(0, 5, 12) + every_second(5, 10, 16),
        [(5.0, 4)],
    ),
    "idle scales down to minReplicas after the downscale delay": (
        3,
        every_second(0, 40, 0),
        [(20.0, 1)],
    ),
    "a lull shorter than the downscale delay stops nothing": (
        3,
        every_second(0, 15, 0) + every_second(15, 60, 12),
        [],
    ),
    "a proposal that turns around starts its delay over": (
        2,
        # up 3 s, down 3 s, then up again: 5 s from t=6 (not from t=0)
        every_second(0, 3, 12) + every_second(3, 6, 0) + every_second(6, 30, 12),
        [(11.0, 3)],
    ),
}


@pytest.mark.parametrize(("start", "loads", "changes"), CASES.values(), ids=list(CASES))
def test_scaling_decisions(start, loads, changes):
    assert run(Autoscaler(INSTANT, start), loads) == changes


def test_averaging_smooths_a_short_burst_and_lags_a_drop():
    """Over a 10 s look-back a 2 s burst of 6 (1.5x the target) never asks for a second
    replica for the 5 s delay; after a busy period the mean falls slowly, so the
    downscale delay starts once it has fallen below what the count serves."""
    assert run(Autoscaler(POLICY, 1), every_second(0, 2, 6) + every_second(2, 60, 0)) == []
    # 3 replicas, 12 ongoing for 5 s: the mean (60 / samples) drops below 8 (2
    # replicas) at t=7, and 20 s later the newest proposal is 1
    busy_then_idle = every_second(0, 5, 12) + every_second(5, 40, 0)
    assert run(Autoscaler(POLICY, 3), busy_then_idle) == [(27.0, 1)]


def test_the_proposal_is_the_averaged_load_over_the_target_rounded_up():
    autoscaler = Autoscaler(POLICY, 1)
    autoscaler.observe(0.0, 9)
    autoscaler.observe(1.0, 4)  # mean 6.5 -> 6.5 / 4 -> 2
    assert autoscaler.mean_ongoing == 6.5 and autoscaler.wanted == autoscaler.proposal == 2
    autoscaler.observe(2.0, 87)  # mean 100 / 3 -> 9 wanted, 4 within the bounds
    assert (autoscaler.wanted, autoscaler.proposal) == (9, 4)
    assert autoscaler.status(2.0)["wanted"] == 9
    autoscaler.observe(12.5, 0)  # the first three samples left the 10 s window
    assert autoscaler.mean_ongoing == 0 and autoscaler.proposal == 1
    status = autoscaler.status(12.0)
    assert status["proposal"] == 1 and status["pending"] is None


def test_pending_changes_show_in_the_status():
    autoscaler = Autoscaler(POLICY, 1)
    autoscaler.observe(0.0, 12)
    autoscaler.observe(2.0, 12)
    assert autoscaler.status(3.0)["pending"] == {"direction": "up", "for_s": 3.0}


def test_start_and_counts_set_by_hand_are_clamped_and_taken_at_once():
    assert Autoscaler(POLICY, 0).replicas == 1
    assert Autoscaler(POLICY, 9).replicas == 4
    autoscaler = Autoscaler(POLICY, 1)
    autoscaler.observe(0.0, 12)  # an upscale is pending...
    autoscaler.retune(POLICY, replicas=2)  # ...when kubectl scale sets 2
    assert autoscaler.replicas == 2 and autoscaler.status(1.0)["pending"] is None
    narrower = POLICY.model_copy(update={"max_replicas": 1})
    autoscaler.retune(narrower)
    assert autoscaler.replicas == 1  # new bounds apply to the current count


TO_ZERO = INSTANT.model_copy(update={"min_replicas": 0})


def test_an_idle_pool_scales_to_zero_after_the_downscale_delay_and_wakes_at_once():
    """minReplicas 0: no load for the downscale delay takes the count to 0; a request
    then (held at the gateway, counted as load) brings a replica back at once, without
    the upscale delay; more load then waits for that delay as usual."""
    idle_then_one = every_second(0, 30, 0) + every_second(30, 40, 1)
    assert run(Autoscaler(TO_ZERO, 1), idle_then_one) == [(20.0, 0), (30.0, 1)]
    waking = Autoscaler(TO_ZERO, 0)
    assert run(waking, [(0.0, 9)]) == [(0.0, 3)]  # what the held requests ask for
    assert run(waking, every_second(1, 10, 16)) == [(6.0, 4)]  # from 3: the 5 s delay
    assert Autoscaler(INSTANT, 0).replicas == 1  # minReplicas 1 never goes to zero


def test_open_sessions_keep_one_replica():
    """A streaming session's KV lives on a replica: idle but open sessions hold the
    count at one; once they close, the pool goes to zero."""
    autoscaler = Autoscaler(TO_ZERO, 2)
    changes = [
        (now, change.new)
        for now in range(0, 80)
        if (change := autoscaler.observe(float(now), 0, sessions_open=3 if now < 40 else 0))
    ]
    assert changes == [(20.0, 1), (60.0, 0)]
    assert autoscaler.status(80.0)["min_replicas"] == 0
