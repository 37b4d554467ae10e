"""GraphRunner: bucket choice, emulated graphs without CUDA, capture and replay with it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from specd.kernels.emulated_graph import GraphCaptureError
from specd.workers.runner.graph_runner import GraphRunner, default_sizes


@pytest.mark.parametrize(
    "max_bs,sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
    ],
)
def test_default_sizes(max_bs, sizes):
    assert default_sizes(max_bs) == sizes


def toy_runner(device):
    """Bucket: an input buffer; body: 2 * x + 1 into a fresh output."""
    return GraphRunner(
        make_bucket=lambda size: torch.zeros(size, device=device),
        body=lambda x: 2 * x + 1,
        sizes=[4, 1, 2],
        device=torch.device(device),
    )


def run_toy(runner, values):
    size = runner.size_for(len(values))
    runner.bucket(size)[: len(values)] = torch.tensor(values, device=runner.device)
    return runner.run(size)[: len(values)].tolist()


def test_buckets_and_emulated_replays_on_cpu():
    runner = toy_runner("cpu")
    assert runner.sizes == [1, 2, 4] and runner.max_batch_size == 4
    assert [runner.size_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    with pytest.raises(RuntimeError, match="before capture"):
        runner.run(1)
    runner.capture()
    assert runner.mode == "emulated" and runner.status()["mode"] == "emulated"
    assert run_toy(runner, [1.0, 2.0, 3.0]) == [3.0, 5.0, 7.0]
    assert run_toy(runner, [5.0]) == [11.0]
    assert runner.replays == 2


def test_replays_leave_outputs_in_the_captured_tensors():
    """A run's outputs are the size's static outputs: the next run of the same size
    overwrites them (as a CUDA graph replay does), another size does not."""
    runner = toy_runner("cpu")
    runner.capture()
    first = runner.run(runner.size_for(2))
    runner.bucket(2)[:] = torch.tensor([1.0, 2.0])
    second = runner.run(2)
    assert second is first and first.tolist() == [3.0, 5.0]
    runner.bucket(4)[:] = 10.0
    assert runner.run(4).tolist() == [21.0] * 4 and first.tolist() == [3.0, 5.0]


def test_a_body_that_reads_changing_host_state_replays_it_stale():
    """What a capture freezes stays frozen: a host value read by the body is baked in,
    so a body that depends on one is caught by its outputs, as it would be on a GPU."""
    scale = {"value": 2.0}
    runner = GraphRunner(
        make_bucket=lambda size: torch.ones(size),
        body=lambda x: x * scale["value"],
        sizes=[2],
        device=torch.device("cpu"),
    )
    runner.capture()
    scale["value"] = 3.0
    assert runner.run(2).tolist() == [2.0, 2.0]


class _Cycle:
    """Refers to itself: only a garbage collection frees it."""

    def __init__(self):
        self.me = self


def test_no_garbage_is_collected_during_a_capture():
    """A collection inside a capture could destroy a dropped graph mid-capture (which
    invalidates a CUDA capture): garbage goes before, none during, collection resumes
    after, also when the body fails."""
    enabled_in_body = []

    def body(x):
        enabled_in_body.append(gc.isenabled())
        return 2 * x

    dropped = weakref.ref(_Cycle())
    assert dropped() is not None
    runner = GraphRunner(lambda size: torch.zeros(size), body, [1, 2], torch.device("cpu"))
    runner.capture()
    assert dropped() is None  # collected before the captures began
    assert enabled_in_body == [False, False] and gc.isenabled()

    def failing(x):
        raise ValueError("a body that fails")

    runner = GraphRunner(lambda size: torch.zeros(size), failing, [1], torch.device("cpu"))
    with pytest.raises(ValueError, match="fails"):
        runner.capture()
    assert gc.isenabled()


def test_a_body_that_syncs_cannot_be_captured():
    runner = GraphRunner(
        make_bucket=lambda size: torch.ones(size),
        body=lambda x: x[: int(x.sum().item())],
        sizes=[2],
        device=torch.device("cpu"),
    )
    with pytest.raises(GraphCaptureError, match="reads a value on the host"):
        runner.capture()


@pytest.mark.gpu
def test_capture_replays_the_bucket_it_was_filled_with():
    runner = toy_runner("cuda")
    runner.capture()
    assert runner.mode == "captured" and runner.status()["mode"] == "captured"
    assert run_toy(runner, [1.0, 2.0, 3.0]) == [3.0, 5.0, 7.0]
    assert run_toy(runner, [4.0, 0.5]) == [9.0, 2.0]  # the replay read the new buffer
    assert runner.capture_seconds > 0
