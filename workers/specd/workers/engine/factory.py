"""An engine's parts, built from its `DeploymentSpec`: tokenizer, target model and draft,
the KV memory (request rows, page allocator, K/V pools, prefix cache), the attention
backend, the model runner and speculative decoder, the scheduler and session store, and
the step executor.

The plain-vs-speculative choice is made here, once: a spec with a draft gets a
`SpeculativeExecutor` (decoder, adaptive policy, draft pool), one without a
`PlainExecutor`; the engine only talks to the `StepExecutor` interface.

Runs on the engine's compute thread (`Engine.start`): loading is torch work.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend, available_backends, get_backend, resolve_backend_name
from specd.kernels.ops import KernelOps
from specd.kernels.ops_choice import ops_for_backend
from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import ConfigError, DeploymentSpec
from specd.workers.engine.compute import Compute
from specd.workers.engine.decoders import build_spec_decoder
from specd.workers.engine.executors import (
    PlainExecutor,
    SpeculativeExecutor,
    StepExecutor,
    spec_graph_rungs,
)
from specd.workers.engine.metrics import EngineMetrics
from specd.workers.engine.parts import KVMemory, Models
from specd.workers.engine.rank_group import (
    MirroredModel,
    MirroredOps,
    PoolShape,
    RankFollower,
    RankLeader,
    RankRendezvous,
    join_rank_group,
)
from specd.workers.engine.rank_wire import KVLayout
from specd.workers.engine.session_transfer import SessionTransfer, kv_layout_of, vocabulary_of
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.block_keys import EvictedBlocks
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.mem_cache.sizing import (
    SpecShape,
    check_widest_rung_fits_context,
    kv_pool_tokens,
    row_width,
)
from specd.workers.model.config import ModelConfig
from specd.workers.model.cpu_linear import native_bfloat16_matmuls
from specd.workers.model.draft_loader import DraftConfig, load_draft
from specd.workers.model.loader import load_model
from specd.workers.model.null_model import load_null_model
from specd.workers.model.parallel import SINGLE_RANK, TpGroup, TpShape
from specd.workers.model.tokenizer import eos_token_ids, load_tokenizer
from specd.workers.runner.graph_runner import default_sizes
from specd.workers.runner.logits_processors import LogitsProcessors
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.scheduler.fit import FitPolicy
from specd.workers.scheduler.scheduler import Scheduler, SchedulerConfig
from specd.workers.scheduler.session_store import SessionStore
from specd.workers.speculation_spec import DRAFT_FREE
from specd.workers.speculative.adaptive import SpecPolicy
from specd.workers.speculative.decoder import SpecDecoder
from specd.workers.speculative.draft_head import DraftHead

logger = logging.getLogger(__name__)


def check_backend_supports_layout(backend: str, shape: SpecShape | None, page_size: int) -> None:
    """Seed 002: page size > 1 with topk > 1 only on backends that declare the paged tree."""
    if shape is None or page_size == 1 or shape.topk == 1:
        return
    backends = available_backends()
    if not backends[backend].supports_paged_tree:
        able = sorted(name for name, caps in backends.items() if caps.supports_paged_tree)
        raise ConfigError(
            f"spec.attentionBackend: {backend} does not support spec.kvCache.pageSize "
            f"{page_size} with spec.speculative.topk {shape.topk}; use one of {able}, "
            f"or pageSize 1, or topk 1"
        )


def pick_device(spec: DeploymentSpec) -> str:
    return "cuda" if spec.resources.gpus > 0 and torch.cuda.is_available() else "cpu"


def sampling_defaults(spec: DeploymentSpec, config: ModelConfig) -> dict:
    """What requests that leave sampling fields out get (``SamplingDefaultsSpec``)."""
    return spec.sampling_defaults.resolve(config.generation_sampling)


@dataclass(frozen=True, slots=True)
class EngineParts:
    models: Models
    memory: KVMemory
    runner: ModelRunner
    spec_decoder: SpecDecoder | None
    executor: StepExecutor
    graphs_off: str | None  # why there are no CUDA graphs (None: captured)
    fit: FitPolicy
    sessions: SessionStore
    scheduler: Scheduler
    session_transfer: SessionTransfer
    ranks: RankLeader | None  # rank 0's end of a tensor-parallel replica's wire


def build_engine_parts(
    spec: DeploymentSpec,
    *,
    device: torch.device,
    knobs: BenchKnobs,
    metrics: EngineMetrics,
    compute: Compute,
    rendezvous: RankRendezvous | None = None,
) -> EngineParts:
    """Load and size everything one replica runs (on the compute thread).  With
    ``rendezvous`` this is rank 0 of a tensor-parallel replica: it joins the group, loads
    its shards, and mirrors every collective call to the other ranks."""
    if rendezvous is None:
        return build_parts(spec, device, knobs, metrics, compute, SINGLE_RANK, None)
    if device.type == "cpu":  # each rank has its CPUs (as Ray gives the other ranks)
        torch.set_num_threads(max(1, int(spec.resources.cpu)))
    tp, wire = join_rank_group(rendezvous, 0, device)
    leader = RankLeader(wire, rendezvous.timeout_s)
    try:
        return build_parts(spec, device, knobs, metrics, compute, tp, leader)
    except BaseException:
        leader.close()  # the other ranks stop waiting; this process leaves the group
        raise


def build_parts(
    spec: DeploymentSpec,
    device: torch.device,
    knobs: BenchKnobs,
    metrics: EngineMetrics,
    compute: Compute,
    tp: TpGroup,
    leader: RankLeader | None,
) -> EngineParts:
    """`build_engine_parts` once this process's rank (``tp``) is known."""
    models = load_models(spec, device, knobs, tp)
    memory = build_memory(spec, models, device, tp.size)
    if leader is not None:
        models = mirrored_models(models, leader)
        pools = {"target": memory.kv_pool}
        if memory.draft_pool is not None:
            pools["draft"] = memory.draft_pool
        leader.start(KVLayout(memory.kv_pool.num_slots, memory.backend_name), pools)
    processors = LogitsProcessors(sorted(models.eos_token_ids))
    runner = ModelRunner(
        models.model, memory.req_pool, memory.kv_pool, memory.backend, device, processors
    )
    ops = memory.kv.ops if leader is None else MirroredOps(memory.kv.ops, leader)
    spec_decoder = build_spec_decoder(spec, models, memory, device, knobs, processors, ops)
    fit = FitPolicy(
        context_length=models.context_length,
        page_size=memory.allocator.page_size,
        pool_tokens=memory.allocator.total_tokens,
        spec=models.spec_shape,
    )
    sessions = SessionStore(
        memory.kv,
        fit=fit,
        enabled=spec.sessions.enabled,
        max_sessions=spec.sessions.max_sessions,
        timeout_s=spec.sessions.timeout_seconds,
        bos_token_id=models.tokenizer.bos_token_id,
    )
    scheduler = build_scheduler(spec, models, memory.kv, sessions)
    executor = build_executor(spec, models, scheduler, runner, spec_decoder, compute, metrics)
    graphs_off = graphs_off_reason(spec, memory.backend_name, memory.kv.ops.name, tp.size)
    if graphs_off is None:
        executor.capture_graphs(
            default_sizes(min(spec.cuda_graph.max_batch_size, spec.max_running_requests))
        )
    transfer = SessionTransfer(
        sessions,
        memory.kv,
        memory.pools,
        compute.run,
        vocabulary=vocabulary_of(spec),
        kv_layout=kv_layout_of(spec, memory.kv_pool.buffer.dtype),
        context_length=models.context_length,
        moves_kv=tp.size == 1,
    )
    return EngineParts(
        models=models,
        memory=memory,
        runner=runner,
        spec_decoder=spec_decoder,
        executor=executor,
        graphs_off=graphs_off,
        fit=fit,
        sessions=sessions,
        scheduler=scheduler,
        session_transfer=transfer,
        ranks=leader,
    )


