"""The speculative decoder a spec asks for, built from its loaded parts: a draft model's
(EAGLE, EAGLE-3), hybrid (a draft model with SUFFIX's output cache), NGRAM's or SUFFIX's.
None for plain decode."""

from __future__ import annotations

import torch

from specd.kernels.ops import KernelOps
from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import DeploymentSpec, NgramSpec, SuffixSpec
from specd.workers.engine.parts import KVMemory, Models
from specd.workers.runner.logits_processors import LogitsProcessors
from specd.workers.speculative.decoder import SpecDecoder
from specd.workers.speculative.hybrid_decoder import HybridDecoder
from specd.workers.speculative.ngram import NgramProposer
from specd.workers.speculative.ngram_decoder import NgramDecoder
from specd.workers.speculative.suffix import SuffixCache, SuffixDrafting
from specd.workers.speculative.suffix_decoder import SuffixDecoder


def build_spec_decoder(
    spec: DeploymentSpec,
    models: Models,
    memory: KVMemory,
    device: torch.device,
    knobs: BenchKnobs,
    processors: LogitsProcessors,
    ops: KernelOps,
) -> SpecDecoder | None:
    """The decoder for ``spec.draft`` (None without one)."""
    if models.spec_shape is None:
        return None
    common = {
        "ops": ops,
        "force_accept_len": knobs.force_accept_len,
        "processors": processors,
    }
    if spec.ngram is not None:
        return build_draft_free_decoder(spec, models, memory, device, common)
    args = (
        models.model,
        models.draft_head,
        spec.kv_cache.page_size,
        memory.req_pool,
        memory.kv_pool,
        memory.draft_pool,
        memory.backend,
        device,
    )
    common["guided_drafts"] = not knobs.unguided_drafts
    if spec.suffix is None:
        return SpecDecoder(*args, **common)
    drafting = suffix_drafting(NgramSpec(), spec.suffix)
    return HybridDecoder(*args, drafting=drafting, threshold=spec.suffix.hybrid_threshold, **common)


def build_draft_free_decoder(
    spec: DeploymentSpec,
    models: Models,
    memory: KVMemory,
    device: torch.device,
    common: dict,
) -> NgramDecoder:
    """NGRAM's decoder, or SUFFIX's (NGRAM's with the replica's output cache)."""
    policy = models.spec_policy  # plain steps measure what its rung would accept
    plain = policy.cost_model is not None or policy.max_batch_for_spec is not None
    common = {**common, "shadow_rung": policy.fixed if plain and policy.fixed.speculates else None}
    args = (
        models.model,
        NgramProposer(spec.ngram.min_match, spec.ngram.max_match),
        spec.kv_cache.page_size,
        memory.req_pool,
        memory.kv_pool,
        memory.backend,
        device,
    )
    if spec.suffix is None:
        return NgramDecoder(*args, **common)
    return SuffixDecoder(*args, drafting=suffix_drafting(spec.ngram, spec.suffix), **common)


def suffix_drafting(ngram: NgramSpec, suffix: SuffixSpec) -> SuffixDrafting:
    """SUFFIX's proposals: own-token matches by ``ngram``, the output cache by ``suffix``."""
    cache = SuffixCache(suffix.max_depth, suffix.max_cached_tokens, suffix.share_across_keys)
    own = NgramProposer(ngram.min_match, ngram.max_match)
    return SuffixDrafting(own, cache, suffix.min_token_prob, suffix.max_spec_factor)
