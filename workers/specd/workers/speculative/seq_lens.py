"""A verify batch's sequence lengths in one place (seed 001).

The device tensor ``seq_lens`` is what kernels read; ``seq_lens_cpu`` and ``seq_lens_sum``
are what the host plans with (KV index sizes, per-request loops).  Producers change only
the device tensor and mark the host view stale; ``refresh_seq_lens_cpu`` is the only place
the host copy and the sum are recomputed.  A speculative step advances the lengths by
its accept lengths on the device and syncs once (``sync=True``) before the host needs
them again; a batch builder that finds the sum stale refreshes lazily (``sync=False``
when the host copy is known to be current).
"""

from __future__ import annotations

import torch

from specd.kernels.ops import host_tensor


class SeqLens:
    def __init__(self, lens: list[int], device: torch.device | str):
        self.seq_lens = host_tensor(lens, device)  # no wait for the queued step
        self.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        self.seq_lens_sum: int | None = sum(lens)
        self.num_syncs = 0  # device -> host copies made by refresh_seq_lens_cpu

    def advance(self, num_new_tokens: torch.Tensor) -> None:
        """Producer: every request grew by ``num_new_tokens`` [bs] (on the device)."""
        self.seq_lens = self.seq_lens + num_new_tokens.to(self.seq_lens)
        self.seq_lens_sum = None  # the host view is stale until the next refresh

    def refresh_seq_lens_cpu(self, sync: bool = True) -> None:
        """Recompute the host view: with ``sync`` copy the device tensor first (the one
        sync point of a step); without it only the sum is recomputed from the host copy."""
        if sync:
            self.seq_lens_cpu = self.seq_lens.to("cpu")
            self.num_syncs += 1
        self.seq_lens_sum = int(self.seq_lens_cpu.sum())

    def host(self) -> list[int]:
        """The host lengths for building a forward batch (refreshed lazily when stale)."""
        if self.seq_lens_sum is None:
            self.refresh_seq_lens_cpu(sync=True)
        return self.seq_lens_cpu.tolist()
