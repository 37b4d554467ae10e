"""Run a target model the way the engine does, without the engine: requests as rows of
``req_to_token`` over paged KV, batches as flat token lists (tests and checks)."""

from __future__ import annotations

import torch

from specd.kernels import build_attention_metadata, get_backend
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.model.forward_context import ForwardContext


class PagedRunner:
    """Runs the model the way the engine will: request rows in ``req_to_token`` whose
    pages come from a free list (shuffled, so a request's slots are non-contiguous)."""

    def __init__(self, model, page_size: int, num_pages: int, shuffle: bool, num_rows: int = 4):
        cfg = model.config
        self.model, self.page_size = model, page_size
        self.pool = KVPool(
            cfg.num_hidden_layers,
            num_pages * page_size,
            model.model.layers[0].self_attn.num_kv_heads,  # this rank's, under TP
            cfg.head_dim,
            next(model.parameters()).dtype,
            "cpu",
        )
        self.backend = get_backend("torch")
        self.req_to_token = torch.zeros(num_rows, 64, dtype=torch.int32)  # [rows, width]
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7))
        self.free_pages = (order if shuffle else torch.arange(num_pages)).tolist()
        self.seq_lens = [0] * num_rows

    def _claim_slots(self, row: int, end: int) -> None:
        """Give positions ``[seq_len, end)`` of ``row`` slots, a whole page at a time."""
        for pos in range(self.seq_lens[row], end):
            if pos % self.page_size == 0:
                page = self.free_pages.pop(0)
                slots = torch.arange(page * self.page_size, (page + 1) * self.page_size)
                self.req_to_token[row, pos : pos + self.page_size] = slots.to(torch.int32)

    def batch(self, rows: list[int], chunks: list[list[int]]):
        """Append ``chunks[i]`` to request ``rows[i]``; -> (input_ids, positions, ctx)."""
        positions, locs = [], []
        for row, chunk in zip(rows, chunks, strict=True):
            start, end = self.seq_lens[row], self.seq_lens[row] + len(chunk)
            self._claim_slots(row, end)
            positions.append(torch.arange(start, end))
            locs.append(self.req_to_token[row, start:end].long())
            self.seq_lens[row] = end
        meta = build_attention_metadata(
            self.req_to_token,
            rows,
            qo_lens=[len(c) for c in chunks],
            kv_lens=[self.seq_lens[r] for r in rows],
        )
        ctx = ForwardContext(self.backend.plan(meta), torch.cat(locs), self.pool, self.backend)
        return torch.tensor([t for c in chunks for t in c]), torch.cat(positions), ctx

    def extend(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """-> logits [sum(len(chunk)), vocab] of every appended token."""
        return self.model.compute_logits(self.model(*self.batch(rows, chunks)))

    def extend_with_aux(self, rows, chunks, capture_layers: tuple[int, ...]):
        """-> (final-normed hidden [sum(len(chunk)), hidden], captured layers)."""
        return self.model.forward_with_aux(*self.batch(rows, chunks), capture_layers)
