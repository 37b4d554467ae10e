"""The speculative decoder with NGRAM drafting: no draft model, no draft KV.

Everything after the draft is `SpecDecoder`'s: the verify forward over the tree, greedy
or tree speculative sampling (drafts are deterministic proposals, which is what its
target-only sampling assumes), the accepted path's KV move, log-probs, grammars and the
plain rung.  What differs is the drafting state: per request, its tokens so far
(``RequestTokens``, whose last is the root), kept on the compute side like EAGLE's draft state, so the host
lagging a step behind under overlap changes nothing.  A token decoded plainly (a plain
rung, or beside prefill chunks) is appended at once: there is no draft to catch up.

On plain steps the cost model still learns NGRAM's acceptance, which comes in bursts
(a request starts copying its context, then stops): up to ``SHADOWS_AT_ONCE`` requests
keep the draft they would have verified (``ShadowDraft``) and walk it with the tokens
plain decode produces; each finished walk is a sample (``shadow_samples``).

Proposals differ in size, and a request may have none: the verify is ragged.  Each
request's tree is its own nodes (``padded_tree`` cuts the padding off), and the verify
forward runs those alone, so a request with nothing to propose costs what a plain
decode of it would, beside the others' trees in the same forward.
"""

from __future__ import annotations

import torch

from specd.kernels import AttentionBackend
from specd.kernels.ops import TORCH_OPS, KernelOps, host_tensor
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.requests.request import Req
from specd.workers.rung import Rung
from specd.workers.runner.logits_processors import LogitsProcessors
from specd.workers.runner.model_runner import extend_layout
from specd.workers.speculative.decoder import AcceptedPaths, SpecDecoder
from specd.workers.speculative.guided_draft import DraftGuide
from specd.workers.speculative.layout import TreeLayout
from specd.workers.speculative.ngram import (
    NgramProposer,
    Proposal,
    RequestTokens,
    ShadowDraft,
    padded_tree,
)
from specd.workers.speculative.tree import DraftTree, ragged_verify_mask

SHADOWS_AT_ONCE = 8  # requests whose plain tokens measure acceptance at a time


