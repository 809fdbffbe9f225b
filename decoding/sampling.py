"""Logit warping shared by target and draft: temperature, then top-k, then top-p (transformers' order).

Both sides must use the identical warp: speculative sampling is lossless with respect to the *warped* target law.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.config import SamplingParams


@dataclass(frozen=True)
class WarpParams:
    """Per-row sampling parameters as tensors, so a ragged batch warps in one call."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> WarpParams:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        )

    def __getitem__(self, rows: torch.Tensor | slice) -> WarpParams:
        return WarpParams(self.temperature[rows], self.top_k[rows], self.top_p[rows])


def warp_probs(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """Warped float32 probabilities for logits [B, ..., V] with per-row params; greedy rows get temperature 1."""
    shape = logits.shape
    flat = logits.float().reshape(shape[0], -1, shape[-1])
    temperature = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    flat = flat / temperature[:, None, None]
    top_k = params.top_k.clamp(max=shape[-1])
    if bool((top_k > 0).any()):
        kth = torch.topk(flat, int(top_k.max()), dim=-1).values  # [B, N, kmax], descending
        index = (top_k.clamp(min=1) - 1)[:, None, None].expand(-1, flat.shape[1], 1)
        threshold = kth.gather(-1, index)
        threshold = torch.where((top_k > 0)[:, None, None], threshold, torch.full_like(threshold, -torch.inf))
        flat = flat.masked_fill(flat < threshold, -torch.inf)
    nucleus_rows = (params.top_p < 1).nonzero().flatten()
    if len(nucleus_rows):
        sub = flat[nucleus_rows]
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays in).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p[nucleus_rows][:, None, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        flat[nucleus_rows] = sub.masked_fill(drop, -torch.inf)
    return flat.softmax(-1).reshape(shape)


def draw(law: torch.Tensor, num: int, replacement: bool, generator: torch.Generator | None) -> torch.Tensor:
    """``num`` tokens from one law [V]; without replacement they are distinct while the support allows.

    Past the support, the first token repeats: verification skips a repeat of a rejected token (its
    proposal mass is 0), so the padding changes nothing but wasted width.
    """
    if replacement:
        return torch.multinomial(law, num, replacement=True, generator=generator)
    support = int((law > 0).sum())
    drawn = torch.multinomial(law, min(num, support), replacement=False, generator=generator)
    return torch.cat([drawn, drawn[:1].expand(num - len(drawn))])
