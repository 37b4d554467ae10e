"""Turns a ScheduledBatch into tensors, runs the model and samples next tokens."""

from __future__ import annotations

import torch

from specd.kernels import AttentionBackend, build_attention_metadata
from specd.workers.engine.sampling import sample_next_tokens
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.scheduler.batch import RunnerOutput, ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        req_pool: ReqToTokenPool,
        kv_pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
    ):
        self.model = model
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = device

    def _inputs(self, batch: ScheduledBatch):
        """Flattened token ids, positions and the KV slots they write, in batch order."""
        ids, positions, rows = [], [], []
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            ids.extend(req.fill_ids[start : start + n])
            positions.extend(range(start, start + n))
            rows.append(req.kv.row)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [num_tokens]
        positions_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        table = self.req_pool.req_to_token
        out_cache_loc = table[
            rows_t.repeat_interleave(torch.tensor(batch.extend_lens, device=self.device)),
            positions_t,
        ]
        return input_ids, positions_t, rows_t, out_cache_loc

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, capture_layers: tuple[int, ...] | None = None
    ) -> RunnerOutput:
        """Extend/decode forward + sampling.  With ``capture_layers`` (a speculative
        engine) the output also carries every row's hidden state and those layers'."""
        input_ids, positions, rows, out_cache_loc = self._inputs(batch)
        kv_lens = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True)]
        meta = build_attention_metadata(
            self.req_pool.req_to_token, rows, list(batch.extend_lens), kv_lens
        )
        ctx = ForwardContext(self.backend.plan(meta), out_cache_loc, self.kv_pool, self.backend)
        aux = None
        if capture_layers is None:
            hidden = self.model(input_ids, positions, ctx)  # [num_tokens, hidden]
        else:
            hidden, aux = self.model.forward_with_aux(input_ids, positions, ctx, capture_layers)
        ends = torch.cumsum(torch.tensor(batch.extend_lens), 0) - 1
        last = ends[torch.tensor(batch.sample, dtype=torch.bool)].to(self.device)
        tokens: tuple[int, ...] = ()
        if last.numel():
            logits = self.model.compute_logits(hidden[last])  # [num_sampled, vocab] float32
            tokens = tuple(sample_next_tokens(logits, batch.sampled_reqs))
        if capture_layers is None:
            return RunnerOutput(tokens)
        return RunnerOutput(tokens, hidden=hidden, aux=aux)
