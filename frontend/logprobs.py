"""Log-probabilities in vLLM's shape, for the pipeline's rows and the server's responses alike.

The engine's entries (``GenerationResult.logprobs`` / ``prompt_logprobs``) are per position
``{token_id, logprob, rank, top_logprobs: [{token_id, logprob, rank}]}`` or None; vLLM's are per position
``{token_id: {logprob, rank, decoded_token}}``, the chosen token first, then its top alternatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

PositionLogprobs = dict[int, dict[str, Any]]


def vllm_logprobs(entries: Sequence[dict[str, Any] | None] | None, decode: Callable[[list[int]], list[str]] | None
                  ) -> list[PositionLogprobs | None] | None:
    """``entries`` in vLLM's shape; ``decode`` turns token ids into their texts, one each (None: no texts)."""
    if entries is None:
        return None
    positions: list[PositionLogprobs | None] = []
    for entry in entries:
        if entry is None:
            positions.append(None)
            continue
        ranked = [entry, *(alt for alt in entry.get("top_logprobs", ()) if alt["token_id"] != entry["token_id"])]
        texts = decode([item["token_id"] for item in ranked]) if decode is not None else [None] * len(ranked)
        positions.append({item["token_id"]: {"logprob": item["logprob"], "rank": item.get("rank"),
                                             "decoded_token": text} for item, text in zip(ranked, texts, strict=True)})
    return positions
