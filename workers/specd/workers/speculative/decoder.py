"""One speculative decode step on tensors: draft a tree, verify it, keep the accepted path.

The scheduler has already grown each request's allocation and pre-claimed the root slot;
this module only reads and writes KV inside ``[root_pos - tail, root_pos + alloc_len)``.
Per step, for ``bs`` requests at the batch's rung (k = topk, S = steps, T = draft tokens)::

    draft step 0      logits from the stored draft hidden             -> k nodes
    draft steps 1..S-1  bs*k one-token forwards (prefix + ancestors)  -> k nodes each
    build_tree        best T-1 nodes + root                           -> [bs, T]
    verify            one target forward over bs*T tokens, tree mask
    accept            greedy walk or tree speculative sampling; move the path's KV
    draft extend      the draft re-reads the accepted tokens with the target's hidden
    (scheduler)       append tokens, stop rules, resolve committed (maybe a step later)

The plain rung (S = 0, T = 1) verifies the root alone: one target token per request,
chosen exactly as plain decode would (argmax, or a draw from the filtered target
distribution), then the draft extend over it keeps the draft state current.  Its draft
step 0 is reduced to a free probe: the draft's top-1 from the stored state, compared
with the target's token, so the adaptive controller can measure acceptance at rung 0.

The draft loop lives in ``draft_loop.py``; with CUDA graphs enabled (``step_graphs.py``)
the draft loop, the verify forward and the draft extend replay captured graphs when one
fits the batch, and run eagerly otherwise.

Draft position ``p`` pairs token ``p + 1`` with the target hidden of position ``p``
(``model/eagle.py``), so the draft rows of a verify's accepted path sit at the same row
positions as the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specd.kernels import AttentionBackend
from specd.kernels.ops import TORCH_OPS, KernelOps, host_tensor
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.requests.faults import contained
from specd.workers.requests.request import Req
from specd.workers.rung import Rung
from specd.workers.runner.logits_processors import LogitsProcessors
from specd.workers.runner.logprobs import path_logprobs
from specd.workers.runner.model_runner import extend_layout
from specd.workers.runner.sampling import (
    filtered_probs,
    greedy_ids,
    request_generator,
    usable_probs,
)
from specd.workers.speculative.deferred_extend import Backlog
from specd.workers.speculative.draft_head import DraftHead
from specd.workers.speculative.draft_loop import DraftInputs, DraftLoop
from specd.workers.speculative.forced_accept import forced_accept
from specd.workers.speculative.guided_draft import DraftGuide
from specd.workers.speculative.layout import TreeLayout
from specd.workers.speculative.seq_lens import SeqLens
from specd.workers.speculative.tree import DraftTree, build_tree, tree_attention_mask_for_verify
from specd.workers.speculative.verify import (
    VerifyResult,
    accepted_path_positions,
    unusable_paths,
    verify_greedy,
    verify_sampling,
)


@dataclass(frozen=True, slots=True)
class AcceptedPaths:
    """A verify's accepted paths, as the draft re-reads them: per request its row and root,
    the tokens appended (accepted drafts, then the bonus), the target's draft features
    at every tree node [bs, T, H], and the path's node indices [bs, S+1] (PAD-padded)."""

    rows: list[int]
    roots: list[int]
    tokens: list[list[int]]
    features: torch.Tensor
    accept_index: torch.Tensor


class KVWriteOutOfBounds(RuntimeError):
    """A speculative step would write KV outside its request's allocation."""


@dataclass(frozen=True, slots=True)
class DraftState:
    """A request's drafting state between steps, kept on the compute side (the host may
    lag a step behind under overlap): the root and the draft's output before it."""

    root_position: int  # the root (last bonus token) sits here; its KV is not written yet
    root_token: int
    features: torch.Tensor  # [H] input features for the next draft step
    logit_hidden: torch.Tensor  # [H] scores the token after the root


