"""Next-token sampling: greedy ids as argmax gives them, seeded draws reproduce."""

import pytest
import torch

from specd.workers.engine.sampling import greedy_ids, sample_next_tokens
from specd.workers.engine.types import SamplingParams
from specd.workers.scheduler.request import Req


@pytest.mark.parametrize("shape", [(8192,), (6, 8192), (2, 3, 17)])
def test_greedy_ids_are_argmax_and_take_the_first_of_tied_maxima(shape):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    peak = logits.max() + 1
    logits[..., 9] = peak  # every row ties at 9 and 4: the first index wins
    logits[..., 4] = peak
    assert torch.equal(greedy_ids(logits), logits.argmax(-1))
    assert (greedy_ids(logits) == 4).all()
    assert greedy_ids(logits).dtype == torch.int64


def _req(rid: str, **params) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_tokens=4, **params))


def test_greedy_rows_take_the_argmax_and_a_seeded_row_reproduces():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req("a"), _req("b", temperature=1.0, seed=7), _req("c")]
    first = sample_next_tokens(logits, reqs)
    assert first[0] == logits[0].argmax() and first[2] == logits[2].argmax()
    again = sample_next_tokens(logits, [_req("a"), _req("b", temperature=1.0, seed=7), _req("c")])
    assert torch.equal(first, again)
