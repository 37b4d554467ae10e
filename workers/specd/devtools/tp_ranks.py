"""Run a function on the ranks of one tensor-parallel group, each in a fresh process
(gloo on CPU, one torch thread each), and collect what each returns: tests and
benchmarks of the sharded model without Ray or the engine.

``model_trace`` is such a function: it loads a checkpoint at the group's tensor size,
runs chunked prefill and greedy paged decode (and a draft head over the same rows), and
returns the logits, so a test compares tensor N with tensor 1 and with transformers.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specd.devtools.paged_runner import PagedRunner
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.model.draft_loader import load_draft
from specd.workers.model.eagle3 import Eagle3DraftModel
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaAttention
from specd.workers.model.loader import load_model
from specd.workers.model.parallel import (
    SINGLE_RANK,
    TpGroup,
    init_tensor_parallel,
    set_group_timeout,
)

RANK_START_S = 60  # a fresh process imports torch and specd before it joins


def run_on_ranks(
    size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120, late_s: float = 0.0
) -> list:
    """``fn(tp, *args)`` on each of ``size`` ranks (``fn`` importable, args picklable);
    -> the ranks' results in rank order.  A rank's exception is raised here with its
    traceback; a rank that neither returns nor fails within ``timeout_s`` (plus its
    start and ``late_s``) is killed.  The last rank joins the group ``late_s`` after the others."""
    context = mp.get_context("spawn")
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        box = context.Queue()
        ranks = [
            context.Process(
                target=_rank_main,
                args=(r, size, init, timeout_s, box, fn, args, late_s if r == size - 1 else 0),
            )
            for r in range(size)
        ]
        for process in ranks:
            process.start()
        try:
            while len(results) < size:
                rank, ok, value = box.get(timeout=RANK_START_S + late_s + timeout_s)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
        except queue.Empty:
            raise TimeoutError(f"ranks {sorted(set(range(size)) - set(results))} hung") from None
        finally:
            for process in ranks:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    return [results[r] for r in range(size)]


def _rank_main(rank, size, init, timeout_s, box, fn, args, late_s) -> None:
    torch.set_num_threads(1)
    time.sleep(late_s)
    try:
        tp = init_tensor_parallel(rank, size, init, timeout_s, "gloo") if size > 1 else SINGLE_RANK
        # plain pickle: tensors travel as bytes, not as shared memory that dies with this process
        box.put((rank, True, pickle.dumps(fn(tp, *args))))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        box.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stalled_collective(tp: TpGroup, timeout_s: float, stall_s: float) -> tuple[float, str]:
    """The group's timeout set to ``timeout_s``; one all-reduce; then the last rank
    stalls ``stall_s`` and rank 0 runs another.
    -> (seconds rank 0's second all-reduce took, its error's type name or "")."""
    set_group_timeout(tp.group, timeout_s)
    x = torch.ones(4)
    tp.all_reduce(x)
    if tp.rank == tp.size - 1:
        time.sleep(stall_s)
        return stall_s, ""
    started = time.monotonic()
    try:
        tp.all_reduce(x)
    except RuntimeError as err:
        return time.monotonic() - started, type(err).__name__
    return time.monotonic() - started, ""


@dataclasses.dataclass
class ModelTrace:
    """What one rank computed (identical on every rank but ``weight_bytes``)."""

    prefill: list[torch.Tensor]  # per prompt, the logits of every prompt token [L, vocab]
    decode: list[torch.Tensor]  # per greedy step, the batch's logits [batch, vocab]
    tokens: list[list[int]]  # each prompt followed by its greedy tokens
    draft: torch.Tensor | None  # the draft's logits over the prompts' rows
    weight_bytes: int  # this rank's resident weights (target, then draft)


@torch.no_grad()
def model_trace(
    tp: TpGroup,
    path: str,
    prompts: list[list[int]],
    page_size: int,
    steps: int,
    draft: tuple[str, str] | None = None,
) -> ModelTrace:
    """Load ``path`` at ``tp`` (float32), prefill ``prompts`` (the first in two chunks),
    decode ``steps`` greedy tokens each; with ``draft`` = (algorithm, folder), run the
    draft head over the prompts' rows as EAGLE does after a prefill."""
    model, config = load_model(path, dtype="float32", tp=tp)
    runner = PagedRunner(model, page_size, num_pages=256 // page_size, shuffle=True)
    rows = list(range(len(prompts)))
    head = prompts[0][: len(prompts[0]) // 2]
    first = runner.extend(rows, [head, *prompts[1:]])
    rest = runner.extend([0], [prompts[0][len(head) :]])
    chunks = first.split([len(head), *(len(p) for p in prompts[1:])])
    prefill = [torch.cat([chunks[0], rest]), *chunks[1:]]
    weight_bytes = resident_bytes(model)
    draft_logits = None
    if draft is not None:
        draft_model, draft_config = load_draft(draft[1], draft[0], model, config, "float32")
        draft_logits = _draft_over_prompts(model, draft_model, draft_config, prompts, page_size)
        weight_bytes += resident_bytes(draft_model)
    tokens = [list(p) for p in prompts]
    last = torch.stack([logits[-1] for logits in prefill])
    decode = []
    for _ in range(steps):
        next_ids = last.argmax(-1).tolist()
        for seq, token in zip(tokens, next_ids, strict=True):
            seq.append(token)
        last = runner.extend(rows, [[t] for t in next_ids])
        decode.append(last)
    return ModelTrace(prefill, decode, tokens, draft_logits, weight_bytes)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors ``model`` holds: parameters, buffers and the plain tensor
    attributes of re-laid-out linears, each storage counted once (a tied head too)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        held = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in held:
            if tensor.is_mkldnn:  # oneDNN-packed: no storage to share
                total += tensor.numel() * tensor.element_size()
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _draft_over_prompts(target, draft, draft_config, prompts, page_size) -> torch.Tensor:
    """The draft's logits for rows (token i+1, target hidden i) of each prompt."""
    runner = PagedRunner(target, page_size, num_pages=256 // page_size, shuffle=True)
    rows = list(range(len(prompts)))
    capture = draft_config.aux_layer_ids
    input_ids, positions, ctx = runner.batch(rows, prompts)
    hidden, aux = target.forward_with_aux(input_ids, positions, ctx, capture)
    pool = KVPool(
        draft_config.num_kv_layers,
        runner.pool.num_slots,
        next(m.num_kv_heads for m in draft.modules() if isinstance(m, LlamaAttention)),
        draft_config.head_dim,
        torch.float32,
        "cpu",
    )
    draft_ctx = ForwardContext(ctx.attn_plan, ctx.out_cache_loc, pool, ctx.backend)
    shifted = torch.cat([input_ids[1:], input_ids[-1:]])  # token i+1 beside hidden i
    if isinstance(draft, Eagle3DraftModel):
        fused = draft.fuse_aux_hidden([aux[i] for i in capture])
        _, normed = draft(shifted, fused, positions, draft_ctx)
        return draft.compute_logits(normed)
    return draft.compute_logits(draft(shifted, hidden, positions, draft_ctx))
