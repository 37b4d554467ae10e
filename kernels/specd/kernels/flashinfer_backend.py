"""flashinfer attention over the token pool (CUDA, bfloat16 / float16).

The pool is one slot per token, so it is flashinfer's paged KV with page size 1: a
layer's ``k_buffer [slots, kv_heads, head_dim]`` is the ``NHD`` page table
``[slots, 1, kv_heads, head_dim]`` as a view, ``kv_indices`` are the page indices and
every last page holds one token.  That covers every read the engine makes, holey
per-branch draft layouts included (seed 002), with no layout of its own.

* A batch of one-token queries without a custom mask (decode, draft steps) runs
  ``BatchDecodeWithPagedKVCacheWrapper``; anything else (prefill chunks, mixed batches,
  tree verify with its custom mask) runs ``BatchPrefillWithPagedKVCacheWrapper``.
* ``plan`` keeps the host-side index arrays; the wrapper's own ``plan`` needs the
  head counts, head size and dtypes, which only the first layer's ``forward`` knows, so
  it runs there once and every later layer of the batch reuses it.  A wrapper serves
  one planned batch at a time; a plan whose wrapper was re-planned for another batch
  plans it again.
* CUDA-graph batches (``graph_plan``) get wrappers of their own in flashinfer's graph
  mode, on fixed buffers; ``update_graph_plan`` plans them (host side) before a replay.
* Every prefill wrapper runs flashinfer's FA2 kernels (``PREFILL_KERNELS``).  A wrapper
  left on ``backend="auto"`` picks its kernel family at its first plan and keeps it; on
  Hopper an unmasked first plan picks FA3, which runs no custom mask, so the first tree
  verify after a causal prefill would fail (flashinfer 0.7.2: ``is_fa3_backend_supported``
  is False with a custom mask, and the SM90 kernel returns ``cudaErrorNotSupported``).
* A plan writes the wrapper's schedule into a pinned host buffer and queues its copy to
  the device without waiting (flashinfer's ``scheduler.cuh``), so re-planning a wrapper
  before that copy ran would rewrite what the earlier batch reads.  Each plan records an
  event; the next plan of the same wrapper waits for it (mini-sglang #103 hit this race
  under overlap scheduling).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import flashinfer
import torch

from specd.kernels.backend import BackendCapabilities, register_backend
from specd.kernels.metadata import AttentionMetadata, GraphBuffers, GraphShape

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended split-k scratch
PREFILL_KERNELS = "fa2"  # one family for causal and masked batches (see above)
_plan_ids = itertools.count()


@dataclass(slots=True)
class FlashInferPlan:
    """One batch: host index arrays (flashinfer plans from host copies, no sync)."""

    meta: AttentionMetadata | None  # None: a graph batch planned from its lengths alone
    decode: bool  # every request a single causal query: the decode wrapper
    qo_indptr: torch.Tensor  # [bs + 1] int32, host
    kv_indptr: torch.Tensor  # [bs + 1] int32, host
    kv_indices: torch.Tensor  # [sum(kv_len)] int32, on device
    last_page_len: torch.Tensor  # [bs] int32, host: all 1 (page size 1)
    plan_id: int = field(default_factory=lambda: next(_plan_ids))


@dataclass(slots=True)
class FlashInferGraphPlan:
    """A graph-mode wrapper on fixed buffers, for batches of one ``GraphShape``."""

    shape: GraphShape
    wrapper: object
    kv_indices: torch.Tensor  # the wrapper's page-index buffer (int32)


def _host_indptr(lens: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out


@register_backend(
    BackendCapabilities(
        name="flashinfer",
        devices=("cuda",),
        supports_custom_mask=True,
        supports_paged_tree=True,
        dtypes=(torch.bfloat16, torch.float16),
        supports_graphs=True,
        head_dims=(64, 128, 256),  # its FA2 prefill tiles head_dim in 64-wide steps
    )
)
class FlashInferAttentionBackend:
    def __init__(self):
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[str, object] = {}
        self._planned: dict[str, tuple[int, int, int, int]] = {}  # kind -> (plan, H, Hkv, D)
        self._plan_copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan

    def plan(self, meta: AttentionMetadata) -> FlashInferPlan:
        decode = meta.custom_mask is None and all(q == 1 for q in meta.qo_lens)
        return FlashInferPlan(
            meta=meta,
            decode=decode,
            qo_indptr=_host_indptr(meta.qo_lens),
            kv_indptr=_host_indptr(meta.kv_lens),
            kv_indices=meta.kv_indices.to(torch.int32),
            last_page_len=torch.ones(meta.batch_size, dtype=torch.int32),
        )

    @staticmethod
    def graph_buffer_needs(shape: GraphShape) -> dict[str, tuple[int, torch.dtype]]:
        """The shared buffers (``GraphBuffers``) a plan of ``shape`` takes views of: page
        indices, and the custom mask as flashinfer packs it (bits, each request's padded
        to a byte)."""
        bs = shape.batch_size
        needs = {"kv_indices": (bs * shape.max_kv_len, torch.int32)}
        if shape.custom_mask:
            needs["custom_mask"] = (bs * (shape.qo_len * shape.max_kv_len // 8 + 1), torch.uint8)
        return needs

    def graph_plan(
        self, shape: GraphShape, device: torch.device, buffers: GraphBuffers
    ) -> FlashInferGraphPlan:
        bs = shape.batch_size
        needs = self.graph_buffer_needs(shape)
        kv_indices = buffers.view("kv_indices", needs["kv_indices"][0])
        indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        last_page_len = torch.ones(bs, dtype=torch.int32, device=device)
        workspace = self._workspace_on(device)
        if shape.qo_len == 1 and not shape.custom_mask:
            group = shape.num_qo_heads // shape.num_kv_heads
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=group >= 4,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
            return FlashInferGraphPlan(shape, wrapper, kv_indices)
        masked = shape.custom_mask
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            backend=PREFILL_KERNELS,
            qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=device),
            paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last_page_len,
            custom_mask_buf=buffers.view("custom_mask", needs["custom_mask"][0])
            if masked
            else None,
            mask_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=device)
            if masked
            else None,
        )
        return FlashInferGraphPlan(shape, wrapper, kv_indices)

    def update_graph_plan(self, plan: FlashInferGraphPlan, meta: AttentionMetadata) -> None:
        """Plan the graph's wrapper for a batch padded to its shape (``pad_metadata``)."""
        self._plan_graph_wrapper(plan, self.plan(meta))

    def update_graph_plan_lens(
        self, plan: FlashInferGraphPlan, qo_lens: list[int], kv_lens: list[int]
    ) -> None:
        """Plan for a padded causal batch whose page indices the graph writes itself (into
        ``graph_kv_indices``): the planner copies the buffer onto itself."""
        qo_indptr, kv_indptr = _host_indptr(tuple(qo_lens)), _host_indptr(tuple(kv_lens))
        eager = FlashInferPlan(
            meta=None,
            decode=all(q == 1 for q in qo_lens),
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=plan.kv_indices[: int(kv_indptr[-1])],
            last_page_len=torch.ones(len(qo_lens), dtype=torch.int32),
        )
        self._plan_graph_wrapper(plan, eager)

    @staticmethod
    def graph_kv_indices(plan: FlashInferGraphPlan) -> torch.Tensor:
        return plan.kv_indices

    def _plan_graph_wrapper(self, plan: FlashInferGraphPlan, eager: FlashInferPlan) -> None:
        shape = plan.shape
        q = torch.empty(0, shape.num_qo_heads, shape.head_dim, dtype=shape.dtype)
        k = torch.empty(0, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
        self._plan_wrapper(plan.wrapper, eager, q, k, shape.head_dim**-0.5)

    def forward(self, q, k_buffer, v_buffer, plan, scale: float):
        """q [N, H, D] -> [N, H, D], reading K/V through ``plan`` (page size 1).  q may be
        a strided view (sliced out of a fused projection); flashinfer gets it packed."""
        q = q.contiguous()
        kv = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # NHD pages of one token
        if isinstance(plan, FlashInferGraphPlan):
            if abs(scale - plan.shape.head_dim**-0.5) > 1e-12:
                raise ValueError("flashinfer graph plans use the softmax scale head_dim**-0.5")
            return plan.wrapper.run(q, kv)
        return self._planned_wrapper(plan, q, k_buffer, scale).run(q, kv)

    def _planned_wrapper(self, plan: FlashInferPlan, q, k_buffer, scale: float):
        kind = _wrapper_kind(plan.decode, q.shape[1] // k_buffer.shape[1])
        key = (plan.plan_id, q.shape[1], k_buffer.shape[1], q.shape[2])
        wrapper = self._wrapper(kind, q.device)
        if self._planned.get(kind) != key:
            self._plan_wrapper(wrapper, plan, q, k_buffer, scale)
            self._planned[kind] = key
        return wrapper

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _wrapper(self, kind: str, device: torch.device):
        self._workspace_on(device)
        if kind not in self._wrappers:
            if kind == "prefill":
                self._wrappers[kind] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", backend=PREFILL_KERNELS
                )
            else:  # the tensor-core choice is fixed at construction
                self._wrappers[kind] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=kind == "decode_tensor_cores"
                )
        return self._wrappers[kind]

    def _plan_wrapper(self, wrapper, plan: FlashInferPlan, q, k_buffer, scale: float) -> None:
        """Plan ``wrapper`` for ``plan``'s batch (the decode or the prefill signature), once
        its previous plan's copy to the device has run."""
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        planner = self._plan_decode if plan.decode else self._plan_prefill
        planner(wrapper, plan, q, k_buffer, scale)
        if self._workspace.is_cuda and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
            self._plan_copied[id(wrapper)] = event

    @staticmethod
    def _plan_decode(wrapper, plan: FlashInferPlan, q, k_buffer, scale: float) -> None:
        heads = (q.shape[1], k_buffer.shape[1], q.shape[2], 1)  # q, kv heads, dim, page size
        wrapper.plan(
            plan.kv_indptr, plan.kv_indices, plan.last_page_len, *heads,
            **_dtypes_and_scale(q, k_buffer, scale),
        )  # fmt: skip

    @staticmethod
    def _plan_prefill(wrapper, plan: FlashInferPlan, q, k_buffer, scale: float) -> None:
        heads = (q.shape[1], k_buffer.shape[1], q.shape[2], 1)
        mask = plan.meta.custom_mask if plan.meta is not None else None
        wrapper.plan(
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len, *heads,
            custom_mask=mask, causal=mask is None,
            **_dtypes_and_scale(q, k_buffer, scale),
        )  # fmt: skip


def _wrapper_kind(decode: bool, group: int) -> str:
    """The eager wrapper a batch runs on: decode, with tensor cores once a KV head serves
    >= 4 query heads (a draft's group may differ from its target's), or prefill."""
    if not decode:
        return "prefill"
    return "decode_tensor_cores" if group >= 4 else "decode"


def _dtypes_and_scale(q: torch.Tensor, k_buffer: torch.Tensor, scale: float) -> dict:
    return {"q_data_type": q.dtype, "kv_data_type": k_buffer.dtype, "sm_scale": scale}
