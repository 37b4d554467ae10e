"""Verify a draft tree against the target: greedy, and lossless tree speculative sampling.

The target ran once over the T tree nodes; its row at node i predicts the token after
the path root..i.  Verify walks from the root, accepting at most one child per level, and
ends with a bonus token drawn from the target at the last accepted node, so every verify
emits ``accept_len + 1`` tokens.  Outputs are padded with ``PAD`` to width S+1
(S = ``tree.num_steps``: at most S accepted drafts, then the bonus).

Note the counting: ``accept_len`` here excludes the bonus; the design's resolve rule
``committed += accept_len - 1`` counts it, i.e. uses ``num_new_tokens`` from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.kernels.ops import TORCH_OPS, KernelOps, first_true
from specd.workers.speculative.tree import DraftTree

PAD = -1

Coins = torch.Tensor | torch.Generator | Sequence[torch.Generator]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Per request (int64, PAD-padded to width S+1).

    accept_index [bs, S+1]: node indices of the accepted path, root first.
    accept_len [bs]: accepted draft tokens (bonus excluded).
    bonus_tokens [bs]: the target's token after the last accepted node.
    accepted_tokens [bs, S+1]: the tokens to append: accepted drafts, then the bonus.
    num_new_tokens [bs]: ``accept_len + 1``.
    """

    accept_index: torch.Tensor
    accept_len: torch.Tensor
    bonus_tokens: torch.Tensor
    accepted_tokens: torch.Tensor
    num_new_tokens: torch.Tensor


