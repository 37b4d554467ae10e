"""Train an EAGLE head for a shipped target, reproducibly and offline.

The head is the EAGLE (v1) layout of ``model/eagle.py``: ``fc`` over [token embedding,
target hidden] + one Llama decoder layer, the target's frozen embedding and ``lm_head``,
no final norm.  It learns from the target itself, on the corpus and train/validation
split ``train_demo`` trained the target on (same functions, the target's tokenizer).
Each batch runs the target teacher-forced without grad and builds the draft rows
``eagle.py`` describes -- row t is token x_{t+1} with target hidden h_t -- and trains
with EAGLE's two losses:

    feature  smooth-L1(d_t, h_{t+1})                           weight --v-weight
    token    CE(lm_head(d_t), softmax(lm_head(h_{t+1})))       weight --p-weight

Token labels are the target's whole next-token distribution (``--labels soft``, EAGLE's
choice).  A 200-step ablation on the demo pair gave teacher-forced mean acceptance
lengths (5-step chain, 256 held-out windows, +-0.07) of 2.39 for soft labels, 2.41 for
the target's argmax and 2.26 for soft labels at ``--p-weight 0.5`` (whose free-running
chain collapsed: the feature loss is what keeps later steps on track).  Greedy
acceptance ties, so soft labels win on what else the engine does with the draft's
probabilities: tree drafting ranks top-k candidates by them, and speculative sampling
accepts with min(1, p/q), both of which want the target's distribution, not one-hot
confidence.  The corpus token is no label at all: it differs from the target's argmax
on 57% of held-out rows.  Uniform noise in [-noise, noise] on the hidden inputs (EAGLE's
recipe; the target's final-normed hidden has RMS ~1.2) makes later chain steps, which
feed the draft its own slightly wrong hidden, less brittle.

Training and evaluation run the serving modules themselves (``LlamaForCausalLM.forward``
and ``EagleDraftModel.forward``) on dense ``[batch, seq]`` blocks: ``DenseKV``
stands in for the paged KV pool and attention backend with plain causal attention.

    python -m specd.devtools.train_draft --target examples/models/demo-target \\
        --out examples/models/demo-eagle

The folder holds ``config.json`` (Llama-style, as published heads ship),
``model.safetensors`` (bf16, published tensor names, no embedding copy: the loader uses
the target's) and ``manifest.json`` (arguments, corpus digest, the target manifest's
sha256, losses, acceptance, file hashes).  ``--steps``, ``--minutes``, checkpoints and the
``reproduce`` command work as in ``train_demo``.  The final manifest's ``acceptance`` is
measured on the saved folder as the engine loads it (``evaluate_pair``): teacher-forced
per-position acceptance on held-out windows, and a free-running greedy chain.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedTokenizerFast

from specd.devtools.tiny_draft import _llama_config
from specd.devtools.train_demo import (
    _sha256_text,
    corpus_files,
    encode_stream,
    lr_at,
    parse_cli,
    publish,
    read_texts,
    reproduce_command,
    sample_batch,
    sha256_file,
    split_files,
)
from specd.workers.config import DraftAlgorithm
from specd.workers.model.config import ModelConfig
from specd.workers.model.cpu_linear import relayout_linears
from specd.workers.model.draft_loader import load_draft, parse_draft_config
from specd.workers.model.eagle import EagleDraftModel
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.model.loader import load_model

SCRIPT = "python -m specd.devtools.train_draft"
LABELS = ("soft", "argmax")


@dataclass(frozen=True)
class DraftArgs:
    out: str
    target: str
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    steps: int = 2100  # LR schedule length and step limit
    stop_after: int = 0  # stop after this many steps (0: at --steps); replays a cut-off run
    minutes: float = 33.0  # wall-clock cap for training, 0 = none (final evaluation excluded)
    eval_every: int = 100
    checkpoint_minutes: float = 5.0
    max_files: int = 0  # 0 = the whole standard library, as the demo target was trained
    seed: int = 0
    threads: int = 2
    bf16_autocast: int = 1  # target and draft matmuls in bf16 (draft master weights fp32)
    noise: float = 0.1  # half-width of the uniform noise on the target hidden inputs
    v_weight: float = 1.0  # feature regression (smooth L1)
    p_weight: float = 0.1  # token loss against the target's next-token distribution
    labels: str = "soft"  # soft: the target's distribution; argmax: its greedy token
    draft_steps: int = 5  # chain length the acceptance numbers are measured at
    eval_windows: int = 256  # held-out windows for teacher-forced acceptance
    eval_context: int = 128  # tokens of true prefix per window
    chain_prompts: int = 8  # held-out prompts for the free-running chain (final only)
    chain_prompt_len: int = 64
    chain_new_tokens: int = 128
    eval_dtype: str = "float32"  # final evaluation dtype (examples/demo.yaml serves fp32)


class DenseKV:
    """Stands in for both the KV pool and the attention backend of a ``ForwardContext``,
    so the serving modules run on ``batch`` dense sequences (tokens flattened row-major,
    ``[batch * new]``) with plain causal attention and no paging.

    Each layer's K/V are kept as ``[batch, kv_heads, length, head_dim]``; ``extend(new)``
    appends ``new`` positions per sequence, which attend to every kept position and
    causally among themselves; ``truncate(length)`` forgets rejected positions.  A fresh
    cache per forward is a plain causal forward (training: autograd flows through)."""

    def __init__(self, batch: int):
        self.batch, self.length = batch, 0
        self._past = 0  # kept positions before the forward in progress
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, new: int) -> tuple[ForwardContext, torch.Tensor]:
        """-> (context for ``new`` more positions per sequence, positions [batch * new])."""
        self._past, self.length = self.length, self.length + new
        positions = torch.arange(self._past, self.length).repeat(self.batch)
        ctx = ForwardContext((self.batch, self._past, new), positions, self, self)  # type: ignore[arg-type]
        return ctx, positions

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [batch * new, kv_heads, d] appended after the kept positions."""

        def grow(old: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(self.batch, -1, x.shape[1], x.shape[2]).transpose(1, 2)
            return (
                x if old is None or self._past == 0 else torch.cat((old[:, :, : self._past], x), 2)
            )

        old_k, old_v = self._kv.get(layer, (None, None))
        self._kv[layer] = (grow(old_k, k), grow(old_v, v))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]

    def forward(self, q, k, v, plan, scale: float) -> torch.Tensor:
        """q [b*new, heads, d], k/v [b, kv_heads, past+new, d] -> [b*new, heads, d]."""
        b, past, new = plan
        q4 = q.reshape(b, new, q.shape[1], q.shape[2]).transpose(1, 2)  # [b, heads, new, d]
        # query i (position past + i) sees keys 0 .. past + i
        mask = None
        if past and new > 1:
            mask = torch.arange(past + new)[None, :] <= past + torch.arange(new)[:, None]
        out = F.scaled_dot_product_attention(
            q4, k, v, attn_mask=mask, is_causal=past == 0, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape)


