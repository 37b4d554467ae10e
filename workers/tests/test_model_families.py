"""Qwen3, Qwen3-MoE and Mixtral targets: their config.json read as transformers reads it
(and what the engine does not run refused, naming the field), the sparse MoE block against
transformers' own, and the engine's greedy output token for token against transformers
``generate``.  (The model's logits against transformers: test_model.py's CASES.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from specd.devtools import tiny_checkpoint
from specd.devtools.testing import (
    check_exact_run,
    hf_greedy,
    metric_value,
    random_prompts,
    start_engine,
)
from specd.kernels.moe import route_topk
from specd.workers.model.config import ModelConfig, ModelLoadError
from specd.workers.model.loader import load_model
from specd.workers.model.moe_block import SparseMoeBlock

MAX_NEW = 12
HIDDEN = 64
_SHARED = dict(
    vocab_size=32,
    hidden_size=HIDDEN,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)
# family -> (transformers config, its sparse block class, architecture)
BLOCKS = {
    "qwen3-moe": (
        lambda: Qwen3MoeConfig(
            **_SHARED,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
        ),
        Qwen3MoeSparseMoeBlock,
        "Qwen3MoeForCausalLM",
    ),
    "mixtral": (
        lambda: MixtralConfig(
            **_SHARED, intermediate_size=48, num_local_experts=4, sliding_window=None
        ),
        MixtralSparseMoeBlock,
        "MixtralForCausalLM",
    ),
}
UNCHOSEN = 3  # the expert the "unchosen" routing never picks


def _block_pair(family: str, dtype: torch.dtype):
    """(ours with per-expert linears, ours stacked, transformers' eager block), same weights."""
    make_config, hf_class, architecture = BLOCKS[family]
    hf_config = make_config()
    hf_config._experts_implementation = "eager"  # the reference arithmetic
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": [architecture]})
    plain = SparseMoeBlock(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in plain.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        plain.gate.weight[UNCHOSEN] = -1.0  # never picked for positive inputs
    plain = plain.to(dtype)
    stacked = SparseMoeBlock(config).to(dtype)
    stacked.load_state_dict(plain.state_dict())
    stacked.stack_experts()
    hf = hf_class(hf_config).to(dtype)
    w13, w2 = plain.expert_weights()
    with torch.no_grad():
        hf.gate.weight.copy_(plain.gate.weight)
        hf.experts.gate_up_proj.copy_(w13)
        hf.experts.down_proj.copy_(w2)
    return plain, stacked, hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("family", list(BLOCKS))
@torch.no_grad()
def test_moe_block_equals_transformers(family, tokens, dtype):
    """Stacked experts (the serving layout) equal the checkpoint layout bit for bit and
    transformers' block: in bf16 that holds only with each family's routing-weight dtype
    (Qwen3-MoE rounds the weights to bf16 first, Mixtral scales in float32; the other
    rule changes about a quarter of the outputs).  Expert 3 is chosen by no token."""
    plain, stacked, hf = _block_pair(family, dtype)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).abs() + 0.1
    x = x.to(dtype)
    _, ids = route_topk(plain.gate(x), plain.top_k, plain.renormalize)
    counts = torch.bincount(ids.flatten(), minlength=plain.gate.weight.shape[0])
    assert counts[UNCHOSEN] == 0 and (counts > 0).sum() > (1 if tokens == 1 else 2)
    ours = plain(x)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert torch.equal(stacked(x), ours)
    assert stacked.experts is None and stacked.w13.shape == plain.expert_weights()[0].shape
    want = hf(x[None])[0]
    if dtype == torch.float32:
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    else:  # bit for bit but where a CPU's matmul rounds its float32 sums otherwise
        assert (ours == want).float().mean() > 0.99


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@torch.no_grad()
def test_load_stacks_the_experts_and_keeps_the_outputs(tiny_models, family):
    """The published expert tensors load 1:1; the inference layout holds each sparse
    layer's experts as w13 [E, 2I, H] and w2 [E, H, I] and gives the same logits."""
    path = tiny_models(family)
    plain, config = load_model(path, dtype="float32", inference_layout=False)
    stacked, _ = load_model(path, dtype="float32")
    assert set(plain.state_dict()) == set(load_file(f"{path}/model.safetensors"))
    moe = config.moe
    for i, layer in enumerate(stacked.model.layers):
        block = layer.feed_forward
        assert isinstance(block, SparseMoeBlock) == config.is_sparse_layer(i)
        if isinstance(block, SparseMoeBlock):
            assert block.experts is None
            assert block.w13.shape == (moe.num_experts, 2 * moe.intermediate_size, HIDDEN)
            assert block.w2.shape == (moe.num_experts, HIDDEN, moe.intermediate_size)
    assert sorted(moe.sparse_layers) == ([0, 2] if family == "qwen3-moe" else [0, 1, 2])
    tokens = torch.tensor(random_prompts(1, 300, seed=4, lo=20, hi=20)[0])
    hidden = [m.model.embed_tokens(tokens) for m in (plain, stacked)]
    for plain_layer, stacked_layer in zip(plain.model.layers, stacked.model.layers, strict=True):
        hidden = [plain_layer.feed_forward(hidden[0]), stacked_layer.feed_forward(hidden[1])]
        torch.testing.assert_close(hidden[1], hidden[0], atol=1e-4, rtol=0)


def _raw_config(architecture: str, **fields) -> dict:
    """A minimal config.json of ``architecture`` (3 layers), with ``fields`` over it."""
    raw = {
        "architectures": [architecture],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
    }
    if architecture == "Qwen3MoeForCausalLM":
        raw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)
    elif architecture == "MixtralForCausalLM":
        raw.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return {**raw, **fields}


