"""Target model vs transformers on tiny offline checkpoints: prefill, paged decode, loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specd.devtools import tiny_checkpoint
from specd.devtools.paged_runner import PagedRunner
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.model.config import ModelConfig, ModelLoadError, parse_rope
from specd.workers.model.inference_layout import (
    fuse_projections,
    stack_linears,
    use_fused_elementwise,
    use_fused_moe,
)
from specd.workers.model.loader import load_model
from specd.workers.model.rope import RotaryEmbedding
from specd.workers.model.tokenizer import (
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
    token_bytes_reader,
)

ATOL = 1e-4
DECODE_STEPS = 8
CASES = {
    "gqa": dict(variant="gqa"),
    "tied": dict(variant="tied"),
    "bias": dict(variant="bias"),
    "llama3-rope": dict(variant="llama3"),
    "linear-rope": dict(variant="linear"),
    "mistral": dict(variant="mistral"),
    "sharded": dict(variant="gqa", sharded=True, seed=1),
    "qwen3": dict(variant="qwen3"),  # q/k head norms, head_dim 32 != hidden / heads
    "qwen3-moe": dict(variant="qwen3-moe"),  # layers 0 and 2 sparse, 1 dense
    "mixtral": dict(variant="mixtral", sharded=True),  # experts split across shards
}


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    ours, _ = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gqa"), variant="gqa")


@pytest.fixture
def broken_dir(gqa_dir, tmp_path):
    """A writable copy of the gqa checkpoint for tests that damage it."""
    return shutil.copytree(gqa_dir, tmp_path / "ckpt")


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]  # [len(tokens), vocab]


@torch.no_grad()
def test_prefill_matches_transformers(models):
    ours, hf = models
    prompts = _prompts(ours.config.vocab_size, (5, 1, 12, 7))
    runner = PagedRunner(ours, page_size=1, num_pages=64, shuffle=False)
    logits = runner.extend(list(range(len(prompts))), prompts)
    for prompt, got in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=ATOL, rtol=0)


@torch.no_grad()
def test_paged_decode_matches_transformers_generate(models):
    ours, hf = models
    prompts = _prompts(ours.config.vocab_size, (6, 3, 9), seed=1)
    rows = [3, 0, 2]
    runner = PagedRunner(ours, page_size=4, num_pages=16, shuffle=True)
    # Chunked prefill: request 0's prompt arrives in two pieces, the second one alone.
    first = runner.extend(rows, [prompts[0][:4], prompts[1], prompts[2]])
    second = runner.extend(rows[:1], [prompts[0][4:]])
    _, first_1, first_2 = first.split([4, len(prompts[1]), len(prompts[2])])
    last = torch.stack([second[-1], first_1[-1], first_2[-1]])  # [bs, vocab]
    seqs = [list(p) for p in prompts]
    for _ in range(DECODE_STEPS):
        next_tokens = last.argmax(-1).tolist()
        for seq, token in zip(seqs, next_tokens, strict=True):
            seq.append(token)
        last = runner.extend(rows, [[t] for t in next_tokens])  # [bs, vocab]
        expected = torch.stack([_hf_logits(hf, seq)[-1] for seq in seqs])
        torch.testing.assert_close(last, expected, atol=ATOL, rtol=0)
    for prompt, seq in zip(prompts, seqs, strict=True):
        generated = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=DECODE_STEPS
        )[0, len(prompt) :].tolist()
        assert seq[len(prompt) : len(prompt) + len(generated)] == generated
        assert len(generated) == DECODE_STEPS or generated[-1] in ours.config.eos_token_ids


@torch.no_grad()
def test_captured_layers_match_transformers_hidden_states(models):
    ours, hf = models
    (prompt,) = _prompts(ours.config.vocab_size, (6,))
    layers = ours.config.num_hidden_layers
    runner = PagedRunner(ours, page_size=1, num_pages=16, shuffle=False)
    hidden, captured = runner.extend_with_aux([0], [prompt], (0, 1, layers))
    expected = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert sorted(captured) == [0, 1, layers]
    for i in (0, 1):
        torch.testing.assert_close(captured[i], expected.hidden_states[i][0], atol=ATOL, rtol=0)
    # transformers' last hidden state is after the final norm; ours is the pre-norm stream.
    final = expected.hidden_states[layers][0]
    torch.testing.assert_close(hf.model.norm(captured[layers]), final, atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden, final, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.compute_logits(hidden), expected.logits[0], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        runner.extend_with_aux([1], [prompt], (layers + 1,))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_matches_transformers_at_arbitrary_positions(rope_scaling):
    hf_config = LlamaConfig(
        hidden_size=1024, num_attention_heads=8, rope_theta=500000.0, rope_scaling=rope_scaling
    )
    rope = parse_rope(hf_config.to_dict())
    positions = torch.tensor([0, 7, 3, 100_000, 8191, 8192, 65_535, 1])
    cos, sin = RotaryEmbedding(128, rope)(positions, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_rope_config_read_from_old_and_new_keys():
    scaling = {"factor": 2.0, "type": "linear"}
    old = parse_rope({"rope_theta": 1e6, "rope_scaling": scaling})
    new = parse_rope({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    assert old == new and old.theta == 1e6 and old.rope_type == "linear"
    assert parse_rope({}).rope_type == "default"
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        parse_rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        parse_rope(
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                }
            }
        )


def _edit_config(**changes):
    def edit(folder):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def _edit_weights(edit):
    def apply(folder):
        path = folder / "model.safetensors"
        weights = load_file(path)
        edit(weights)
        save_file(weights, path)

    return apply


def _delete(name: str):
    return lambda folder: (folder / name).unlink()


UP_PROJ = "model.layers.1.mlp.up_proj.weight"
K_PROJ = "model.layers.2.self_attn.k_proj.weight"
LOAD_ERRORS = {  # case -> (damage to a copy of the gqa checkpoint, expected message)
    "architecture": (
        _edit_config(architectures=["GPT2LMHeadModel"]),
        "architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM",
    ),
    "sliding-window": (
        _edit_config(architectures=["MistralForCausalLM"], sliding_window=16),
        "sliding_window=16",
    ),
    "shape": (
        _edit_weights(lambda w: w.update({UP_PROJ: torch.zeros(100, 64)})),
        rf"{UP_PROJ} has shape \(100, 64\), expected \(128, 64\)",
    ),
    "missing": (_edit_weights(lambda w: w.pop(K_PROJ)), f"missing tensors: {K_PROJ}"),
    "unexpected": (
        _edit_weights(lambda w: w.update({"model.extra.weight": torch.zeros(2)})),
        "unexpected tensors: model.extra.weight",
    ),
    "no-weights": (
        _delete("model.safetensors"),
        "no weights in .*ckpt: expected model.safetensors",
    ),
    "no-config": (_delete("config.json"), "has no config.json"),
}


def test_bf16_load_and_forward(tmp_path, gqa_dir):
    model, _ = load_model(gqa_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    bf16_dir = make_tiny_checkpoint(tmp_path, variant="tied", dtype="bfloat16")
    model, config = load_model(bf16_dir, inference_layout=False)  # auto = the checkpoint's dtype
    assert config.torch_dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    (prompt,) = _prompts(config.vocab_size, (9,))
    logits = PagedRunner(model, page_size=4, num_pages=8, shuffle=True).extend([0], [prompt])
    hf = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    expected = _hf_logits(hf, prompt).float()
    assert logits.dtype == torch.float32
    assert torch.cosine_similarity(logits, expected, dim=-1).min() > 0.99


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_load_errors_name_the_problem(broken_dir, case):
    damage, message = LOAD_ERRORS[case]
    damage(broken_dir)
    with pytest.raises(ModelLoadError, match=message):
        load_model(broken_dir)


def test_load_ignores_rope_buffer_and_reports_missing_folder_and_shard(broken_dir, tmp_path):
    rope_buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_weights(lambda w: w.update({rope_buffer: torch.zeros(8)}))(broken_dir)
    load_model(broken_dir)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    sharded = make_tiny_checkpoint(tmp_path / "sharded", sharded=True)
    (sharded / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00007.safetensors"):
        load_model(sharded)


@pytest.mark.parametrize("variant", ["gqa", "bias", "qwen3"])
@torch.no_grad()
def test_inference_layout_fuses_projections_and_keeps_outputs(variant, tmp_path):
    """Loading fuses q/k/v and gate/up (biases too); the checkpoint layout, kept with
    ``inference_layout=False``, gives the same logits."""
    path = make_tiny_checkpoint(tmp_path, variant=variant)
    fused, config = load_model(path, dtype="float32")
    plain, _ = load_model(path, dtype="float32", inference_layout=False)
    assert set(plain.state_dict()) == set(load_file(path / "model.safetensors"))
    for layer in fused.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")
        assert attn.qkv_proj.out_features == sum(attn.qkv_sizes)
        assert (attn.qkv_proj.bias is not None) == config.attention_bias
        assert mlp.gate_up_proj.out_features == 2 * config.intermediate_size
    prompts = _prompts(config.vocab_size, (6, 1, 9))
    rows = list(range(len(prompts)))
    got = PagedRunner(fused, page_size=4, num_pages=16, shuffle=True).extend(rows, prompts)
    want = PagedRunner(plain, page_size=4, num_pages=16, shuffle=True).extend(rows, prompts)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_fused_elementwise_kernels_keep_the_model_outputs(gqa_dir):
    """With RMSNorm, SiLU-and-mul and RoPE on their Triton kernels (as on CUDA; here in
    Triton's interpreter) a paged prefill and decode give the eager model's logits."""
    pytest.importorskip("triton")
    eager, config = load_model(gqa_dir, dtype="float32")
    fused, _ = load_model(gqa_dir, dtype="float32")
    layers = config.num_hidden_layers
    assert use_fused_elementwise(fused) == 2 * layers + 1 + 2 * layers  # norms, MLPs, attns
    layer = fused.model.layers[0]
    assert layer.input_layernorm.fused and layer.mlp.fused_silu_and_mul
    assert layer.self_attn.fused_rotary
    _check_same_logits(eager, fused, config.vocab_size)


def _check_same_logits(eager, fused, vocab_size: int) -> None:
    """A ragged prefill of two prompts and a decode step: the same logits from both."""
    prompts = _prompts(vocab_size, (7, 3))
    runners = [PagedRunner(m, page_size=4, num_pages=16, shuffle=True) for m in (eager, fused)]
    want, got = (r.extend([0, 1], prompts) for r in runners)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    step = [[int(t)] for t in want.view(-1, vocab_size)[[6, 9]].argmax(-1)]
    want, got = (r.extend([0, 1], step) for r in runners)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_fused_kernels_keep_qwen3_moe_outputs(tmp_path):
    """Qwen3's q/k head norms through the Triton RMSNorm (rows of one head each) and the
    experts through the Triton fused MoE, in Triton's interpreter: the eager logits."""
    pytest.importorskip("triton")
    path = make_tiny_checkpoint(tmp_path, variant="qwen3-moe")
    eager, config = load_model(path, dtype="float32")
    fused, _ = load_model(path, dtype="float32")
    layers = config.num_hidden_layers
    # norms (2 per layer, the final one, q and k per layer), 1 dense MLP, attentions
    assert use_fused_elementwise(fused) == 2 * layers + 1 + 2 * layers + 1 + layers
    assert use_fused_moe(fused) == len(config.moe.sparse_layers) == 2
    attn = fused.model.layers[0].self_attn
    assert attn.q_norm.fused and attn.k_norm.fused and fused.model.layers[2].mlp.fused
    _check_same_logits(eager, fused, config.vocab_size)


def test_fusing_twice_is_a_no_op_and_mismatched_linears_are_refused(gqa_dir):
    plain, config = load_model(gqa_dir, dtype="float32", inference_layout=False)
    numel = sum(p.numel() for p in plain.parameters())
    assert fuse_projections(plain) == 2 * config.num_hidden_layers  # attention + MLP each
    assert fuse_projections(plain) == 0
    assert sum(p.numel() for p in plain.parameters()) == numel
    with pytest.raises(ValueError, match="same input width"):
        stack_linears([torch.nn.Linear(4, 2), torch.nn.Linear(8, 2)])
    with pytest.raises(ValueError, match="all or no biases"):
        stack_linears([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2, bias=False)])


