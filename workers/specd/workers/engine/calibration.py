"""The cost model's calibration at load (DESIGN §5): before a replica serves, made-up
batches of each of ``costModel.calibrationBatchSizes`` run a few verify steps on the
speculating rung and a few plain, so that the first real batch of that size finds both
step costs (and their ratio) measured, and has only the draft's acceptance left to
learn from real text.  Measurement goes on online from there.

The made-up requests are the engine's own (scheduler, KV, draft state), without a
stream: nothing is sent, the prefix cache is set aside (``KVManager.uncached``), their
acceptance is not counted (``SpecPolicy.calibrating``), and the engine's metrics start
over afterwards (``calibrate_at_load``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specd.workers.contracts import CostCalibration
from specd.workers.engine.pipeline import StepPipeline
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.requests.request import Req
from specd.workers.rung import PLAIN, Rung
from specd.workers.scheduler.scheduler import Scheduler
from specd.workers.speculative.adaptive import SpecPolicy
from specd.workers.speculative.cost_model import FIRST_SAMPLES_DROPPED, MIN_SAMPLES
from specd.workers.types import SamplingParams

log = logging.getLogger(__name__)

PROMPT_TOKENS = 64  # per made-up prompt, at most (``CalibrationPlan.prompt_tokens``)
STEPS_PER_RUNG = FIRST_SAMPLES_DROPPED + MIN_SAMPLES  # a rung's steps per batch size
STEP_LIMIT = 512  # steps one phase may take: a batch that cannot form must not hang the load


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What a calibration runs: the batch sizes, each request's prompt and output."""

    batch_sizes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int

    @classmethod
    def of(
        cls,
        asked: Sequence[int],
        *,
        max_running: int,
        kv_tokens: int,
        context_length: int,
        chunk_tokens: int,
        verify_tokens: int,
    ) -> CalibrationPlan | None:
        """``asked`` clipped to what the replica can run: at most ``max_running``
        requests, as many as half the KV pool holds, and without the largest sizes
        whose requests would not fit the context (``_fitted``).  None: nothing to run
        (none asked, or no room)."""
        sizes = sorted({min(size, max_running) for size in asked})
        while sizes:
            plan = cls._fitted(sizes, kv_tokens, context_length, chunk_tokens, verify_tokens)
            if plan is not None:
                return plan
            sizes.pop()
        return None

    @classmethod
    def _fitted(
        cls,
        sizes: list[int],
        kv_tokens: int,
        context_length: int,
        chunk_tokens: int,
        verify_tokens: int,
    ) -> CalibrationPlan | None:
        """A prompt takes at most ``PROMPT_TOKENS`` and a quarter of the context, and
        the largest batch's prompts about four prefill chunks of ``chunk_tokens``; a
        request's output has room for the plain decodes beside the other prompts'
        chunks and two rungs' steps of up to ``verify_tokens`` each.  None: such a
        request does not fit the context, or no size fits the pool."""
        widest = sizes[-1]
        prompt = min(PROMPT_TOKENS, context_length // 4, max(4 * chunk_tokens // widest, 8))
        prefill_steps = -(-widest * prompt // chunk_tokens) + widest
        max_tokens = prefill_steps + 2 * STEPS_PER_RUNG * verify_tokens + 4
        if prompt < 1 or prompt + max_tokens + verify_tokens >= context_length:
            return None
        fits = kv_tokens // (2 * (prompt + max_tokens + verify_tokens))
        fitted = sorted({min(size, fits) for size in sizes} - {0})
        return cls(tuple(fitted), prompt, max_tokens) if fitted else None


def made_up_prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids drawn from the whole vocabulary: no text, so no draft guesses
    them, and a verify's width (a draft model's tree) is the same as on real text."""
    draw = random.Random(seed)
    return [draw.randrange(vocab_size) for _ in range(length)]


def calibrate_at_load(engine) -> None:
    """Measure a loaded ``Engine``'s step costs on made-up batches before it serves
    (where its cost model decides and a draft model drafts), then start its metrics over
    and check that every KV slot came back.  (The engine is not imported here: it
    imports this module.)"""
    policy, spec = engine.spec_policy, engine.spec
    if policy is None or not policy.calibrates:
        return
    plan = CalibrationPlan.of(
        policy.cost_model.params.calibration_batch_sizes,
        max_running=spec.max_running_requests,
        kv_tokens=engine.allocator.total_tokens,
        context_length=engine.context_length,
        chunk_tokens=spec.scheduler.chunked_prefill_size,
        verify_tokens=max(rung.draft_tokens for rung in spec.speculative.ladder) + 1,
    )
    if plan is None:
        return
    try:
        report = calibrate(
            plan,
            policy,
            engine.pipeline,
            engine.scheduler,
            engine.kv,
            engine.model_config.vocab_size,
        )
    except Exception as err:
        raise RuntimeError(
            f"the cost model's calibration at load failed ({type(err).__name__}: {err}); "
            "spec.speculative.policy.costModel.calibrationBatchSizes: [] skips it"
        ) from err
    policy.cost_model.calibration = report
    log.info("engine %s: cost model calibrated: %s", engine.replica, report)
    engine.scheduler.take_step_stats()
    engine.metrics.start_over()
    engine.metrics.kv_tokens_total.set(engine.allocator.total_tokens)
    engine.executor.publish_info()
    engine.leak_checks.run("idle")


def calibrate(
    plan: CalibrationPlan,
    policy: SpecPolicy,
    pipeline: StepPipeline,
    scheduler: Scheduler,
    kv: KVManager,
    vocab_size: int,
) -> CostCalibration:
    """Run ``plan``'s batches through the engine's own steps, the speculating rung then
    plain at each size, and leave the engine as it was, with the cost model's step
    costs measured."""
    start, steps = time.perf_counter(), 0
    speculating = policy.active
    with kv.uncached():
        try:
            for size in plan.batch_sizes:
                policy.calibrating = speculating
                reqs = [
                    Req(
                        rid=f"calibration-{size}-{i}",
                        prompt_ids=made_up_prompt(i, plan.prompt_tokens, vocab_size),
                        params=SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True),
                    )
                    for i in range(size)
                ]
                for req in reqs:
                    scheduler.add(req)
                steps += _run_batch(reqs, policy, pipeline, speculating)
                pipeline.settle("calibration")
                for req in reqs:
                    scheduler.abort(req.rid)
        finally:
            pipeline.settle("calibration")
            policy.calibrating = None
    return CostCalibration(
        batch_sizes=plan.batch_sizes, steps=steps, seconds=round(time.perf_counter() - start, 3)
    )


def _run_batch(
    reqs: list[Req], policy: SpecPolicy, pipeline: StepPipeline, speculating: Rung
) -> int:
    """Prefill ``reqs``, then verify them ``STEPS_PER_RUNG`` times at ``speculating`` and
    at plain -> the steps run (each phase at most ``STEP_LIMIT``)."""
    model, size = policy.cost_model, len(reqs)
    steps = _run_until(pipeline, lambda: all(r.spec_ready or r.finished for r in reqs))
    for rung in (speculating, PLAIN):
        policy.calibrating = rung
        target = model.samples(size, rung) + STEPS_PER_RUNG

        def measured(rung=rung, target=target) -> bool:
            return model.samples(size, rung) >= target or all(r.finished for r in reqs)

        steps += _run_until(pipeline, measured)
    return steps


def _run_until(pipeline: StepPipeline, done: Callable[[], bool]) -> int:
    """Run engine steps until ``done`` (at most ``STEP_LIMIT``) -> the steps run."""
    for steps in range(STEP_LIMIT):
        if done():
            return steps
        pipeline.run_step()
    return STEP_LIMIT
