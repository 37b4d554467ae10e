"""Write a draft's token map: the most frequent target tokens of a corpus, offline.

    python -m specd.devtools.token_map --target examples/models/demo-target \\
        --out examples/models/demo-eagle/token_map.json --size 2048

Counts every token id of the texts (default: the demo's training corpus and split,
``train_demo.corpus_files`` / ``split_files``; or ``--texts`` files, such as a sample of
a deployment's own traffic) with the target's tokenizer, and keeps the ``--size`` most
frequent, ties to the lower id.  The JSON written holds ``token_ids`` (ascending, what
``spec.draft.tokenMap`` reads) and how they were counted: the corpus digest, the share
of the corpus's tokens the map covers, and the command that rebuilds it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specd.devtools.train_demo import _sha256_text, corpus_files, read_texts, split_files


def token_counts(tokenizer, texts: list[str], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each id occurs in ``texts`` (no special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int) -> list[int]:
    """The ``size`` most counted ids (ties: lower id first), ascending."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"--size {size} must be in [1, {counts.numel()}]")
    order = torch.sort(-counts, stable=True).indices  # a stable sort keeps ties by id
    return sorted(order[:size].tolist())


def build(target: str, size: int, texts: list[str], source: str) -> dict:
    """The token map document for ``target``'s tokenizer over ``texts``."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    vocab_size = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    counts = token_counts(tokenizer, texts, vocab_size)
    ids = most_frequent(counts, size)
    total = int(counts.sum())
    return {
        "token_ids": ids,
        "size": size,
        "target_vocab_size": vocab_size,
        "corpus": {
            "source": source,
            "texts": len(texts),
            "tokens": total,
            "sha256": _sha256_text(texts),
        },
        "coverage": round(int(counts[ids].sum()) / max(total, 1), 4),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target model's folder (its tokenizer)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--size", type=int, default=2048, help="how many token ids to keep")
    ap.add_argument("--texts", nargs="*", help="text files to count (default: demo corpus)")
    args = ap.parse_args(argv)
    if args.texts:
        texts, source = read_texts([Path(p) for p in args.texts]), "the --texts files"
    else:
        texts = read_texts(split_files(corpus_files())[0])
        source = "train_demo.corpus_files / split_files, training files"
    doc = build(args.target, args.size, texts, source)
    doc["reproduce"] = " ".join(
        ["python -m specd.devtools.token_map", f"--target {args.target}", f"--out {args.out}"]
        + [f"--size {args.size}"]
        + ([f"--texts {' '.join(args.texts)}"] if args.texts else [])
    )
    Path(args.out).write_text(json.dumps(doc) + "\n")
    print(f"{args.out}: {args.size} ids covering {doc['coverage']:.1%} of the corpus's tokens")


if __name__ == "__main__":
    main()
