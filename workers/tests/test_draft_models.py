"""EAGLE / EAGLE-3 draft heads: published checkpoint format, loader errors, and paged
numerics against a dense reference written from the published forward passes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specd.devtools import tiny_draft
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.devtools.tiny_draft import make_tiny_eagle, make_tiny_eagle3
from specd.kernels import build_attention_metadata, get_backend
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.model.config import ModelConfig, ModelLoadError
from specd.workers.model.draft_loader import eagle3_aux_layer_ids, load_draft
from specd.workers.model.eagle import EagleDraftModel
from specd.workers.model.eagle3 import Eagle3DraftModel
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.loader import load_model

ATOL = 1e-4
DRAFT_STEPS = 3
DRAFT_VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """variant -> (folder, our target, transformers' target), built once per module."""
    cache: dict[str, tuple[Path, torch.nn.Module, torch.nn.Module]] = {}

    def get(variant: str):
        if variant not in cache:
            folder = make_tiny_checkpoint(tmp_path_factory.mktemp(variant), variant=variant)
            ours, _ = load_model(folder, dtype="float32")
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            cache[variant] = (folder, ours, hf)
        return cache[variant]

    return get


# Published tensor names and shapes, written down from the reference code:
#  - EAGLE: SafeAILab/EAGLE eagle/model/cnets1.py -- Model.embed_tokens, Model.fc
#    (Linear(2H, H, bias=config "bias", default True)), Model.layers[i] = LlamaDecoderLayer
#    whose input_layernorm exists only for index != 0, q/k/v bias iff config "qkv_bias";
#    no final norm, no lm_head (EaModel passes base_model.lm_head).
#  - EAGLE-3: eagle/model/cnets.py -- Model.embed_tokens (frozen, not saved: training saves
#    with exclude_frozen_parameters), lm_head Linear(H, draft_vocab_size, bias=False),
#    midlayer = LlamaDecoderLayeremb (q/k/v Linear(2H, ..), hidden_norm, input_layernorm,
#    post_attention_layernorm), fc Linear(3H, H, bias=False), norm, buffers d2t [draft
#    vocab] int64 and t2d [vocab] bool.
# SGLang and vLLM (models/llama_eagle.py, llama_eagle3.py) read these names as they are.
def published_eagle(c: ModelConfig, *, fc_bias: bool = True, qkv_bias: bool = False):
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    table = {
        "embed_tokens.weight": (v, h),
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.post_attention_layernorm.weight": (h,),
    }
    if fc_bias:
        table["fc.bias"] = (h,)
    if qkv_bias:
        table |= {
            "layers.0.self_attn.q_proj.bias": (q,),
            "layers.0.self_attn.k_proj.bias": (kv,),
            "layers.0.self_attn.v_proj.bias": (kv,),
        }
    return table


def published_eagle3(c: ModelConfig, draft_vocab: int):
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
        "d2t": (draft_vocab,),
        "t2d": (v,),
    }


