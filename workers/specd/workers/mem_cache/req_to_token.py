"""The request-row pool: ``req_to_token[row, position] -> token-pool slot``.

One row past the pool's, ``pad_row``, is never handed out: every entry maps to the KV
pool's pad slot, so the pad requests of graph batches read and write only that slot.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(
        self, num_rows: int, width: int, device: torch.device | str = "cpu", pad_slot: int = 0
    ):
        self.num_rows = num_rows
        self.width = width
        self.req_to_token = torch.zeros(num_rows + 1, width, dtype=torch.int64, device=device)
        self.pad_row = num_rows
        self.req_to_token[self.pad_row] = pad_slot
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when all rows are taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self._free_rows.append(row)
