"""EmulatedGraph: a CPU capture freezes and replays what a CUDA graph would, and refuses
what a CUDA capture cannot hold."""

from __future__ import annotations

import threading

import pytest
import torch

from specd.kernels.emulated_graph import EmulatedGraph, GraphCaptureError, GraphReplayError
from specd.kernels.ops import TorchOps
from specd.kernels.ops_choice import get_ops


def captured(body, *inputs):
    graph = EmulatedGraph()
    with torch.inference_mode(), graph.capture():
        out = body(*inputs)
    return graph, out


def test_replay_recomputes_from_the_buffers_as_they_are_now():
    """Fresh allocations, in-place writes, views and multi-output ops all leave the new
    results in the tensors the capture returned."""
    x = torch.tensor([3.0, 1.0, 2.0, 5.0])
    scratch = torch.zeros(4)

    def body(x):
        scratch.copy_(x * 2)  # in place on a buffer from outside
        doubled = scratch.view(2, 2)  # a view of it
        values, index = torch.topk(x, 2)  # two fresh outputs
        return doubled, values, index, (x + 1)[1:]

    graph, (doubled, values, index, tail) = captured(body, x)
    x.copy_(torch.tensor([0.0, 9.0, 4.0, 7.0]))
    graph.replay()
    assert doubled.tolist() == [[0.0, 18.0], [8.0, 14.0]]
    assert values.tolist() == [9.0, 7.0] and index.tolist() == [1, 3]
    assert tail.tolist() == [10.0, 5.0, 8.0]


def test_host_values_are_frozen_at_capture():
    x = torch.arange(6)
    limit = {"n": 2}
    graph, out = captured(lambda x: x[: limit["n"]] * 10, x)
    limit["n"] = 5
    x.add_(1)
    graph.replay()
    assert out.tolist() == [10, 20]  # the slice bound of the capture, the data of now


def test_scalar_assignments_are_capturable():
    x = torch.zeros(2, 3, dtype=torch.long)

    def body(x):
        x[:, 0] = -1  # torch wraps the scalar in a 0-dim tensor: not host data
        return x.repeat_interleave(2, dim=0)  # repeats by an int: a fixed shape

    graph, out = captured(body, x)
    x.fill_(7)
    graph.replay()
    assert out[:, 0].tolist() == [-1] * 4 and out[:, 1].tolist() == [7] * 4


SYNCS = {
    "item": lambda x: x.sum().item(),
    "int": lambda x: int(x[0]),
    "bool": lambda x: 1 if (x > 0).any() else 0,
    "tolist": lambda x: x.tolist(),
    "nonzero": lambda x: x.nonzero(),
    "mask-index": lambda x: x[x > 1],
    "mask-assign": lambda x: x.__setitem__(x > 1, 0),
    "host-data": lambda x: x + torch.tensor([1, 2, 3]),
    "repeat-by-tensor": lambda x: x.repeat_interleave(x),
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("name", SYNCS)
def test_what_a_cuda_capture_cannot_hold_is_refused(name):
    with pytest.raises(GraphCaptureError, match="a captured body calls aten"):
        captured(SYNCS[name], torch.tensor([1, 2, 3]))


def test_triton_launches_are_recorded_and_replayed():
    """A Triton kernel (the interpreter on CPU) replays on the inputs' new contents, and
    its own host-side work is not mistaken for the body's."""
    parents = torch.tensor([[-1, 0, 0, 1]])
    graph, tree = captured(get_ops("triton").tree_structure, parents)
    parents.copy_(torch.tensor([[-1, 0, 1, 2]]))  # a chain now
    graph.replay()
    expected = TorchOps().tree_structure(parents)
    assert torch.equal(tree.depths, expected.depths) and tree.depths.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(tree.tree_mask, expected.tree_mask)
    assert torch.equal(tree.next_token, expected.next_token)


def test_only_the_capturing_thread_is_recorded():
    x, other = torch.ones(3), torch.zeros(3)
    started, release = threading.Event(), threading.Event()

    def elsewhere():
        started.wait()
        other.add_(1)  # while the main thread captures
        release.set()

    worker = threading.Thread(target=elsewhere)
    worker.start()

    def body(x):
        started.set()
        release.wait(10)
        return x * 2

    graph, _ = captured(body, x)
    worker.join()
    graph.replay()
    graph.replay()
    assert other.tolist() == [1.0] * 3


def test_a_replay_after_an_input_was_dropped_is_refused():
    """The graph does not keep what it reads alive (a CUDA graph keeps addresses): an
    input whose owner let it go is memory a GPU may have handed to someone else."""
    owner = {"buffer": torch.ones(3)}
    kept = torch.ones(3)
    graph, out = captured(lambda: owner["buffer"] + kept)
    graph.replay()
    assert out.tolist() == [2.0] * 3
    owner["buffer"] = torch.zeros(3)  # rebound: the captured tensor is gone
    with pytest.raises(GraphReplayError, match=r"\(3,\) torch.float32.*freed"):
        graph.replay()


def test_what_the_graph_made_and_changed_in_place_outlives_the_body():
    """Intermediates live with the graph (its memory pool); an input changed in place is
    still the caller's, not the graph's."""
    owner = {"x": torch.ones(2)}

    def body(x):
        tmp = x * 3  # made by the graph, dropped by the body
        x.add_(1)  # in place on the input: returns the input itself
        return tmp + x

    graph, out = captured(body, owner["x"])
    assert out.tolist() == [5.0, 5.0]
    graph.replay()  # tmp = 6, x = 3
    assert out.tolist() == [9.0, 9.0] and owner["x"].tolist() == [3.0, 3.0]
    owner.clear()
    with pytest.raises(GraphReplayError):
        graph.replay()


def test_captures_neither_nest_nor_repeat():
    graph = EmulatedGraph()
    with graph.capture():
        torch.ones(1).add_(1)
        with pytest.raises(GraphCaptureError, match="do not nest"), EmulatedGraph().capture():
            pass
    with pytest.raises(GraphCaptureError, match="already captured"), graph.capture():
        pass