def _result(tree: DraftTree, last: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    """Result from the last accepted node [bs] and the bonus [bs]: the path is its ancestors."""
    rows = torch.arange(tree.batch_size, device=last.device)
    level = torch.arange(tree.num_steps + 1, device=last.device)  # [S+1]
    on_path = tree.tree_mask[rows, last]  # [bs, T]: ancestors of last, and last
    at_level = on_path[:, None, :] & (tree.depths[:, None, :] == level[None, :, None])
    accept_index = first_true(at_level)  # [bs, S+1]
    accept_len = tree.depths[rows, last]  # [bs]
    path_tokens = tree.tokens.gather(1, accept_index.clamp(min=0))  # [bs, S+1], root first
    drafts = torch.cat([path_tokens[:, 1:], torch.full_like(path_tokens[:, :1], PAD)], 1)
    accepted = torch.where(level < accept_len[:, None], drafts, PAD)
    accepted = torch.where(level == accept_len[:, None], bonus[:, None], accepted)
    return VerifyResult(accept_index, accept_len, bonus, accepted, accept_len + 1)


def unusable_paths(logits: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """logits [bs, T, V] a verify chose by -> bool [bs]: requests nothing could be
    chosen for (``engine/request_faults.py``): a NaN or +inf in any node's row, or the
    row the bonus was taken from all -inf (e.g. a grammar that allows no token there)."""
    peaks = logits.amax(-1)  # [bs, T]; amax propagates NaN
    bonus_row = result.accept_index.gather(1, result.accept_len[:, None].long())  # [bs, 1]
    broken = (torch.isnan(peaks) | torch.isposinf(peaks)).any(-1)
    return broken | torch.isneginf(peaks.gather(1, bonus_row))[:, 0]


def verify_greedy(
    tree: DraftTree, target_argmax: torch.Tensor, ops: KernelOps = TORCH_OPS
) -> VerifyResult:
    """target_argmax [bs, T]: the target's argmax at each node.

    From the root, move to the child whose token equals the target's argmax at the
    current node (the lowest index if siblings repeat a token) until none matches; the
    bonus is the argmax at the last accepted node.
    """
    target_argmax = target_argmax.long()
    last = ops.greedy_walk(
        tree.walk_tokens(),
        tree.parents,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        target_argmax,
        tree.num_steps,
    )
    rows = torch.arange(tree.batch_size, device=last.device)
    return _result(tree, last, target_argmax[rows, last])


def draw_coins(
    batch_size: int,
    num_tokens: int,
    generators: torch.Generator | Sequence[torch.Generator],
    device: torch.device | str,
) -> torch.Tensor:
    """[bs, T+1] uniforms in [0, 1): coin i decides node i when it is tried (each node is
    tried at most once); coin T samples the bonus.

    One generator draws the whole batch; a list gives request b its own stream, so its
    coins do not depend on which other requests share the batch.
    """
    n = num_tokens + 1
    if isinstance(generators, torch.Generator):
        return torch.rand(batch_size, n, generator=generators, device=generators.device).to(device)
    if len(generators) != batch_size:
        raise ValueError(f"got {len(generators)} generators for {batch_size} requests")
    rows = [torch.rand(n, generator=g, device=g.device).to(device) for g in generators]
    return torch.stack(rows) if rows else torch.zeros(0, n, device=device)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, coins: Coins) -> VerifyResult:
    """Lossless tree speculative sampling with target-only probabilities.

    target_probs [bs, T, V]: the target's distribution at each node, after temperature /
    top-k / top-p (one-hot rows reproduce greedy).  coins: [bs, T+1] uniforms (see
    ``draw_coins``), or the generator(s) to draw them from.  Drafts count as deterministic
    proposals: at a node with residual p, try the children in order, accepting token x
    with probability p(x) / sum(p); on rejection set p(x) = 0 and try the next sibling.
    On acceptance move to the child (p = its target row); when no child is left, sample
    the bonus from p.  Each emitted token is thus x with probability exactly p(x).

    Vectorized over requests; the loop runs once per try (at most T-1, each try uses up a
    node), with one host sync per try to stop early.  A fused kernel can replace it.
    """
    bs, t = tree.tokens.shape
    u = coins if isinstance(coins, torch.Tensor) else draw_coins(bs, t, coins, tree.tokens.device)
    rows = torch.arange(bs, device=tree.tokens.device)
    last = torch.zeros(bs, dtype=torch.long, device=rows.device)  # last accepted node
    cand = tree.retrieve_next_token[:, 0]  # [bs] child being tried, -1 when none left
    residual = target_probs[:, 0].double()  # [bs, V], unnormalized
    for _ in range(t - 1):
        trying = cand >= 0
        if not bool(trying.any()):
            break
        c = cand.clamp(min=0)
        x = tree.tokens[rows, c]
        px = residual[rows, x]
        accept = trying & (u[rows, c].double() * residual.sum(-1) < px)
        reject = trying & ~accept
        residual = residual.scatter(1, x[:, None], torch.where(reject, 0.0, px)[:, None])
        residual = torch.where(accept[:, None], target_probs[rows, c].double(), residual)
        last = torch.where(accept, c, last)
        nxt = torch.where(
            accept, tree.retrieve_next_token[rows, c], tree.retrieve_next_sibling[rows, c]
        )
        cand = torch.where(trying, nxt, cand)
    return _result(tree, last, _sample(residual, u[:, t]))


def _sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: weights [bs, V] >= 0 (unnormalized), u [bs] in [0, 1) -> [bs].

    float64 keeps ``u * total < total``, so a zero-weight token is never drawn.
    """
    cdf = weights.double().cumsum(-1)  # [bs, V]
    target = u.double()[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp(max=weights.shape[-1] - 1)


@dataclass(frozen=True, slots=True)
class PathMoves:
    """KV moves that make the accepted path contiguous; offsets are from ``seq_len``.

    src [bs, S+1]: where verify wrote the KV of the path node at depth d; dst [bs, S+1]: d.
    valid [bs, S+1]: d <= accept_len (the root and the accepted drafts; the bonus has no KV
    yet).  Everything after ``seq_len + accept_len + 1`` is rejected and stays as
    over-allocation.  Apply as gather-then-scatter (read every src, then write), e.g.
    ``k[dst_slots] = k[src_slots]``: a src may equal another entry's dst.
    """

    src: torch.Tensor
    dst: torch.Tensor
    valid: torch.Tensor

    def needed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(request [n], src [n], dst [n]) of the valid entries with src != dst (a sync)."""
        move = self.valid & (self.src != self.dst)
        req = torch.arange(self.src.shape[0], device=self.src.device)[:, None].expand_as(move)
        return req[move], self.src[move], self.dst[move]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) [bs, S+1] with every invalid entry a no-op move of offset 0 (the
        root onto itself): the same moves as ``needed`` with no host sync."""
        return self.src.clamp(min=0), self.dst.clamp(min=0)


def accepted_path_positions(
    result: VerifyResult, node_offsets: torch.Tensor | None = None
) -> PathMoves:
    """Where the accepted path's KV is and where it must go, as offsets from ``seq_len``.

    node_offsets [bs, T]: offset at which verify wrote node i's KV; default i (the T verify
    tokens at ``[seq_len, seq_len + T)`` in node order).  With the default, src >= dst and
    both increase along the path.
    """
    idx = result.accept_index.clamp(min=0)  # [bs, S+1]
    src = idx if node_offsets is None else node_offsets.long().gather(1, idx)
    dst = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    valid = dst <= result.accept_len[:, None]
    return PathMoves(torch.where(valid, src, PAD), torch.where(valid, dst, PAD), valid)