def mirrored_models(models: Models, leader: RankLeader) -> Models:
    """Rank 0's models with their collective calls broadcast first (`MirroredModel`)."""
    model = MirroredModel(models.model, "target", leader)
    if models.draft_head is not None:
        models.draft_head.model = MirroredModel(models.draft_head.model, "draft", leader)
    return dataclasses.replace(models, model=model)


def build_follower(
    spec: DeploymentSpec, rank: int, rendezvous: RankRendezvous, knobs: BenchKnobs
) -> RankFollower:
    """Rank ``rank`` (> 0) of a tensor-parallel replica: joins the group and loads its
    shards of the target and the draft; `RankFollower.serve` then runs rank 0's calls."""
    device = torch.device(pick_device(spec))
    tp, wire = join_rank_group(rendezvous, rank, device)
    model, config = load_target(spec, device, knobs, None, tp)
    models: dict = {"target": model}
    shapes = {"target": local_pool_shape(config, config.num_hidden_layers, tp.size)}
    if spec.has_draft_model:
        draft, draft_config = load_spec_draft(spec, model, config, device, knobs, tp)
        models["draft"] = draft
        shapes["draft"] = local_pool_shape(draft_config.model, draft_config.num_kv_layers, tp.size)
    dtype = next(model.parameters()).dtype
    return RankFollower(wire, models, shapes, dtype, device, rendezvous.timeout_s)


