"""One model's forwards over its pool: the target's, or a draft's.

A runner runs its model as the pool's execution says (``execution.py``, resolved once at build) and decides, here
only, which of its forwards replay CUDA graphs captured at build (``cuda_graphs.py``): a prefill never (prompt
lengths vary); a step forward (a decode, a verification, a draft level) where the model's step shapes were
captured and the execution replays graphs. A replaying verification carries whole trees (only those are captured).
"""

from __future__ import annotations

from typing import Any

import torch

from decoding.model.forward import forward_tree
from decoding.model.kv_cache import PagedKVCache, Rows
from decoding.model.lean_forward import LeanCausalLM


class ModelRunner:
    """``model``'s forwards over ``cache``; ``captured``: its step shapes are captured at build (the target's, a
    self-draft's levels; not a separate draft's, whose catch-up prefix varies its shapes)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, captured: bool) -> None:
        self.model, self.cache, self.captured = model, cache, captured

    @property
    def replays(self) -> bool:
        """Whether its step forwards replay graphs: the one place that decides it."""
        return self.captured and self.cache.execution.graphs and isinstance(self.model, LeanCausalLM)

    def prefill(self, rows: Rows, input_ids: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor,
                **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward over prompts (``forward_tree``'s arguments), eager."""
        return forward_tree(self.model, self.cache, rows, input_ids, ancestors, valid, **options)

    def step(self, rows: Rows, input_ids: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor,
             **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode, verification or draft-level forward (``forward_tree``'s arguments), replayed where it can."""
        return forward_tree(self.model, self.cache, rows, input_ids, ancestors, valid, graphs=self.replays,
                            **options)