class NgramDecoder(SpecDecoder):
    algorithm = "NGRAM"

    def __init__(
        self,
        target: LlamaForCausalLM,
        proposer: NgramProposer,
        page_size: int,
        req_pool: ReqToTokenPool,
        target_pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        *,
        ops: KernelOps = TORCH_OPS,
        force_accept_len: float | None = None,
        processors: LogitsProcessors | None = None,
        shadow_rung: Rung | None = None,
    ):
        """``shadow_rung``: measure on plain steps what this rung would accept (for the
        cost model), or None."""
        super().__init__(
            target,
            None,
            page_size,
            req_pool,
            target_pool,
            None,
            backend,
            device,
            ops=ops,
            force_accept_len=force_accept_len,
            processors=processors,
            guided_drafts=False,  # proposals are checked by the grammar at verify
        )
        self.proposer = proposer
        self.shadow_rung = shadow_rung
        self._shadows: dict[str, ShadowDraft] = {}  # rid -> its draft in the shadow
        self._shadow_samples: list[tuple[str, int]] = []  # (rid, accepted drafts)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden  # unused: NGRAM reads tokens only

    def after_extend(
        self,
        reqs: list[Req],
        starts: list[int],
        token_ids: list[list[int]],
        features: list[torch.Tensor],
        complete: list[bool],
    ) -> None:
        """A request whose prompt is now complete starts drafting from its sampled token,
        with its prompt (session history included) as the tokens it matches against."""
        self.states.update(RequestTokens.of_completed_prompts(reqs, starts, token_ids, complete))

    def defer(
        self, reqs: list[Req], roots: list[int], tokens: list[int], root_features: torch.Tensor
    ) -> tuple[float, int]:
        """A plainly decoded token joins its request's tokens at once -> (0.0, 0)."""
        for req, root, token in zip(reqs, roots, tokens, strict=True):
            state = self.state_at(req, root)
            shadow = self._shadow(req.rid, state)
            state.history.extend((token,))  # the root moves with it
            accepted = None if shadow is None else shadow.follow(token)
            if accepted is not None:  # the walk ended: the next root drafts anew
                self._shadow_samples.append((req.rid, accepted))
                del self._shadows[req.rid]
        return 0.0, 0

    def _shadow(self, rid: str, state: RequestTokens) -> ShadowDraft | None:
        """The request's draft in the shadow, proposed now (at its root) if it has none
        and fewer than ``SHADOWS_AT_ONCE`` requests have one (a bound on the cost)."""
        shadow = self._shadows.get(rid)
        if (
            shadow is None
            and self.shadow_rung is not None
            and (len(self._shadows) < SHADOWS_AT_ONCE)
        ):
            rung = self.shadow_rung
            proposal = self.propose(state, rung.steps, rung.topk, rung.draft_tokens - 1)
            shadow = self._shadows[rid] = ShadowDraft.of(proposal, rung.steps)
        return shadow

    def shadow_samples(self) -> tuple[tuple[str, int], ...]:
        samples, self._shadow_samples = tuple(self._shadow_samples), []
        return samples

    def propose(self, state: RequestTokens, steps: int, topk: int, num_nodes: int) -> Proposal:
        """The drafts for ``state``'s request: at most ``num_nodes``, ``steps`` deep and
        ``topk`` wide."""
        return self.proposer.propose(state.history, steps, topk, num_nodes)

    def drop(self, rids: list[str], finished: bool = False) -> None:
        super().drop(rids, finished)
        for rid in rids:
            self._shadows.pop(rid, None)

    def catch_up(self, reqs: list[Req]) -> tuple[float, int]:
        return 0.0, 0  # nothing is ever behind

    def _advance(
        self, reqs: list[Req], new_roots: list[int], rung: Rung, accepted: AcceptedPaths
    ) -> None:
        for req, old, toks in zip(reqs, accepted.roots, accepted.tokens, strict=True):
            self._shadows.pop(req.rid, None)  # a real verify ran: its walk is moot
            self.state_at(req, old).history.extend(toks)  # the root moves to the last

    def _duplicate_prefix_tails(
        self, rows: list[int], roots: list[int], layout: TreeLayout
    ) -> None:
        pass  # no draft KV to lay out

    def _draft_tree(
        self,
        reqs: list[Req],
        rows: list[int],
        states: list[RequestTokens],
        layout: TreeLayout,
        rung: Rung,
        guide: DraftGuide | None,
    ) -> DraftTree:
        nodes = rung.draft_tokens - 1
        proposals = [self.propose(s, rung.steps, rung.topk, nodes) for s in states]
        roots = [s.root_token for s in states]
        return padded_tree(proposals, roots, rung.steps, rung.draft_tokens, self.device, self.ops)

    def _verify_forward(
        self, rows: list[int], roots: list[int], tree: DraftTree
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged tree's verify forward: over request b's first ``tree.node_counts[b]``
        nodes only (no mask where every request verifies its root alone: a plain
        decode's attention) -> (hidden, features) [bs*T, H], zeros at the padding."""
        if tree.node_counts is None:
            return super()._verify_forward(rows, roots, tree)
        counts, width = list(tree.node_counts), tree.num_tokens
        own = host_tensor(
            [b * width + i for b, n in enumerate(counts) for i in range(n)], self.device
        )
        mask = None if max(counts) == 1 else ragged_verify_mask(tree, roots, counts)
        _, out_loc, meta = extend_layout(self.req_pool.req_to_token, rows, roots, counts, mask)
        positions = tree.positions(host_tensor(roots, self.device)).flatten()[own]
        ctx = ForwardContext.planned(self.backend, meta, out_loc, self.target_pool)
        hidden, features = self.verify_body(tree.tokens.flatten()[own], positions, ctx)
        padded = [
            x.new_zeros(len(rows) * width, x.shape[-1]).index_copy_(0, own, x)
            for x in (hidden, features)
        ]
        return padded[0], padded[1]

    def _draft_guesses(self, states: list[RequestTokens]) -> torch.Tensor:
        """The plain rung's probe: the token a chain would propose after each root."""
        firsts = [self.propose(s, 1, 1, 1).tokens for s in states]
        return host_tensor([f[0] if f else -1 for f in firsts], self.device)
