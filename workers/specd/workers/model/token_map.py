"""A draft's token map: the target ids an EAGLE draft may propose, and its head over them.

An EAGLE draft scores the next token through the target's ``lm_head``, whose vocabulary
rows are most of a draft step's weight reads (the demo pair: 4.2M of a step's 7.5M
parameters; Llama-3-8B: 525M of ~740M).  Restricting the draft to the most frequent
tokens (FR-Spec, SGLang's ``--speculative-token-map``) shrinks that head to the map's
rows; the target still verifies over its whole vocabulary, so outputs are unchanged and
only a draft of a token outside the map is lost.

The file is a JSON list of token ids, a JSON object whose ``token_ids`` is that list
(what ``specd.devtools.token_map`` writes, with how it was counted), or a 1-D integer
tensor saved by ``torch.save`` (the format SGLang and FR-Spec publish).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specd.workers.model.config import ModelLoadError

FIELD = "spec.draft.tokenMap"
_MAX_FILE_BYTES = 64 << 20  # a map of every id of a 1M-token vocabulary is ~8 MB of JSON
Logits = Callable[[torch.Tensor], torch.Tensor]  # [M, H] -> [M, V] float32, every rank's
_ROWS_PER_CHUNK = 256  # identity rows pushed through the head at once: bounds its output


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The file's token ids, ascending, as int64 [N]; checked against the target's vocab."""
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"{FIELD}: {file} is not a file; give a token map's path")
    if file.stat().st_size > _MAX_FILE_BYTES:
        raise ModelLoadError(
            f"{FIELD}: {file} is {file.stat().st_size} bytes, more than any vocabulary's map "
            f"({_MAX_FILE_BYTES} bytes at most); give a list of token ids"
        )
    ids = _ids_in(file)
    if not ids:
        raise ModelLoadError(f"{FIELD}: {file} lists no token ids; list the ids to draft")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise ModelLoadError(f"{FIELD}: {file} holds non-integer entries such as {bad[0]!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ModelLoadError(
            f"{FIELD}: token id {outside[0]} in {file} is outside the target's vocabulary "
            f"[0, {vocab_size})"
        )
    if len(set(ids)) != len(ids):
        raise ModelLoadError(f"{FIELD}: {file} lists a token id more than once")
    return torch.tensor(sorted(ids), dtype=torch.int64)


def _ids_in(file: Path) -> list:
    if file.suffix == ".json":
        try:
            doc = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{FIELD}: {file} is not valid JSON: {err}") from None
        ids = doc.get("token_ids") if isinstance(doc, dict) else doc
        if not isinstance(ids, list):
            raise ModelLoadError(
                f"{FIELD}: {file} must hold a list of token ids, or an object whose "
                "token_ids is one"
            )
        return ids
    try:
        tensor = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- any unreadable file is the same user error
        raise ModelLoadError(
            f"{FIELD}: {file} is neither a .json list nor a torch-saved tensor: {err}"
        ) from None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.is_floating_point():
        raise ModelLoadError(f"{FIELD}: {file} must hold a 1-D integer tensor of token ids")
    return tensor.tolist()


@torch.inference_mode()
def head_rows(
    compute_logits: Logits,
    hidden_size: int,
    ids: torch.Tensor,
    head_dtype: torch.dtype,
    like: torch.Tensor,
):
    """The rows ``ids`` [N] of the linear head behind ``compute_logits`` ([M, H] of
    ``head_dtype`` -> [M, V] float32, all ranks' columns) as a [N, H] tensor on ``like``'s
    device and of its dtype.

    The head is read through its forward on the identity, so any layout it is stored in
    (oneDNN-packed on CPU, sharded by vocabulary across ranks) gives its exact rows.
    """
    ids = ids.to(like.device)
    parts = []
    for start in range(0, hidden_size, _ROWS_PER_CHUNK):
        rows = min(_ROWS_PER_CHUNK, hidden_size - start)
        eye = torch.zeros(rows, hidden_size, dtype=head_dtype, device=like.device)
        eye[torch.arange(rows), torch.arange(start, start + rows)] = 1
        parts.append(compute_logits(eye)[:, ids])  # [rows, N]: column j of row i is W[j, i]
    return torch.cat(parts).t().to(like.dtype).contiguous()


def restricted_head(
    compute_logits: Logits,
    hidden_size: int,
    ids: torch.Tensor,
    head_dtype: torch.dtype,
    like: torch.Tensor,
):
    """An ``nn.Linear`` (on ``like``'s device, of its dtype) scoring only ``ids``, with the
    rows of the head behind ``compute_logits`` (replicated on every rank: its logits need
    no gather)."""
    rows = head_rows(compute_logits, hidden_size, ids, head_dtype, like)
    head = nn.Linear(hidden_size, ids.numel(), bias=False, device=like.device, dtype=like.dtype)
    head.weight = nn.Parameter(rows, requires_grad=False)
    return head
