"""CUDA graphs of the speculative step (``engine/graph_runner.py``): the draft loop, the
target's verify forward and the draft's re-read of the accepted tokens, one graph per
batch size and per shape the rungs need.

* draft (per rung with steps > 0): ``DraftLoop.run`` over a static ``DraftInputs``; each
  draft step's attention reads a static plan whose KV indices the loop itself gathers on
  the device (its lengths are planned before the replay).
* verify (per T): the target over ``B * T`` tree tokens with the tree mask; returns the
  final hidden and the draft features (the logits and the accept stay eager).
* extend (per Q = the most tokens a verify at a rung accepts, bonus included): the draft
  over Q tokens per request; a request that accepted fewer runs on garbage past them,
  which causal attention keeps away from its real rows (and the KV it writes there lies
  inside its allocation, past the new root, where the next step writes before reading).

Pad requests use the request-row pool's pad row and root 0, so everything they read and
write is the KV pools' pad slot.  A replay's outputs live in the graph's memory until the
same graph replays again: what outlives a step (the draft states) is copied out.  A batch larger than the largest size, or a shape no
graph was made for, runs eagerly (the caller's fallback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from specd.kernels.metadata import (
    AttentionMetadata,
    GraphBuffers,
    GraphShape,
    metadata_from_indices,
    pad_metadata,
)
from specd.kernels.ops import host_tensor
from specd.workers.model.forward_context import ForwardContext
from specd.workers.rung import Rung
from specd.workers.runner.graph_runner import GraphRunner
from specd.workers.runner.model_runner import extend_layout, model_graph_shape
from specd.workers.speculative.draft_loop import DraftInputs
from specd.workers.speculative.tree import DraftTree

if TYPE_CHECKING:  # the decoder holds this module's SpecGraphs
    from specd.workers.speculative.decoder import AcceptedPaths


def accepted_len_bound(rung: Rung) -> int:
    """Q: the most tokens one verify at ``rung`` appends (accepted drafts and the bonus)."""
    return min(rung.steps + 1, rung.draft_tokens)


@dataclass(slots=True)
class DraftBucket:
    inputs: DraftInputs
    plans: list[Any]  # one static attention plan per draft step 1..S-1


@dataclass(slots=True)
class ForwardBucket:
    """Static inputs of one forward over ``shape.qo_len`` tokens per request."""

    shape: GraphShape
    tokens: torch.Tensor  # [B*Q]
    positions: torch.Tensor  # [B*Q]
    out_loc: torch.Tensor  # [B*Q] KV slots written; pad rows: the pad slot
    plan: Any
    features: torch.Tensor | None = None  # [B*Q, H] draft input features (extend only)


class SpecGraphs:
    """The graphs of one ``SpecDecoder`` for the rungs it may run."""

    def __init__(self, decoder, rungs: Sequence[Rung], sizes: Sequence[int]):
        self.dec = decoder
        self.device = decoder.device
        self.pad_row = decoder.req_pool.pad_row
        self.pad_slot = decoder.target_pool.pad_slot
        self.dtype = next(decoder.target.parameters()).dtype
        self.draft_dtype = decoder.head.dtype  # its features, hidden and KV (may differ on CPU)
        self.buffers = self._shared_buffers(rungs, sizes)
        graph = partial(GraphRunner, sizes=sizes, device=self.device)
        self.draft = {
            rung: graph(partial(self._draft_bucket, rung), partial(self._draft_body, rung))
            for rung in rungs
            if rung.speculates
        }
        self.verify = {
            t: graph(partial(self._forward_bucket, t, True), self._verify_body)
            for t in sorted({r.draft_tokens for r in rungs})
        }
        self.extend = {
            q: graph(partial(self._forward_bucket, q, False), self._extend_body)
            for q in sorted({accepted_len_bound(r) for r in rungs})
        }

    def _shared_buffers(self, rungs: Sequence[Rung], sizes: Sequence[int]) -> GraphBuffers:
        """One set of static index and mask buffers for every graph below."""
        shapes = [
            shape
            for size in sizes
            for rung in rungs
            for shape in (
                self._draft_shape(size * rung.topk, 1, False),
                self._forward_shape(size, rung.draft_tokens, True),
                self._forward_shape(size, accepted_len_bound(rung), False),
            )
        ]
        needs = [self.dec.backend.graph_buffer_needs(shape) for shape in shapes]
        return GraphBuffers(needs, self.device)

    def runners(self) -> list[GraphRunner]:
        """In the order a step replays them (``capture`` relies on it)."""
        return [*self.draft.values(), *self.verify.values(), *self.extend.values()]

    def capture(self) -> None:
        """Every graph, in one memory pool on one capture stream, in the order a step
        replays them (draft, verify, extend).  A later capture may place its outputs in an
        earlier graph's freed intermediates, which that graph's next replay overwrites;
        that is safe because a step reads each graph's outputs before the next step
        replays the graphs captured before it (the draft tree, read after the verify, was
        captured first), so ``runners()`` must keep the replay order."""
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        stream = torch.cuda.Stream(self.device) if cuda else None
        for runner in self.runners():
            runner.capture(pool, stream)

    def status(self) -> dict:
        runners = self.runners()
        return {
            "mode": runners[0].status()["mode"],
            "sizes": list(runners[0].sizes),
            "graphs": sum(len(r.sizes) for r in runners),
            "buffer_bytes": self.buffers.nbytes,
            "capture_seconds": round(sum(r.capture_seconds for r in runners), 3),
            "replays": {
                "draft": sum(r.replays for r in self.draft.values()),
                "verify": sum(r.replays for r in self.verify.values()),
                "extend": sum(r.replays for r in self.extend.values()),
            },
        }

    # -- draft loop -----------------------------------------------------------------------
    def _draft_bucket(self, rung: Rung, size: int) -> DraftBucket:
        layout = self.dec.layout_for(rung)
        hidden = self.dec.head.config.model.hidden_size
        ints, _ = DraftInputs.pack(layout, [self.pad_row] * size, [0] * size, [0] * size)
        feats = torch.zeros(2, size, hidden, dtype=self.draft_dtype, device=self.device)
        inputs = DraftInputs.view(host_tensor(ints, self.device), layout, size, feats[0], feats[1])
        shape = self._draft_shape(size * rung.topk, 1, False)
        plans = [
            self.dec.backend.graph_plan(shape, self.device, self.buffers)
            for _ in range(rung.steps - 1)
        ]
        bucket = DraftBucket(inputs, plans)
        self._fill_draft(bucket, rung, [], [], [], None, None)
        return bucket

    def _draft_body(self, rung: Rung, b: DraftBucket) -> DraftTree:
        layout = self.dec.layout_for(rung)
        return self.dec.draft_loop.run(b.inputs, layout, rung.draft_tokens, b.plans)

    def _fill_draft(self, b, rung, rows, roots, root_tokens, feats, hidden) -> None:
        size = b.inputs.rows.shape[0]
        pad = size - len(rows)
        layout = self.dec.layout_for(rung)
        ints, kv_lens = DraftInputs.pack(
            layout, rows + [self.pad_row] * pad, roots + [0] * pad, root_tokens + [0] * pad
        )
        b.inputs.ints.copy_(host_tensor(ints, self.device))
        if rows:
            b.inputs.root_feats[: len(rows)].copy_(feats)
            b.inputs.root_hidden[: len(rows)].copy_(hidden)
        for plan, lens in zip(b.plans, kv_lens, strict=True):
            self.dec.backend.update_graph_plan_lens(plan, [1] * len(lens), lens)

    def run_draft(self, rung, rows, roots, root_tokens, feats, hidden) -> DraftTree | None:
        """The draft loop's tree for these requests, or None when no graph fits."""
        runner = self.draft.get(rung)
        size = runner.size_for(len(rows)) if runner is not None else None
        if size is None:
            return None
        self._fill_draft(runner.bucket(size), rung, rows, roots, root_tokens, feats, hidden)
        tree = runner.run(size)
        return first_requests(tree, len(rows))

    # -- verify and draft extend ------------------------------------------------------------
    def _forward_bucket(self, qo_len: int, verify: bool, size: int) -> ForwardBucket:
        """Static buffers of a verify (target, tree mask) or a draft extend (draft, causal)."""
        n = size * qo_len
        config = self.dec.target.config if verify else self.dec.head.config.model
        shape = self._forward_shape(size, qo_len, verify)
        zeros = torch.zeros(3, n, dtype=torch.int64, device=self.device)
        bucket = ForwardBucket(
            shape,
            tokens=zeros[0],
            positions=zeros[1],
            out_loc=zeros[2] + self.pad_slot,
            plan=self.dec.backend.graph_plan(shape, self.device, self.buffers),
            features=None
            if verify
            else torch.zeros(n, config.hidden_size, dtype=self.draft_dtype, device=self.device),
        )
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        mask = torch.zeros(0, dtype=torch.bool, device=self.device) if verify else None
        self._fill_forward(bucket, empty, empty, empty, metadata_from_indices(empty, [], [], mask))
        return bucket

    def _fill_forward(self, b: ForwardBucket, tokens, positions, out_loc, meta) -> None:
        n = tokens.numel()
        b.tokens[:n].copy_(tokens)
        b.positions[:n].copy_(positions)
        b.out_loc[:n].copy_(out_loc)
        b.out_loc[n:].fill_(self.pad_slot)
        self.dec.backend.update_graph_plan(b.plan, pad_metadata(meta, b.shape, self.pad_slot))

    def _verify_body(self, b: ForwardBucket) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = ForwardContext(b.plan, b.out_loc, self.dec.target_pool, self.dec.backend)
        return self.dec.verify_body(b.tokens, b.positions, ctx)

    def _extend_body(self, b: ForwardBucket) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = ForwardContext(b.plan, b.out_loc, self.dec.draft_pool, self.dec.backend)
        return self.dec.head.forward(b.tokens, b.features, b.positions, ctx)

    def run_verify(
        self, num_tokens: int, tokens, positions, out_loc, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, features) of the real rows, or None when no graph fits."""
        runner = self.verify.get(num_tokens)
        size = runner.size_for(meta.batch_size) if runner is not None else None
        if size is None:
            return None
        self._fill_forward(runner.bucket(size), tokens, positions, out_loc, meta)
        hidden, features = runner.run(size)
        n = tokens.numel()
        return hidden[:n], features[:n]

    def run_extend(
        self, rung: Rung, accepted: AcceptedPaths
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per request, the draft's (features, logit hidden) after its accepted tokens;
        None when no graph fits."""
        rows, roots, tokens = accepted.rows, accepted.roots, accepted.tokens
        bs = len(rows)
        q = accepted_len_bound(rung)
        size = self.extend[q].size_for(bs) if q in self.extend else None
        if size is None:
            return None
        b = self.extend[q].bucket(size)
        positions, out_loc, meta = extend_layout(  # Q positions from each root (past: junk)
            self.dec.req_pool.req_to_token, rows, roots, [q] * bs
        )
        ids = host_tensor([t for ts in tokens for t in ts + [0] * (q - len(ts))], self.device)
        index = accepted.accept_index[:, :q].clamp(min=0)  # [bs, Q] nodes (past the path: any)
        features = accepted.features
        path = features.gather(1, index[:, :, None].expand(-1, -1, features.shape[-1]))
        b.features[: bs * q].copy_(path.flatten(0, 1))
        self._fill_forward(b, ids, positions, out_loc, meta)
        next_feats, logit_hidden = self.extend[q].run(size)
        last = host_tensor([i * q + len(ts) - 1 for i, ts in enumerate(tokens)], self.device)
        # copies: the draft states outlive this replay, the graph's outputs do not
        feats, hidden = next_feats.index_select(0, last), logit_hidden.index_select(0, last)
        return list(zip(feats.unbind(0), hidden.unbind(0), strict=True))

    def _forward_shape(self, size: int, qo_len: int, verify: bool) -> GraphShape:
        """A verify (the target, tree mask) or a draft extend (the draft, causal)."""
        config = self.dec.target.config if verify else self.dec.head.config.model
        dtype = self.dtype if verify else self.draft_dtype
        return model_graph_shape(config, size, qo_len, self.dec.req_pool.width, verify, dtype)

    def _draft_shape(self, batch: int, qo_len: int, custom_mask: bool) -> GraphShape:
        config = self.dec.head.config.model
        return model_graph_shape(
            config, batch, qo_len, self.dec.req_pool.width, custom_mask, self.draft_dtype
        )


def first_requests(tree: DraftTree, n: int) -> DraftTree:
    """``tree`` cut to its first ``n`` requests (a padded graph batch's real ones)."""
    tensors = {
        f.name: getattr(tree, f.name)[:n]
        for f in dataclasses.fields(tree)
        if isinstance(getattr(tree, f.name), torch.Tensor)
    }
    return dataclasses.replace(tree, **tensors)
