"""Draft-length policies: how deep to draft this step, and when to stop drafting early.

Every policy sees only draft-side signals and past steps, so verification stays lossless.
- static: always the configured depth.
- heuristic: transformers' schedule per sequence, +2 after a fully accepted step, -1 otherwise.
- online (default): no training. Estimates per-level acceptance from recent steps, takes verify and draft
  costs from a measured calibration (costs.py), and picks the depth (0 = no speculation) with the most expected
  tokens per second (on-the-fly draft-length adaptation, Liu, Park & Shen 2025), depth 0 unless another wins by
  a margin. It probes one level deeper now and then, within a small time budget, so it can come back from 0.
- threshold: SpecDec++ acceptance head; a candidate stops drafting once P(some drafted token is rejected)
  > threshold (that last token is still verified).
- decision: Lu et al.'s early-stop decision model; a candidate stops drafting after the token the model says
  to stop at.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from decoding.config import SpeculativeConfig
from decoding.costs import BatchCosts


@dataclass(frozen=True)
class StepRecord:
    """What a policy learns from one verified step."""

    ids: list[str]
    planned_depth: list[int]  # depth each row was given (after the engine's room limits)
    drafted_depth: list[int]  # deepest valid drafted level of each row
    accepted: list[int]  # accepted drafted tokens of each row


class LengthPolicy:
    needs_hidden_states = False

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def plan(self, ids: list[str]) -> torch.Tensor:
        """Planned depth per row before drafting."""
        return torch.full((len(ids),), self.max_depth, dtype=torch.long)

    def keep(
        self, level: int, depths: torch.Tensor, token_probs: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether each candidate [B, w] keeps its new token at ``level`` (1-based), and whether it drafts on.

        A stop decision only ever ends drafting *after* a token: the token that triggered it is already drafted
        and costs almost nothing to verify, while deciding on it before keeping it would mean a draft forward per
        step whose output is thrown away.
        """
        del hidden
        kept = (level <= depths)[:, None].expand_as(token_probs)
        return kept, kept & (level < depths)[:, None]

    def observe(self, record: StepRecord) -> None:
        del record

    def forget(self, seq_id: str) -> None:
        del seq_id


class HeuristicPolicy(LengthPolicy):
    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.depth: dict[str, int] = {}

    def plan(self, ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.depth.get(i, self.max_depth) for i in ids], dtype=torch.long)

    def observe(self, record: StepRecord) -> None:
        for seq_id, drafted, accepted in zip(record.ids, record.drafted_depth, record.accepted):
            current = self.depth.get(seq_id, self.max_depth)
            grown = current + 2 if drafted > 0 and accepted == drafted else current - 1
            self.depth[seq_id] = min(self.max_depth, max(1, grown))

    def forget(self, seq_id: str) -> None:
        self.depth.pop(seq_id, None)


class OnlinePolicy(LengthPolicy):
    """Pick the depth maximising expected tokens/second from recent acceptance and measured costs."""

    def __init__(
        self,
        max_depth: int,
        tree_size: Callable[[int], int],
        verify_cost: BatchCosts,
        draft_cost: BatchCosts | None,
        draft_tokens: tuple[int, int],
        decay: float = 0.9,
        probe_every: int = 8,
        probe_budget: float = 0.02,
        margin: float = 0.05,
    ) -> None:
        super().__init__(max_depth)
        self.tree_size = tree_size  # depth -> nodes per row
        self.verify_cost = verify_cost  # seconds of the verify forward vs. rows and tokens per row
        self.draft_cost = draft_cost  # the same for one draft forward (None: drafting is ~free)
        self.draft_tokens = draft_tokens  # tokens per row in the first and in later draft forwards
        self.decay = decay
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        # Speculate only for a predicted gain above the cost model's error (calibrated at a short context): a
        # marginal depth is as likely to lose as to win, and plain decoding must never be the faster choice.
        self.margin = margin
        # Per-level pseudo-counts: "reached level j" and "accepted at level j"; prior acceptance 0.5.
        self.reached = torch.ones(max_depth + 1, dtype=torch.float64)
        self.accepted = torch.full((max_depth + 1,), 0.5, dtype=torch.float64)
        self.steps = 0

    def expected_tokens(self, depth: int) -> float:
        """Tokens per step per row: the target's own token plus the expected accepted prefix."""
        rate = (self.accepted / self.reached).clamp(0, 1)
        return 1.0 + float(torch.cumprod(rate[1 : depth + 1], 0).sum())

    def step_seconds(self, depth: int, rows: int) -> float:
        seconds = self.verify_cost(rows, self.tree_size(depth))
        if depth and self.draft_cost is not None:
            first, later = self.draft_tokens
            seconds += self.draft_cost(rows, first) + (depth - 1) * self.draft_cost(rows, later)
        return seconds

    def plan(self, ids: list[str]) -> torch.Tensor:
        self.steps += 1
        rows = len(ids)
        speed = [self.expected_tokens(d) / max(self.step_seconds(d, rows), 1e-9) for d in range(self.max_depth + 1)]
        best = max(range(self.max_depth + 1), key=speed.__getitem__)
        if speed[best] < (1 + self.margin) * speed[0]:
            best = 0
        if best < self.max_depth:
            # Probe one level deeper now and then to keep its acceptance estimate fresh (and to come back from
            # depth 0), but rarely enough that probing costs at most ``probe_budget`` of the time.
            extra = self.step_seconds(best + 1, rows) / max(self.step_seconds(best, rows), 1e-9) - 1
            if self.steps % max(self.probe_every, math.ceil(extra / self.probe_budget)) == 0:
                best += 1
        return torch.full((rows,), best, dtype=torch.long)

    def observe(self, record: StepRecord) -> None:
        reached = torch.zeros_like(self.reached)
        accepted = torch.zeros_like(self.accepted)
        # A level planned but not drafted (an n-gram lookup with no or a short match) counts as a rejection:
        # the batch's verify forward is as wide as its deepest row, so that row paid for it and gained nothing.
        for depth, taken in zip(record.planned_depth, record.accepted):
            reached[1 : min(taken + 1, depth) + 1] += 1
            accepted[1 : taken + 1] += 1
        seen = reached > 0
        self.reached[seen] = self.reached[seen] * self.decay + reached[seen]
        self.accepted[seen] = self.accepted[seen] * self.decay + accepted[seen]


