"""One face over the EAGLE and EAGLE-3 draft models, so drafting code has no branches.

* ``features``: target outputs -> the draft's input features (EAGLE: the final-normed
  hidden; EAGLE-3: ``fc`` over the captured low/mid/high residual streams).
* ``forward``: (token ids, features, positions) -> (features for the next step, hidden
  for logits); writes the draft's KV.
* ``logprobs`` over the draft vocabulary and ``to_target_ids`` (EAGLE-3's d2t map, or
  an EAGLE draft's token map: ``model/token_map.py``).
"""

from __future__ import annotations

import torch

from specd.workers.config import DraftAlgorithm
from specd.workers.model.draft_loader import DraftConfig, DraftModel
from specd.workers.model.forward_context import ForwardContext


class DraftHead:
    def __init__(self, model: DraftModel, config: DraftConfig):
        self.model = model
        self.config = config
        self.is_eagle3 = config.algorithm == DraftAlgorithm.EAGLE3
        self.dtype = next(model.parameters()).dtype  # may differ from the target's (on CPU)
        # draft ids differ from target ids: EAGLE-3's own vocabulary, or a token map
        self.maps_vocab = self.is_eagle3 or model.maps_vocab

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target residual streams the draft consumes (EAGLE-3), else ()."""
        return self.config.aux_layer_ids

    def features(self, hidden: torch.Tensor, aux: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target final hidden [N, H] and captured streams -> draft input features [N, H]
        (of the draft's dtype)."""
        if not self.is_eagle3:
            return hidden.to(self.dtype)
        return self.model.fuse_aux_hidden([aux[i].to(self.dtype) for i in self.capture_layers])

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features for the next draft step [N, H], hidden for logits [N, H])."""
        if self.is_eagle3:
            return self.model(input_ids, features, positions, ctx)
        out = self.model(input_ids, features, positions, ctx)
        return out, out

    def logprobs(self, logit_hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] -> log-probabilities over the draft vocabulary [M, V_draft] (float32)."""
        return torch.log_softmax(self.model.compute_logits(logit_hidden), dim=-1)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.draft_to_target(ids) if self.maps_vocab else ids

    def draft_vocab_targets(self) -> torch.Tensor | None:
        """[V_draft]: the target id of each draft token, None when the vocabularies agree."""
        if not self.maps_vocab:
            return None
        size = self.config.draft_vocab_size
        return self.model.draft_to_target(
            torch.arange(size, device=self.model.embed_tokens.weight.device)
        )