def target_hidden(
    target: LlamaForCausalLM, tokens: torch.Tensor, cache: DenseKV | None = None
) -> torch.Tensor:
    """tokens [b, t] (after what ``cache`` holds) -> final-normed hidden [b, t, H]."""
    b, t = tokens.shape
    ctx, positions = (cache or DenseKV(b)).extend(t)
    return target(tokens.flatten(), positions, ctx).view(b, t, -1)


def draft_hidden(
    draft: EagleDraftModel,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    cache: DenseKV | None = None,
) -> torch.Tensor:
    """Draft rows (tokens [b, t], hidden [b, t, H]) after what ``cache`` holds -> [b, t, H]."""
    b, t = tokens.shape
    ctx, positions = (cache or DenseKV(b)).extend(t)
    return draft(tokens.flatten(), hidden.flatten(0, 1), positions, ctx).view(b, t, -1)


def accepted_lengths(drafted: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """[n, k] draft tokens vs the target's greedy tokens -> [n] leading matches."""
    return (drafted == greedy).long().cumprod(dim=1).sum(dim=1)


def acceptance_summary(lengths: torch.Tensor, steps: int) -> dict[str, Any]:
    """Accepted drafts per verify -> per-position acceptance (position k accepted means
    drafts 1..k all were, what the engine's per-position counter counts), the same
    conditional on position k-1, and the mean acceptance length (bonus token included)."""
    reached = [(lengths >= k).float().mean().item() for k in range(steps + 1)]  # [1.0, ...]
    return {
        "per_position": [round(r, 4) for r in reached[1:]],
        "conditional": [
            round(r / p, 4) if p else 0.0 for p, r in zip(reached[:-1], reached[1:], strict=True)
        ],
        "mean_accept_len": round(1.0 + lengths.float().mean().item(), 3),
        "samples": len(lengths),
    }


def draft_chain(
    draft: EagleDraftModel,
    cache: DenseKV,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """Greedy chain of ``steps`` draft tokens -> [b, steps].

    ``tokens`` [b, t] / ``hidden`` [b, t, H] are the prefix rows (x_{i+1}, h_i) not yet
    in ``cache``, ending with the row of the last known token x_L; each step then feeds
    (its own token, the previous row's draft hidden) at the next position, as the
    engine's drafter does.  The chain rows are dropped from ``cache`` afterwards: their
    K/V came from draft hiddens, not the target's."""
    committed = cache.length + tokens.shape[1]
    last = draft_hidden(draft, tokens, hidden, cache)[:, -1]  # [b, H]
    drafted = []
    for step in range(steps):
        drafted.append(draft.compute_logits(last).argmax(-1))  # [b]
        if step + 1 < steps:
            rows = last[:, None].to(hidden.dtype)
            last = draft_hidden(draft, drafted[-1][:, None], rows, cache)[:, -1]
    cache.truncate(committed)
    return torch.stack(drafted, dim=1)


@dataclass
class TeacherForcedReference:
    """The target's side of teacher-forced acceptance, computed once per target."""

    windows: torch.Tensor  # [n, L+1] held-out tokens x_0 .. x_L
    hidden: torch.Tensor  # [n, L+1, H] the target's hidden h_0 .. h_L
    greedy: torch.Tensor  # [n, steps] the target's greedy continuation of each window


@torch.no_grad()
def target_reference(
    target: LlamaForCausalLM, windows: torch.Tensor, steps: int, chunk: int = 32
) -> TeacherForcedReference:
    hiddens, greedy = [], []
    for block in windows.split(chunk):
        cache = DenseKV(len(block))
        hidden = target_hidden(target, block, cache)
        hiddens.append(hidden)
        tokens = [target.compute_logits(hidden[:, -1]).argmax(-1)]  # [b]
        for _ in range(steps - 1):
            last = target_hidden(target, tokens[-1][:, None], cache)[:, -1]
            tokens.append(target.compute_logits(last).argmax(-1))
        greedy.append(torch.stack(tokens, dim=1))
    return TeacherForcedReference(windows, torch.cat(hiddens), torch.cat(greedy))


@torch.no_grad()
def teacher_forced_acceptance(
    draft: EagleDraftModel, ref: TeacherForcedReference, chunk: int = 32
) -> dict[str, Any]:
    """Acceptance from true prefixes: for each held-out window x_0..x_L the draft chains
    from the target's hiddens of the window and is compared with the target's own greedy
    continuation of it.  Unlike free-running generation, a small model's loops cannot
    inflate this."""
    steps = ref.greedy.shape[1]
    lengths = []
    for start in range(0, len(ref.windows), chunk):
        rows = slice(start, start + chunk)
        tokens, hidden = ref.windows[rows, 1:], ref.hidden[rows, :-1]
        drafted = draft_chain(draft, DenseKV(len(tokens)), tokens, hidden, steps)
        lengths.append(accepted_lengths(drafted, ref.greedy[rows]))
    return acceptance_summary(torch.cat(lengths), steps)


@torch.no_grad()
def chain_acceptance(
    target: LlamaForCausalLM,
    draft: EagleDraftModel,
    prompts: torch.Tensor,
    steps: int = 5,
    new_tokens: int = 128,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Free-running greedy speculative decoding (chain, ``steps`` drafts per verify) from
    each prompt [n, p] -> (acceptance summary over all verifies, the generated tokens).

    The generated tokens are the target's own greedy output whatever the draft proposes
    (a check of this loop); acceptance on them is what the engine would see."""
    lengths, outputs = [], []
    for prompt in prompts:
        target_kv, draft_kv = DenseKV(1), DenseKV(1)
        fresh = target_hidden(target, prompt[None], target_kv)  # hiddens the draft lacks
        bonus = target.compute_logits(fresh[:, -1]).argmax(-1)[:, None]
        seq = torch.cat((prompt[None], bonus), dim=1)  # [1, n + 1]: K/V for all but the last
        while seq.shape[1] - prompt.numel() < new_tokens:
            n = target_kv.length
            rows = seq[:, draft_kv.length + 1 :]  # tokens x_{i+1} paired with ``fresh``
            drafted = draft_chain(draft, draft_kv, rows, fresh, steps)  # [1, steps]
            verify = target_hidden(target, torch.cat((seq[:, n:], drafted), 1), target_kv)
            greedy = target.compute_logits(verify[0]).argmax(-1)[None]  # [1, steps + 1]
            accepted = int(accepted_lengths(drafted, greedy[:, :steps]))
            target_kv.truncate(n + 1 + accepted)
            fresh = verify[:, : 1 + accepted]
            seq = torch.cat((seq, drafted[:, :accepted], greedy[:, accepted : accepted + 1]), 1)
            lengths.append(accepted)
        outputs.append(seq[0, prompt.numel() : prompt.numel() + new_tokens].tolist())
    return acceptance_summary(torch.tensor(lengths), steps), outputs


def evaluation_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``length`` tokens -> [count, length]."""
    starts = torch.linspace(0, len(stream) - length - 1, count).long().tolist()
    return torch.stack([stream[s : s + length] for s in starts])


def evaluate_pair(
    target_dir: str | Path,
    draft_dir: str | Path,
    val_stream: torch.Tensor,
    args: DraftArgs,
    log=print,
) -> dict[str, Any]:
    """Load the pair as the engine does (``load_model``, ``load_draft``, ``eval_dtype``)
    and measure teacher-forced and free-running chain acceptance on held-out tokens."""
    target, config = load_model(target_dir, dtype=args.eval_dtype)
    draft, _ = load_draft(draft_dir, DraftAlgorithm.EAGLE, target, config)
    steps = args.draft_steps
    windows = evaluation_windows(val_stream, args.eval_windows, args.eval_context + 1)
    teacher = teacher_forced_acceptance(draft, target_reference(target, windows, steps))
    log(f"teacher-forced acceptance: {json.dumps(teacher)}")
    prompts = evaluation_windows(val_stream, args.chain_prompts, args.chain_prompt_len)
    chain, _ = chain_acceptance(target, draft, prompts, steps, args.chain_new_tokens)
    log(f"chain acceptance: {json.dumps(chain)}")
    log(f"mean acceptance length ({steps}-step chain): {chain['mean_accept_len']}")
    return {
        "dtype": args.eval_dtype,
        "draft_steps": steps,
        "teacher_forced": {
            **teacher,
            "windows": args.eval_windows,
            "context": args.eval_context,
        },
        "chain": {
            **chain,
            "prompts": args.chain_prompts,
            "prompt_len": args.chain_prompt_len,
            "new_tokens": args.chain_new_tokens,
        },
    }


@dataclass
class Corpus:
    train: torch.Tensor  # token stream of the target's training files
    val: torch.Tensor  # token stream of its held-out files
    info: dict[str, Any]  # for the manifest


def load_corpus(args: DraftArgs, target_manifest: dict[str, Any]) -> Corpus:
    """train_demo's files and split, encoded with the target's tokenizer."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.target)
    files = corpus_files(args.max_files)
    train_files, val_files = split_files(files)
    train_texts = read_texts(train_files)
    digest = _sha256_text(train_texts)
    train = encode_stream(tokenizer, train_texts)
    val = encode_stream(tokenizer, read_texts(val_files))
    expected = target_manifest.get("corpus", {}).get("sha256")
    info = {
        "source": "train_demo.corpus_files / split_files (the target's corpus and split)",
        "files": len(files),
        "train_files": len(train_files),
        "val_files": len(val_files),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "sha256": digest,
        "matches_target_manifest": None if expected is None else digest == expected,
    }
    return Corpus(train, val, info)


def load_target(args: DraftArgs) -> tuple[LlamaForCausalLM, ModelConfig, nn.Module, nn.Module]:
    """The frozen target in the training dtype, plus float32 copies of its embedding and
    lm_head as plain modules (the target's own are pre-packed for speed and carry no
    gradient to their input).  The projections stay unfused, so the shipped head's
    ``reproduce`` command replays the same arithmetic it was trained with."""
    dtype = "bfloat16" if args.bf16_autocast else "float32"
    target, config = load_model(args.target, dtype=dtype, inference_layout=False)
    embed = nn.Embedding.from_pretrained(target.model.embed_tokens.weight.float(), freeze=True)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head.weight = nn.Parameter(target.lm_head.weight.detach().float(), requires_grad=False)
    relayout_linears(target, "packed")  # the arithmetic the shipped head was trained with
    return target, config, embed, head


def build_draft(
    raw_config: dict[str, Any], target_config: ModelConfig, embed: nn.Module, head: nn.Module
) -> EagleDraftModel:
    """A freshly initialised head exactly as ``load_draft`` would build from ``raw_config``."""
    config = parse_draft_config(raw_config, DraftAlgorithm.EAGLE, target_config)
    return EagleDraftModel(config.model, embed, head, config.fc_bias)


def draft_losses(
    draft: EagleDraftModel,
    target: LlamaForCausalLM,
    chunk: torch.Tensor,
    args: DraftArgs,
    noise: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """chunk [b, t+1] tokens -> {"loss", "v", "p", "top1"}; noise on the inputs when a
    generator is given.  top1: rows where the draft's argmax is the target's."""
    with torch.no_grad():
        hidden = target_hidden(target, chunk)  # [b, t+1, H]: h_0 .. h_t
        teacher = target.compute_logits(hidden[:, 1:])  # [b, t, V]: scores x_2 .. x_{t+1}
    inputs = hidden[:, :-1].float()
    if noise is not None and args.noise > 0:
        inputs = inputs + (torch.rand(inputs.shape, generator=noise) * 2 - 1) * args.noise
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16_autocast)):
        out = draft_hidden(draft, chunk[:, 1:], inputs)  # [b, t, H]: d_0 .. d_{t-1}
        logits = draft.compute_logits(out)  # [b, t, V] float32
    v_loss = F.smooth_l1_loss(out.float(), hidden[:, 1:].float())
    labels = teacher.softmax(-1) if args.labels == "soft" else teacher.argmax(-1)
    p_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
    top1 = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return {
        "loss": args.v_weight * v_loss + args.p_weight * p_loss,
        "v": v_loss,
        "p": p_loss,
        "top1": top1,
    }


@torch.no_grad()
def validate(draft, target, windows: torch.Tensor, args: DraftArgs) -> dict[str, float]:
    """Mean losses and one-step agreement over fixed held-out windows, no noise."""
    blocks = [draft_losses(draft, target, b, args, None) for b in windows.split(args.batch_size)]
    return {name: sum(b[name].item() for b in blocks) / len(blocks) for name in blocks[0]}


def write_draft(draft: EagleDraftModel, raw_config: dict[str, Any], folder: Path) -> None:
    """config.json + model.safetensors in bf16, the published names, no embedding copy."""
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")


class Run:
    """One training run: state, periodic records, manifests and saves."""

    def __init__(self, args: DraftArgs, log):
        self.args, self.log = args, log
        target_dir = Path(args.target)
        manifest_file = target_dir / "manifest.json"
        target_manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else {}
        self.target_info = {
            "path": args.target,
            "manifest_sha256": sha256_file(manifest_file) if manifest_file.is_file() else None,
        }
        self.corpus = load_corpus(args, target_manifest)
        self.target, self.target_config, embed, head = load_target(args)
        raw_target = json.loads((target_dir / "config.json").read_text())
        self.raw_config = _llama_config(
            self.target_config, raw_target, "bfloat16", architecture="LlamaForCausalLM"
        )
        self.draft = build_draft(self.raw_config, self.target_config, embed, head)
        self.params = sum(p.numel() for p in self.draft.parameters())
        self.val_windows = evaluation_windows(
            self.corpus.val, 2 * args.batch_size, args.seq_len + 1
        )
        windows = evaluation_windows(self.corpus.val, args.eval_windows, args.eval_context + 1)
        self.reference = target_reference(self.target, windows, args.draft_steps)
        self.step, self.t0 = 0, time.monotonic()
        self.history: list[dict[str, Any]] = []
        self.recent: list[dict[str, float]] = []  # train losses since the last record

    def record(self) -> None:
        """Append train (mean since the last record) and held-out numbers to the history."""
        entry: dict[str, Any] = {"step": self.step}
        if self.recent:
            for key in self.recent[0]:
                mean = sum(r[key] for r in self.recent) / len(self.recent)
                entry[f"train_{key}"] = round(mean, 4)
            self.recent.clear()
        val = validate(self.draft, self.target, self.val_windows, self.args)
        entry |= {f"val_{key}": round(value, 4) for key, value in val.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(self.args.bf16_autocast)):
            accept = teacher_forced_acceptance(self.draft, self.reference)
        entry["tf_per_position"] = accept["per_position"]
        entry["tf_mean_accept_len"] = accept["mean_accept_len"]
        entry["seconds"] = round(time.monotonic() - self.t0, 1)
        self.history.append(entry)
        self.log(json.dumps(entry))

    def manifest(self, final: bool, stop: int) -> dict[str, Any]:
        args, last = self.args, (self.history[-1] if self.history else {})
        last_train = next((h for h in reversed(self.history) if "train_loss" in h), {})
        model = self.draft.config
        return {
            "script": SCRIPT,
            "args": asdict(args),
            "seed": args.seed,
            "reproduce": reproduce_command(args, self.step, script=SCRIPT),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "target": self.target_info,
            "corpus": self.corpus.info,
            "model": {
                "algorithm": "EAGLE",
                "num_hidden_layers": model.num_hidden_layers,
                "hidden_size": model.hidden_size,
                "intermediate_size": model.intermediate_size,
                "num_attention_heads": model.num_attention_heads,
                "num_key_value_heads": model.num_key_value_heads,
                "vocab_size": model.vocab_size,
                "shares_target": "embed_tokens, lm_head",
            },
            "params": self.params,
            "steps_done": self.step,
            "stopped_by": "steps" if self.step >= stop else "minutes",
            "tokens_seen": self.step * args.batch_size * args.seq_len,
            "train_seconds": round(time.monotonic() - self.t0, 1),
            "final_metrics": {
                k: v for k, v in {**last_train, **last}.items() if k.startswith(("train_", "val_"))
            },
            "history": self.history,
            "final": final,
            "date": datetime.date.today().isoformat(),
        }

    def save(self, final: bool, stop: int) -> dict[str, Any]:
        """Write the folder; a final save first measures acceptance on the written files."""

        def write(scratch: Path) -> dict[str, Any]:
            write_draft(self.draft, self.raw_config, scratch)
            if not final:
                return {"acceptance": None}
            accept = evaluate_pair(self.args.target, scratch, self.corpus.val, self.args, self.log)
            return {"acceptance": accept}

        return publish(Path(self.args.out), write, self.manifest(final, stop))


def train(args: DraftArgs, log=print) -> dict[str, Any]:
    """Train the head, checkpoint, save with a final evaluation; returns the manifest."""
    if args.labels not in LABELS:
        raise ValueError(f"--labels must be one of {LABELS}, got {args.labels!r}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    run = Run(args, log)
    corpus, draft = run.corpus, run.draft
    log(
        f"corpus: {corpus.info['train_tokens']} / {corpus.info['val_tokens']} train / val "
        f"tokens (matches the target's: {corpus.info['matches_target_manifest']}); "
        f"draft {run.params / 1e6:.2f}M trainable params"
    )
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed)
    noise = torch.Generator().manual_seed(args.seed + 1)
    last_ckpt = time.monotonic()
    deadline = run.t0 + args.minutes * 60 if args.minutes > 0 else math.inf
    stop = min(args.steps, args.stop_after or args.steps)
    draft.train()
    while run.step < stop and time.monotonic() < deadline:
        for group in opt.param_groups:
            group["lr"] = lr_at(run.step, args, args.steps)
        losses = draft_losses(
            draft, run.target, sample_batch(corpus.train, args, batches), args, noise
        )
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        run.step += 1
        run.recent.append({k: v.item() for k, v in losses.items()})
        if run.step % args.eval_every == 0 or run.step == 1:
            run.record()
        if time.monotonic() - last_ckpt >= args.checkpoint_minutes * 60:
            run.save(final=False, stop=stop)
            log(f"checkpoint: step {run.step} -> {args.out}")
            last_ckpt = time.monotonic()
    if not run.history or run.history[-1]["step"] != run.step:
        run.record()
    if run.step < stop:
        log(f"wall-clock cap hit at step {run.step} of {stop}; the LR schedule did not finish")
    draft.eval()
    result = run.save(final=True, stop=stop)
    log(f"saved {args.out}: " + json.dumps(result["final_metrics"]))
    return result


def main(argv: list[str] | None = None) -> None:
    """CLI: one ``--flag`` per :class:`DraftArgs` field."""
    train(parse_cli(DraftArgs, argv, __doc__.splitlines()[0]))


if __name__ == "__main__":
    main()
