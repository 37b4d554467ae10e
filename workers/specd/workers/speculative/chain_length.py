"""A chain's length per batch (``costModel.chooseSteps``, DESIGN §5).

With ``chooseSteps``, a chain drafted by a model (topk 1) is weighed with each shorter
chain (``CostModel.choose_chain``).  Their drafts are the chain's first ones, so the
chain's own verifies say how often a request accepts its first j drafts
(``acceptance.ChainAcceptance``: P(accepted >= j) per depth j), and a chain of s steps
accepts the sum of the first s of those.  A shorter chain's cost per request, until the
bucket has measured it, lies on the line through the measured ones (as ratios to
plain's; plain is the chain of 0 steps).  Per verify step on the 2-core VM, a batch of
32 made the most tokens per second with 1-2 of the demo chain's 5 steps, and batches of
1 and 8 with all 5: one configured chain, its length per batch (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from specd.workers.rung import Rung


def shorter_chains(rung: Rung) -> list[Rung]:
    """The speculating rungs a batch offered ``rung`` may run: each chain of 1 to its
    steps when it is a chain, else ``rung`` alone (a tree keeps its shape)."""
    if rung.topk != 1 or not rung.speculates:
        return [rung]
    return [Rung(steps, 1, steps + 1) for steps in range(1, rung.steps + 1)]


def ratio_on_line(points: Sequence[tuple[int, float]], steps: int) -> float:
    """A chain of ``steps``' cost ratio to plain on the broken line through ``points``
    ((steps, ratio), ascending, from (0, 1.0): plain), past the last one along the last
    segment, never falling (a longer chain does not cost less; noisy ratios may say
    so): a verify's step time grows about linearly with its draft steps."""
    for (s0, r0), (s1, r1) in itertools.pairwise(points):
        if steps <= s1:
            return r0 + (r1 - r0) * (steps - s0) / (s1 - s0)
    (s0, r0), (s1, r1) = points[-2], points[-1]
    return r1 + max(r1 - r0, 0.0) * (steps - s1) / (s1 - s0)


def fastest_chain(
    accepted: Mapping[Rung, float],
    measured: Mapping[int, float],
    kept: Rung | None,
    margin: float,
) -> Rung:
    """Of the chains in ``accepted`` (their accepted drafts per request), the one with
    the most tokens per unit of plain's cost: ``1 + accepted`` over its cost ratio to
    plain, ``measured`` (steps -> ratio) or on the line through those
    (``ratio_on_line``).  ``kept``, the bucket's last choice, stays unless another is
    ``margin`` ahead."""
    line = [(0, 1.0), *sorted(measured.items())]
    gains = {c: (1.0 + n) / ratio_on_line(line, c.steps) for c, n in accepted.items()}
    best = max(gains, key=gains.__getitem__)
    if kept in gains and gains[best] < gains[kept] * (1.0 + margin):
        return kept
    return best
