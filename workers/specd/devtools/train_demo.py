"""Train the demo target model the repo ships, reproducibly and offline.

Corpus: the Python standard library's own ``*.py`` sources (sorted; every 40th file
held out for validation), so anyone with the same Python version rebuilds the same
data.  A byte-level BPE tokenizer is trained on it, then a Llama-architecture model
(``transformers.LlamaForCausalLM``) is trained with AdamW and a cosine schedule at a
fixed seed.  The result is saved in bf16 safetensors with the tokenizer, a chat
template and ``manifest.json`` (arguments, corpus digest, losses, file hashes).

    python -m specd.devtools.train_demo --out examples/models/demo-target

``--steps`` is the length of the LR schedule; ``--minutes`` caps wall time (0: no cap)
and may stop a run early.  Checkpoints (same layout, ``"final": false`` in the
manifest) replace the folder's files every ``--checkpoint-minutes``.  The manifest's
``reproduce`` field is the command that replays the run step for step, time cap
excluded (same seed, data order and schedule; bitwise only on the same CPU kind).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_EXCLUDED_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo")


@dataclass(frozen=True)
class TrainArgs:
    out: str
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 1.5e-3
    warmup_steps: int = 50
    steps: int = 1200  # LR schedule length and step limit
    stop_after: int = 0  # stop after this many steps (0: at --steps); replays a cut-off run
    minutes: float = 80.0  # wall-clock cap, 0 = none
    eval_every: int = 50
    checkpoint_minutes: float = 10.0
    max_files: int = 0  # 0 = the whole standard library
    seed: int = 0
    threads: int = 2
    bf16_autocast: int = 1  # matmuls in bf16 (fp32 master weights): ~3x faster on AVX512-BF16 CPUs


def corpus_files(max_files: int = 0) -> list[Path]:
    """The stdlib's .py files in a fixed order, without test suites and demos."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in _EXCLUDED_DIRS for part in p.relative_to(root).parts[:-1])
    )
    return files[:max_files] if max_files else files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Every 40th file is held out for validation."""
    return [f for i, f in enumerate(files) if i % 40], [
        f for i, f in enumerate(files) if not i % 40
    ]


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each file framed by BOS ... EOS."""
    ids: list[int] = []
    for text in texts:
        ids += [
            tokenizer.bos_token_id,
            *tokenizer.encode(text, add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
    return torch.tensor(ids, dtype=torch.int64)


def build_model(args: TrainArgs, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: TrainArgs, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def sample_batch(stream: torch.Tensor, args: TrainArgs, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
    return torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, stream: torch.Tensor, args: TrainArgs, batches: int = 4
) -> float:
    """Mean loss over fixed, evenly spaced validation windows."""
    model.eval()
    n = args.seq_len + 1
    starts = torch.linspace(0, len(stream) - n - 1, batches * args.batch_size).long().tolist()
    losses = []
    for i in range(batches):
        chunk = torch.stack(
            [stream[s : s + n] for s in starts[i * args.batch_size : (i + 1) * args.batch_size]]
        )
        losses.append(_loss(model, chunk))
    model.train()
    return sum(losses) / len(losses)


def _loss(model: LlamaForCausalLM, chunk: torch.Tensor) -> torch.Tensor | float:
    logits = model(input_ids=chunk[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())
    return loss if torch.is_grad_enabled() else loss.item()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sha256_text(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def model_summary(config: LlamaConfig) -> dict:
    """The architecture numbers a reader of the manifest cares about."""
    keys = (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
        "tie_word_embeddings",
    )  # fmt: skip
    rope = getattr(config, "rope_parameters", None) or {}
    summary = {"architecture": "LlamaForCausalLM", **{k: getattr(config, k) for k in keys}}
    summary["rope_theta"] = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return summary


def reproduce_command(
    args, steps_done: int, script: str = "python -m specd.devtools.train_demo"
) -> str:
    """CLI that replays this run's steps without the wall-clock cap.  ``args`` is a
    run-arguments dataclass with ``steps``, ``stop_after`` and ``minutes`` fields;
    its required fields lead, then every field that differs from its default."""
    replay = {**asdict(args), "minutes": 0.0, "stop_after": 0}
    if steps_done < args.steps:
        replay["stop_after"] = steps_done
    required = {f.name: replay.pop(f.name) for f in fields(args) if f.default is MISSING}
    defaults = asdict(type(args)(**required))
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in required.items()]
    flags += [f"--{k.replace('_', '-')} {v}" for k, v in replay.items() if v != defaults[k]]
    return " ".join([script, *flags])


def publish(out: Path, write: Callable[[Path], dict | None], manifest: dict) -> dict:
    """``write(scratch)`` fills a scratch folder next to ``out`` (and may return extra
    manifest fields); the manifest gets every file's sha256 and the files are moved in
    one by one, manifest last, so a crash mid-write leaves the previous checkpoint
    readable.  Returns the manifest written."""
    out.mkdir(parents=True, exist_ok=True)
    with TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        scratch = Path(tmp)
        extra = write(scratch) or {}
        files = sorted(p for p in scratch.iterdir() if p.is_file())
        manifest = {**manifest, **extra, "files": {p.name: sha256_file(p) for p in files}}
        (scratch / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        for p in [*files, scratch / "manifest.json"]:  # manifest last: it vouches for the rest
            os.replace(p, out / p.name)
    return manifest


def save(model, tokenizer, out: Path, manifest: dict) -> dict:
    """bf16 safetensors + tokenizer + manifest with file hashes, written atomically."""

    def write(scratch: Path) -> None:
        bf16 = LlamaForCausalLM(model.config).to(torch.bfloat16)
        bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        bf16.config.dtype = "bfloat16"
        bf16.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)

    return publish(out, write, manifest)


def train(args: TrainArgs, log=print) -> dict:
    """Build the corpus and tokenizer, train, checkpoint, save; returns the manifest."""
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    files = corpus_files(args.max_files)
    train_files, val_files = split_files(files)
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream, val_stream = (
        encode_stream(tokenizer, train_texts),
        encode_stream(tokenizer, val_texts),
    )
    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"corpus: {len(train_files)} train / {len(val_files)} val files, "
        f"{len(train_stream)} / {len(val_stream)} tokens; model {params / 1e6:.1f}M params"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = last_ckpt = time.monotonic()
    deadline = t0 + args.minutes * 60 if args.minutes > 0 else math.inf
    total = args.steps
    stop = min(total, args.stop_after or total)
    history: list[dict] = []
    recent: list[float] = []  # train losses since the last record
    step = 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rel = [str(f.relative_to(stdlib)) for f in files]
    val_rel = [str(f.relative_to(stdlib)) for f in val_files]

    def record() -> None:
        val = evaluate(model, val_stream, args)
        entry = {"step": step}
        if recent:  # mean over the steps since the last record, not one noisy batch
            entry["train_loss"] = round(sum(recent) / len(recent), 4)
            recent.clear()
        entry |= {
            "val_loss": round(val, 4),
            "val_ppl": round(math.exp(val), 2),
            "seconds": round(time.monotonic() - t0, 1),
        }
        history.append(entry)
        log(json.dumps(entry))

    def manifest(final: bool) -> dict:
        last = history[-1] if history else {}
        last_train = next((h["train_loss"] for h in reversed(history) if "train_loss" in h), None)
        return {
            "script": "python -m specd.devtools.train_demo",
            "args": asdict(args),
            "seed": args.seed,
            "reproduce": reproduce_command(args, step),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "corpus": {
                "source": "Python standard library *.py (sorted), excluding dirs "
                + ", ".join(_EXCLUDED_DIRS),
                "stdlib_relative_to": "sysconfig.get_paths()['stdlib']",
                "files": len(files),
                "files_sha256": _sha256_text(rel),
                "train_files": len(train_files),
                "val_files": val_rel,
                "train_tokens": len(train_stream),
                "val_tokens": len(val_stream),
                "sha256": _sha256_text(train_texts),
            },
            "tokenizer": {"vocab_size": len(tokenizer), "type": "byte-level BPE"},
            "model": model_summary(model.config),
            "params": params,
            "steps_done": step,
            "stopped_by": "steps" if step >= stop else "minutes",
            "tokens_seen": step * args.batch_size * args.seq_len,
            "train_seconds": round(time.monotonic() - t0, 1),
            "final_metrics": {
                "train_loss": last_train,
                "train_ppl": round(math.exp(last_train), 2) if last_train is not None else None,
                "val_loss": last.get("val_loss"),
                "val_ppl": last.get("val_ppl"),
            },
            "history": history,
            "final": final,
            "date": datetime.date.today().isoformat(),
        }

    model.train()
    while step < stop and time.monotonic() < deadline:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, total)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16_autocast)):
            loss = _loss(model, sample_batch(train_stream, args, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.item())
        if step % args.eval_every == 0 or step == 1:
            record()
        if time.monotonic() - last_ckpt >= args.checkpoint_minutes * 60:
            save(model, tokenizer, Path(args.out), manifest(final=False))
            log(f"checkpoint: step {step} -> {args.out}")
            last_ckpt = time.monotonic()
    if not history or history[-1]["step"] != step:
        record()
    if step < stop:
        log(f"wall-clock cap hit at step {step} of {stop}; the LR schedule did not finish")
    result = save(model, tokenizer, Path(args.out), manifest(final=True))
    log(f"saved {args.out}: " + json.dumps(result["final_metrics"]))
    return result


def parse_cli(cls, argv: list[str] | None, description: str):
    """One ``--flag`` per field of the dataclass ``cls``; fields without a default are
    required strings.  Returns a ``cls``."""
    ap = argparse.ArgumentParser(description=description)
    for f in fields(cls):
        required = f.default is MISSING
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=str if required else type(f.default),
            default=None if required else f.default,
            required=required,
        )
    return cls(**vars(ap.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    """CLI: one ``--flag`` per :class:`TrainArgs` field."""
    train(parse_cli(TrainArgs, argv, __doc__.splitlines()[0]))


if __name__ == "__main__":
    main()