def _read_raw(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors exactly as stored."""
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", weights_only=True)
    return load_file(folder / "model.safetensors")


def _shapes(tensors) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


FORMATS = {  # case -> (target variant, maker, kwargs, algorithm, table kwargs)
    "eagle-bin": ("gqa", make_tiny_eagle, {}, "EAGLE", {}),
    "eagle-no-fc-bias": ("gqa", make_tiny_eagle, dict(fc_bias=False), "EAGLE", dict(fc_bias=False)),
    "eagle-qkv-bias": ("bias", make_tiny_eagle, {}, "EAGLE", dict(qkv_bias=True)),
    "eagle-safetensors": ("gqa", make_tiny_eagle, dict(weights_format="safetensors"), "EAGLE", {}),
    "eagle3-bin": ("gqa", make_tiny_eagle3, {}, "EAGLE3", {}),
    "eagle3-safetensors": (
        "gqa",
        make_tiny_eagle3,
        dict(weights_format="safetensors"),
        "EAGLE3",
        {},
    ),
}


@pytest.mark.parametrize("case", list(FORMATS))
def test_checkpoints_use_published_names_and_load(case, targets, tmp_path):
    variant, maker, kwargs, algorithm, table_kwargs = FORMATS[case]
    target_dir, target, _ = targets(variant)
    folder = maker(tmp_path, target_dir, **kwargs)
    config = json.loads((folder / "config.json").read_text())
    raw = _read_raw(folder)
    if algorithm == "EAGLE":
        table = published_eagle(target.config, **table_kwargs)
        assert config["architectures"] == ["LlamaForCausalLM"]
        own = {k: v for k, v in table.items() if k != "embed_tokens.weight"}
    else:
        table = published_eagle3(target.config, DRAFT_VOCAB)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["draft_vocab_size"] == DRAFT_VOCAB
        assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
        own = table
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == target.config.vocab_size
    assert _shapes(raw) == table
    draft, draft_config = load_draft(
        folder, algorithm, target, target.config, inference_layout=False
    )
    assert _shapes(draft.state_dict()) == own  # the target's embedding is not duplicated
    assert draft_config.num_kv_layers == 1


def test_draft_shares_the_targets_embedding_and_head(targets, tmp_path):
    target_dir, target, _ = targets("gqa")
    eagle, _ = load_draft(
        make_tiny_eagle(tmp_path / "e", target_dir), "EAGLE", target, target.config
    )
    eagle3, config3 = load_draft(
        make_tiny_eagle3(tmp_path / "e3", target_dir), "EAGLE3", target, target.config
    )
    assert isinstance(eagle, EagleDraftModel) and isinstance(eagle3, Eagle3DraftModel)
    assert eagle.embed_tokens is target.model.embed_tokens
    assert eagle.lm_head is target.lm_head
    assert eagle3.embed_tokens is target.model.embed_tokens
    assert eagle3.lm_head is not target.lm_head  # EAGLE-3 has its own reduced-vocab head
    for draft in (eagle, eagle3):
        names = {name for name, _ in draft.named_modules()}
        assert not any("embed_tokens" in n for n in names)
    assert config3.aux_layer_ids == (0, 1, 2)  # (2, L//2, L-3) for L=3, ascending


def test_auto_dtype_follows_the_target_and_keeps_the_id_map(targets, tmp_path):
    target_dir, _, _ = targets("gqa")
    target, config = load_model(target_dir, dtype="bfloat16")
    folder = make_tiny_eagle3(tmp_path, target_dir)  # float32 on disk
    draft, _ = load_draft(folder, "EAGLE3", target, config, inference_layout=False)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert torch.equal(draft.d2t, _read_raw(folder)["d2t"])


def test_tiny_drafts_are_deterministic_cached_and_have_a_cli(targets, tmp_path, capsys):
    target_dir, _, _ = targets("gqa")
    first = _read_raw(make_tiny_eagle3(tmp_path / "a", target_dir, seed=3))
    second = _read_raw(make_tiny_eagle3(tmp_path / "b", target_dir, seed=3))
    assert all(torch.equal(first[name], second[name]) for name in first)
    before = (tmp_path / "a" / "pytorch_model.bin").stat().st_mtime_ns
    make_tiny_eagle3(tmp_path / "a", target_dir, seed=3)  # same arguments: reused
    assert (tmp_path / "a" / "pytorch_model.bin").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="not empty"):
        make_tiny_eagle(tmp_path / "a", target_dir)
    tiny_draft.main([str(tmp_path / "c"), str(target_dir), "--algorithm", "EAGLE"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "c")
    assert (tmp_path / "c" / "pytorch_model.bin").is_file()


def test_aux_layer_ids_default_and_override():
    assert eagle3_aux_layer_ids({}, 32) == (2, 16, 29)
    # eagle_aux_hidden_state_layer_ids name layer outputs = inputs of the next layer.
    override = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [44, 1, 23]}}
    assert eagle3_aux_layer_ids(override, 48) == (2, 24, 45)
    last = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert eagle3_aux_layer_ids(last, 3) == (1, 2, 3)  # 3 = last layer output, pre-norm
    with pytest.raises(ModelLoadError, match=r"default EAGLE-3 layers .* L=5.* distinct"):
        eagle3_aux_layer_ids({}, 5)  # (2, 2, 2)
    with pytest.raises(ModelLoadError, match=r"outside \[0, 2\]"):
        eagle3_aux_layer_ids({}, 2)


# ---- damaged checkpoints -------------------------------------------------------------


def _edit_config(**changes):
    def edit(folder):
        path = folder / "config.json"
        raw = {**json.loads(path.read_text()), **changes}
        path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))

    return edit


def _edit_weights(edit):
    def apply(folder):
        weights = _read_raw(folder)
        edit(weights)
        if (folder / "pytorch_model.bin").is_file():
            torch.save(weights, folder / "pytorch_model.bin")
        else:
            save_file(weights, folder / "model.safetensors")

    return apply


def _delete(name: str):
    return lambda folder: (folder / name).unlink()


def _set(name: str, value):
    return _edit_weights(lambda w: w.update({name: value}))


def _pop(name: str):
    return _edit_weights(lambda w: w.pop(name))


def _shift_d2t(index: int, delta: int):
    def edit(w):
        w["d2t"][index] += delta

    return _edit_weights(edit)


def _aux_ids(ids):
    return _edit_config(eagle_config={"eagle_aux_hidden_state_layer_ids": ids})


Q3 = "midlayer.self_attn.q_proj.weight"
# case -> (damage to a copy of the draft, expected message); "eagle3-*" cases damage the
# EAGLE-3 folder, the others the EAGLE one, and each loads as its own algorithm unless
# LOAD_AS says otherwise.
LOAD_ERRORS = {
    "eagle-hidden": (
        _edit_config(hidden_size=32),
        "spec.draft: draft hidden size 32 != target hidden size 64",
    ),
    "eagle3-hidden": (
        _edit_config(hidden_size=32),
        "spec.draft: draft hidden size 32 != target hidden size 64",
    ),
    "eagle3-target-hidden": (
        _edit_config(target_hidden_size=48),
        "draft target_hidden_size 48 != target hidden size 64",
    ),
    "eagle-vocab": (
        _edit_config(vocab_size=320),
        r"draft vocab size 320 \(config.json vocab_size\) != target vocab size 384",
    ),
    "eagle-embed-shape": (
        _set("embed_tokens.weight", torch.zeros(320, 64)),
        r"embed_tokens.weight has shape \(320, 64\), expected \(384, 64\)",
    ),
    "eagle3-d2t-out-of-vocab": (
        _shift_d2t(-1, 1000),
        r"d2t .* maps draft id 127 to target id \d+, outside the target vocab \[0, 384\)",
    ),
    "eagle3-d2t-negative": (
        _shift_d2t(0, -1000),
        r"maps draft id 0 to target id -\d+, outside the target vocab",
    ),
    "eagle3-d2t-duplicate": (
        _set("d2t", torch.tensor([0, -1] + [0] * (DRAFT_VOCAB - 2))),
        "maps several draft ids to the same target id",
    ),
    "eagle3-draft-vocab-size": (
        _edit_config(draft_vocab_size=100),
        r"tensor d2t has shape \(128,\), expected \(100,\) from config.json",
    ),
    "eagle-missing": (
        _pop("layers.0.mlp.up_proj.weight"),
        "missing tensors: layers.0.mlp.up_proj.weight",
    ),
    "eagle-missing-fc-bias": (_pop("fc.bias"), "missing tensors: fc.bias"),
    "eagle3-missing": (
        _pop("midlayer.hidden_norm.weight"),
        "missing tensors: midlayer.hidden_norm.weight",
    ),
    "eagle3-missing-d2t": (_pop("d2t"), "missing tensors: d2t"),
    "eagle-layer0-input-norm": (
        _set("layers.0.input_layernorm.weight", torch.ones(64)),
        "unexpected tensors: layers.0.input_layernorm.weight",
    ),
    "eagle3-extra": (
        _set("midlayer.self_attn.q_proj.bias", torch.zeros(64)),
        "unexpected tensors: midlayer.self_attn.q_proj.bias",
    ),
    "eagle-shape": (
        _set("fc.weight", torch.zeros(64, 192)),
        r"fc.weight has shape \(64, 192\), expected \(64, 128\)",
    ),
    "eagle3-shape": (
        _set(Q3, torch.zeros(64, 64)),
        rf"{Q3} has shape \(64, 64\), expected \(64, 128\)",
    ),
    "eagle3-two-layers": (_edit_config(num_hidden_layers=2), "EAGLE-3 num_hidden_layers 2"),
    "eagle3-aux-duplicate": (
        _aux_ids([0, 0, 1]),
        "eagle_aux_hidden_state_layer_ids must name 3 distinct target layers",
    ),
    "eagle3-aux-range": (_aux_ids([0, 1, 5]), r"capture points \[1, 2, 6\] outside \[0, 3\]"),
    "eagle-loaded-as-eagle3": (None, "holds an EAGLE checkpoint .* set it to EAGLE"),
    "eagle3-loaded-as-eagle": (None, "holds an EAGLE-3 checkpoint .* set it to EAGLE3"),
    "eagle-unknown-algorithm": (None, "spec.draft.algorithm: 'MEDUSA' is not supported"),
    "eagle-no-weights": (_delete("pytorch_model.bin"), "no weights in .*draft"),
    "eagle-no-config": (_delete("config.json"), "has no config.json"),
    "eagle-config-key": (
        _edit_config(intermediate_size=None),
        "missing required key 'intermediate_size'",
    ),
}
LOAD_AS = {
    "eagle-loaded-as-eagle3": "EAGLE3",
    "eagle3-loaded-as-eagle": "EAGLE",
    "eagle-unknown-algorithm": "MEDUSA",
}


@pytest.fixture(scope="module")
def pristine(targets, tmp_path_factory):
    target_dir, _, _ = targets("gqa")
    return {
        "EAGLE": make_tiny_eagle(tmp_path_factory.mktemp("eagle"), target_dir),
        "EAGLE3": make_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target_dir),
    }


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_load_errors_name_the_problem(case, pristine, targets, tmp_path):
    damage, message = LOAD_ERRORS[case]
    kind = "EAGLE3" if case.startswith("eagle3-") else "EAGLE"
    folder = shutil.copytree(pristine[kind], tmp_path / "draft")
    if damage is not None:
        damage(folder)
    load_as = LOAD_AS.get(case, kind)
    _, target, _ = targets("gqa")
    with pytest.raises(ModelLoadError, match=message):
        load_draft(folder, load_as, target, target.config)


# ---- EAGLE-3 vocabulary map ----------------------------------------------------------


def test_d2t_maps_draft_ids_to_target_ids(pristine, targets):
    _, target, _ = targets("gqa")
    draft, config = load_draft(pristine["EAGLE3"], "EAGLE3", target, target.config)
    assert config.draft_vocab_size == DRAFT_VOCAB and config.vocab_size == 384
    mapped = draft.draft_to_target(torch.arange(DRAFT_VOCAB))
    # Draft id i is the i-th smallest target id the draft can emit, i.e. the i-th True of t2d.
    assert torch.equal(mapped, draft.t2d.nonzero().flatten())
    assert draft.draft_to_target(torch.tensor([[5, 0]])).shape == (1, 2)


def test_d2t_worked_example_and_identity(targets, tmp_path):
    target_dir, target, _ = targets("gqa")
    folder = make_tiny_eagle3(tmp_path / "four", target_dir, draft_vocab_size=4)
    t2d = torch.zeros(384, dtype=torch.bool)
    t2d[[0, 5, 12, 23]] = True
    _set("d2t", torch.tensor([0, 4, 10, 20]))(folder)
    _set("t2d", t2d)(folder)
    draft, _ = load_draft(folder, "EAGLE3", target, target.config)
    assert draft.draft_to_target(torch.tensor([3, 0, 2, 1])).tolist() == [23, 0, 12, 5]
    logits = draft.compute_logits(torch.randn(2, 64))
    assert logits.shape == (2, 4) and logits.dtype == torch.float32

    # Full-vocabulary drafts may omit d2t/t2d (the reference deletes them): identity.
    full = make_tiny_eagle3(tmp_path / "full", target_dir, draft_vocab_size=384)
    _edit_weights(lambda w: (w.pop("d2t"), w.pop("t2d")))(full)
    draft, config = load_draft(full, "EAGLE3", target, target.config)
    ids = torch.tensor([0, 7, 383])
    assert config.draft_vocab_size == 384 and torch.equal(draft.draft_to_target(ids), ids)


def test_t2d_disagreeing_with_d2t_is_logged(pristine, targets, tmp_path, caplog):
    folder = shutil.copytree(pristine["EAGLE3"], tmp_path / "draft")
    _set("t2d", torch.ones(384, dtype=torch.bool))(folder)
    _, target, _ = targets("gqa")
    with caplog.at_level(logging.WARNING):
        load_draft(folder, "EAGLE3", target, target.config)
    assert "t2d does not mark exactly the target ids d2t maps to" in caplog.text


# ---- numerics: paged draft vs a dense reference --------------------------------------


def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x, cos, sin):
    """HF rotate_half convention; x [n, heads, d], cos/sin [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DenseReference:
    """The published draft forward passes on contiguous tensors: plain causal attention over
    the whole sequence (no cache, no paging), HF rope from the draft's own config.json,
    weights under their published names, embedding and lm_head from transformers' target."""

    def __init__(self, folder: Path, hf_target):
        self.raw = json.loads((folder / "config.json").read_text())
        self.w = {
            k: (v.float() if v.is_floating_point() else v) for k, v in _read_raw(folder).items()
        }
        self.rope = LlamaRotaryEmbedding(LlamaConfig(**self.raw))
        self.embed = hf_target.model.embed_tokens.weight
        self.target_head = hf_target.lm_head.weight
        self.eps = self.raw["rms_norm_eps"]
        self.heads = self.raw["num_attention_heads"]
        self.kv_heads = self.raw["num_key_value_heads"]

    def _linear(self, x, name):
        out = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return out if bias is None else out + bias

    def _attention(self, x, prefix):
        n = x.shape[0]
        head_dim = self.w[f"{prefix}.o_proj.weight"].shape[1] // self.heads
        cos, sin = self.rope(x, torch.arange(n)[None])
        q = self._linear(x, f"{prefix}.q_proj").view(n, self.heads, head_dim)
        k = self._linear(x, f"{prefix}.k_proj").view(n, self.kv_heads, head_dim)
        v = self._linear(x, f"{prefix}.v_proj").view(n, self.kv_heads, head_dim)
        q, k = _rotate(q, cos[0], sin[0]), _rotate(k, cos[0], sin[0])
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        return self._linear(out, f"{prefix}.o_proj")

    def _mlp(self, x, prefix):
        gate, up = self._linear(x, f"{prefix}.gate_proj"), self._linear(x, f"{prefix}.up_proj")
        return self._linear(F.silu(gate) * up, f"{prefix}.down_proj")

    def eagle(self, tokens, hidden):
        """cnets1.Model.forward: fc(cat(emb, hidden)); layer 0 without input_layernorm."""
        x = self._linear(torch.cat((self.embed[tokens], hidden), dim=-1), "fc")
        x = x + self._attention(x, "layers.0.self_attn")
        x = x + self._mlp(
            _rms(x, self.w["layers.0.post_attention_layernorm.weight"], self.eps), "layers.0.mlp"
        )
        return x, x @ self.target_head.T  # no norm before the target's head

    def eagle3_fuse(self, aux):
        return self._linear(torch.cat(aux, dim=-1), "fc")

    def eagle3(self, tokens, hidden):
        """cnets.LlamaDecoderLayeremb + Model.norm + lm_head."""
        w, eps = self.w, self.eps
        emb = _rms(self.embed[tokens], w["midlayer.input_layernorm.weight"], eps)
        x = torch.cat((emb, _rms(hidden, w["midlayer.hidden_norm.weight"], eps)), dim=-1)
        h = hidden + self._attention(x, "midlayer.self_attn")
        h = h + self._mlp(
            _rms(h, w["midlayer.post_attention_layernorm.weight"], eps), "midlayer.mlp"
        )
        return h, _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T

    def to_target(self, draft_ids):
        return draft_ids + self.w["d2t"][draft_ids] if "d2t" in self.w else draft_ids


class SharedSlotRunner:
    """Target and draft KV pools addressed by the same request rows and slots; pages come
    from a shuffled free list, so each request's slots are non-contiguous."""

    def __init__(self, target, draft_config, page_size: int = 4, num_pages: int = 24):
        tc, slots = target.config, page_size * num_pages
        self.target_pool = KVPool(
            tc.num_hidden_layers, slots, tc.num_key_value_heads, tc.head_dim, torch.float32, "cpu"
        )
        self.draft_pool = KVPool(
            draft_config.num_kv_layers,
            slots,
            draft_config.num_kv_heads,
            draft_config.head_dim,
            torch.float32,
            "cpu",
        )
        self.backend = get_backend("torch")
        self.page_size = page_size
        self.req_to_token = torch.zeros(4, 64, dtype=torch.int32)  # [rows, width]
        self.free_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3))
        self.free_pages = self.free_pages.tolist()
        self.seq_lens = [0] * 4

    def extend(self, rows: list[int], counts: list[int]):
        """Give each row ``counts[i]`` more positions -> (positions, target ctx, draft ctx)."""
        positions, locs = [], []
        for row, count in zip(rows, counts, strict=True):
            start, end = self.seq_lens[row], self.seq_lens[row] + count
            for pos in range(start, end):
                if pos % self.page_size == 0:
                    page = self.free_pages.pop(0)
                    slots = torch.arange(page * self.page_size, (page + 1) * self.page_size)
                    self.req_to_token[row, pos : pos + self.page_size] = slots.to(torch.int32)
            positions.append(torch.arange(start, end))
            locs.append(self.req_to_token[row, start:end].long())
            self.seq_lens[row] = end
        meta = build_attention_metadata(
            self.req_to_token, rows, counts, [self.seq_lens[r] for r in rows]
        )
        plan, loc = self.backend.plan(meta), torch.cat(locs)
        return (
            torch.cat(positions),
            ForwardContext(plan, loc, self.target_pool, self.backend),
            ForwardContext(plan, loc, self.draft_pool, self.backend),
        )


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_residual_streams(hf, prompt: list[int]) -> list[torch.Tensor]:
    """Stream entering each target layer i (0..L-1), then the last layer's output before
    the final norm (index L) -- transformers' own last hidden state is normed."""
    last = {}

    def keep(_module, _args, out):
        last["h"] = out[0] if isinstance(out, tuple) else out

    handle = hf.model.layers[-1].register_forward_hook(keep)
    try:
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    finally:
        handle.remove()
    return [h[0] for h in out.hidden_states[:-1]] + [last["h"][0]]