def test_qwen2_bias_layout():
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "eos_token_id": [5, 6],
    }
    config = ModelConfig.from_dict(raw, generation={"eos_token_id": [6, 7]})
    assert config.attention_bias and not config.o_proj_bias
    assert config.num_key_value_heads == 2 and config.head_dim == 4
    assert config.eos_token_ids == (5, 6, 7)


def test_tokenizer_chat_template_and_fallback(gqa_dir):
    tok = load_tokenizer(gqa_dir)
    config = load_model(gqa_dir)[1]
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    ids = apply_chat_template(tok, messages)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids) == "<s><|user|>Hello, how are you?</s><|assistant|>"
    tok.chat_template = None
    fallback = tok.decode(apply_chat_template(tok, messages))
    assert fallback == "<s><|user|>\nHello, how are you?</s>\n<|assistant|>\n"
    assert eos_token_ids(tok, config) == {tok.eos_token_id}


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style vocabulary: ``▁`` for spaces and ``<0xNN>`` byte-fallback pieces."""
    pieces = ["<unk>", "<s>", "▁hi", "▁there", "<0xE6>", "<0x97>", "<0xA5>", "!"]
    model = BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")


def test_token_bytes_are_exact_for_partial_characters(gqa_dir):
    """Byte-level BPE and SentencePiece byte fallback: each token's own bytes, so the
    three tokens of one CJK character add up to it (each decoded alone is U+FFFD)."""
    byte_level = load_tokenizer(gqa_dir)
    read = token_bytes_reader(byte_level)
    ids = byte_level("héllo 日本!", add_special_tokens=False)["input_ids"]
    assert b"".join(read(i) for i in ids).decode() == "héllo 日本!"
    assert any(byte_level.decode([i]) == "\ufffd" for i in ids)  # why decode is not enough
    assert read(byte_level.bos_token_id) == b"<s>"

    sp = sentencepiece_style_tokenizer()
    read = token_bytes_reader(sp)
    by_piece = {p: read(sp.convert_tokens_to_ids(p)) for p in ("▁hi", "<0xE6>", "<0x97>", "!")}
    assert by_piece == {"▁hi": b" hi", "<0xE6>": b"\xe6", "<0x97>": b"\x97", "!": b"!"}
    assert read(sp.bos_token_id) == b"<s>"


def test_tokenizer_errors_name_the_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def test_tiny_checkpoint_cli_and_cache(tmp_path, capsys):
    tiny_checkpoint.main([str(tmp_path), "--variant", "bias", "--sharded"])
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    before = (tmp_path / "config.json").stat().st_mtime_ns
    assert make_tiny_checkpoint(tmp_path, variant="bias", sharded=True) == tmp_path
    assert (tmp_path / "config.json").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="not empty"):
        make_tiny_checkpoint(tmp_path, variant="gqa")
