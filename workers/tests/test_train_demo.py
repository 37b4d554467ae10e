"""The demo-model training script on a tiny setting: it learns, saves bf16 with a
tokenizer, and its manifest describes and hashes what it wrote."""

import hashlib
import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.workers.tools.train_demo import TrainArgs, train


def test_tiny_training_run_learns_and_writes_a_loadable_checkpoint(tmp_path):
    args = TrainArgs(
        out=str(tmp_path / "demo"),
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
    result = train(args, log=lambda _: None)
    history = result["history"]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5
    out = tmp_path / "demo"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["final"] and manifest["steps_done"] == 30 and manifest["args"]["seed"] == 0
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ).endswith("<|assistant|>\n")
