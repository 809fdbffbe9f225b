"""One model's forwards over its pool: the target's, or a draft's.

A runner runs its model as the pool's execution says (``execution.py``, resolved once at build), owns the CUDA
graphs its step forwards replay (``cuda_graphs.py``) and the clock its phases are timed with (``timing.py``), and
decides, here only, which forwards replay: a prefill never (prompt lengths vary); a verification (a decode is one of
a one-node tree) or a draft level where the model's step shapes are captured and the execution replays graphs. A
replaying verification carries whole trees (only those are captured).

A runner given the engine's adapter slots (``lora``: the target's, a self-draft's) adds each row's adapter to its
forwards, as its pool's ``row_adapters`` say; a forward whose rows are all the base's runs exactly as without.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from decoding.model.cuda_graphs import GraphedForward, build_shapes, pool_key
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import PagedKVCache, Rows
from decoding.model.lean_forward import LeanCausalLM
from decoding.model.lora import LoraSlots, adapted
from decoding.model.timing import PhaseClock


class ModelRunner:
    """``model``'s forwards over ``cache``; ``captured``: its step shapes are captured (the target's, a self-draft's
    levels; not a separate draft's, whose catch-up prefix varies its shapes)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, captured: bool,
                 lora: LoraSlots | None = None) -> None:
        self.model, self.cache, self.execution = model, cache, cache.execution
        self.clock = PhaseClock(cache.device)  # what the length policy learns the phases cost, timed on the device
        # The one place that decides whether step forwards replay graphs: a replaying runner owns them.
        replays = captured and self.execution.graphs and isinstance(model, LeanCausalLM)
        self.graphs = GraphedForward(
            functools.partial(model.flat_forward, execution=self.execution), cache.max_positions_per_row,
            key_buckets=self.execution.kernels != "triton",  # the fused kernels read sequence lengths on the device
        ) if replays else None
        self.lora = lora

    @property
    def lora(self) -> LoraSlots | None:
        """The adapter slots its forwards apply (its graphs' too); None: the base model only."""
        return self._lora

    @lora.setter
    def lora(self, slots: LoraSlots | None) -> None:
        self._lora = slots
        if self.graphs is not None:
            self.graphs.adapters = slots.resident if slots is not None else None

    @property
    def replays(self) -> bool:
        """Whether its step forwards replay captured graphs (and a verification carries whole trees)."""
        return self.graphs is not None

    def capture(self, tokens_per_row: list[int], hidden: bool, budget: int, memory: Callable[[], int]) -> int:
        """Capture the step forwards of ``tokens_per_row`` tokens per row, every row and key bucket, within
        ``budget`` bytes of ``memory()``'s growth (``GraphedForward.capture``); returns how many were captured."""
        assert self.graphs is not None, "only a replaying runner captures"
        cache = self.cache
        shapes = build_shapes(pool_key(cache.keys), cache.max_rows, cache.max_positions_per_row, tokens_per_row,
                              hidden, self.graphs.key_buckets, adapters=self.lora is not None)
        return self.graphs.capture(shapes, cache.keys, cache.values, budget, memory)

    def token_slots(self, rows: Rows, tokens_per_row: int) -> torch.Tensor | None:
        """Each token's adapter slot (on the host) in a forward of ``tokens_per_row`` tokens for each of ``rows``;
        None where no row has an adapter."""
        if self.lora is None:
            return None
        slots = self.cache.row_adapters[rows]
        return slots.repeat_interleave(tokens_per_row) if bool(slots.any()) else None

    def prefill(self, rows: Rows, input_ids: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor,
                **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward over prompts (``forward_tree``'s arguments), eager."""
        return self._forward(rows, input_ids, ancestors, valid, None, options)

    def verify(self, rows: Rows, input_ids: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor,
               **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward over a tree (a decode: a one-node tree), replayed where captured (with its rows'
        adapters where any has one)."""
        return self._forward(rows, input_ids, ancestors, valid, self.graphs, options)

    def _forward(self, rows: Rows, input_ids: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor,
                 replay: GraphedForward | None, options: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        slots = self.token_slots(rows, input_ids.shape[1])
        if slots is None:
            return forward_tree(self.model, self.cache, rows, input_ids, ancestors, valid, replay=replay, **options)
        lora = self.lora.batch(slots)
        if isinstance(self.model, LeanCausalLM):
            return forward_tree(self.model, self.cache, rows, input_ids, ancestors, valid, replay=replay, lora=lora,
                                adapter_slots=slots.to(input_ids.device, non_blocking=True) if replay else None,
                                **options)
        with adapted(self.model, lora):  # transformers' forward: the deltas added by hooks on its projections
            return forward_tree(self.model, self.cache, rows, input_ids, ancestors, valid, **options)

    # A draft's forward over one level of its chains (after its catch-up prefix): the same step forward.
    draft_level = verify
