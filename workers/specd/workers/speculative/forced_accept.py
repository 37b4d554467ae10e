"""Benchmark-only verify: acceptance forced to a chosen mean length (``BenchKnobs``).

Random-weight models accept almost nothing, so a benchmark of speculative decoding at a
realistic acceptance draws how many drafts each verify accepts instead of comparing
tokens.  Everything after the accept (KV moves, draft extend, stop rules, metrics) runs
as for a real verify; only the tokens are no longer the target's.
"""

from __future__ import annotations

import math

import torch

from specd.workers.speculative.tree import DraftTree
from specd.workers.speculative.verify import VerifyResult, _result


def forced_accept(
    tree: DraftTree,
    target_argmax: torch.Tensor,
    mean_len: float,
    generator: torch.Generator,
) -> VerifyResult:
    """Accept ``n`` drafts along the first-child chain (node 0 -> retrieve_next_token
    -> ...), ``n`` drawn per request; the bonus is the target's argmax at the last one.

    mean_len: tokens per verify including the bonus (SGLang's accept length), so ``n``
    is ``floor(mean_len - 1)`` or one more, the latter with probability equal to the
    fractional part: its mean is ``mean_len - 1``.  ``n`` is clamped to the chain's
    depth, which only a tree (or ``mean_len - 1 > steps``) can make shorter.
    target_argmax [bs, T]; generator: seeded, on the tree's device.
    """
    bs = tree.batch_size
    device = tree.tokens.device
    drafts = mean_len - 1
    coins = torch.rand(bs, generator=generator, device=generator.device).to(device)  # [bs]
    n = math.floor(drafts) + (coins < drafts - math.floor(drafts)).long()  # [bs]
    rows = torch.arange(bs, device=device)
    last = torch.zeros(bs, dtype=torch.long, device=device)
    for depth in range(tree.num_steps):  # a walk that ran out of children stays put
        child = tree.retrieve_next_token[rows, last]
        last = torch.where((child >= 0) & (n > depth), child, last)
    return _result(tree, last, target_argmax.long()[rows, last])
