"""The torch MoE path: routing, and its two ways of running the experts (grouped
matmuls on CPU where torch has them, a loop over experts otherwise) giving the same
bits."""

import pytest
import torch

from specd.kernels import moe


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=g)
    return x, w13, w2, *moe.route_topk(logits, top_k, renormalize=True)


def test_route_topk_renormalises_the_chosen_softmax():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    weights, ids = moe.route_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))
    raw, _ = moe.route_topk(logits, 2, renormalize=False)
    assert raw.sum() < 1


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_grouped_experts_equal_the_expert_loop(tokens, monkeypatch):
    x, w13, w2, weights, ids = _case(tokens, experts=8, top_k=2, hidden=64, inter=32)
    assert moe._grouped_mm_runs(x, w2)
    grouped = moe.moe_torch(x, w13, w2, weights, ids)
    monkeypatch.setattr(moe, "_grouped_mm_runs", lambda *_: False)
    looped = moe.moe_torch(x, w13, w2, weights, ids)
    assert torch.equal(grouped, looped)


def test_widths_grouped_mm_cannot_take_run_the_loop():
    x, w13, w2, weights, ids = _case(5, experts=4, top_k=2, hidden=70, inter=40)
    assert not moe._grouped_mm_runs(x, w2)
    want = torch.zeros_like(x)
    for token in range(5):  # the definition, one token and one expert at a time
        for slot in range(2):
            e = ids[token, slot]
            gate, up = (w13[e] @ x[token]).chunk(2)
            want[token] += weights[token, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe.moe_torch(x, w13, w2, weights, ids), want)
