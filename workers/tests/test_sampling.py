"""Next-token sampling: greedy ids as argmax gives them, seeded draws reproduce, the
deployment's sampling defaults fill what a request leaves out, and a request's
parameters reach the engine."""

import pytest
import torch

from specd.workers.gateway.protocol import ChatCompletionRequest, CompletionRequest
from specd.workers.gateway.responses_api import ResponsesRequest, to_chat
from specd.workers.requests.request import Req
from specd.workers.runner.sampling import greedy_ids, sample_next_tokens
from specd.workers.types import SamplingParams


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
    first, unusable = sample_next_tokens(logits, reqs)
    assert not unusable.any()
    assert first[0] == logits[0].argmax() and first[2] == logits[2].argmax()
    again, _ = sample_next_tokens(
        logits, [_req("a"), _req("b", temperature=1.0, seed=7), _req("c")]
    )
    assert torch.equal(first, again)


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_defaults_fill_only_the_fields_a_request_leaves_out(kind):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    if kind is ChatCompletionRequest:
        del body["prompt"]
    else:
        del body["messages"]
    defaults = {
        "temperature": 0.0,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
    }
    left_out = kind.model_validate(body).sampling_params(16, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.0, 0.8, 20)
    assert (left_out.repetition_penalty, left_out.min_p) == (1.1, 0.05)
    assert left_out.greedy
    # a request's own value wins, also when it is the OpenAI default
    own = kind.model_validate({**body, "temperature": 1.0, "top_k": -1, "repetition_penalty": 1})
    params = own.sampling_params(16, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.8, -1)
    assert (params.repetition_penalty, params.min_p) == (1.0, 0.05)
    plain = kind.model_validate(body).sampling_params(16)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1)
    assert (plain.repetition_penalty, plain.min_p) == (1.0, 0.0)


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_speculative_false_reaches_the_engines_parameters(kind):
    body = {"model": "m", "prompt": "x"}
    if kind is ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert kind.model_validate(body).sampling_params(16).speculative
    opted_out = kind.model_validate({**body, "speculative": False}).sampling_params(16)
    assert opted_out.speculative is False


def test_a_responses_request_passes_speculative_false_to_chat():
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "speculative": False})
    chat = ChatCompletionRequest.model_validate(to_chat(body, []))
    assert chat.sampling_params(16).speculative is False


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-12])
def test_a_top_p_below_float32s_smallest_still_keeps_the_top_token(top_p):
    # 5e-324 is a valid float in (0, 1] that rounds to 0 in float32: without the first
    # token pinned, every token was dropped and the request failed "logits are not finite"
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    reqs = [
        _req("a", temperature=1.0, top_p=top_p, seed=1),
        _req("b", temperature=1.0, top_p=top_p),
    ]
    tokens, unusable = sample_next_tokens(logits, reqs)
    assert not unusable.any()
    assert tokens.tolist() == logits.argmax(-1).tolist()
