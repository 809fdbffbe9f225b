"""The acceptance metrics, defined once, in vLLM's vocabulary (``spec_decode`` in docs/reference.md).

Every place that reports speculation (engine results, output rows, ``summary.json``, the report, the server's
``metrics``, Prometheus, the benchmark, eval_draft) builds a ``SpecDecodeStats`` and reads its fields, so the
definitions cannot drift apart:

- ``num_spec_steps``: verification steps that drafted at least one token (vLLM's ``num_drafts``);
- ``mean_acceptance_length``: 1 + accepted / num_spec_steps (vLLM's; 1.0 when nothing was drafted);
- ``tokens_per_forward``: generated tokens / all target forwards, prefill included;
- ``acceptance_histogram``: spec steps by accepted count (sums to num_spec_steps);
- ``accepted_per_pos``: spec steps whose accepted run reached each draft position (vLLM's
  ``num_accepted_tokens_per_pos``);
- ``num_grammar_forced_tokens``: accepted draft tokens that a constraint (structured outputs) allowed alone, so
  that the target's masked law gave them probability 1; ``grammar_forced_share`` over the generated tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class _Result(Protocol):
    token_ids: list[int]
    per_step_drafted: list[int]
    per_step_accepted: list[int]
    num_target_forwards: int
    acceptance_histogram: list[int]
    num_grammar_forced_tokens: int


def acceptance_histogram(
    per_step_drafted: Sequence[int], per_step_accepted: Sequence[int], max_depth: int
) -> list[int]:
    """Spec steps (those that drafted) by accepted count, ``max_depth + 1`` bins."""
    counts = [0] * (max_depth + 1)
    for drafted, accepted in zip(per_step_drafted, per_step_accepted, strict=True):
        if drafted:
            counts[accepted] += 1
    return counts


def target_forwards(verification_steps: int, generations: int) -> int:
    """Target forwards: each generation's prefill, then one per verification step (one per_step entry each)."""
    return generations + verification_steps


def _forwards(per_step_drafted: Sequence[int], generated: int) -> int:
    return target_forwards(len(per_step_drafted), 1) if generated else 0


def _add(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return tuple(x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer))


@dataclass(frozen=True)
class SpecDecodeStats:
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_generated_tokens: int = 0
    num_target_forwards: int = 0
    acceptance_histogram: tuple[int, ...] = ()
    num_grammar_forced_tokens: int = 0

    @classmethod
    def of(cls, result: _Result) -> SpecDecodeStats:
        """One generation's statistics (an engine ``GenerationResult``)."""
        return cls.from_steps(
            result.per_step_drafted, result.per_step_accepted, len(result.token_ids), result.num_target_forwards,
            len(result.acceptance_histogram) - 1, result.num_grammar_forced_tokens,
        )

    @classmethod
    def from_steps(
        cls, per_step_drafted: Sequence[int], per_step_accepted: Sequence[int], generated: int,
        target_forwards: int | None = None, max_depth: int | None = None, grammar_forced: int = 0,
    ) -> SpecDecodeStats:
        """From per-step counts. ``target_forwards`` defaults to the prefill plus one per verification step (an
        output row's ``per_step_drafted`` has one entry per step); ``max_depth`` to the deepest accepted run."""
        if target_forwards is None:
            target_forwards = _forwards(per_step_drafted, generated)
        if max_depth is None:
            max_depth = max(per_step_accepted, default=0)
        return cls(
            num_spec_steps=sum(1 for d in per_step_drafted if d),
            num_draft_tokens=sum(per_step_drafted),
            num_accepted_draft_tokens=sum(per_step_accepted),
            num_generated_tokens=generated,
            num_target_forwards=target_forwards,
            acceptance_histogram=tuple(acceptance_histogram(per_step_drafted, per_step_accepted, max(max_depth, 0))),
            num_grammar_forced_tokens=grammar_forced,
        )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SpecDecodeStats:
        """From an output row (``num_generated_tokens``, ``per_step_drafted``, ``spec_decode``)."""
        struct, generated = row["spec_decode"] or {}, row["num_generated_tokens"] or 0
        return cls(
            num_spec_steps=struct.get("num_spec_steps") or 0,
            num_draft_tokens=struct.get("num_draft_tokens") or 0,
            num_accepted_draft_tokens=struct.get("num_accepted_draft_tokens") or 0,
            num_generated_tokens=generated,
            num_target_forwards=_forwards(row["per_step_drafted"] or [], generated),
            acceptance_histogram=tuple(struct.get("acceptance_histogram") or ()),
            num_grammar_forced_tokens=struct.get("num_grammar_forced_tokens") or 0,
        )

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_spec_steps + other.num_spec_steps,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_draft_tokens + other.num_accepted_draft_tokens,
            self.num_generated_tokens + other.num_generated_tokens,
            self.num_target_forwards + other.num_target_forwards,
            _add(self.acceptance_histogram, other.acceptance_histogram),
            self.num_grammar_forced_tokens + other.num_grammar_forced_tokens,
        )

    @classmethod
    def total(cls, parts: Iterable[SpecDecodeStats]) -> SpecDecodeStats:
        return sum(parts, cls())

    @property
    def mean_acceptance_length(self) -> float:
        if self.num_spec_steps:
            return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps
        return 1.0 if self.num_generated_tokens else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def grammar_forced_share(self) -> float:
        return self.num_grammar_forced_tokens / self.num_generated_tokens if self.num_generated_tokens else 0.0

    @property
    def accepted_per_pos(self) -> list[int]:
        """Spec steps that accepted at least ``i + 1`` draft tokens, for each position i."""
        histogram = self.acceptance_histogram
        return [sum(histogram[i + 1 :]) for i in range(max(len(histogram) - 1, 0))]

    def struct(self) -> dict[str, Any]:
        """The ``spec_decode`` struct of an output row (and the server's ``metrics.speculative_decoding``)."""
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_forward": self.tokens_per_forward,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_grammar_forced_tokens": self.num_grammar_forced_tokens,
        }


# ------------------------------------------------------------------------------------------------ Prometheus
# vLLM's spec-decode counters (``vllm/v1/spec_decode/metrics.py``), fed with each finished generation. The adapters
# choose the backend (Ray's metrics export from actors and replicas): this module stays free of Ray.