def local_pool_shape(config: ModelConfig, num_layers: int, tensor: int) -> PoolShape:
    """A KV pool's shape on one rank: its share of the KV heads."""
    return PoolShape(num_layers, TpShape.of(config, tensor).kv_heads, config.head_dim)


def load_models(
    spec: DeploymentSpec, device: torch.device, knobs: BenchKnobs, tp: TpGroup = SINGLE_RANK
) -> Models:
    """Tokenizer, target and draft (``tp``: this rank's shards); a speculative spec's
    widest rung checked against the context length before the draft loads."""
    tokenizer = load_tokenizer(spec.model.tokenizer or spec.model.path)
    model, config = load_target(spec, device, knobs, tokenizer, tp)
    context_length = spec.model.context_length or config.max_position_embeddings
    eos = frozenset(eos_token_ids(tokenizer, config))
    defaults = sampling_defaults(spec, config)
    spec_shape = SpecShape.from_spec(spec.speculative)
    spec_policy = None
    if spec.speculative is not None:
        if spec.speculative.adaptive.enabled:
            check_widest_rung_fits_context(spec_shape, spec.kv_cache.page_size, context_length)
        draft_free = spec.draft is not None and spec.draft.algorithm in DRAFT_FREE
        spec_policy = SpecPolicy(spec.speculative, draft_free=draft_free)
    draft_head = None
    if spec.has_draft_model:
        draft_head = DraftHead(*load_spec_draft(spec, model, config, device, knobs, tp))
        check_draft_vocab_fits_topk(spec, draft_head.config)
    return Models(
        tokenizer=tokenizer,
        model=model,
        config=config,
        context_length=context_length,
        eos_token_ids=eos,
        sampling_defaults=defaults,
        spec_shape=spec_shape,
        spec_policy=spec_policy,
        draft_head=draft_head,
    )


def load_spec_draft(
    spec: DeploymentSpec,
    model: torch.nn.Module,
    config: ModelConfig,
    device: torch.device,
    knobs: BenchKnobs,
    tp: TpGroup = SINGLE_RANK,
) -> tuple[torch.nn.Module, DraftConfig]:
    """``spec.draft`` over ``model`` (sharded as the target is, over ``tp``)."""
    assert spec.draft is not None
    return load_draft(
        spec.draft.path,
        spec.draft.algorithm,
        model,
        config,
        device=str(device),
        dummy=knobs.dummy_weights,
        fused_elementwise=not knobs.eager_elementwise,
        token_map=spec.draft.token_map,
        dtype=draft_dtype(spec, device, model.model.embed_tokens.weight.dtype, tp),
    )


def check_draft_vocab_fits_topk(spec: DeploymentSpec, draft: DraftConfig) -> None:
    """Each draft step keeps its top-k of the draft's vocabulary: a token map (or an
    EAGLE-3 vocabulary) must hold at least the widest rung's topk ids."""
    assert spec.speculative is not None and spec.draft is not None
    widest = max(rung.topk for rung in spec.speculative.ladder)
    if draft.draft_vocab_size < widest:
        source = "spec.draft.tokenMap" if spec.draft.token_map else "the draft's draft_vocab_size"
        raise ConfigError(
            f"{source}: the draft proposes from {draft.draft_vocab_size} token ids, fewer "
            f"than spec.speculative's topk {widest}; list more ids or lower topk"
        )


