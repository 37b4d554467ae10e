"""What the scheduler did during one engine step, as a value the engine adds to its
metrics (the scheduler keeps the running totals; `Scheduler.take_step_stats`)."""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True, slots=True)
class StepStats:
    retractions: int = 0  # running requests requeued because KV ran out
    preemptions: int = 0  # running requests requeued for a waiting one of higher priority
    session_evictions: int = 0  # session KV freed under pressure (their tokens kept)
    prefix_queried_tokens: int = 0  # tokens admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found (their prefill skipped)
    row_width_errors: int = 0  # drafting requests failed: their row could not grow

    def since(self, earlier: StepStats) -> StepStats:
        """The counts added after ``earlier`` (both running totals)."""
        return StepStats(*(a - b for a, b in zip(astuple(self), astuple(earlier), strict=True)))