def test_qwen3_and_moe_configs_are_read_as_transformers_reads_them():
    qwen3 = ModelConfig.from_dict(_raw_config("Qwen3ForCausalLM", attention_bias=True))
    assert qwen3.qk_norm and qwen3.moe is None and qwen3.head_dim == 128  # Qwen3's default
    assert qwen3.attention_bias and qwen3.o_proj_bias  # Qwen3's bias covers o_proj too
    window = dict(use_sliding_window=True, sliding_window=64, max_window_layers=3)
    assert ModelConfig.from_dict(_raw_config("Qwen3ForCausalLM", **window)).moe is None
    moe = ModelConfig.from_dict(
        _raw_config(
            "Qwen3MoeForCausalLM",
            num_experts=None,
            num_local_experts=4,  # as transformers 5 saves it
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            num_hidden_layers=6,
            norm_topk_prob=True,
        )
    ).moe
    assert moe.num_experts == 4 and moe.top_k == 2 and moe.intermediate_size == 4
    assert moe.renormalize and moe.sparse_layers == {1, 5}
    mixtral = ModelConfig.from_dict(_raw_config("MixtralForCausalLM", attention_bias=True))
    assert mixtral.moe.sparse_layers == {0, 1, 2} and mixtral.moe.renormalize
    assert mixtral.moe.intermediate_size == 16 and not mixtral.attention_bias
    assert not mixtral.qk_norm and mixtral.head_dim == 4 and mixtral.is_sparse_layer(2)
    no_experts = _raw_config("Qwen3MoeForCausalLM", num_experts=0)
    assert ModelConfig.from_dict(no_experts).moe is None  # every layer dense
    assert {"qwen3", "qwen3-moe", "mixtral"} <= set(tiny_checkpoint.VARIANTS)


