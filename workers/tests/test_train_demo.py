"""The demo-model training script on a tiny setting: it learns, saves bf16 with a
tokenizer, checkpoints on schedule, and its manifest describes and hashes what it wrote."""

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.devtools.train_demo import TrainArgs, main, reproduce_command, train

TINY = TrainArgs(
    out="",
    vocab_size=400,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    seq_len=32,
    batch_size=4,
    lr=5e-3,
    warmup_steps=2,
    steps=30,
    eval_every=10,
    max_files=6,
    minutes=5,
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "demo"
    logs: list[str] = []
    result = train(dataclasses.replace(TINY, out=str(out)), log=logs.append)
    return out, result, logs


def test_tiny_run_learns_and_writes_a_loadable_bf16_checkpoint(tiny_run):
    out, result, _ = tiny_run
    history = result["history"]
    assert [h["step"] for h in history] == [1, 10, 20, 30]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5
    assert history[-1]["train_loss"] < history[1]["train_loss"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings
    assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert (tok.bos_token, tok.eos_token) == ("<|bos|>", "<|eos|>")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|bos|><|user|>\nhi\n<|assistant|>\n"


def test_manifest_describes_the_run_and_hashes_every_file(tiny_run):
    out, result, _ = tiny_run
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == result
    assert manifest["final"] and manifest["steps_done"] == 30 and manifest["seed"] == 0
    assert manifest["stopped_by"] == "steps" and manifest["args"]["steps"] == 30
    corpus = manifest["corpus"]
    assert corpus["files"] == 6 and corpus["train_files"] == 5 and len(corpus["val_files"]) == 1
    assert corpus["train_tokens"] > 0 and len(corpus["sha256"]) == 64
    assert manifest["tokenizer"]["vocab_size"] == manifest["model"]["vocab_size"] <= 400
    assert manifest["model"]["num_hidden_layers"] == 1 and manifest["model"]["rope_theta"]
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    assert manifest["params"] == params
    final = manifest["final_metrics"]
    assert final["val_loss"] == manifest["history"][-1]["val_loss"] and final["train_ppl"] > 1
    written = {p.name for p in out.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == written >= {"model.safetensors", "tokenizer.json"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert not list(out.parent.glob(".demo-*")), "scratch folders are cleaned up"


def test_checkpoints_on_schedule_and_replay_command(tmp_path):
    out = tmp_path / "ckpt"
    args = dataclasses.replace(TINY, out=str(out), steps=3, eval_every=100, checkpoint_minutes=0)
    logs: list[str] = []
    result = train(args, log=logs.append)
    assert sum(line.startswith("checkpoint: step") for line in logs) == 3
    assert result["final"] and result["steps_done"] == 3
    # A run the wall clock cut short replays with --stop-after and no time cap.
    cut = reproduce_command(dataclasses.replace(args, steps=10), steps_done=4)
    assert "--steps 10" in cut and "--stop-after 4" in cut and "--minutes 0.0" in cut
    assert "--stop-after" not in reproduce_command(args, steps_done=3)


def test_cli_parses_every_field(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        "specd.devtools.train_demo.train", lambda args: seen.setdefault("args", args)
    )
    main(["--out", "x", "--num-layers", "2", "--lr", "0.002", "--stop-after", "7"])
    assert seen["args"] == TrainArgs(out="x", num_layers=2, lr=0.002, stop_after=7)
