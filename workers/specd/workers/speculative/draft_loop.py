"""The draft loop of a speculative step: S draft steps growing a top-k tree, then the tree.

Draft step 0 takes the top-k of the draft's output after each root; steps 1..S-1 each
run one draft forward over the k nodes the step before kept, every node reading its
branch's prefix (``TreeLayout.prefix_ranges``) and then its ancestors' draft KV and its
own.  The ancestors depend on which parents the top-k kept, so their row positions are
gathered on the device (``grow_ancestors``): the whole loop runs without a host sync,
which is what lets ``step_graphs`` capture it as one CUDA graph.

Everything the loop reads from the host is packed into one int64 tensor
(``DraftInputs``): built per step for an eager run, or copied into a graph bucket's
static buffer before a replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend, AttentionMetadata
from specd.kernels.metadata import metadata_from_indices
from specd.kernels.ops import KernelOps, exclusive_cumsum
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.speculative.draft_head import DraftHead
from specd.workers.speculative.guided_draft import DraftGuide
from specd.workers.speculative.layout import TreeLayout
from specd.workers.speculative.tree import DraftTree, StepOut, build_tree, expand_step, first_step


def grow_ancestors(
    ancestors: torch.Tensor, parents: torch.Tensor, own: torch.Tensor
) -> torch.Tensor:
    """The draft-KV row positions the nodes of the next draft step read after the prefix.

    ancestors [bs, k, s-1]: the previous step's lists; parents [bs, k]: each node's parent
    among the previous step's nodes (unused at s = 1: step-0 nodes hang off the root,
    which has no draft KV); own [bs, k]: where this step writes each node.  -> [bs, k, s]
    (own position last), gathered on the device so drafting needs no host sync.
    """
    bs, k, depth = ancestors.shape
    if depth:
        ancestors = ancestors.gather(1, parents[:, :, None].expand(-1, -1, depth))
    return torch.cat([ancestors, own[:, :, None]], 2)


@dataclass(slots=True)
class DraftInputs:
    """What the draft loop of ``B`` requests reads from the host, as views of one int64
    tensor ``ints``, plus the draft state after each root.

    rows [B]: request rows; root_tokens [B].  Per draft step s = 1..S-1 (index s - 1):
    own [S-1, B, k]: where step s writes node j's draft KV; positions [S-1, B*k]: its
    RoPE positions (root + s - 1); ranges [S-1, B*k, R, 2]: the prefix ranges node j
    reads; kv_indptr [S-1, B*k + 1]: where each node's KV list starts.  kv_lens
    [S-1][B*k] (host): the lists' lengths.  root_feats, root_hidden [B, H]: the draft's
    features and logit hidden after each root.
    """

    ints: torch.Tensor
    rows: torch.Tensor
    root_tokens: torch.Tensor
    own: torch.Tensor
    positions: torch.Tensor
    ranges: torch.Tensor
    kv_indptr: torch.Tensor
    kv_lens: list[list[int]]
    root_feats: torch.Tensor
    root_hidden: torch.Tensor

    @classmethod
    def view(
        cls,
        ints: torch.Tensor,
        layout: TreeLayout,
        batch: int,
        root_feats: torch.Tensor,
        root_hidden: torch.Tensor,
        kv_lens: list[list[int]] | None = None,
    ) -> DraftInputs:
        """The views of ``ints`` (``pack`` order) for ``batch`` requests."""
        steps, n = max(layout.num_steps - 1, 0), batch * layout.topk
        ranges = steps * n * layout.num_ranges * 2
        sizes = [batch, batch, steps * n, steps * n, ranges, steps * (n + 1)]
        parts = ints.split(sizes)
        return cls(
            ints=ints,
            rows=parts[0],
            root_tokens=parts[1],
            own=parts[2].view(steps, batch, layout.topk),
            positions=parts[3].view(steps, n),
            ranges=parts[4].view(steps, n, layout.num_ranges, 2),
            kv_indptr=parts[5].view(steps, n + 1),
            kv_lens=kv_lens if kv_lens is not None else [],
            root_feats=root_feats,
            root_hidden=root_hidden,
        )

    @staticmethod
    def pack(
        layout: TreeLayout, rows: list[int], roots: list[int], root_tokens: list[int]
    ) -> tuple[list[int], list[list[int]]]:
        """Host ints in ``view`` order, and kv_lens, for requests at ``roots``."""
        own, positions, ranges, indptr, kv_lens = [], [], [], [], []
        k = layout.topk
        for s in range(1, layout.num_steps):
            own += layout.node_positions(roots, s)
            positions += [root + s - 1 for root in roots for _ in range(k)]
            reads = [layout.prefix_ranges(root, j) for root in roots for j in range(k)]
            ranges += [x for r in reads for a_b in r for x in a_b]
            lens = [sum(b - a for a, b in r) + s for r in reads]
            indptr += exclusive_cumsum(lens)
            kv_lens.append(lens)
        return list(rows) + list(root_tokens) + own + positions + ranges + indptr, kv_lens


class DraftLoop:
    """Runs the draft loop on the draft model and its KV pool (eagerly, or inside a graph
    with each step's attention reading a static plan)."""

    def __init__(
        self,
        head: DraftHead,
        ops: KernelOps,
        req_pool: ReqToTokenPool,
        draft_pool: KVPool,
        backend: AttentionBackend,
    ):
        self.head = head
        self.ops = ops
        self.req_pool = req_pool
        self.draft_pool = draft_pool
        self.backend = backend

    def run(
        self,
        x: DraftInputs,
        layout: TreeLayout,
        num_tokens: int,
        graph_plans: list[Any] | None = None,
        guide: DraftGuide | None = None,
    ) -> DraftTree:
        """The tree of T = ``num_tokens`` nodes for each of x's requests.  With
        ``graph_plans`` (one static attention plan per draft step, its lengths already
        planned) each step's KV indices are written into the plan on the device; with
        ``guide``, constrained requests draft only what their grammar allows (eager)."""
        k = layout.topk
        batch = x.rows.shape[0]
        root_logprobs = self.head.logprobs(x.root_hidden)
        if guide is not None:
            root_logprobs = guide.roots(root_logprobs)
        steps = [self._kept(first_step(root_logprobs, k), guide)]
        feats = x.root_feats[:, None, :].expand(-1, k, -1)  # [B, k, H] inputs of step 1
        ancestors = x.ints.new_zeros((batch, k, 0))  # [B, k, s]: none before step 1
        node_rows = x.rows.repeat_interleave(k)  # [B*k]
        for s in range(1, layout.num_steps):
            prev = steps[-1]
            if s > 1:
                feats = feats.gather(1, prev.parents[:, :, None].expand(-1, -1, feats.shape[-1]))
            ancestors = grow_ancestors(ancestors, prev.parents, x.own[s - 1])
            plan, meta = self._step_plan(x, s, node_rows, ancestors, graph_plans)
            out_loc = self.req_pool.req_to_token[node_rows, ancestors[:, :, -1].flatten()]
            ctx = ForwardContext(plan, out_loc, self.draft_pool, self.backend, meta)
            next_feats, logit_hidden = self.head.forward(
                prev.tokens.flatten(), feats.flatten(0, 1), x.positions[s - 1], ctx
            )
            feats = next_feats.view(batch, k, -1)
            child = self.head.logprobs(logit_hidden).view(batch, k, -1)
            if guide is not None:
                child = guide.children(child)
            steps.append(self._kept(expand_step(prev, child, k), guide))
        return build_tree(x.root_tokens, steps, num_tokens, self.ops)

    def _step_plan(
        self,
        x: DraftInputs,
        s: int,
        node_rows: torch.Tensor,
        ancestors: torch.Tensor,
        graph_plans: list[Any] | None,
    ) -> tuple[Any, AttentionMetadata | None]:
        """Draft step ``s``'s attention plan (and, eager, its metadata): node j reads
        ``x.ranges`` then its ancestors."""
        batch, k, _ = ancestors.shape
        table = self.req_pool.req_to_token
        extras = ancestors.view(batch * k, s)
        if graph_plans is None:
            lens = x.kv_lens[s - 1]
            kv_indices = self.ops.gather_row_slots(table, node_rows, x.ranges[s - 1], extras, lens)
            meta = metadata_from_indices(kv_indices, [1] * len(lens), lens)
            return self.backend.plan(meta), meta
        plan = graph_plans[s - 1]
        self.ops.gather_row_slots_into(
            self.backend.graph_kv_indices(plan),
            x.kv_indptr[s - 1],
            table,
            node_rows,
            x.ranges[s - 1],
            extras,
            self.req_pool.width,
        )
        return plan, None

    def _kept(self, step: StepOut, guide: DraftGuide | None) -> StepOut:
        """A step's nodes in target ids (the guide records their paths)."""
        step = dataclasses.replace(step, tokens=self.head.to_target_ids(step.tokens))
        if guide is not None:
            guide.kept(step)
        return step