QWEN3_WINDOW = dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)
CONFIG_ERRORS = {  # case -> (config.json, the message naming the field)
    "shared expert": (
        _raw_config("Qwen3MoeForCausalLM", shared_expert_intermediate_size=32),
        "shared_expert_intermediate_size=32: shared experts are not supported",
    ),
    "deepseek shared experts": (
        _raw_config("MixtralForCausalLM", n_shared_experts=1),
        "n_shared_experts=1: shared experts",
    ),
    "experts on a dense model": (
        _raw_config("LlamaForCausalLM", num_local_experts=8),
        "num_local_experts=8 describes experts, but LlamaForCausalLM is dense",
    ),
    "moe width on qwen3 dense": (
        _raw_config("Qwen3ForCausalLM", moe_intermediate_size=32),
        "moe_intermediate_size=32 describes experts",
    ),
    "top-k above experts": (
        _raw_config("Qwen3MoeForCausalLM", num_experts_per_tok=5),
        "num_experts_per_tok=5 must be between 1 and the number of experts",
    ),
    "top-k zero": (
        _raw_config("MixtralForCausalLM", num_experts_per_tok=0),
        "num_experts_per_tok=0",
    ),
    "no expert count": (
        _raw_config("MixtralForCausalLM", num_local_experts=None),
        r"needs num_experts \(or num_local_experts\)",
    ),
    "no top-k": (
        _raw_config("Qwen3MoeForCausalLM", num_experts_per_tok=None),
        "needs num_experts_per_tok",
    ),
    "no expert width": (
        _raw_config("Qwen3MoeForCausalLM", moe_intermediate_size=None),
        "needs moe_intermediate_size",
    ),
    "expert counts disagree": (
        _raw_config("Qwen3MoeForCausalLM", num_local_experts=8),
        "num_experts and num_local_experts disagree",
    ),
    "zero mixtral experts": (
        _raw_config("MixtralForCausalLM", num_local_experts=0, num_experts_per_tok=1),
        "num_local_experts=0 must be >= 1",
    ),
    "sparse step zero": (
        _raw_config("Qwen3MoeForCausalLM", decoder_sparse_step=0),
        "decoder_sparse_step=0 must be >= 1",
    ),
    "dense layers on mixtral": (
        _raw_config("MixtralForCausalLM", mlp_only_layers=[1]),
        r"mlp_only_layers=\[1\] is not supported on MixtralForCausalLM",
    ),
    "qwen3 sliding window": (
        _raw_config("Qwen3ForCausalLM", **QWEN3_WINDOW),
        r"use_sliding_window with sliding_window=64 on layers \[1, 2\]",
    ),
    "qwen3 sliding layer types": (
        _raw_config(
            "Qwen3ForCausalLM",
            **QWEN3_WINDOW,
            layer_types=["full_attention", "full_attention", "sliding_attention"],
        ),
        r"on layers \[2\] \(layer_types",
    ),
    "qwen3-moe sliding window": (
        _raw_config("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=64),
        "sliding_window=64",
    ),
    "mixtral sliding window": (
        _raw_config("MixtralForCausalLM", sliding_window=64),
        r"sliding_window=64 \(< max_position_embeddings=2048\)",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_unsupported_family_settings_are_refused_naming_the_field(case):
    raw, message = CONFIG_ERRORS[case]
    with pytest.raises(ModelLoadError, match=f"config.json: .*{message}"):
        ModelConfig.from_dict(raw)


@pytest.fixture(
    scope="module",
    # Qwen3 dense is also held to transformers in test_model.py and, through the engine,
    # in test_spec_model_families.py; its engine runs here are slow (transformers'
    # reference takes ~15 s per family on 2 cores)
    params=[pytest.param("qwen3", marks=pytest.mark.slow), "qwen3-moe", "mixtral"],
)
def family_reference(request, tiny_models):
    """(checkpoint, 16 ragged prompts, transformers' greedy outputs) for one family."""
    path = tiny_models(request.param)
    prompts = random_prompts(16, 300, seed=30)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(family_reference, page_size):
    """One prompt alone, then 16 ragged prompts concurrently, chunked prefill (chunks of
    8 split most prompts), strict leak checks: token for token transformers' output."""
    path, prompts, expected = family_reference
    engine = start_engine(
        path,
        kvCache={"pageSize": page_size, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 8},
        debug={"strictMemCheck": 1},
    )
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_fused_moe_on_cuda_equals_transformers(tiny_models, family):
    """On CUDA in float32 the MoE layers run the Triton fused MoE (full-precision dots),
    under CUDA graphs, and greedy output equals transformers' on CPU token for token."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specd.kernels.triton_moe import fused_moe

    path = tiny_models(family)
    prompts = random_prompts(16, 300, seed=31)
    expected = hf_greedy(path, prompts, MAX_NEW)
    engine = start_engine(
        path,
        device="cuda",
        kvCache={"pageSize": 16, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 8},
        debug={"strictMemCheck": 1},
    )
    blocks = [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.is_stacked and b.fused is fused_moe for b in blocks)
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
