"""Turns a ScheduledBatch into tensors, runs the model and samples next tokens.

Decode batches (one token per request) of a plain engine replay a CUDA graph of the
model forward when ``enable_decode_graphs`` was called (``engine/graph_runner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend, AttentionMetadata, build_attention_metadata
from specd.kernels.metadata import GraphBuffers, GraphShape, metadata_from_indices, pad_metadata
from specd.kernels.ops import exclusive_cumsum, host_tensor
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.requests.batch import RunnerOutput, ScheduledBatch
from specd.workers.runner.graph_runner import GraphRunner
from specd.workers.runner.logits_processors import LogitsProcessors
from specd.workers.runner.logprobs import (
    SampledLogprobs,
    prompt_targets,
    sampled_logprobs,
    score_prompt_rows,
)
from specd.workers.runner.sampling import sample_next_tokens


def extend_layout(
    req_to_token: torch.Tensor,
    rows: list[int],
    starts: list[int],
    lens: list[int],
    custom_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Row ``rows[i]`` fills positions ``[starts[i], starts[i] + lens[i])``: -> (flattened
    positions, the KV slots they write, attention metadata reading ``[0, start + n)``).

    Built from host rows and lengths: small host-to-device copies, no device sync."""
    spans = list(zip(rows, starts, lens, strict=True))
    token_rows = [r for r, _, n in spans for _ in range(n)]
    token_positions = [p for _, s, n in spans for p in range(s, s + n)]
    index = host_tensor(token_rows + token_positions, req_to_token.device)
    positions = index[len(token_rows) :]  # [num_tokens]
    out_loc = req_to_token[index[: len(token_rows)], positions]
    kv_lens = [s + n for _, s, n in spans]
    meta = build_attention_metadata(req_to_token, rows, list(lens), kv_lens, custom_mask)
    return positions, out_loc, meta


@dataclass(slots=True)
class LaunchedStep:
    """A launched batch's sampled ids (and log-probs, if asked) on their way to the host
    (``done``: the copies' CUDA event; None on CPU, where they are already there)."""

    out: ComputedStep
    done: torch.cuda.Event | None = None

    def wait(self) -> RunnerOutput:
        if self.done is not None:
            self.done.synchronize()
        return self.out.to_host()


@dataclass(slots=True)
class ComputedStep:
    """A batch's forward and sampling: the sampled ids [num_sampled] (on the device, or
    their host copy), their log-probs if any request asked, the prompt tokens' log-probs
    scored for scoring requests (host, per batch request), and with captured layers the
    hidden states and those layers' (speculative engines)."""

    tokens: torch.Tensor
    logprobs: SampledLogprobs | None = None
    prompt_logprobs: tuple = ()
    hidden: torch.Tensor | None = None
    aux: Any = None
    unusable: torch.Tensor | None = None  # [num_sampled] bool: rows nothing could be sampled from

    def to_host(self) -> RunnerOutput:
        per_request = (
            () if self.logprobs is None else self.logprobs.per_request(self.tokens.numel())
        )
        unusable = () if self.unusable is None else self.unusable.nonzero().flatten().tolist()
        return RunnerOutput(
            tuple(self.tokens.tolist()),
            hidden=self.hidden,
            aux=self.aux,
            logprobs=per_request,
            prompt_logprobs=self.prompt_logprobs,
            unusable_rows=tuple(unusable),
        )


@dataclass(slots=True)
class DecodeBucket:
    """The static buffers of one decode batch size (see ``GraphRunner``)."""

    shape: GraphShape
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    out_loc: torch.Tensor  # [B] pool slots; pad rows: the pool's pad slot
    plan: Any  # the attention backend's graph plan


