"""The EAGLE-head training script on a tiny target: it learns, writes a published-format
bf16 folder that ``load_draft`` loads, its dense training forward equals the engine's
paged forward, and its acceptance measurements are right on hand-checked cases."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from specd.devtools import train_draft
from specd.devtools.train_demo import _sha256_text, corpus_files, read_texts, split_files
from specd.devtools.train_draft import (
    DenseKV,
    DraftArgs,
    acceptance_summary,
    accepted_lengths,
    chain_acceptance,
    draft_chain,
    draft_hidden,
    target_hidden,
)
from specd.kernels import build_attention_metadata, get_backend
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.model.draft_loader import load_draft
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.loader import load_model

MAX_FILES = 6
PUBLISHED = {  # the EAGLE head's own tensors (the embedding is the target's)
    "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}  # fmt: skip


def tiny_args(out, target) -> DraftArgs:
    """30 steps of 4 x 32 tokens, 1 thread; acceptance on 12 windows and 2 short prompts."""
    schedule = dict(seq_len=32, batch_size=4, lr=3e-3, warmup_steps=2, steps=30, eval_every=10)
    accept = dict(eval_windows=12, eval_context=20, chain_prompts=2, chain_prompt_len=12)
    rest = dict(chain_new_tokens=12, max_files=MAX_FILES, minutes=5, threads=1)
    return DraftArgs(str(out), str(target), **schedule, **accept, **rest)


@pytest.fixture(scope="module")
def target_dir(tiny_models, tmp_path_factory):
    """The tiny target with a manifest.json naming the corpus digest, as train_demo writes."""
    folder = shutil.copytree(tiny_models("gqa"), tmp_path_factory.mktemp("t") / "target")
    train_files, _ = split_files(corpus_files(MAX_FILES))
    digest = _sha256_text(read_texts(train_files))
    (folder / "manifest.json").write_text(json.dumps({"corpus": {"sha256": digest}}))
    return folder


@pytest.fixture(scope="module")
def tiny_run(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "eagle"
    logs: list[str] = []
    result = train_draft.train(tiny_args(out, target_dir), log=logs.append)
    return out, result, logs


@pytest.fixture(scope="module")
def pair(tiny_run, target_dir):
    """The trained head loaded as the engine loads it, float32, no pre-packing."""
    target, config = load_model(target_dir, dtype="float32", inference_layout=False)
    draft, draft_config = load_draft(
        tiny_run[0], "EAGLE", target, config, dtype="float32", inference_layout=False
    )
    return target, draft, draft_config


def test_tiny_run_learns_and_writes_a_published_bf16_head(tiny_run, pair):
    out, result, _ = tiny_run
    history = result["history"]
    assert [h["step"] for h in history] == [1, 10, 20, 30]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.05
    assert history[-1]["val_p"] < history[0]["val_p"] and history[-1]["val_v"] < history[0]["val_v"]
    assert history[-1]["train_loss"] < history[1]["train_loss"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
    assert names == PUBLISHED
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    _, draft, draft_config = pair
    assert draft_config.fc_bias and draft_config.model.hidden_size == 64
    assert sum(p.numel() for p in draft.parameters()) == result["params"]


def test_manifest_describes_the_run_and_hashes_every_file(tiny_run, target_dir):
    out, result, logs = tiny_run
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result
    assert manifest["final"] and manifest["steps_done"] == 30 and manifest["seed"] == 0
    assert manifest["script"] == "python -m specd.devtools.train_draft"
    assert manifest["reproduce"].startswith(
        f"python -m specd.devtools.train_draft --out {out} --target {target_dir} "
    )
    assert manifest["stopped_by"] == "steps" and manifest["args"]["labels"] == "soft"
    target_manifest = hashlib.sha256((target_dir / "manifest.json").read_bytes()).hexdigest()
    assert manifest["target"]["manifest_sha256"] == target_manifest
    corpus = manifest["corpus"]
    assert corpus["matches_target_manifest"] is True and len(corpus["sha256"]) == 64
    assert corpus["files"] == MAX_FILES and corpus["val_files"] == 1 and corpus["val_tokens"] > 0
    assert manifest["final_metrics"]["val_loss"] == manifest["history"][-1]["val_loss"]
    accept = manifest["acceptance"]
    for kind in ("teacher_forced", "chain"):
        per_position = accept[kind]["per_position"]
        assert len(per_position) == 5 and per_position == sorted(per_position, reverse=True)
        assert accept[kind]["mean_accept_len"] == pytest.approx(1 + sum(per_position), abs=3e-3)
    assert accept["teacher_forced"]["samples"] == 12
    assert any(line.startswith("mean acceptance length (5-step chain):") for line in logs)
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert {p.name for p in out.parent.iterdir()} == {"eagle"}, "no scratch folders left"


def test_manifest_acceptance_is_measured_on_the_saved_files(tiny_run, target_dir):
    out, result, _ = tiny_run
    _, val_files = split_files(corpus_files(MAX_FILES))
    tokenizer = train_draft.PreTrainedTokenizerFast.from_pretrained(target_dir)
    val = train_draft.encode_stream(tokenizer, read_texts(val_files))
    again = train_draft.evaluate_pair(target_dir, out, val, tiny_args(out, target_dir), log=print)
    assert again == result["acceptance"]


class PagedPair:
    """Target and draft over the engine's paged pools: one request row, slots from a
    shuffled page list (non-contiguous), the torch reference backend."""

    def __init__(self, target, draft_config, page_size: int = 4, pages: int = 16):
        tc = target.config
        slots = page_size * pages
        self.pools = (
            KVPool(tc.num_hidden_layers, slots, tc.num_key_value_heads, tc.head_dim,
                   torch.float32, "cpu"),
            KVPool(draft_config.num_kv_layers, slots, draft_config.num_kv_heads,
                   draft_config.head_dim, torch.float32, "cpu"),
        )  # fmt: skip
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(5))
        slot_ids = (order[:, None] * page_size + torch.arange(page_size)).flatten()
        self.req_to_token = slot_ids[None].to(torch.int32)  # [1 row, width]
        self.backend = get_backend("torch")
        self.lens = [0, 0]  # positions written per pool

    def run(self, which: int, model, *inputs):
        """Append len(inputs[0]) positions to pool ``which`` and run ``model`` on them."""
        start, count = self.lens[which], len(inputs[0])
        self.lens[which] += count
        meta = build_attention_metadata(self.req_to_token, [0], [count], [start + count])
        loc = self.req_to_token[0, start : start + count].long()
        ctx = ForwardContext(self.backend.plan(meta), loc, self.pools[which], self.backend)
        return model(*inputs, torch.arange(start, start + count), ctx)


@torch.no_grad()
def test_dense_training_forward_matches_the_paged_engine_path(pair):
    """The training forward (dense causal, no cache) and the evaluation's cached chain
    both equal the engine's paged forward: rows (x_{t+1}, h_t), then two drafting rounds
    where the chain rows are dropped and the next round appends two true rows."""
    target, draft, draft_config = pair
    tokens = torch.randint(3, 384, (2, 17), generator=torch.Generator().manual_seed(2))
    target_kv, draft_kv = DenseKV(2), DenseKV(2)
    h1 = target_hidden(target, tokens[:, :15], target_kv)  # [2, 15, H]
    h2 = target_hidden(target, tokens[:, 15:], target_kv)  # [2, 2, H], positions 15, 16
    dense_d = draft_hidden(draft, tokens[:, 1:15], h1[:, :-1])  # the training forward
    first = draft_chain(draft, draft_kv, tokens[:, 1:15], h1[:, :-1], steps=3)
    assert draft_kv.length == 14  # chain rows dropped
    rows = torch.cat((h1[:, -1:], h2[:, :1]), dim=1)  # h_14, h_15 for x_15, x_16
    second = draft_chain(draft, draft_kv, tokens[:, 15:17], rows, steps=3)

    def paged_chain(paged, last):
        chain, committed = [], paged.lens[1]
        for _ in range(3):  # (own token, previous draft hidden) at the next position
            chain.append(draft.compute_logits(last).argmax(-1))
            last = paged.run(1, draft, chain[-1], last)
        paged.lens[1] = committed
        return torch.cat(chain)

    for i in range(2):
        paged = PagedPair(target, draft_config)
        h = paged.run(0, target, tokens[i, :15])
        torch.testing.assert_close(h1[i], h, atol=1e-4, rtol=1e-4)
        d = paged.run(1, draft, tokens[i, 1:15], h[:-1])
        torch.testing.assert_close(dense_d[i], d, atol=1e-4, rtol=1e-4)
        assert torch.equal(first[i], paged_chain(paged, d[-1:]))
        h_next = paged.run(0, target, tokens[i, 15:])
        torch.testing.assert_close(h2[i], h_next, atol=1e-4, rtol=1e-4)
        d = paged.run(1, draft, tokens[i, 15:17], torch.cat((h[-1:], h_next[:1])))
        assert torch.equal(second[i], paged_chain(paged, d[-1:]))


def test_gradients_reach_only_the_heads_own_weights(target_dir):
    args = dataclasses.replace(tiny_args("unused", target_dir), labels="argmax")
    target, config, embed, head = train_draft.load_target(args)
    raw = json.loads((target_dir / "config.json").read_text())
    draft = train_draft.build_draft(
        train_draft._llama_config(config, raw, "bfloat16", "LlamaForCausalLM"), config, embed, head
    )
    chunk = torch.randint(3, 384, (2, 9), generator=torch.Generator().manual_seed(1))
    losses = train_draft.draft_losses(draft, target, chunk, args, torch.Generator())
    losses["loss"].backward()
    assert {name for name, _ in draft.named_parameters()} == PUBLISHED
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())
    assert embed.weight.grad is None and head.weight.grad is None
    assert torch.isfinite(losses["p"]) and 0 <= losses["top1"] <= 1


@torch.no_grad()
def test_losses_pair_each_token_with_the_previous_hidden(pair, target_dir):
    """Row t = (x_{t+1}, h_t) regresses to h_{t+1} and is scored on x_{t+2} (eagle.py)."""
    target, draft, _ = pair
    args = dataclasses.replace(tiny_args("unused", target_dir), bf16_autocast=0)
    chunk = torch.randint(3, 384, (3, 11), generator=torch.Generator().manual_seed(3))
    losses = train_draft.draft_losses(draft, target, chunk, args, noise=None)
    h = target_hidden(target, chunk)
    d = draft_hidden(draft, chunk[:, 1:], h[:, :-1])
    teacher = target.compute_logits(h[:, 1:]).softmax(-1)
    log_q = draft.compute_logits(d).log_softmax(-1)
    torch.testing.assert_close(losses["v"], torch.nn.functional.smooth_l1_loss(d, h[:, 1:]))
    torch.testing.assert_close(losses["p"], -(teacher * log_q).sum(-1).mean())
    torch.testing.assert_close(losses["loss"], losses["v"] + 0.1 * losses["p"])


@torch.no_grad()
def test_chain_acceptance_output_is_the_targets_greedy_output(pair):
    target, draft, _ = pair
    prompts = torch.randint(3, 384, (2, 9), generator=torch.Generator().manual_seed(4))
    summary, outputs = chain_acceptance(target, draft, prompts, steps=3, new_tokens=14)
    for prompt, output in zip(prompts, outputs, strict=True):
        seq = prompt[None]
        for _ in range(14):  # plain greedy, full recompute, no cache
            nxt = target.compute_logits(target_hidden(target, seq)[:, -1]).argmax(-1)
            seq = torch.cat((seq, nxt[:, None]), dim=1)
        assert output == seq[0, 9:].tolist()
    assert summary["samples"] >= 2 * 14 // 4 and len(summary["per_position"]) == 3


def test_acceptance_counts_leading_matches_only():
    drafted = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 8]])
    greedy = torch.tensor([[1, 2, 3]] * 4)
    assert accepted_lengths(drafted, greedy).tolist() == [3, 1, 0, 2]
    summary = acceptance_summary(torch.tensor([0, 1, 5, 2]), steps=5)
    assert summary["per_position"] == [0.75, 0.5, 0.25, 0.25, 0.25]
    assert summary["conditional"] == [0.75, 0.6667, 0.5, 1.0, 1.0]
    assert summary["mean_accept_len"] == 3.0 and summary["samples"] == 4


def test_cli_parses_every_field_and_rejects_unknown_labels(monkeypatch, tmp_path):
    bad = DraftArgs(out=str(tmp_path / "o"), target="t", labels="data")
    with pytest.raises(ValueError, match="--labels must be one of"):
        train_draft.train(bad)
    seen = {}
    monkeypatch.setattr(train_draft, "train", lambda args: seen.setdefault("args", args))
    train_draft.main(["--out", "o", "--target", "t", "--labels", "argmax", "--noise", "0"])
    assert seen["args"] == DraftArgs(out="o", target="t", labels="argmax", noise=0.0)
