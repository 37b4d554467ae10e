"""Tensor parallelism inside one replica: the rank group, and how a model is cut.

A replica of tensor size N runs N ranks, one process each (Megatron-LM's layout, as
SGLang and vLLM run ``--tp``):

    column parallel  q/k/v, gate/up, experts' gate/up   rank r holds rows r/N of the weight
    row parallel     o_proj, down_proj, experts' down   columns r/N, then one all-reduce
    vocab parallel   embed_tokens, lm_head              rows r/N of the padded vocabulary:
                     a masked lookup + all-reduce, and logits all-gathered for sampling
    replicated       norms, the MoE router, RoPE, EAGLE's fc, EAGLE-3's vocab maps

KV heads split across ranks when N divides them; when there are fewer KV heads than
ranks, each KV head is replicated on N / kv ranks, and rank r's query heads all read
KV head r * kv // N.  A row-parallel bias is added once: rank 0 holds it, the other
ranks hold zeros (the all-reduce sums the ranks' outputs).

Modules keep ``nn.Linear`` at the shard's shape, so the checkpoint names, the fused
q|k|v and gate|up layouts, the CPU re-layout and the KV pool all work unchanged;
``ShardPlan`` cuts each checkpoint tensor to its rank's piece while it is read, by
comparing the model's shapes at tensor 1 and at tensor N.  ``TpGroup.single()`` makes
every collective a no-op: tensor 1 runs exactly the single-device code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import distributed_c10d

from specd.workers.model.config import ModelConfig, ModelLoadError

FIELD = "spec.parallelism.tensor"
# biases of row-parallel linears: added once, by rank 0 (the other ranks hold zeros)
ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")
# column-parallel linears cut by KV head (replicated when there are fewer KV heads than ranks)
KV_PROJECTIONS = ("self_attn.k_proj.", "self_attn.v_proj.")


@dataclass(frozen=True)
class TpGroup:
    """This process's place in its replica's rank group, and the collectives it runs.

    Passed explicitly to the modules that communicate (no process-wide group), so a
    process can hold models of different tensor sizes (a test's reference at 1)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)  # torch.distributed ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same result."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a CPU collective on the group; each
        rank then takes the same decision from what it alone can see)."""
        if self.size == 1:
            return flag
        votes = torch.tensor([int(flag)])
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        return bool(votes.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] on each rank -> [..., N * d], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TpGroup()  # tensor 1: every collective is a no-op


def init_tensor_parallel(
    rank: int, size: int, init_method: str, timeout_s: float, backend: str | None = None
) -> TpGroup:
    """Join the rank group met at ``init_method`` (``tcp://host:port`` of rank 0, or a
    shared ``file://`` path).  NCCL on CUDA, gloo on CPU; every collective of the group
    fails after ``timeout_s`` instead of hanging."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TpGroup(rank, size, dist.group.WORLD)


def set_group_timeout(group: Any, timeout_s: float) -> None:
    """Every later collective of the formed ``group`` fails after ``timeout_s`` (torch's
    one way to give a group another timeout than it was formed with)."""
    distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def _split(total: int, size: int, what: str) -> int:
    if total % size:
        raise ModelLoadError(
            f"{FIELD} {size} does not divide the {what} ({total}); choose a tensor size "
            f"that divides it"
        )
    return total // size


@dataclass(frozen=True, slots=True)
class TpShape:
    """One rank's share of a model's dimensions at tensor size ``size``."""

    size: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank
    kv_replicas: int  # ranks holding each KV head (1 when the KV heads are split)
    intermediate: int  # dense MLP columns per rank
    moe_intermediate: int | None  # each expert's MLP columns per rank

    @classmethod
    def of(cls, config: ModelConfig, size: int, whose: str = "model") -> TpShape:
        """The shares, or ``ModelLoadError`` naming ``spec.parallelism.tensor`` when a
        dimension does not split into ``size`` equal parts (``whose``: "model" or
        "draft", for the message) or the checkpoint is FP8 (its block scales are not
        cut yet)."""
        if size > 1 and config.quantization is not None:
            raise ModelLoadError(
                f"{FIELD} {size}: FP8 checkpoints are served at tensor 1 only; serve the "
                f"bf16 checkpoint over {size} GPUs or the FP8 one on one GPU"
            )
        heads = _split(config.num_attention_heads, size, f"{whose}'s attention heads")
        kv = config.num_key_value_heads
        if kv % size == 0:
            kv_heads, kv_replicas = kv // size, 1
        elif size % kv == 0:
            kv_heads, kv_replicas = 1, size // kv
        else:
            raise ModelLoadError(
                f"{FIELD} {size} neither divides the {whose}'s {kv} KV heads nor is a "
                f"multiple of them; choose a tensor size that does one or the other"
            )
        inter = _split(config.intermediate_size, size, f"{whose}'s MLP intermediate size")
        moe = config.moe
        moe_inter = None if moe is None else _split(moe.intermediate_size, size, "expert width")
        return cls(size, heads, kv_heads, kv_replicas, inter, moe_inter)


def vocab_shard(vocab: int, size: int) -> int:
    """Rows of a vocabulary-sized matrix per rank: the vocabulary padded up to a
    multiple of ``size`` (the padding rows are zeros and their logits are dropped)."""
    return -(-vocab // size)


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's rows of the vocabulary (``weight`` keeps its
    name): ids outside them look up zeros, and the all-reduce fills them in."""

    def __init__(self, vocab: int, hidden: int, tp: TpGroup):
        rows = vocab_shard(vocab, tp.size)
        super().__init__(rows, hidden)
        self.tp, self.start = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


def gather_logits(tp: TpGroup, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """This rank's logits [M, vocab / N] -> all of them [M, vocab] float32 (padding dropped)."""
    return tp.all_gather_last(logits)[..., :vocab].float()


@dataclass(frozen=True)
class ShardPlan:
    """How to cut each checkpoint tensor for one rank: the tensor-1 and tensor-N shapes
    of every model tensor (from the model built twice on the meta device)."""

    rank: int
    kv_replicas: int
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name -> (full, local)

    @classmethod
    def between(cls, full: nn.Module, local: nn.Module, tp: TpGroup, kv_replicas: int) -> ShardPlan:
        """The plan from ``full`` (built at tensor 1) to ``local`` (this rank's)."""
        local_shapes = {n: tuple(t.shape) for n, t in local.state_dict().items()}
        shapes = {
            name: (tuple(t.shape), local_shapes[name])
            for name, t in full.state_dict().items()
            if name in local_shapes
        }
        return cls(tp.rank, kv_replicas, shapes)

    def take(self, name: str, source: Any) -> torch.Tensor:
        """This rank's piece of tensor ``name`` from ``source`` (a tensor, or a
        safetensors slice, read one tensor at a time: a rank holds at most one whole
        tensor, briefly, besides its shard).  Tensors the plan does not know
        (vocab maps, a tensor the checkpoint should not have) come whole.  A stored shape
        other than the whole model's is refused, naming the tensor."""
        full, local = self.shapes.get(name, (None, None))
        stored = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
        if full is not None and stored != full:
            raise ModelLoadError(
                f"tensor {name} has shape {stored}, expected {full} from config.json"
            )
        if full is None or full == local:
            whole = source if isinstance(source, torch.Tensor) else source[:]
            if self.rank and name.endswith(ROW_PARALLEL_BIASES):
                return torch.zeros_like(whole)
            return whole
        dims = [d for d, (f, s) in enumerate(zip(full, local, strict=True)) if f != s]
        if len(dims) != 1:
            raise ModelLoadError(f"{name}: cannot shard shape {full} into {local}")
        dim, rows = dims[0], local[dims[0]]
        index = (
            self.rank // self.kv_replicas if any(k in name for k in KV_PROJECTIONS) else self.rank
        )
        start = min(index * rows, full[dim])
        stop = min(start + rows, full[dim])
        cut = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(full)))
        piece = source[cut].clone()  # its own storage: the whole tensor is freed
        if stop - start < rows:  # the last rank's share of a padded vocabulary
            pad = [0, 0] * (len(full) - 1 - dim) + [0, rows - (stop - start)]
            piece = F.pad(piece, pad)
        return piece