def _last_rows(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(lengths).cumsum(0) - 1


def _run_draft_steps(
    draft, reference_step, runner, rows, ref_seqs, ours_hidden, ours_logits, map_ids
):
    """Chain DRAFT_STEPS single-token steps; each step the reference recomputes densely.

    ref_seqs[i] = [tokens, input hiddens, outputs] of request i, grown one row per step:
    each side's last output hidden feeds its own next step, and both must pick the same
    next token."""
    for _ in range(DRAFT_STEPS):
        next_ids = map_ids(ours_logits.argmax(-1))  # [bs] target ids
        positions, _, ctx = runner.extend(rows, [1] * len(rows))
        ours_hidden, ours_logits = draft_step(draft, next_ids, ours_hidden, positions, ctx)
        for i, seq in enumerate(ref_seqs):
            seq[0] = torch.cat((seq[0], next_ids[i : i + 1]))
            seq[1] = torch.cat((seq[1], seq[2][-1:]))  # the previous step's output hidden
            out, logits = reference_step(seq[0], seq[1])
            seq[2] = out
            torch.testing.assert_close(ours_hidden[i], out[-1], atol=ATOL, rtol=0)
            torch.testing.assert_close(ours_logits[i], logits[-1], atol=ATOL, rtol=0)
            assert int(ours_logits[i].argmax()) == int(logits[-1].argmax())


def draft_step(draft, ids, hidden, positions, ctx):
    """One forward of either draft -> (hidden that feeds the next step, logits)."""
    if isinstance(draft, Eagle3DraftModel):
        next_hidden, logit_hidden = draft(ids, hidden, positions, ctx)
        return next_hidden, draft.compute_logits(logit_hidden)
    out = draft(ids, hidden, positions, ctx)
    return out, draft.compute_logits(out)


@pytest.mark.parametrize("variant", ["gqa", "bias", "llama3"])
@torch.no_grad()
def test_eagle_paged_matches_dense_reference(variant, targets, tmp_path):
    target_dir, target, hf = targets(variant)
    folder = make_tiny_eagle(tmp_path, target_dir)
    draft, config = load_draft(folder, "EAGLE", target, target.config)
    ref = DenseReference(folder, hf)
    prompts, rows = _prompts(target.config.vocab_size, (7, 3)), [2, 0]
    lengths = [len(p) for p in prompts]
    runner = SharedSlotRunner(target, config)
    positions, target_ctx, draft_ctx = runner.extend(rows, lengths)
    hidden = target(torch.tensor(sum(prompts, [])), positions, target_ctx)  # final-normed
    bonus = target.compute_logits(hidden[_last_rows(lengths)]).argmax(-1).tolist()
    # Draft rows pair token p+1 with the hidden of position p (the bonus closes the row).
    shifted = torch.tensor([t for p, b in zip(prompts, bonus, strict=True) for t in p[1:] + [b]])
    ours_hidden, ours_logits = draft_step(draft, shifted, hidden, positions, draft_ctx)
    ref_seqs = []
    for i, (prompt, b) in enumerate(zip(prompts, bonus, strict=True)):
        # What EaModel feeds the draft: base_model.model(...)[0], after the final norm.
        target_hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        assert int((target_hidden[-1] @ ref.target_head.T).argmax()) == b
        tokens = torch.tensor(prompt[1:] + [b])
        out, logits = ref.eagle(tokens, target_hidden)
        rows_i = slice(sum(lengths[:i]), sum(lengths[: i + 1]))
        torch.testing.assert_close(ours_hidden[rows_i], out, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_logits[rows_i], logits, atol=ATOL, rtol=0)
        ref_seqs.append([tokens, target_hidden, out])
    last = _last_rows(lengths)
    _run_draft_steps(
        draft,
        ref.eagle,
        runner,
        rows,
        ref_seqs,
        ours_hidden[last],
        ours_logits[last],
        map_ids=lambda ids: ids,
    )


# case -> (target variant, eagle_aux_hidden_state_layer_ids, fused residual streams in fc
# order: the reference captures inputs of layers 2, L//2, L-3 (L=3 here) in forward order;
# SGLang maps configured layer ids i to the input of layer i + 1).
EAGLE3_CASES = {
    "default-layers": ("gqa", None, (0, 1, 2)),
    "llama3-rope": ("llama3", None, (0, 1, 2)),
    "config-layers-incl-last": ("gqa", [2, 0, 1], (1, 2, 3)),  # 3 = L: last output, pre-norm
}


@pytest.mark.parametrize("case", list(EAGLE3_CASES))
@torch.no_grad()
def test_eagle3_paged_matches_dense_reference(case, targets, tmp_path):
    variant, aux_ids, streams_in_fc_order = EAGLE3_CASES[case]
    target_dir, target, hf = targets(variant)
    folder = make_tiny_eagle3(tmp_path, target_dir, aux_layer_ids=aux_ids)
    draft, config = load_draft(folder, "EAGLE3", target, target.config)
    ref = DenseReference(folder, hf)
    prompts, rows = _prompts(target.config.vocab_size, (7, 3)), [2, 0]
    lengths = [len(p) for p in prompts]
    runner = SharedSlotRunner(target, config)
    positions, target_ctx, draft_ctx = runner.extend(rows, lengths)
    hidden, captured = target.forward_with_aux(
        torch.tensor(sum(prompts, [])), positions, target_ctx, config.aux_layer_ids
    )
    bonus = target.compute_logits(hidden[_last_rows(lengths)]).argmax(-1).tolist()
    fused = draft.fuse_aux_hidden([captured[i] for i in config.aux_layer_ids])  # [N, H]
    shifted = torch.tensor([t for p, b in zip(prompts, bonus, strict=True) for t in p[1:] + [b]])
    ours_hidden, ours_logits = draft_step(draft, shifted, fused, positions, draft_ctx)
    assert ours_logits.shape == (sum(lengths), DRAFT_VOCAB)
    ref_seqs = []
    for i, (prompt, b) in enumerate(zip(prompts, bonus, strict=True)):
        streams = _hf_residual_streams(hf, prompt)
        ref_fused = ref.eagle3_fuse([streams[j] for j in streams_in_fc_order])
        tokens = torch.tensor(prompt[1:] + [b])
        out, logits = ref.eagle3(tokens, ref_fused)
        rows_i = slice(sum(lengths[:i]), sum(lengths[: i + 1]))
        torch.testing.assert_close(fused[rows_i], ref_fused, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_hidden[rows_i], out, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_logits[rows_i], logits, atol=ATOL, rtol=0)
        ref_seqs.append([tokens, ref_fused, out])
    last = _last_rows(lengths)
    _run_draft_steps(
        draft,
        ref.eagle3,
        runner,
        rows,
        ref_seqs,
        ours_hidden[last],
        ours_logits[last],
        map_ids=draft.draft_to_target,
    )
    every_id = torch.arange(DRAFT_VOCAB)
    assert torch.equal(ref.to_target(every_id), draft.draft_to_target(every_id))