def draft_dtype(
    spec: DeploymentSpec, device: torch.device, target: torch.dtype, tp: TpGroup = SINGLE_RANK
) -> str:
    """``spec.draft.dtype``, where this device can run it (``auto``: `auto_draft_dtype`).
    On CUDA the attention plans and graphs are built for the target's dtype, which the
    draft then shares.  The ranks of ``tp`` each see their own CPU, so ``auto`` asks
    them all: a bfloat16 draft only where every rank multiplies bfloat16 natively (a
    rank's shards must match the others' dtype)."""
    assert spec.draft is not None
    wanted = spec.draft.dtype.value
    if device.type == "cuda" and wanted not in ("auto", spec.model.dtype.value):
        raise ConfigError(
            f"spec.draft.dtype: {wanted} differs from spec.model.dtype "
            f"({spec.model.dtype.value}); on CUDA the draft runs in the target's dtype: "
            "leave spec.draft.dtype out"
        )
    if wanted == "auto":  # no vote on CUDA: auto is the target's dtype there, and an
        # NCCL group cannot reduce the vote's CPU tensor
        native_bf16 = device.type == "cpu" and tp.all_agree(native_bfloat16_matmuls())
        return auto_draft_dtype(target, device, native_bf16)
    if device.type == "cpu" and wanted == "bfloat16" and not native_bfloat16_matmuls():
        logger.warning(
            "spec.draft.dtype bfloat16 on a CPU without native bfloat16 matmuls (AVX512-BF16 "
            "or AMX): draft steps will be slower than in float32; leave spec.draft.dtype "
            "out (auto) on this machine"
        )
    return wanted


def auto_draft_dtype(target: torch.dtype, device: torch.device, native_bf16: bool) -> str:
    """``spec.draft.dtype: auto``: a bfloat16 draft beside a float32 target on a CPU that
    multiplies bfloat16 natively (2.5-4x faster draft steps, outputs unchanged: the
    target verifies every token); the target's dtype everywhere else."""
    if device.type == "cpu" and target == torch.float32 and native_bf16:
        return "bfloat16"
    return "auto"


def load_target(
    spec: DeploymentSpec,
    device: torch.device,
    knobs: BenchKnobs,
    tokenizer: Any,
    tp: TpGroup = SINGLE_RANK,
) -> tuple[torch.nn.Module, ModelConfig]:
    """The checkpoint's model (``tp``: this rank's shard), or with ``knobs.null_model``
    a `NullCausalLM` from its config.json alone (plain decoding only: a draft would read
    hidden states it has not)."""
    if not knobs.null_model:
        return load_model(
            spec.model.path,
            dtype=spec.model.dtype.value,
            device=str(device),
            dummy=knobs.dummy_weights,
            fused_elementwise=not knobs.eager_elementwise,
            tp=tp,
        )
    if tp.size > 1:
        raise ConfigError(
            "BenchKnobs.null_model (SPECD_BENCH_KNOBS) runs at spec.parallelism.tensor 1 only"
        )
    if spec.draft is not None:
        raise ConfigError(
            "BenchKnobs.null_model (SPECD_BENCH_KNOBS) serves plain decoding only: the null "
            "model has no hidden states for spec.draft to read; drop spec.draft"
        )
    return load_null_model(spec.model.path, spec.model.dtype.value, device, tokenizer)


