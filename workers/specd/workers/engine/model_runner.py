"""Turns a ScheduledBatch into tensors, runs the model and samples next tokens."""

from __future__ import annotations

import torch

from specd.kernels import AttentionBackend, AttentionMetadata, build_attention_metadata
from specd.kernels.ops import TORCH_OPS, KernelOps, host_tensor
from specd.workers.engine.sampling import sample_next_tokens
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.scheduler.batch import RunnerOutput, ScheduledBatch


def extend_layout(
    req_to_token: torch.Tensor,
    rows: list[int],
    starts: list[int],
    lens: list[int],
    custom_mask: torch.Tensor | None = None,
    ops: KernelOps = TORCH_OPS,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Row ``rows[i]`` fills positions ``[starts[i], starts[i] + lens[i])``: -> (flattened
    positions, the KV slots they write, attention metadata reading ``[0, start + n)``).

    Built from host lengths: one small host-to-device copy, no device sync."""
    device = req_to_token.device
    spans = list(zip(rows, starts, lens, strict=True))
    token_rows = [r for r, _, n in spans for _ in range(n)]
    token_positions = [p for _, s, n in spans for p in range(s, s + n)]
    index = host_tensor(token_rows + token_positions + list(rows), device)
    num_tokens = len(token_rows)
    positions = index[num_tokens : 2 * num_tokens]  # [num_tokens]
    out_loc = req_to_token[index[:num_tokens], positions]
    kv_lens = [s + n for _, s, n in spans]
    meta = build_attention_metadata(
        req_to_token, index[2 * num_tokens :], list(lens), kv_lens, custom_mask, ops
    )
    return positions, out_loc, meta


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        req_pool: ReqToTokenPool,
        kv_pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        ops: KernelOps = TORCH_OPS,
    ):
        self.model = model
        self.ops = ops
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = device

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, capture_layers: tuple[int, ...] | None = None
    ) -> RunnerOutput:
        """Extend/decode forward + sampling.  With ``capture_layers`` (a speculative
        engine) the output also carries every row's hidden state and those layers'."""
        positions, out_cache_loc, meta = extend_layout(
            self.req_pool.req_to_token,
            [r.kv.row for r in batch.reqs],
            list(batch.prefix_lens),
            list(batch.extend_lens),
            ops=self.ops,
        )
        ids = [
            t
            for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True)
            for t in req.fill_ids[start : start + n]
        ]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [num_tokens]
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
