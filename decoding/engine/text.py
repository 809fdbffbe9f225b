"""A sequence's text as its tokens arrive, each token decoded once (tokenizers' ``DecodeStream``).

Re-decoding the whole generation after every step costs O(length) per step, O(length^2) per sequence; stop
strings (engine) and streamed deltas (server) only need what the new tokens add.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# What a byte-level tokenizer decodes a character's incomplete UTF-8 bytes to.
PARTIAL_CHAR = "\ufffd"


class IncrementalDecoder:
    """``push`` token ids, read ``text``: the decoded text so far, without a trailing incomplete character.

    A fast tokenizer decodes through ``DecodeStream``; another (a slow tokenizer, a test double with only
    ``decode``) falls back to decoding all ids and keeping the stable prefix, which is correct but quadratic.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the text they added (possibly empty while a character is incomplete)."""
        before = len(self.text)
        if self._stream is not None:
            for token_id in token_ids:
                self.text += self._stream.step(self._backend, token_id) or ""
        else:
            self._ids.extend(token_ids)
            decoded = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
            self.text = decoded.rstrip(PARTIAL_CHAR)
        return self.text[before:]