@dataclass(frozen=True, slots=True)
class SpecStepOut:
    """Per request: tokens to append (accepted drafts, then the bonus) and the stats."""

    new_tokens: tuple[tuple[int, ...], ...]
    accept_lens: tuple[int, ...]  # accepted drafts, bonus excluded
    # plain rung only: 1 where the draft's top-1 guess equalled the target's token
    probes: tuple[int, ...] = ()
    # per request, its new tokens' TokenLogprobs (None if it did not ask)
    logprobs: tuple = ()
    # indices of the requests whose logits were unusable (engine/request_faults.py)
    unusable: tuple[int, ...] = ()
    seconds: float = 0.0  # the step's compute time, set by the executor (cost model)
    catch_up_seconds: float = 0.0  # of which the draft reading deferred tokens took
    catch_up_tokens: int = 0  # the deferred tokens it read
    # drafts a speculating step would have accepted, measured on plain tokens (NGRAM)
    shadow_accepted: tuple[tuple[str, int], ...] = ()  # (rid, accepted drafts) per walk
    suffix_trees: int = 0  # requests that verified SUFFIX's tree instead (hybrid)
    # per request, the nodes it verified, the root included, where the tree was ragged
    # (NGRAM, SUFFIX: no padding); empty: the rung's T for every request
    node_counts: tuple[int, ...] = ()


