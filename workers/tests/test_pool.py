"""The pool controller's reconcile plan (`pool.plan_reconcile`) as tables, a
simulated rolling update, the count it keeps with autoscaling, and its monitor loop's
end.  Pure: no Ray cluster, no HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from specd.devtools.status_docs import replica_info, replica_status
from specd.workers.config import RoutingSpec, spec_for_model
from specd.workers.contracts import DELTA_WIRE, ReplicaInfo
from specd.workers.pool.controller import PoolController
from specd.workers.pool.plan import Plan, plan_reconcile
from specd.workers.pool.replica import Replica, ReplicaState


@dataclass
class R:
    name: str
    state: ReplicaState
    config_hash: str = "new"


S, RD, D = ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING

PLANS = {
    "fresh start": ([], 2, Plan(start=2)),
    "steady": ([R("r0", RD), R("r1", RD)], 2, Plan()),
    "starting counts": ([R("r0", RD), R("r1", S)], 2, Plan()),
    "replace the dead": ([R("r0", RD), R("r1", ReplicaState.DEAD)], 2, Plan(start=1)),
    "draining does not count": ([R("r0", RD), R("r1", D)], 2, Plan(start=1)),
    "scale up": ([R("r0", RD)], 3, Plan(start=2)),
    "scale down newest first": (
        [R("r0", RD), R("r1", RD), R("r2", RD)],
        1,
        Plan(retire=("r2", "r1")),
    ),
    "scale down starting first": ([R("r0", RD), R("r1", S), R("r2", RD)], 2, Plan(retire=("r1",))),
    "scale to zero": ([R("r0", RD), R("r1", S)], 0, Plan(retire=("r1", "r0"))),
    "roll: surge one": ([R("r0", RD, "old"), R("r1", RD, "old")], 2, Plan(start=1)),
    "roll: wait for the surge": ([R("r0", RD, "old"), R("r1", RD, "old"), R("r2", S)], 2, Plan()),
    "roll: new ready -> retire oldest, surge next": (
        [R("r0", RD, "old"), R("r1", RD, "old"), R("r2", RD)],
        2,
        Plan(start=1, retire=("r0",)),
    ),
    "roll: last old goes": (
        [R("r1", RD, "old"), R("r2", RD), R("r3", RD)],
        2,
        Plan(retire=("r1",)),
    ),
    "roll: outdated starting is stopped": (
        [R("r0", RD), R("r1", S, "old")],
        2,
        Plan(start=1, retire=("r1",)),
    ),
    "roll + scale down": (
        [R("r0", RD, "old"), R("r1", RD, "old")],
        1,
        Plan(start=1, retire=("r0",)),
    ),
    "roll + scale up": ([R("r0", RD, "old"), R("r1", RD, "old")], 3, Plan(start=1)),
    "roll + too many current": (
        [R("r0", RD, "old"), R("r1", RD), R("r2", RD)],
        1,
        Plan(retire=("r2", "r0")),
    ),
}


@pytest.mark.parametrize("replicas,desired,expected", PLANS.values(), ids=PLANS.keys())
def test_plan_reconcile(replicas, desired, expected):
    assert plan_reconcile(replicas, desired, "new") == expected


def test_plan_backoff_holds_starts_but_not_retirements():
    plan = plan_reconcile(
        [R("r0", RD, "old"), R("r1", RD, "old"), R("r2", RD)], 2, "new", can_start=False
    )
    assert plan == Plan(start=0, retire=("r0",))


def test_rolling_update_converges_without_losing_capacity():
    """Play the plan forward (starts become ready at once) from 3 old replicas."""
    replicas = [R(f"r{i}", RD, "old") for i in range(3)]
    for step in range(20):
        plan = plan_reconcile(replicas, 3, "new")
        if plan == Plan():
            break
        replicas = [r for r in replicas if r.name not in plan.retire]
        replicas += [R(f"n{step}{i}", RD) for i in range(plan.start)]
        assert len(replicas) >= 3  # never below the desired count
        assert len(replicas) <= 4  # at most one surge replica
    assert [r.config_hash for r in replicas] == ["new"] * 3


# -- autoscaling: the count the pool keeps -------------------------------------------

AUTOSCALED = {"autoscaling": {"maxReplicas": 4, "targetOngoingRequests": 2}}


def pool_of(replicas=1, **spec) -> PoolController:
    return PoolController(spec_for_model("/m", replicas=replicas, **spec))


def test_the_pool_keeps_the_autoscalers_count_and_counts_set_by_hand():
    pool = pool_of(2)
    assert pool.desired_replicas == 2 and pool.status().autoscaling is None
    with_autoscaling = spec_for_model("/m", replicas=2, **AUTOSCALED)
    pool.update_spec(with_autoscaling)
    assert pool.desired_replicas == 2  # it starts from the count in force
    pool.autoscaler.replicas = 3  # as if it had scaled up
    rerouted = with_autoscaling.model_copy(update={"routing": RoutingSpec(policy="leastLoad")})
    pool.update_spec(rerouted)
    assert pool.desired_replicas == 3  # another change keeps the autoscaled count
    pool.update_spec(rerouted.model_copy(update={"replicas": 1}))  # kubectl scale
    assert pool.desired_replicas == 1
    narrow = rerouted.autoscaling.model_copy(update={"min_replicas": 2})
    pool.update_spec(rerouted.model_copy(update={"replicas": 1, "autoscaling": narrow}))
    assert pool.desired_replicas == 2  # the new bounds apply
    pool.update_spec(rerouted.model_copy(update={"replicas": 1, "autoscaling": None}))
    assert pool.desired_replicas == 1 and pool.autoscaler is None


def test_the_pool_feeds_the_autoscaler_its_open_streams():
    """The streams open on every replica (a draining one's too) are the load; a new
    count shows as an event and in the status."""
    pool = pool_of(1)
    pool.update_spec(spec_for_model("/m", replicas=1, **AUTOSCALED))
    policy = pool.autoscaler.policy
    for name, state, inflight in [("r0", RD, 7), ("r1", D, 2)]:
        pool._replicas[name] = Replica(name, f"a-{name}", None, "h", state, inflight=inflight)
    assert pool.wanted_replicas == 1  # no load seen yet: the desired count
    pool._autoscale(0.0)
    assert pool.wanted_replicas == 5  # ceil(9 / 2)...
    assert pool.autoscaler.proposal == 4  # ...within maxReplicas
    assert pool.desired_replicas == 1  # asked for, not yet for the delay
    pool._autoscale(policy.upscale_delay_seconds)
    assert pool.desired_replicas == 4
    [event] = [e for e in pool.events if e.event == "autoscaled"]
    assert event.detail.startswith("1 -> 4 replicas: 9.0 ongoing requests (target 2")
    status = pool.status()
    assert status.desired_replicas == 4 and status.autoscaling.proposal == 4


# -- the monitor loop ends when it is told to ----------------------------------------------


class _AnsweredByTheTest:
    """An actor handle whose ``status`` probe the test answers (``probes`` holds each
    probe's future as the monitor starts awaiting it)."""

    def __init__(self) -> None:
        self.probes: asyncio.Queue[asyncio.Future] = asyncio.Queue()
        self.status = self

    def remote(self) -> asyncio.Future:
        probe = asyncio.get_running_loop().create_future()
        self.probes.put_nowait(probe)
        return probe


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_the_monitor_ends_when_cancelled_as_it_wakes(turns):
    """Stopping reconciliation while the monitor loop wakes (a probe answered, a
    replica changed) still ends it, whichever loop turn the cancel lands in.  (With
    ``asyncio.wait_for`` around its sleep, Python 3.11 could swallow the cancel: the loop
    ran on and ``detach`` waited forever, so a replacement gateway never adopted the
    running actors.)"""
    pool = PoolController(spec_for_model("/m", replicas=1), health_interval_s=60)
    handle = _AnsweredByTheTest()
    pool._replicas["r0"] = Replica("r0", "a-r0", handle, pool.spec.config_hash(), RD)
    await pool.start()
    probe = await handle.probes.get()
    probe.set_result(replica_status("r0", pool.spec.config_hash()))
    await asyncio.sleep(0.05)  # the monitor sleeps until woken
    pool._kick()
    for _ in range(turns):
        await asyncio.sleep(0)
    monitor = pool._monitor
    detaching = asyncio.ensure_future(pool.detach())
    await asyncio.wait({detaching}, timeout=5)
    try:
        assert detaching.done() and monitor.done(), "the monitor loop ran on"
        assert pool._monitor is None and not pool._replicas
    finally:
        monitor.cancel()
        detaching.cancel()


def test_an_actor_of_a_specd_with_another_delta_wire_is_not_adoptable():
    """`adopt_running_actors` validates an actor's ``info()``: one that does not speak
    this gateway's delta wire (an older specd streamed deltas over Ray) fails it, so it
    is killed and replaced instead of adopted and failing every request."""
    answer = replica_info("r0").model_dump()
    assert ReplicaInfo.model_validate(answer).delta_wire == DELTA_WIRE
    for other in (
        {k: v for k, v in answer.items() if k != "delta_wire"},
        {**answer, "delta_wire": "ray-stream"},
        {**answer, "delta_wire": "socket/1"},  # deltas on the socket, requests as Ray calls
    ):
        with pytest.raises(ValidationError, match="delta_wire"):
            ReplicaInfo.model_validate(other)
