"""The engine's Prometheus counters in vLLM's vocabulary, exported through Ray's metrics by both adapters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from decoding.stats import SpecDecodeStats

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
COUNTERS: dict[str, str] = {
    "spec_decode_num_drafts": "Verification steps that drafted at least one token.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    PER_POSITION: "Steps whose accepted draft tokens reached each position.",
}


class CounterLike(Protocol):
    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...


class SpecDecodeCounters:
    """The Prometheus counters of one engine (vLLM names, labels ``model_name`` and, per position, ``position``),
    plus the totals they were given, so that what was exported can be checked against the responses."""

    def __init__(self, make_counter: Callable[[str, str, tuple[str, ...]], CounterLike], model_name: str) -> None:
        self.tags = {"model_name": model_name}
        self.counters = {
            name: make_counter(name, description, ("model_name", "position") if name == PER_POSITION
                               else ("model_name",))
            for name, description in COUNTERS.items()
        }
        self.totals = SpecDecodeStats()

    def record(self, stats: SpecDecodeStats) -> None:
        self.totals += stats
        for name, value in (
            ("spec_decode_num_drafts", stats.num_spec_steps),
            ("spec_decode_num_draft_tokens", stats.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", stats.num_accepted_draft_tokens),
        ):
            if value:  # Ray's counters take positive increments only
                self.counters[name].inc(value, self.tags)
        for position, value in enumerate(stats.accepted_per_pos):
            if value:
                self.counters[PER_POSITION].inc(value, {**self.tags, "position": str(position)})