class SpecDecoder:
    def __init__(
        self,
        target: LlamaForCausalLM,
        head: DraftHead | None,
        page_size: int,
        req_pool: ReqToTokenPool,
        target_pool: KVPool,
        draft_pool: KVPool | None,
        backend: AttentionBackend,
        device: torch.device,
        *,
        ops: KernelOps = TORCH_OPS,
        force_accept_len: float | None = None,
        processors: LogitsProcessors | None = None,
        guided_drafts: bool = True,
    ):
        self.target = target
        self.processors = processors or LogitsProcessors(())
        self.head = head
        self.page_size = page_size
        self._layouts: dict[Rung, TreeLayout] = {}
        self.req_pool = req_pool
        self.target_pool = target_pool
        self.draft_pool = draft_pool
        self.backend = backend
        self.device = device
        self.ops = ops  # tree structure, verify walk, KV index gathers and moves
        # rid -> state, or the positions it has not read yet; compute side only
        self.states: dict[str, DraftState | Backlog] = {}
        self.last_seq_lens: SeqLens | None = None  # the last step's lengths (tests, debugging)
        self.force_accept_len = force_accept_len  # benchmark-only (engine/bench_knobs.py)
        self._forced_draws = torch.Generator(device).manual_seed(0)
        self.guided_drafts = guided_drafts  # constrained requests draft what their grammar allows
        if head is not None:  # a draft model (a draft-free subclass drafts otherwise)
            self.algorithm = head.config.algorithm.value
            self.draft_loop = DraftLoop(head, ops, req_pool, draft_pool, backend)
            self._draft_vocab = head.draft_vocab_targets()  # guided drafting's id map
        self.graphs = None  # SpecGraphs once the engine enables CUDA graphs
        self.shadow_rung: Rung | None = None  # see ``shadow_samples``

    def layout_for(self, rung: Rung) -> TreeLayout:
        """The draft-tree placement of ``rung`` (one per rung, built on first use)."""
        if rung not in self._layouts:
            self._layouts[rung] = TreeLayout(self.page_size, rung.topk, rung.steps)
        return self._layouts[rung]

    def drop(self, rids: list[str], finished: bool = False) -> None:
        """Forget requests that were retracted, or ``finished`` (their output is final)."""
        for rid in rids:
            self.states.pop(rid, None)

    # -- draft extend -------------------------------------------------------
    @torch.inference_mode()
    def after_extend(
        self,
        reqs: list[Req],
        starts: list[int],
        token_ids: list[list[int]],
        features: list[torch.Tensor],
        complete: list[bool],
    ) -> None:
        """Draft rows for the positions a target extend just filled; a request whose
        prompt is now complete (``complete``) starts drafting from its sampled token."""
        outputs = self._draft_extend([r.kv.row for r in reqs], starts, token_ids, features)
        for req, start, ids, done, (feats, hidden) in zip(
            reqs, starts, token_ids, complete, outputs, strict=True
        ):
            if done:
                self.states[req.rid] = DraftState(start + len(ids), ids[-1], feats, hidden)

    def _draft_extend(
        self,
        rows: list[int],
        starts: list[int],
        token_ids: list[list[int]],
        features: list[torch.Tensor],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Draft rows for positions ``[start, start + n)`` of each request, causal over its
        row -> per request, the draft's (features, logit hidden) at its last row.

        token_ids[i]: the tokens one position ahead (``fill_ids[p + 1]``); features[i]:
        [n, H] target features at those positions.
        """
        if not rows:
            return []
        lens = [len(t) for t in token_ids]
        positions, out_loc, meta = extend_layout(self.req_pool.req_to_token, rows, starts, lens)
        ids = host_tensor([t for ts in token_ids for t in ts], self.device)
        ctx = ForwardContext.planned(self.backend, meta, out_loc, self.draft_pool)
        next_feats, logit_hidden = self.head.forward(ids, torch.cat(features), positions, ctx)
        ends = (torch.cumsum(torch.tensor(lens), 0) - 1).tolist()
        return [(next_feats[e], logit_hidden[e]) for e in ends]

    # -- one decode step -----------------------------------------------------
    @torch.inference_mode()
    def step(
        self, reqs: list[Req], granted_lens: list[int], rung: Rung, defer: bool = False
    ) -> SpecStepOut:
        """Draft at ``rung``, verify and accept for ``reqs`` (``granted_lens``: the
        allocated length the scheduler gave each for this step, always sized for the
        widest rung); the draft then reads the accepted path, so the next step can start
        from the new states without the host.  ``defer`` (plain rung only): no probe, and
        the draft reads the new tokens later (``deferred_extend.py``)."""
        if defer and rung.speculates:
            raise ValueError(f"only the plain rung defers the draft's extend, not {rung}")
        caught_up = (0.0, 0) if defer else self.catch_up(reqs)
        states = [self.states[r.rid] for r in reqs]
        roots = [s.root_position for s in states]
        rows = [r.kv.row for r in reqs]
        layout = self.layout_for(rung)
        self._check_writes_inside_allocation(reqs, roots, granted_lens, layout, rung)
        guesses = None
        if rung.speculates:
            self._duplicate_prefix_tails(rows, roots, layout)
            guide = DraftGuide.for_batch(reqs, self._draft_vocab) if self.guided_drafts else None
            tree = self._draft_tree(reqs, rows, states, layout, rung, guide)
        else:
            guesses = None if defer else self._draft_guesses(states)
            tree = build_tree(self._root_tokens(states), [], 1, self.ops)
        hidden, features = self._verify_forward(rows, roots, tree)
        logits = self.target.compute_logits(hidden).view(len(reqs), tree.num_tokens, -1)
        result, unusable = self._accept(reqs, tree, logits)
        if rung.speculates:  # a root-only verify wrote its one token in place
            self._move_accepted_kv(rows, roots, result)
        features = features.view(len(reqs), tree.num_tokens, -1)
        seq_lens = SeqLens(roots, self.device)  # tokens before each root
        seq_lens.advance(result.num_new_tokens)
        seq_lens.refresh_seq_lens_cpu(sync=True)  # the step's one length sync (seed 001)
        self.last_seq_lens = seq_lens
        new_roots = seq_lens.host()
        n_new = [new - old for new, old in zip(new_roots, roots, strict=True)]
        tokens = [t[:n] for t, n in zip(result.accepted_tokens.tolist(), n_new, strict=True)]
        probes = ()
        if guesses is not None:  # the bonus is the target's token after the root
            probes = tuple((guesses == result.bonus_tokens).long().tolist())
        self.processors.record(reqs, tokens)
        logprobs = path_logprobs(reqs, logits, result.accept_index, tokens)
        if defer:  # graph buffers are reused: the root features are copied
            root_features = features[:, 0].clone()
            caught_up = self.defer(reqs, roots, [t[0] for t in tokens], root_features)
        else:
            accepted = AcceptedPaths(rows, roots, tokens, features, result.accept_index)
            self._advance(reqs, new_roots, rung, accepted)
        return SpecStepOut(
            new_tokens=tuple(tuple(t) for t in tokens),
            accept_lens=tuple(n - 1 for n in n_new),  # the bonus is the one not drafted
            probes=probes,
            logprobs=logprobs,
            unusable=tuple(unusable.nonzero().flatten().tolist()),
            catch_up_seconds=caught_up[0],
            catch_up_tokens=caught_up[1],
            shadow_accepted=self.shadow_samples(),
            suffix_trees=self.suffix_trees_taken(),
            node_counts=tree.node_counts or (),
        )

    def shadow_samples(self) -> tuple[tuple[str, int], ...]:
        """Acceptance measured on plain steps since the last call, as (rid, accepted
        drafts) per walk (a draft model's would need its forward: none)."""
        return ()

    def suffix_trees_taken(self) -> int:
        """Requests that verified a SUFFIX tree since the last call (hybrid only)."""
        return 0

    def defer(
        self, reqs: list[Req], roots: list[int], tokens: list[int], root_features: torch.Tensor
    ) -> tuple[float, int]:
        """Plain steps' new tokens join their requests' backlogs: ``tokens[i]`` follows the
        root at ``roots[i]``, whose target features are ``root_features[i]`` ([bs, H]).
        Once a backlog is full the whole batch catches up -> that catch-up's (seconds,
        tokens read); zeros if none."""
        for req, root, token, feature in zip(reqs, roots, tokens, root_features, strict=True):
            state = self.state_at(req, root)
            backlog = state if isinstance(state, Backlog) else Backlog(root, (), ())
            self.states[req.rid] = backlog.extended(token, feature)
        if any(self.states[r.rid].full for r in reqs):
            return self.catch_up(reqs)
        return 0.0, 0

    def state_at(self, req: Req, root: int):
        """``req``'s drafting state, which a step that decoded position ``root`` expects
        to have its root there (raises naming the request otherwise)."""
        state = self.states[req.rid]
        if state.root_position != root:
            raise RuntimeError(
                f"request {req.rid}: a step decoded position {root} but its draft "
                f"state's root is at {state.root_position}"
            )
        return state

    def catch_up(self, reqs: list[Req]) -> tuple[float, int]:
        """The draft reads the backlogs of ``reqs`` in one extend, so each has a current
        draft state again -> (the seconds it took, the tokens it read); zeros if nothing
        was behind."""
        behind = [(r, s) for r in reqs if isinstance(s := self.states[r.rid], Backlog)]
        if not behind:
            return 0.0, 0
        start = time.perf_counter()
        outputs = self._draft_extend(
            [r.kv.row for r, _ in behind],
            [b.start for _, b in behind],
            [list(b.tokens) for _, b in behind],
            [torch.stack(b.features) for _, b in behind],
        )
        for (req, backlog), (feats, hidden) in zip(behind, outputs, strict=True):
            self.states[req.rid] = DraftState(
                backlog.root_position, backlog.root_token, feats, hidden
            )
        if self.device.type == "cuda":  # timed apart from the step around it
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start, sum(len(b.tokens) for _, b in behind)

    def _advance(
        self, reqs: list[Req], new_roots: list[int], rung: Rung, accepted: AcceptedPaths
    ) -> None:
        """After a verify: each request's draft state moves to its new root."""
        outputs = self._extend_accepted(rung, accepted)
        for req, root, toks, (feats, hidden) in zip(
            reqs, new_roots, accepted.tokens, outputs, strict=True
        ):
            self.states[req.rid] = DraftState(root, toks[-1], feats, hidden)

    def _extend_accepted(
        self, rung: Rung, accepted: AcceptedPaths
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The draft re-reads each request's accepted tokens with the target's features
        at their tree nodes -> per request, the draft's (features, logit hidden) after them."""
        if self.graphs is not None:
            got = self.graphs.run_extend(rung, accepted)
            if got is not None:
                return got
        index = accepted.accept_index.tolist()
        path_features = [
            accepted.features[b, idx[: len(toks)]]
            for b, (idx, toks) in enumerate(zip(index, accepted.tokens, strict=True))
        ]
        return self._draft_extend(accepted.rows, accepted.roots, accepted.tokens, path_features)

    def _check_writes_inside_allocation(
        self,
        reqs: list[Req],
        roots: list[int],
        granted_lens: list[int],
        layout: TreeLayout,
        rung: Rung,
    ) -> None:
        """Always-on host check: every KV write of this step (at this rung's layout)
        lands inside the allocation the scheduler granted for it; past it the row holds
        stale slots that may belong to another request (seed 002)."""
        for req, root, granted in zip(reqs, roots, granted_lens, strict=True):
            end = max(layout.end(root), root + rung.draft_tokens)
            if end > granted:
                raise KVWriteOutOfBounds(
                    f"request {req.rid}: this verify step writes row positions up to {end} "
                    f"but only {granted} are allocated for it (root at {root}); the "
                    f"per-decode reserve (mem_cache/sizing.py) is too small"
                )

    def _duplicate_prefix_tails(
        self, rows: list[int], roots: list[int], layout: TreeLayout
    ) -> None:
        """Paged tree layout: copy each prefix's tail page into branches 1..k-1 (draft KV)."""
        copies = [
            (row, src, dst)
            for row, root in zip(rows, roots, strict=True)
            for src, dst in layout.prefix_tail_copies(root)
        ]
        if not copies:
            return
        rows, src, dst = host_tensor(sum(copies, ()), self.device).view(-1, 3).unbind(1)
        table = self.req_pool.req_to_token
        self.ops.move_kv(self.draft_pool.planes, table[rows, src], table[rows, dst])

    def _root_tokens(self, states: list[DraftState]) -> torch.Tensor:
        return host_tensor([s.root_token for s in states], self.device)  # [bs]

    def _draft_guesses(self, states: list[DraftState]) -> torch.Tensor:
        """[bs] the draft's top-1 token after each root (target ids): the plain rung's probe."""
        return self.head.to_target_ids(self._root_logprobs(states).argmax(-1))

    def _root_logprobs(self, states: list[DraftState]) -> torch.Tensor:
        """[bs, V_draft] the draft's log-probs of the token after each root."""
        return self.head.logprobs(torch.stack([s.logit_hidden for s in states]))

    def _draft_tree(
        self,
        reqs: list[Req],
        rows: list[int],
        states: list[DraftState],
        layout: TreeLayout,
        rung: Rung,
        guide: DraftGuide | None,
    ) -> DraftTree:
        """The draft loop (``draft_loop.py``) for ``reqs``: a graph replay when one fits
        the batch and none is guided by a grammar, else eagerly."""
        roots = [s.root_position for s in states]
        root_tokens = [s.root_token for s in states]
        root_feats = torch.stack([s.features for s in states])  # [bs, H]
        root_hidden = torch.stack([s.logit_hidden for s in states])  # [bs, H]
        if self.graphs is not None and guide is None:
            tree = self.graphs.run_draft(rung, rows, roots, root_tokens, root_feats, root_hidden)
            if tree is not None:
                return tree
        ints, kv_lens = DraftInputs.pack(layout, rows, roots, root_tokens)
        x = DraftInputs.view(
            host_tensor(ints, self.device), layout, len(rows), root_feats, root_hidden, kv_lens
        )
        return self.draft_loop.run(x, layout, rung.draft_tokens, guide=guide)

    def _verify_forward(
        self, rows: list[int], roots: list[int], tree: DraftTree
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target over the T nodes of every tree, written at ``[root, root + T)`` ->
        (final hidden [bs*T, H], the draft's input features [bs*T, H])."""
        # a root-only tree (the plain rung) needs no mask: it is a plain decode's attention
        # (the torch backend's masked path costs twice as much); graphs hold the masked plan
        root_only = tree.num_tokens == 1 and self.graphs is None
        mask = None if root_only else tree_attention_mask_for_verify(tree, roots, self.ops)
        _, out_loc, meta = extend_layout(  # the nodes' RoPE positions are root + depth
            self.req_pool.req_to_token, rows, roots, [tree.num_tokens] * len(rows), mask
        )
        positions = tree.positions(host_tensor(roots, self.device)).flatten()
        tokens = tree.tokens.flatten()
        if self.graphs is not None:
            got = self.graphs.run_verify(tree.num_tokens, tokens, positions, out_loc, meta)
            if got is not None:
                return got
        ctx = ForwardContext.planned(self.backend, meta, out_loc, self.target_pool)
        return self.verify_body(tokens, positions, ctx)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target residual streams the draft reads (EAGLE-3), else ()."""
        return self.head.capture_layers

    def features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        """A target forward's outputs -> the draft's input features [N, H]."""
        return self.head.features(hidden, aux)

    def verify_body(
        self, tokens: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward of a verify -> (hidden, draft features), device-only."""
        hidden, aux = self.target.forward_with_aux(tokens, positions, ctx, self.capture_layers)
        return hidden, self.features(hidden, aux)

    def _accept(
        self, reqs: list[Req], tree: DraftTree, logits: torch.Tensor
    ) -> tuple[VerifyResult, torch.Tensor]:
        """Greedy walk when every request is greedy, else tree speculative sampling
        (greedy requests get one-hot rows and zero coins, which is the greedy walk), on
        the logits after each request's processors; and which requests' logits were
        unusable (bool [bs], ``unusable_paths``)."""
        if self.force_accept_len is not None:  # benchmarks: acceptance at a chosen mean
            result = forced_accept(
                tree, greedy_ids(logits), self.force_accept_len, self._forced_draws
            )
            return result, torch.zeros(len(reqs), dtype=torch.bool, device=self.device)
        logits = self.processors.apply_tree(logits, reqs, tree)
        if all(r.params.greedy for r in reqs):
            result = verify_greedy(tree, greedy_ids(logits), self.ops)
            return result, unusable_paths(logits, result)
        probs, coins, replaced = self._sampling_inputs(reqs, tree, logits)
        result = verify_sampling(tree, probs, coins)
        return result, unusable_paths(logits, result) | replaced

    def _sampling_inputs(
        self, reqs: list[Req], tree: DraftTree, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tree speculative sampling's target probs [bs, T, V] and coins [bs, T + 1]; a
        sampled request whose probs are no distribution falls back to its greedy rows
        (flagged in the third value, bool [bs])."""
        replaced = torch.zeros(len(reqs), dtype=torch.bool, device=self.device)
        greedy = greedy_ids(logits)  # [bs, T]
        probs = torch.zeros_like(logits).scatter_(-1, greedy[..., None], 1.0)  # one-hot
        coins = torch.zeros(len(reqs), tree.num_tokens + 1, device=self.device)
        for b, req in enumerate(reqs):
            if req.params.greedy:
                continue
            with contained(req, "sampling"):
                probs[b], bad = usable_probs(filtered_probs(logits[b], req.params), greedy[b])
                replaced[b] = bad.any()
                gen = request_generator(req, self.device)
                coins[b] = torch.rand(tree.num_tokens + 1, generator=gen, device=gen.device)
        return probs, coins, replaced

    def _move_accepted_kv(self, rows: list[int], roots: list[int], result: VerifyResult) -> None:
        """Make the accepted path's target KV contiguous at ``[root, root + accepted + 1)``
        (every request moves S+1 entries, the unused ones onto themselves: no sync)."""
        src, dst = accepted_path_positions(result).padded()  # [bs, S+1] offsets from root
        rows_base = host_tensor(rows + roots, self.device).view(2, -1, 1)
        rows_t, base = rows_base[0], rows_base[1]
        table = self.req_pool.req_to_token
        self.ops.move_kv(
            self.target_pool.planes,
            table[rows_t, base + src].flatten(),
            table[rows_t, base + dst].flatten(),
        )
