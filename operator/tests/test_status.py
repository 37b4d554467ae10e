"""`status.compute_status` and helpers, pure: tables of gateway documents -> CR status."""

from __future__ import annotations

import pytest

from specd.operator.status import (
    Observation,
    SddStatus,
    SpeculationStatus,
    compute_status,
    failing_replicas,
    merge_patch,
    speculation_window,
)
from specd.workers.config import AutoscalingSpec, SpecDecodeDeployment

from .gateway_docs import actor, event, gateway_doc

NOW = "2026-01-01T00:00:00Z"


def _sdd(replicas=2, speculative=True):
    spec = {"model": {"path": "/m"}, "replicas": replicas}
    if speculative:
        spec |= {"draft": {"path": "/d"}, "speculative": {"minAcceptLength": 2.0}}
    return SpecDecodeDeployment.model_validate(
        {
            "apiVersion": "specd.dev/v1alpha1",
            "kind": "SpecDecodeDeployment",
            "metadata": {"name": "x"},
            "spec": spec,
        }
    )


def _conditions(status: SddStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_window_counts_only_what_each_actor_gained():
    prev = SpeculationStatus(accept_length=9.0, counters={"r0": [100, 300, 200]})
    actors = [
        actor("r0", "h", verifies=150, drafts=450, accepted=250),  # +50 verifies, +50
        actor("r1", "h", verifies=50, drafts=150, accepted=100),
    ]  # new: all of it
    window = speculation_window(actors, prev)
    assert window.window_verifies == 100
    assert window.accept_length == 1 + 150 / 100
    assert window.counters == {"r0": [150, 450, 250], "r1": [50, 150, 100]}


def test_window_restarts_from_zero_when_counters_go_down():
    prev = SpeculationStatus(counters={"r0": [100, 300, 200]})
    window = speculation_window([actor("r0", "h", verifies=10, drafts=30, accepted=5)], prev)
    assert (window.window_verifies, window.accept_length) == (10, 1.5)


def test_no_verifies_keeps_the_previous_reading():
    prev = SpeculationStatus(accept_length=2.5, accept_rate=0.5, counters={"r0": [10, 30, 15]})
    window = speculation_window([actor("r0", "h", verifies=10, drafts=30, accepted=15)], prev)
    assert (window.accept_length, window.window_verifies) == (2.5, 0)


@pytest.mark.parametrize(
    "events,failing",
    [
        ([], []),
        ([event("r0", "dead", "x")], ["r0"]),
        ([event("r0", "dead", "x"), event("r1", "ready")], []),
        ([event("r0", "ready"), event("r1", "dead", "a"), event("r2", "dead", "b")], ["r1", "r2"]),
    ],
    ids=["quiet", "one-failure", "recovered", "two-after-ready"],
)
def test_failing_replicas(events, failing):
    assert [e.replica for e in failing_replicas(events)] == failing


def test_ready_needs_the_gateway_on_the_current_hash_and_every_actor_on_it():
    sdd = _sdd()
    h = sdd.spec.config_hash()
    cases = [
        (gateway_doc(sdd.spec, [actor("r0", h), actor("r1", h)]), ("True", "AllReplicasReady")),
        (
            gateway_doc(sdd.spec, [actor("r0", h), actor("r1", h)], config_hash="old"),
            ("False", "ConfigPending"),
        ),
        (gateway_doc(sdd.spec, [actor("r0", "old"), actor("r1", h)]), ("False", "RollingUpdate")),
        (gateway_doc(sdd.spec, [actor("r0", h)]), ("False", "ReplicasNotReady")),
        (
            gateway_doc(sdd.spec, [actor("r0", h), actor("r1", h, "starting")]),
            ("False", "ReplicasNotReady"),
        ),
    ]
    for doc, ready in cases:
        status = compute_status(Observation(3, sdd, gateway=doc), SddStatus(), NOW)
        assert _conditions(status)["Ready"] == ready, doc
        assert _conditions(status)["Progressing"][0] == ("False" if ready[0] == "True" else "True")
        assert status.observed_generation == 3


def test_with_autoscaling_the_gateways_count_is_the_desired_one():
    """Ready and the kubectl column follow the autoscaler's count (3 here, spec.replicas
    2); while the gateway cannot be read, spec.replicas within the bounds."""
    sdd = _sdd()
    sdd = sdd.model_copy(
        update={
            "spec": sdd.spec.model_copy(
                update={"autoscaling": AutoscalingSpec(min_replicas=3, max_replicas=4)}
            )
        }
    )
    h = sdd.spec.config_hash()
    three = [actor(f"r{i}", h) for i in range(3)]
    status = compute_status(
        Observation(1, sdd, gateway=gateway_doc(sdd.spec, three, desired=3)), SddStatus(), NOW
    )
    assert _conditions(status)["Ready"] == ("True", "AllReplicasReady")
    assert (status.desired_replicas, status.ready) == (3, "3/3")
    scaled_up = gateway_doc(sdd.spec, three, desired=4)
    status = compute_status(Observation(1, sdd, gateway=scaled_up), SddStatus(), NOW)
    assert _conditions(status)["Ready"] == ("False", "ReplicasNotReady")
    assert status.ready == "3/4"
    unreachable = compute_status(Observation(1, sdd, gateway_error="refused"), SddStatus(), NOW)
    assert unreachable.desired_replicas == 3  # spec.replicas 2, raised to minReplicas


def test_a_deployment_scaled_to_zero_is_ready_saying_so():
    """minReplicas 0 and idle: no actor is desired, none runs; that is Ready (a request
    starts a replica), with the reason ScaledToZero and 0/0 for kubectl."""
    sdd = _sdd()
    policy = AutoscalingSpec(min_replicas=0, max_replicas=2)
    sdd = sdd.model_copy(update={"spec": sdd.spec.model_copy(update={"autoscaling": policy})})
    idle = gateway_doc(sdd.spec, [], desired=0)
    status = compute_status(Observation(1, sdd, gateway=idle), SddStatus(), NOW)
    assert _conditions(status)["Ready"] == ("True", "ScaledToZero")
    assert _conditions(status)["Progressing"] == ("False", "RolloutComplete")
    assert (status.desired_replicas, status.ready) == (0, "0/0")
    waking = gateway_doc(
        sdd.spec, [actor("r0", sdd.spec.config_hash(), state="starting")], desired=1
    )
    status = compute_status(Observation(1, sdd, gateway=waking), SddStatus(), NOW)
    assert _conditions(status)["Ready"] == ("False", "ReplicasNotReady")


def test_leak_check_failures_degrade():
    sdd = _sdd()
    h = sdd.spec.config_hash()
    doc = gateway_doc(sdd.spec, [actor("r0", h, leaks=2), actor("r1", h)])
    status = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), NOW)
    assert _conditions(status)["Degraded"] == ("True", "LeakCheckFailed")
    assert status.leak_check_failures == 2


