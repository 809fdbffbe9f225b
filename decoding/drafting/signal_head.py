"""The small MLP that the threshold and decision length policies run on draft-side signals."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


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