def model_graph_shape(
    config, batch_size: int, qo_len: int, max_kv_len: int, custom_mask: bool, dtype
) -> GraphShape:
    """The ``GraphShape`` of a Llama-family ``config`` for batches of this form."""
    return GraphShape(
        batch_size,
        qo_len,
        max_kv_len,
        custom_mask,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
    )


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        req_pool: ReqToTokenPool,
        kv_pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        processors: LogitsProcessors | None = None,
    ):
        self.model = model
        self.processors = processors or LogitsProcessors(())
        self.decode_graphs: GraphRunner[DecodeBucket] | None = None
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = device
        # each request row's last sampled id, kept on the device by ``launch``
        self.last_sampled = torch.zeros(req_pool.num_rows + 1, dtype=torch.int64, device=device)
        self._inputs_consumed: torch.cuda.Event | None = None  # see ``launch``

    def enable_decode_graphs(self, sizes: list[int], max_kv_len: int) -> GraphRunner:
        """Run decode batches of up to ``max(sizes)`` requests through graphs (the backend
        must have ``supports_graphs``); call ``capture()`` on the result to record them."""
        dtype = next(self.model.parameters()).dtype
        shapes = {
            size: model_graph_shape(self.model.config, size, 1, max_kv_len, False, dtype)
            for size in sizes
        }
        needs = [self.backend.graph_buffer_needs(shape) for shape in shapes.values()]
        buffers = GraphBuffers(needs, self.device)

        def bucket(size: int) -> DecodeBucket:
            zeros = torch.zeros(3, size, dtype=torch.int64, device=self.device)
            b = DecodeBucket(
                shapes[size],
                input_ids=zeros[0],
                positions=zeros[1],
                out_loc=zeros[2] + self.kv_pool.pad_slot,
                plan=self.backend.graph_plan(shapes[size], self.device, buffers),
            )
            empty = zeros[0, :0]
            nothing = metadata_from_indices(empty, [], [])  # an all-pad batch to capture
            pad = self.kv_pool.pad_slot
            self.backend.update_graph_plan(b.plan, pad_metadata(nothing, b.shape, pad))
            return b

        self.decode_graphs = GraphRunner(
            bucket, self._decode_body, sizes, self.device, buffer_bytes=buffers.nbytes
        )
        return self.decode_graphs

    def _decode_body(self, b: DecodeBucket) -> torch.Tensor:
        """Model forward of one token per row -> logits [B, vocab] float32 (captured)."""
        ctx = ForwardContext(b.plan, b.out_loc, self.kv_pool, self.backend)
        return self.model.compute_logits(self.model(b.input_ids, b.positions, ctx))

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, capture_layers: tuple[int, ...] | None = None
    ) -> RunnerOutput:
        """Extend/decode forward + sampling.  With ``capture_layers`` (a speculative
        engine) the output also carries every row's hidden state and those layers'."""
        return self._forward_and_sample(batch, capture_layers).to_host()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Overlap scheduling, plain decode: queue ``batch``'s forward and sampling and
        return at once.  Its sampled ids stay on the device as the inputs of a batch
        scheduled ahead of it (``ScheduledBatch.decode_ahead``), and reach the host through
        a non-blocking copy that ``LaunchedStep.wait`` waits for."""
        if self._inputs_consumed is not None:  # a backend may reuse host staging buffers
            self._inputs_consumed.synchronize()
            self._inputs_consumed = None
        out = self._forward_and_sample(batch, None, launching=True)
        sampled_rows = [r.kv.row for r in batch.sampled_reqs]
        if sampled_rows:
            self.last_sampled[host_tensor(sampled_rows, self.device)] = out.tokens
        if self.device.type != "cuda":
            return LaunchedStep(out)
        host = torch.empty(out.tokens.shape, dtype=out.tokens.dtype, pin_memory=True)
        out.tokens = host.copy_(out.tokens, non_blocking=True)
        if out.unusable is not None:
            flags = torch.empty(out.unusable.shape, dtype=torch.bool, pin_memory=True)
            out.unusable = flags.copy_(out.unusable, non_blocking=True)
        if out.logprobs is not None:
            out.logprobs = out.logprobs.pinned()
        done = torch.cuda.Event()
        done.record()
        if self._inputs_consumed is None:  # eager: the whole step read its inputs by now
            self._inputs_consumed = done
        return LaunchedStep(out, done)

    def _forward_and_sample(
        self,
        batch: ScheduledBatch,
        capture_layers: tuple[int, ...] | None,
        launching: bool = False,
    ) -> ComputedStep:
        """Forward and sampling on the device (hidden states only with
        ``capture_layers``).  ``launching``: called by ``launch`` (see there)."""
        rows = [r.kv.row for r in batch.reqs]
        positions, out_cache_loc, meta = extend_layout(
            self.req_pool.req_to_token, rows, list(batch.prefix_lens), list(batch.extend_lens)
        )
        input_ids = self._input_ids(batch, rows)  # [num_tokens]
        graph_size = self._decode_graph_size(batch, capture_layers)
        if graph_size is not None:
            logits = self._replay_decode(
                graph_size, input_ids, positions, out_cache_loc, meta, launching
            )
            tokens, logprobs, unusable = self._sample(logits, batch)
            return ComputedStep(tokens, logprobs, unusable=unusable)
        ctx = ForwardContext.planned(self.backend, meta, out_cache_loc, self.kv_pool)
        aux = None
        if capture_layers is None:
            hidden = self.model(input_ids, positions, ctx)  # [num_tokens, hidden]
        else:
            hidden, aux = self.model.forward_with_aux(input_ids, positions, ctx, capture_layers)
        ends = exclusive_cumsum(batch.extend_lens)[1:]
        last = [end - 1 for end, sampled in zip(ends, batch.sample, strict=True) if sampled]
        out = ComputedStep(torch.empty(0, dtype=torch.int64, device=self.device))
        if capture_layers is not None:
            out.hidden, out.aux = hidden, aux
        targets = prompt_targets(batch.reqs, batch.prefix_lens, batch.extend_lens)
        if targets:
            compute_logits = self.model.compute_logits
            out.prompt_logprobs = score_prompt_rows(hidden, compute_logits, targets, batch.reqs)
        if last:
            rows_out = (  # every row sampled (decode): no row gather
                hidden if len(last) == len(hidden) else hidden[host_tensor(last, self.device)]
            )
            logits = self.model.compute_logits(rows_out)  # [num_sampled, vocab] float32
            out.tokens, out.logprobs, out.unusable = self._sample(logits, batch)
        return out

    def _sample(
        self, logits: torch.Tensor, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, SampledLogprobs | None, torch.Tensor]:
        """Next ids of the batch's sampled requests (after their logits processors), their
        log-probs (of the raw logits) if any asked, and which rows were unusable."""
        reqs = batch.sampled_reqs
        tokens, unusable = sample_next_tokens(self.processors.apply(logits, reqs), reqs)
        self.processors.record(reqs, tokens)
        return tokens, sampled_logprobs(logits, tokens, reqs), unusable

    def _input_ids(self, batch: ScheduledBatch, rows: list[int]) -> torch.Tensor:
        """The batch's token ids on the device: from the requests' known tokens, or (a
        batch scheduled ahead) the ids the previous launch sampled into ``last_sampled``."""
        if batch.decode_ahead:
            return self.last_sampled[host_tensor(rows, self.device)]
        ids = [
            t
            for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True)
            for t in req.fill_ids[start : start + n]
        ]
        return host_tensor(ids, self.device)

    def _decode_graph_size(
        self, batch: ScheduledBatch, capture_layers: tuple[int, ...] | None
    ) -> int | None:
        """The graph batch size a pure decode batch of a plain engine replays in, if any."""
        if self.decode_graphs is None or capture_layers is not None:
            return None
        if not all(n == 1 for n in batch.extend_lens) or not all(batch.sample):
            return None
        return self.decode_graphs.size_for(len(batch.reqs))

    def _replay_decode(
        self, size, input_ids, positions, out_loc, meta, launching: bool
    ) -> torch.Tensor:
        """Fill the bucket of ``size`` (pad rows write to the pad slot), replay -> logits
        [bs, vocab] of the real rows.  ``launching`` on CUDA: record when every input is
        queued, so the next ``launch`` may plan before this replay has run."""
        b = self.decode_graphs.bucket(size)
        bs = input_ids.numel()
        b.input_ids[:bs].copy_(input_ids)
        b.positions[:bs].copy_(positions)
        b.out_loc[:bs].copy_(out_loc)
        b.out_loc[bs:].fill_(self.kv_pool.pad_slot)
        self.backend.update_graph_plan(b.plan, pad_metadata(meta, b.shape, self.kv_pool.pad_slot))
        if launching and self.device.type == "cuda":
            self._inputs_consumed = torch.cuda.Event()
            self._inputs_consumed.record()
        return self.decode_graphs.run(size)[:bs]