def test_a_load_error_the_gateway_gave_up_on_degrades_naming_it():
    """The pool's `ReplicaFailure` (the same load error twice) for the current config:
    Degraded/ReplicaFailed with the message; for an older config it is not reported."""
    sdd = _sdd(replicas=1)
    message = "config.json: architecture FooForCausalLM is not supported"
    doc = gateway_doc(sdd.spec, [], failure=message)
    status = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), NOW)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ReplicaFailed")
    assert message in degraded.message and "replica r1" in degraded.message
    assert _conditions(status)["Ready"] == ("False", "ReplicasNotReady")
    older = doc.failure.model_copy(update={"config_hash": "older"})
    doc = doc.model_copy(update={"failure": older})
    status = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), NOW)
    assert _conditions(status)["Degraded"] == ("False", "AsExpected")


def test_leak_check_failures_of_replicas_gone_still_count():
    sdd = _sdd()
    h = sdd.spec.config_hash()
    doc = gateway_doc(sdd.spec, [actor("r2", h, leaks=1)], retired_leaks=3)
    status = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), NOW)
    assert status.leak_check_failures == 4


def test_plain_decode_reports_speculation_off():
    sdd = _sdd(speculative=False)
    doc = gateway_doc(sdd.spec, [actor("r0", sdd.spec.config_hash(), speculating=False)])
    status = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), NOW)
    assert _conditions(status)["SpeculationEffective"] == ("False", "SpeculationOff")
    assert status.speculation is None


def test_an_invalid_gateway_document_is_not_ready_and_degraded_naming_the_field():
    """What `reconcile.poll_gateway` reports for a document that breaks `AdminStatus`:
    no document, the field errors, ``gateway_invalid``."""
    sdd = _sdd()
    why = "ready_replicas: Field required (from http://demo-gateway/admin/status)"
    obs = Observation(1, sdd, gateway_error=why, gateway_invalid=True)
    status = compute_status(obs, SddStatus(), NOW)
    conditions = {c.type: c for c in status.conditions}
    assert _conditions(status)["Ready"] == ("False", "GatewayStatusInvalid")
    assert _conditions(status)["Progressing"] == ("True", "WaitingForGateway")
    assert _conditions(status)["Degraded"] == ("True", "GatewayStatusInvalid")
    for type_ in ("Ready", "Degraded"):
        assert conditions[type_].message == f"gateway /admin/status invalid: {why}"


def test_transition_time_moves_only_when_the_status_changes():
    sdd = _sdd()
    h = sdd.spec.config_hash()
    doc = gateway_doc(sdd.spec, [actor("r0", h), actor("r1", h)])
    first = compute_status(Observation(1, sdd, gateway=doc), SddStatus(), "T1")
    again = compute_status(Observation(1, sdd, gateway=doc), first, "T2")
    assert {c.last_transition_time for c in again.conditions} == {"T1"}
    down = compute_status(Observation(1, sdd, gateway=None, gateway_error="x"), again, "T3")
    times = {c.type: c.last_transition_time for c in down.conditions}
    assert times["Ready"] == "T3" and times["Degraded"] == "T1"


def test_merge_patch_removes_what_is_gone():
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1]}
    new = {"a": 1, "b": {"c": 4}, "f": 5}
    assert merge_patch(old, new) == {"b": {"c": 4, "d": None}, "e": None, "f": 5}
