"""SUFFIX drafting (suffix decoding): propose from the replica's recent outputs as well
as from the request's own tokens.

``SuffixIndex`` is a depth-limited suffix tree kept as a table: for every context of
1..``max_depth`` tokens that occurred in the stored outputs, how often each next token
followed it.  The stored outputs are a FIFO bounded by ``max_tokens``: inserting past the
bound evicts the oldest whole outputs and takes their counts back out, so the table
never holds more than ``max_tokens * max_depth`` contexts.

``SuffixCache`` keeps one index per owner (an API key's id; every request shares one
when the deployment allows sharing or has no keys), under one bound for the replica.

A proposal (``SuffixIndex.propose``) starts from the longest context of the request's
last tokens the index knows, then grows a tree best-first by probability: a child's is
its parent's times ``count / total`` of its context, children below ``min_token_prob``
are not proposed, each node keeps at most ``topk`` children, and the depth is at most
``max_spec_factor`` times the matched context's length (a short, weak match proposes
little), capped by the rung's steps.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque

from specd.workers.speculative.ngram import NgramProposer, Proposal, RequestTokens

SHARED = ""  # the owner of every request when outputs are shared


class SuffixIndex:
    """Next-token counts after every context of up to ``max_depth`` tokens in the stored
    outputs, with the outputs kept FIFO under ``max_tokens``."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self._next: dict[tuple[int, ...], Counter] = {}
        self._stored: deque[tuple[tuple[int, ...], int]] = deque()  # (tokens, output start)
        self.tokens = 0  # tokens of the stored outputs, their leads included

    @property
    def contexts(self) -> int:
        return len(self._next)

    def insert(self, tokens: tuple[int, ...], start: int = 0) -> None:
        """Store one output: ``tokens[start:]``, after the context ``tokens[:start]``
        (only tokens of the output are counted as followers)."""
        self._count(tokens, start, +1)
        self._stored.append((tokens, start))
        self.tokens += len(tokens)

    def evict_oldest(self) -> int:
        """Drop the oldest output -> its tokens (0 if none is stored)."""
        if not self._stored:
            return 0
        tokens, start = self._stored.popleft()
        self._count(tokens, start, -1)
        self.tokens -= len(tokens)
        return len(tokens)

    def _count(self, tokens: tuple[int, ...], start: int, sign: int) -> None:
        for end in range(max(start, 1), len(tokens)):
            follower = tokens[end]
            for depth in range(1, min(self.max_depth, end) + 1):
                context = tokens[end - depth : end]
                counts = self._next.get(context)
                if counts is None:
                    counts = self._next[context] = Counter()
                counts[follower] += sign
                if counts[follower] <= 0:
                    del counts[follower]
                    if not counts:
                        del self._next[context]

    def longest_context(self, history: tuple[int, ...]) -> tuple[int, ...]:
        """The longest suffix of ``history`` (at most ``max_depth``) seen, or ()."""
        for depth in range(min(self.max_depth, len(history)), 0, -1):
            context = history[len(history) - depth :]
            if context in self._next:
                return context
        return ()

    def propose(
        self,
        history: tuple[int, ...],
        steps: int,
        topk: int,
        num_nodes: int,
        min_token_prob: float,
        max_spec_factor: float,
    ) -> Proposal:
        """A tree of at most ``num_nodes`` drafts after ``history`` (see the module)."""
        context = self.longest_context(history)
        if not context:
            return Proposal([], [])
        max_depth = min(steps, max(1, int(max_spec_factor * len(context))))
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        # best-first: (-probability, order, parent node, token, depth, context after it)
        frontier: list = []
        order = 0

        def push_children(node: int, ctx: tuple[int, ...], prob: float, depth: int) -> None:
            nonlocal order
            counts = self._counts_after(ctx)
            if counts is None or depth >= max_depth:
                return
            total = sum(counts.values())
            for token, count in counts.most_common(topk):
                p = prob * count / total
                if p >= min_token_prob:
                    after = (*ctx, token)[-self.max_depth :]
                    heapq.heappush(frontier, (-p, order, node, token, depth + 1, after))
                    order += 1

        push_children(-1, context, 1.0, 0)
        while frontier and len(tokens) < num_nodes:
            neg_p, _, parent, token, depth, after = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            score -= neg_p
            push_children(len(tokens) - 1, after, -neg_p, depth)
        return Proposal(tokens, parents, score)

    def _counts_after(self, context: tuple[int, ...]) -> Counter | None:
        """The counts after the longest suffix of ``context`` the index knows."""
        for start in range(len(context)):
            counts = self._next.get(context[start:])
            if counts is not None:
                return counts
        return None


class SuffixCache:
    """Recent outputs per owner, one token bound for the replica (oldest evicted first)."""

    def __init__(self, max_depth: int, max_tokens: int, share: bool):
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.share = share
        self._indexes: dict[str, SuffixIndex] = {}
        self._order: deque[str] = deque()  # owners of the stored outputs, oldest first
        self.tokens = 0

    def owner_key(self, owner: str | None) -> str:
        return SHARED if self.share or owner is None else owner

    def index_of(self, owner: str | None) -> SuffixIndex | None:
        return self._indexes.get(self.owner_key(owner))

    @property
    def contexts(self) -> int:
        return sum(i.contexts for i in self._indexes.values())

    def insert(self, owner: str | None, output: tuple[int, ...], lead: tuple[int, ...]) -> None:
        """Store a finished request's ``output``, after the last ``max_depth`` tokens
        before it (``lead``) so contexts that span the two are counted; then evict the
        oldest outputs until the cache is within its bound."""
        lead = lead[-self.max_depth :] if self.max_depth else ()
        tokens = (*lead, *output)
        if not output or len(tokens) > self.max_tokens:
            return  # nothing to count, or it would evict everything and still not fit
        key = self.owner_key(owner)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = SuffixIndex(self.max_depth)
        index.insert(tokens, len(lead))
        self._order.append(key)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            oldest = self._order.popleft()
            self.tokens -= self._indexes[oldest].evict_oldest()
            if not self._indexes[oldest].tokens:
                del self._indexes[oldest]


class SuffixDrafting:
    """SUFFIX's proposal for a request: its own tokens' (``NgramProposer``) or its
    owner's cached outputs', whichever expects more accepted drafts; and the cache's
    updates from finished requests."""

    def __init__(
        self,
        own: NgramProposer,
        cache: SuffixCache,
        min_token_prob: float,
        max_spec_factor: float,
    ):
        self.own = own
        self.cache = cache
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor

    def propose(self, tokens: RequestTokens, steps: int, topk: int, num_nodes: int) -> Proposal:
        own = self.own.propose(tokens.history, steps, topk, num_nodes)
        index = self.cache.index_of(tokens.owner)
        if index is None:
            return own
        tail = tuple(tokens.history.tokens[-index.max_depth :].tolist())
        cached = index.propose(
            tail, steps, topk, num_nodes, self.min_token_prob, self.max_spec_factor
        )
        return cached if cached.score > own.score else own

    def record(self, tokens: RequestTokens) -> None:
        """A finished request's output joins the cache, after the tokens before it."""
        ids, start = tokens.history.tokens, tokens.output_start
        lead = ids[max(0, start - self.cache.max_depth) : start]
        self.cache.insert(tokens.owner, tuple(ids[start:].tolist()), tuple(lead.tolist()))
