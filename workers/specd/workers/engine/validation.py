"""What a request must satisfy before it is queued: every field checked against the
model, the deployment and the KV pool, refused with ``InvalidRequest`` naming it."""

from __future__ import annotations

from specd.workers.runner.logits_processors import check_processor_params
from specd.workers.runner.logprobs import MAX_TOP_LOGPROBS
from specd.workers.runner.sampling import check_sampling_params
from specd.workers.runner.structured_output import check_grammar_params
from specd.workers.scheduler.fit import FitPolicy
from specd.workers.scheduler.policy import Policy
from specd.workers.types import GenerateRequest, InvalidRequest


def validate_request(
    req: GenerateRequest, *, vocab_size: int, policy: Policy, fit: FitPolicy
) -> None:
    """Raise ``InvalidRequest`` naming the field if ``req`` cannot be served (a session
    turn's length is checked on the loop, with its history: `SessionStore.begin_turn`)."""
    n = len(req.prompt_ids)
    if n == 0:
        raise InvalidRequest("prompt: must contain at least one token")
    vocab = vocab_size
    if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
        raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})")
    if req.params.max_tokens < 1:
        raise InvalidRequest("max_tokens: must be at least 1")
    check_sampling_params(req.params, vocab)
    check_processor_params(req.params, vocab)
    check_grammar_params(req.params)
    for name in ("logprobs", "prompt_logprobs"):
        top = getattr(req.params, name)
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"{name}: must be in [0, {MAX_TOP_LOGPROBS}]")
    if req.params.prompt_logprobs is not None and req.session_id is not None:
        raise InvalidRequest(
            "prompt_logprobs: a session turn's history is cached, not scored; "
            "score the prompt without session_id"
        )
    if req.priority and policy != "priority":
        raise InvalidRequest(
            "priority: this deployment serves requests in arrival order; set "
            "spec.scheduler.policy: priority to use request priorities"
        )
    if req.session_id is None:
        fit.check(n, req.params.max_tokens)
