"""The running batch's row-indexed tensors: sampling parameters, limits and the law each pending token came from.

Row r is the r-th running sequence and row r of the KV cache; a leaving row is replaced by the last one
(swap-remove), here as in the cache and the drafter. The sampling parameters live twice: on the device (the draft
and verification warp there) and on the host (which rows draw random numbers; what warping branches on).
"""

from __future__ import annotations

import torch

from decoding.config import SamplingParams
from decoding.verification.sampling import WarpParams

# The per-row tensors of WarpParams kept as batch state; penalties are built per step, from each row's history.
ROW_FIELDS = ("temperature", "top_k", "top_p")


class BatchState:
    def __init__(self, capacity: int, sampling: SamplingParams, device: torch.device) -> None:
        self.device = device
        self.warp_host = WarpParams.from_params([sampling] * capacity)
        self.warp_device = self.warp_host.to(device)
        self.max_tokens = torch.zeros(capacity, dtype=torch.long)
        # [capacity, V] on the device: the law each row's pending token was drawn from (greedy rows: the logits);
        # allocated at the first prefill, when the logits' width is known.
        self.root_scores: torch.Tensor | None = None

    def set_rows(self, rows: slice, params: list[SamplingParams]) -> None:
        """Admission: the joining sequences' sampling parameters become rows of the batch tensors."""
        new = WarpParams.from_params(params)
        for name in ROW_FIELDS:
            getattr(self.warp_host, name)[rows] = getattr(new, name)
            getattr(self.warp_device, name)[rows] = getattr(new, name).to(self.device, non_blocking=True)
        self.max_tokens[rows] = torch.tensor([p.max_tokens for p in params])

    def set_root_scores(self, rows: slice, scores: torch.Tensor) -> None:
        if self.root_scores is None:
            self.root_scores = scores.new_zeros(len(self.max_tokens), scores.shape[-1])
        self.root_scores[rows] = scores

    def row_warp(self, rows: slice) -> WarpParams:
        """The device's sampling parameters of ``rows``, with what warping branches on read from their host copy."""
        host = WarpParams(*(getattr(self.warp_host, name)[rows] for name in ROW_FIELDS))  # its facts computed
        return WarpParams(*(getattr(self.warp_device, name)[rows] for name in ROW_FIELDS),
                          max_top_k=host.max_top_k, nucleus_rows=host.nucleus_rows)

    def greedy(self, rows: slice) -> torch.Tensor:
        """[B] bool on the host."""
        return self.warp_host.temperature[rows] == 0

    def remove_row(self, row: int, last: int) -> None:
        """Swap-remove: row ``last`` takes ``row``'s place."""
        for state in (*(getattr(w, name) for w in (self.warp_host, self.warp_device) for name in ROW_FIELDS),
                      self.max_tokens, self.root_scores):
            if state is not None:
                state[row] = state[last]
