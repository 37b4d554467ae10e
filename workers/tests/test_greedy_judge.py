"""The float32 judge of bf16 runs, and bf16 speculation on CPU held to it.

The judge must pass a run that takes the runner-up at a near tie and goes on greedily,
and fail one that parts where the float32 choice is clear, or goes wrong after a fair
parting.  The engine runs are the GPU matrix's bf16 check on CPU's bf16 arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from specd.devtools.greedy_judge import GreedyJudge
from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    Reference,
    ragged_demo_prompts,
    start_spec_engine,
)

BF16 = {"dtype": "bfloat16"}


@pytest.fixture(scope="module")
def judge():
    return GreedyJudge(DEMO_TARGET)


@pytest.fixture(scope="module")
def bf16_reference(judge):
    """The torch backend's bf16 greedy run, itself within tolerance of float32."""
    ref = Reference.run(DEMO_TARGET, ragged_demo_prompts(), 24, judge, model=BF16)
    judge.check_greedy(ref.prompts, ref.outputs)
    return ref


def find_position(judge, ref: Reference, near: bool) -> tuple[int, int, int]:
    """(output, position, another token): the first place where ``ref``'s token has a
    float32 rival within half the tolerance (``near``), or none within four times it;
    the rival is the best token other than the one chosen."""
    for n, (prompt, tokens) in enumerate(zip(ref.prompts, ref.outputs, strict=True)):
        logits = judge.logits(prompt, tokens)
        chosen = torch.tensor(tokens)[:, None]
        others = logits.scatter(-1, chosen, float("-inf"))
        gaps = (logits.gather(-1, chosen)[:, 0] - others.max(-1).values).abs()
        hits = torch.nonzero(gaps < judge.tolerance / 2 if near else gaps > 4 * judge.tolerance)
        if len(hits):
            position = int(hits[0])
            return n, position, int(others[position].argmax())
    raise AssertionError(f"no position with near={near} in the reference")


@torch.no_grad()
def float32_greedy(judge, prompt, tokens, n) -> list[int]:
    """``tokens`` continued greedily in float32 to ``n`` tokens."""
    ids = torch.tensor([[*prompt, *tokens]])
    out = judge.model.generate(ids, do_sample=False, max_new_tokens=n - len(tokens))
    return out[0, len(prompt) :].tolist()


def test_a_parting_at_a_near_tie_passes_and_a_clear_one_fails(judge, bf16_reference):
    n, tie, rival = find_position(judge, bf16_reference, near=True)
    prompt, want = bf16_reference.prompts[n], bf16_reference.outputs[n]
    fair = float32_greedy(judge, prompt, [*want[:tie], rival], len(want))
    assert fair != want
    assert judge.check_close([prompt], [fair], [want]) == 0

    worst = int(judge.logits(prompt, fair)[-1].argmin())
    with pytest.raises(AssertionError, match=f"token {len(fair) - 1} .*below the float32"):
        judge.check_close([prompt], [[*fair[:-1], worst]], [want])

    n, clear, wrong = find_position(judge, bf16_reference, near=False)
    prompt, want = bf16_reference.prompts[n], bf16_reference.outputs[n]
    with pytest.raises(AssertionError, match=f"token {clear} .*not a near tie"):
        judge.check_close([prompt], [[*want[:clear], wrong, *want[clear + 1 :]]], [want])


def test_outputs_of_another_length_fail(judge, bf16_reference):
    prompt, want = bf16_reference.prompts[0], bf16_reference.outputs[0]
    with pytest.raises(AssertionError):
        judge.check_close([prompt], [want[:-1]], [want])


@pytest.mark.parametrize(
    "page,steps,topk,overlap",
    [pytest.param(1, 4, 1, False, id="chain"), pytest.param(16, 3, 4, True, id="paged-tree")],
)
def test_bf16_speculation_on_cpu_is_greedy_up_to_near_ties(
    bf16_reference, page, steps, topk, overlap
):
    engine = start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, page, steps, topk, overlap=overlap, model=BF16
    )
    results = bf16_reference.check_run(engine)
    assert sum(r[2].usage.spec_accepted_tokens for r in results) > 20  # the trained draft
