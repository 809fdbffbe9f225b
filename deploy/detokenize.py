"""Incremental detokenization for streaming: deltas that concatenate to exactly the engine's final text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from decoding.engine.text import IncrementalDecoder


class IncrementalText:
    """One sequence's text as its tokens arrive, each token decoded once (``decoding.engine.text``).

    ``push`` returns the new text that is safe to send: it holds back a trailing partial character and any
    suffix that could be the start of a stop string (the engine cuts the final text before a stop string, so
    sending those characters early would make the stream disagree with the non-streamed text).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], skip_special_tokens: bool = True,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        """``stop_ids``: tokens that end the sequence without being part of its text (the engine's rule)."""
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._stop = stop
        self._stop_ids = stop_ids
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        if token_ids and token_ids[-1] in self._stop_ids:  # the sequence's last token: its text is not shown
            token_ids = token_ids[:-1]
        self._decoder.push(token_ids)
        text = self._decoder.text
        return self._advance(text[: len(text) - self._stop_prefix_length(text)])

    def finish(self, final_text: str) -> str:
        """The rest of the sequence, given the engine's final (stop-truncated) text."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        # Decoding more tokens can rewrite the tail (e.g. a space cleaned up): wait until it is stable again.
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
