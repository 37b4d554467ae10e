"""Acceptance estimates for the cost model (``cost_model.py``): an EMA that starts as the
plain mean (``Ema``), when one is known (``acceptance_known``), and how deep a chain's
drafts are accepted (``ChainAcceptance``).  Plain Python, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# a verify batch of this many requests or more moves the acceptance EMA by emaAlpha, a
# smaller one by its share of that: a batch of one (a ragged end, a lone looping
# request) must not weigh as much as a full batch
ACCEPTANCE_BATCH = 8


@dataclass(slots=True)
class Ema:
    """An exponential moving average that starts as the plain mean: each sample moves
    it by ``alpha`` (compounded by its ``weight``) or by its share of all the weight so
    far, whichever is more, so the first samples are not outweighed by the seed."""

    alpha: float
    value: float | None = None
    weight: float = 0.0  # of the samples so far

    def add(self, sample: float, weight: float = 1.0) -> None:
        """Move toward ``sample`` (a mean of ``weight`` samples moves it as they would
        one by one, nearly)."""
        self.weight += weight
        step = max(1.0 - (1.0 - self.alpha) ** weight, weight / self.weight)
        self.value = sample if self.value is None else self.value + step * (sample - self.value)


def acceptance_known(ema: Ema | None) -> bool:
    """Whether an acceptance estimate has the weight of one full verify batch
    (``ACCEPTANCE_BATCH`` requests).  At batch 1 one verify's accepted drafts range over
    the whole tree (1 to 4 of 5 on the demo pair), and a first decision on two or three
    of them sent speculation that wins by 1.3x to plain for a whole 64-token request (a
    speculating loser reruns only after ``reexploreEvery`` decisions)."""
    return ema is not None and ema.weight >= 1.0


@dataclass(slots=True)
class ChainAcceptance:
    """How deep a chain's drafts are accepted: per depth j, an EMA (``Ema``) of the share
    of a verify's requests that accepted at least j drafts, from verifies at any chain
    length of j steps or more.  A chain's drafts do not depend on how many steps it
    drafts, so a chain of s steps accepts E[min(accepted, s)], the sum of the first s
    shares (``accepted``): the longest chain's verifies predict every shorter one."""

    alpha: float
    depths: list[Ema] = field(default_factory=list)  # depth j at [j - 1]
    verifies: int = 0  # observed so far, at any length
    fed: list[int] = field(default_factory=list)  # per depth: ``verifies`` when it last moved

    def add(self, accepted: Sequence[int], steps: int) -> None:
        """One verify at a chain of ``steps``: its requests' accepted drafts, weighed as
        the rung's estimate is (a full weight from ``ACCEPTANCE_BATCH`` requests)."""
        if not accepted:
            return
        self.verifies += 1
        while len(self.depths) < steps:
            self.depths.append(Ema(self.alpha))
            self.fed.append(0)
        weight = min(len(accepted) / ACCEPTANCE_BATCH, 1.0)
        for depth in range(1, steps + 1):
            share = sum(n >= depth for n in accepted) / len(accepted)
            self.depths[depth - 1].add(share, weight)
            self.fed[depth - 1] = self.verifies

    def stale(self, steps: int, every: int) -> bool:
        """Whether depth ``steps`` has not moved for ``every`` verifies: only a chain that
        long measures it, and a bucket that settled on a shorter one no longer runs it,
        so an early estimate (one verify of a batch that accepted little) would stand."""
        return len(self.fed) < steps or self.verifies - self.fed[steps - 1] >= every

    def accepted(self, steps: int) -> float | None:
        """Accepted drafts per request of a chain of ``steps``; None until each depth up
        to ``steps`` is known (``acceptance_known``)."""
        known = self.depths[:steps]
        if len(known) < steps or not all(acceptance_known(e) for e in known):
            return None
        return sum(e.value for e in known)

    def shares(self) -> tuple[float | None, ...]:
        """P(accepted >= j) for j = 1, 2, ... (None: not known yet)."""
        return tuple(e.value if acceptance_known(e) else None for e in self.depths)
