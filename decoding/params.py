"""A request's sampling parameters, validated once, the same way for the pipeline, the server and the engine.

``resolve_sampling`` merges a request's fields onto the configured ones, applies the one set of limits (the field
declarations of ``decoding.config.SamplingParams``, listed in docs/reference.md) and checks the result against the
model. Whatever it returns runs in an engine step without raising; whatever it refuses raises ``RequestError``
naming the field. Torch-free: Ray Data's workers and the server's request path import it without the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from decoding.config import SamplingParams, format_validation_error, quote


class EngineError(ValueError):
    """A request the engine cannot run; it becomes that sequence's error result."""


class RequestError(ValueError):
    """Inputs that cannot become a request; the message names the field and the reason, ``param`` the field
    (OpenAI's error ``param``) where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def resolve_sampling(
    overrides: SamplingParams | Mapping[str, Any] | None,
    defaults: SamplingParams,
    vocab_size: int,
    eos_ids: Collection[int],
    *,
    fan_out: bool = False,
) -> SamplingParams:
    """A request's sampling parameters: ``overrides`` (vLLM's names, older ones included) over the configured
    ``defaults`` field by field, validated, and checked against the model: token ids within its ``vocab_size``
    (``stop_token_ids``, ``logit_bias``, ``allowed_token_ids``), ``logprobs`` and ``prompt_logprobs`` at most the
    vocabulary, some token left to generate (``check_bans``; ``eos_ids`` are the model's), and
    ``n`` 1 unless the caller makes the ``n`` sequences itself (``fan_out``: the server's choices; an engine request
    decodes one). The configured seed is the run's, never a request's (``decoding.verification.sampling``).

    ``overrides`` already a ``SamplingParams`` was merged and validated where it was made (the server and the
    pipeline hand the engine those): only the model checks run again. ``RequestError`` naming the field otherwise.
    """
    params = overrides if isinstance(overrides, SamplingParams) else _merged(overrides, defaults)
    for field, what, tokens in (("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                ("logit_bias", "logit_bias keys", params.logit_bias or ()),
                                ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or ())):
        if any(token >= vocab_size for token in tokens):
            raise RequestError(f"invalid sampling_params: {what} must lie in [0, {vocab_size})", field)
    for field in ("logprobs", "prompt_logprobs"):
        if (top := getattr(params, field)) is not None and top > vocab_size:
            raise RequestError(f"invalid sampling_params: {field} is more than the {vocab_size} tokens", field)
    check_bans(params, vocab_size, eos_ids)
    if params.n != 1 and not fan_out:
        raise RequestError(
            f"invalid sampling_params: n is {params.n}; one request decodes one sequence (the server returns n "
            "choices; a batch job writes one row per input row, so repeat the row for more samples)", "n")
    return params


def check_bans(params: SamplingParams, vocab_size: int, eos_ids: Collection[int],
               bad_words: Sequence[Sequence[int]] = ()) -> None:
    """``RequestError`` naming the fields when the request's bans leave it no token to start its output with: the
    stop tokens ``min_tokens`` bans (EOS and ``stop_token_ids``) and the one-token ``bad_words`` (``bad_words``: their
    token sequences, ``bad_words_token_ids``, where the tokenizer has made them), against ``allowed_token_ids`` or
    the whole vocabulary. Sampling such a row would draw a token the request forbids."""
    bans: dict[str, tuple[set[int], str]] = {}
    if params.min_tokens:
        bans["min_tokens"] = (params.stop_ids(eos_ids), f"EOS and stop_token_ids before {params.min_tokens} tokens")
    if singles := {word[0] for word in bad_words if len(word) == 1}:
        bans["bad_words"] = (singles, "its one-token words, everywhere")
    if not bans:
        return
    banned = set().union(*(tokens for tokens, _ in bans.values()))
    allowed = params.allowed_token_ids
    if (len(set(allowed) - banned) if allowed is not None else vocab_size - len(banned)) > 0:
        return
    fields = " and ".join(bans)
    reasons = "; ".join(f"{field}: {what}" for field, (_, what) in bans.items())
    raise RequestError(f"invalid sampling_params: {fields} would ban every token of "
                       f"{'allowed_token_ids' if allowed is not None else 'the vocabulary'} ({reasons})",
                       # without allowed_token_ids only stop_token_ids can be that many (bad words are 128 at most)
                       "allowed_token_ids" if allowed is not None else "stop_token_ids")


def _merged(overrides: Mapping[str, Any] | None, defaults: SamplingParams) -> SamplingParams:
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise RequestError(f"invalid sampling_params: expected an object, got {type(overrides).__name__}")
    try:
        # Renamed before the merge: an older name must replace a configured value under the current one.
        overrides = SamplingParams.current_names(overrides)
    except ValueError as exc:
        raise RequestError(f"invalid sampling_params: {exc}", "structured_outputs") from None
    try:
        return SamplingParams.model_validate({**defaults.model_dump(exclude={"seed"}), **overrides})
    except ValidationError as exc:
        raise RequestError(f"invalid sampling_params: {format_validation_error(exc)}", _param(exc, overrides)) from None


def _param(exc: ValidationError, overrides: Mapping[str, Any]) -> str | None:
    """The field to blame: a field's own error names it; a check across fields (min_tokens above max_tokens, stop
    without detokenize) names the one the request set, as its message says first."""
    loc = exc.errors()[0]["loc"]
    if loc:
        return str(loc[0])
    message = str(exc)
    named = {name: found.start() for name in overrides if (found := re.search(rf"\b{name}\b", message))}
    return min(named, key=named.__getitem__) if named else None


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """The token sequences ``bad_words`` ban, as vLLM's ``SamplingParams.update_from_tokenizer`` makes them: each word
    (leading whitespace stripped) encoded as it is, and with a leading space where that spells it with as many
    tokens starting differently (the word inside a text rather than at its start). ``encode``: text to token ids
    without special tokens. A word of no token, or of a token past the model's ``vocab_size``, is refused naming
    ``bad_words``. Computed once per request, where its tokenizer is known (the engine's ``prepare``)."""
    found: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = list(encode(prefix + word.lstrip()))
            if not ids:
                if not prefix:
                    raise RequestError(f"invalid sampling_params: bad_words entry {quote(word)} spells no token",
                                       "bad_words")
                continue
            if not prefix or (ids[0] != found[-1][0] and len(ids) == len(found[-1])):
                found.append(ids)
    if any(not 0 <= token < vocab_size for ids in found for token in ids):
        raise RequestError(f"invalid sampling_params: bad_words spell token ids outside [0, {vocab_size})",
                           "bad_words")
    return found