def build_memory(
    spec: DeploymentSpec, models: Models, device: torch.device, tensor: int = 1
) -> KVMemory:
    """Size the KV pool (the draft's KV shares the target's slots), then build the rows,
    pages, prefix cache and K/V pools; the attention backend is chosen on the way.
    ``tensor``: each rank holds its share of the KV heads."""
    cfg, page = models.config, spec.kv_cache.page_size
    dtype = next(models.model.parameters()).dtype
    shape = local_pool_shape(cfg, cfg.num_hidden_layers, tensor)
    per_token = KVPool.bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype)
    draft_cfg = models.draft_head.config if models.draft_head is not None else None
    draft_shape = None
    if draft_cfg is not None:  # the draft's KV shares the target's slots
        draft_shape = local_pool_shape(draft_cfg.model, draft_cfg.num_kv_layers, tensor)
        per_token += KVPool.bytes_per_token(
            draft_shape.num_layers,
            draft_shape.num_kv_heads,
            draft_shape.head_dim,
            models.draft_head.dtype,
        )
    free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    tokens = kv_pool_tokens(spec.kv_cache, per_token, free_bytes, models.context_length)
    num_pages = tokens // page
    allocator = PagedTokenAllocator(num_pages, page)
    sessions = spec.sessions.max_sessions if spec.sessions.enabled else 0
    req_pool = ReqToTokenPool(
        spec.max_running_requests + sessions,  # idle sessions keep their row
        row_width(models.context_length, models.spec_shape, page),
        device,
        pad_slot=num_pages * page,  # the KV pools' pad slot (one past the allocator's)
    )
    head_dims = [cfg.head_dim] + ([draft_cfg.head_dim] if draft_cfg is not None else [])
    backend_name, backend, ops = choose_backend(spec, models.spec_shape, device, dtype, head_dims)
    evicted_blocks = EvictedBlocks(page)
    cache = (
        PrefixCache(allocator, evicted_blocks.evicted, evicted_blocks.block_tokens)
        if spec.kv_cache.prefix_cache
        else None
    )
    kv = KVManager(req_pool, allocator, ops, cache)
    slots = num_pages * page
    kv_pool = KVPool(shape.num_layers, slots, shape.num_kv_heads, shape.head_dim, dtype, device)
    draft_pool = None
    if draft_shape is not None:
        draft_pool = KVPool(
            draft_shape.num_layers,
            slots,
            draft_shape.num_kv_heads,
            draft_shape.head_dim,
            models.draft_head.dtype,
            device,
        )
    return KVMemory(
        req_pool=req_pool,
        allocator=allocator,
        kv=kv,
        kv_pool=kv_pool,
        draft_pool=draft_pool,
        evicted_blocks=evicted_blocks,
        backend_name=backend_name,
        backend=backend,
    )


def choose_backend(
    spec: DeploymentSpec,
    shape: SpecShape | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dims: list[int],
) -> tuple[str, AttentionBackend, KernelOps]:
    """The attention backend ``spec.attentionBackend`` resolves to here, and its kernel ops."""
    page = spec.kv_cache.page_size
    try:
        paged_tree = shape is not None and page > 1 and shape.topk > 1
        backend_name = resolve_backend_name(
            spec.attention_backend, device.type, dtype, paged_tree, head_dims
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    check_backend_supports_layout(backend_name, shape, page)
    backend = get_backend(backend_name, device.type, dtype)
    return backend_name, backend, ops_for_backend(backend_name)


def build_scheduler(
    spec: DeploymentSpec, models: Models, kv: KVManager, sessions: SessionStore
) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(
            max_running_requests=spec.max_running_requests,
            chunked_prefill_size=spec.scheduler.chunked_prefill_size,
            context_length=models.context_length,
            eos_token_ids=models.eos_token_ids,
            spec=models.spec_shape,
            policy=spec.scheduler.policy,
        ),
        kv,
    )
    scheduler.sessions = sessions
    return scheduler


def build_executor(
    spec: DeploymentSpec,
    models: Models,
    scheduler: Scheduler,
    runner: ModelRunner,
    spec_decoder: SpecDecoder | None,
    compute: Compute,
    metrics: EngineMetrics,
) -> StepExecutor:
    """The one place that picks plain or speculative decode."""
    overlap = spec.scheduler.overlap
    if spec_decoder is None:
        return PlainExecutor(scheduler, runner, compute, overlap)
    return SpeculativeExecutor(
        scheduler,
        runner,
        compute,
        overlap,
        decoder=spec_decoder,
        policy=models.spec_policy,
        graph_rungs=spec_graph_rungs(spec.speculative, models.spec_policy),
        metrics=metrics,
    )


def graphs_off_reason(
    spec: DeploymentSpec, backend_name: str, ops_name: str, tensor: int = 1
) -> str | None:
    """Why this engine runs without CUDA graphs, or None: the spec and the backend allow
    them (captured on CUDA; without it emulated, see ``EmulatedGraph``)."""
    if not spec.cuda_graph.enabled:
        return "spec.cudaGraph.enabled is false"
    if spec.ngram is not None:
        algorithm = spec.draft.algorithm.value
        return f"{algorithm} drafting runs its verify eagerly (no graphs captured for it yet)"
    if tensor > 1:  # rank 0 sends each eager call's inputs; a replay has none to send
        return f"spec.parallelism.tensor is {tensor}: graphs run at tensor 1 only"
    if not available_backends()[backend_name].supports_graphs:
        return f"the {backend_name} backend has no graph plans"
    if ops_name != "triton":  # the torch ops read index lengths on the host
        return f"graph bodies need the Triton kernel ops, not {ops_name}"
    return None