class DraftSignalMLP(nn.Module):
    """A small residual MLP on draft-side signals: the draft's hidden state, q(x), log q(x) and the level.

    Used as the SpecDec++ acceptance head (predicts P(token accepted)) and as Lu et al.'s decision model
    (predicts P(keep drafting)); train-head and train-decision produce its weights.
    """

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.inp = nn.Sequential(nn.LayerNorm(hidden_size + 3), nn.Linear(hidden_size + 3, width))
        self.block = nn.Sequential(nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.out = nn.Linear(width, 1)

    @staticmethod
    def features(hidden: torch.Tensor, token_probs: torch.Tensor, level: int) -> torch.Tensor:
        extra = torch.stack(
            [token_probs, token_probs.clamp_min(1e-9).log(), torch.full_like(token_probs, level / 8.0)], -1
        )
        return torch.cat([hidden.float(), extra], -1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logit of the predicted probability."""
        h = self.inp(features)
        return self.out(h + self.block(h)).squeeze(-1)

    def save(self, directory: str | Path, metadata: dict | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), directory / "head.pt")
        meta = {"hidden_size": self.hidden_size, "width": self.block[1].in_features, **(metadata or {})}
        (directory / "head.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> DraftSignalMLP:
        directory = Path(directory)
        if not (directory / "head.pt").exists():
            raise FileNotFoundError(f"no trained head at {directory} (expected head.pt and head.json)")
        meta = json.loads((directory / "head.json").read_text())
        head = cls(meta["hidden_size"], meta["width"])
        head.load_state_dict(torch.load(directory / "head.pt", map_location="cpu"))
        return head.eval()


class _HeadPolicy(LengthPolicy):
    needs_hidden_states = True

    def __init__(self, max_depth: int, head: DraftSignalMLP) -> None:
        super().__init__(max_depth)
        self.head = head

    @torch.no_grad()
    def predict(self, level: int, token_probs: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("trained length policies need the draft's hidden states")
        return torch.sigmoid(self.head(DraftSignalMLP.features(hidden, token_probs, level)))


class ThresholdPolicy(_HeadPolicy):
    """SpecDec++: a candidate drafts on while P(all its drafted tokens are accepted) >= 1 - threshold."""

    def __init__(self, max_depth: int, head: DraftSignalMLP, threshold: float) -> None:
        super().__init__(max_depth, head)
        self.threshold = threshold
        self.all_accepted: torch.Tensor | None = None

    def keep(self, level, depths, token_probs, hidden):
        accept = self.predict(level, token_probs, hidden)
        if level == 1 or self.all_accepted is None:
            self.all_accepted = torch.ones_like(accept)
        self.all_accepted = self.all_accepted * accept
        kept, deeper = super().keep(level, depths, token_probs, hidden)
        return kept, deeper & (1 - self.all_accepted <= self.threshold)


class DecisionPolicy(_HeadPolicy):
    """Lu et al.: a learned stop/continue decision after each drafted token."""

    def keep(self, level, depths, token_probs, hidden):
        kept, deeper = super().keep(level, depths, token_probs, hidden)
        return kept, deeper & (self.predict(level, token_probs, hidden) >= 0.5)


def make_policy(
    config: SpeculativeConfig,
    tree_size: Callable[[int], int],
    costs: Callable[[], tuple[BatchCosts, BatchCosts | None]],
    draft_tokens: tuple[int, int],
) -> LengthPolicy:
    """The configured policy; ``costs`` (verify, draft) is only measured when the online policy needs it."""
    depth = config.num_speculative_tokens if config.method != "none" else 0
    if config.length_policy == "static" or depth == 0:
        return LengthPolicy(depth)
    if config.length_policy == "heuristic":
        return HeuristicPolicy(depth)
    if config.length_policy == "online":
        return OnlinePolicy(depth, tree_size, *costs(), draft_tokens)
    if config.length_policy == "threshold":
        return ThresholdPolicy(depth, DraftSignalMLP.load(config.acceptance_head), config.stop_threshold)
    return DecisionPolicy(depth, DraftSignalMLP.load(config.decision_model))
