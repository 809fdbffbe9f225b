"""Requests, results, and one sequence's life in the engine: what it generated and when it must stop."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.chat_templates import supports_tools
from decoding.config import SamplingParams
from decoding.drafting.drafters import RowDraftState
from decoding.drafting.length_policies import RowMemory
from decoding.engine.text import IncrementalDecoder
from decoding.params import EngineError
from decoding.stats import SpecDecodeStats, acceptance_histogram
from decoding.verification.sampling import NO_TOKEN

if TYPE_CHECKING:  # xgrammar loads when a constraint appears
    from decoding.constraints.grammar import RowGrammar
    from decoding.model.kv_cache import Claim


def nothing_left(params: SamplingParams) -> str:
    """Why a row ends where its law has nothing left (NO_TOKEN): its constraint's dead end, or its bans with it."""
    if params.structured_outputs is not None and not params.bans_tokens:
        return (f"structured_outputs.{params.structured_outputs.kind} reached a point that no token of this model's "
                "vocabulary continues")
    return ("no token is left to generate: allowed_token_ids, bad_words, min_tokens and structured_outputs together "
            "ban every token here")


@dataclass
class Request:
    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | dict[str, Any] | None = None
    seed_key: str | None = None  # what the row's random stream derives from with the run seed; default: id
    # How ``messages`` render (vLLM's chat request fields): a template instead of the tokenizer's, extra variables
    # for the template (e.g. ``enable_thinking``), and whether to open the assistant's turn or continue the last one.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's function tools (``{"type": "function", "function": {...}}``), given to the chat template.
    tools: list[dict[str, Any]] | None = None
    # Requests of one group (the n choices of one HTTP request) share one turn in fair admission; default: its id.
    group: str | None = None
    # vLLM's input options: whether a text prompt is tokenized with the tokenizer's special tokens (None: yes for
    # ``prompt``, no for ``messages``, whose template adds them); keep only the prompt's last k tokens (-1: as many
    # as the context holds); a salt that separates its cached prefix blocks from those of other salts.
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    # The LoRA adapter it runs under (a name of ``lora.modules``, or one under ``dynamic_lora_loading_path``); None:
    # the base model.
    lora: str | None = None


@dataclass
class GenerationResult:
    id: str
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | error
    error: str | None
    time_taken: float
    token_accepted: list[bool]
    per_step_drafted: list[int]
    per_step_accepted: list[int]
    num_target_forwards: int
    acceptance_histogram: list[int]
    # One tuple per drafted candidate token: (step, depth, candidate, token_id, draft_prob, target_prob, accepted)
    token_stats: list[tuple[int, int, int, int, float, float, bool]] = field(default_factory=list)
    # With sampling_params.logprobs: per generated token, its entry {token_id, logprob, rank, top_logprobs: [{token_id,
    # logprob, rank}]} under the target's raw law.
    logprobs: list[dict[str, Any]] | None = None
    # With sampling_params.prompt_logprobs: per prompt token, the same entry given the tokens before it (the first
    # None: nothing precedes it).
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # Accepted draft tokens that were the only token the row's constraint allowed (structured outputs).
    num_grammar_forced_tokens: int = 0
    # Prompt tokens whose keys and values came from the prefix cache (vLLM's RequestOutput.num_cached_tokens).
    num_cached_tokens: int = 0
    # vLLM's stop_reason: the stop string, or the stop_token_ids entry, that ended it (None: EOS, length, error).
    stop_reason: int | str | None = None
    lora: str | None = None  # the adapter that produced it (None: the base model)

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats.of(self)

    @property
    def spec_decode(self) -> dict[str, Any]:
        return self.stats.struct()


@dataclass
class StepOutput:
    finished: list[GenerationResult]
    new_tokens: dict[str, list[int]]  # tokens each running sequence emitted this step (for streaming)
    # For per-step metrics: this step's speculation over its rows (each row that drafted is one spec step; tokens
    # and target forwards count prefills too), and the batch after the step.
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # Engine.kv_cache_usage
    # Prompt tokens of the rows that joined this step, and those found in the prefix cache (vLLM's counters).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # With sampling_params.logprobs: the entries of ``new_tokens`` (for streaming them).
    new_logprobs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # For vLLM's request intervals (queue, prefill, decode): the requests that joined the batch this step (vLLM's
    # SCHEDULED event) with their max_tokens, when the step began (a time.perf_counter() reading), and the engine's
    # context (vLLM's max_model_len: where the request-size histograms' buckets end).
    scheduled: dict[str, int] = field(default_factory=dict)
    started: float = 0.0
    max_context: int = 0
    # With LoRA adapters (``max_lora`` device slots, 0: none): the adapters of the running and of the waiting rows
    # after the step (vLLM's lora_requests_info).
    max_lora: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


@dataclass
class Sequence:
    """A request in the engine: its prompt, parameters, random stream and everything generated so far."""

    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    started: float
    generated: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    token_stats: list[tuple] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # filled by its prefill, where asked for
    bad_words: list[list[int]] = field(default_factory=list)  # its bad words' token sequences (params.bad_words)
    forwards: int = 0
    finish_reason: str | None = None
    stop_text: str | None = None
    stop_reason: int | str | None = None  # ``GenerationResult.stop_reason``
    stop_ids: set[int] = field(default_factory=set)  # EOS unless ignore_eos, and stop_token_ids
    text: IncrementalDecoder | None = None  # the generation's text so far, kept only to match stop strings
    # A constrained row's grammar, at the committed tokens before the pending one (decoding.constraints.constrained).
    grammar: RowGrammar | None = None
    grammar_committed: int = 0  # generated tokens the grammar has consumed
    grammar_forced: int = 0  # accepted draft tokens the grammar allowed alone
    error: str | None = None  # why a row ended with finish_reason "error" after it started generating
    group: str = ""  # its request's admission group (Request.group, else its id)
    claims: list[Claim] = field(default_factory=list)  # KV blocks admission claimed, a claim per pool, until it joins
    cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache
    cache_salt: str = ""  # ``Request.cache_salt``: its prefix blocks are shared only with rows of the same salt
    lora: str | None = None  # ``Request.lora``
    lora_key: str | None = None  # its adapter's key (``decoding.model.lora.Adapters``), part of ``cache_salt``
    lora_slot: int = 0  # the device slot its adapter holds while it runs (0: the base)
    policy_memory: RowMemory = field(default_factory=RowMemory)  # what the length policy learned of it
    draft_state: RowDraftState = field(default_factory=RowDraftState)  # what the drafter keeps of it

    @property
    def context(self) -> list[int]:
        """Committed tokens whose KV is cached: everything but the pending (last) token."""
        return self.prompt_ids + self.generated[:-1]


    def emit(self, tokens: list[int], accepted: list[bool], max_context: int,
             tokenizer: PreTrainedTokenizerBase) -> int:
        """Append ``tokens`` up to a stop condition (a stop token, max_tokens, the context, a stop string);
        returns how many were kept."""
        before = len(self.generated)
        for token, flag in zip(tokens, accepted):
            if token == NO_TOKEN:
                self.finish_reason, self.error = "error", nothing_left(self.params)
                break
            self.generated.append(token)
            self.accepted.append(flag)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                self.stop_reason = token if token in (self.params.stop_token_ids or ()) else None
                break
            if len(self.generated) >= self.params.max_tokens or (
                len(self.prompt_ids) + len(self.generated) >= max_context
            ):
                self.finish_reason = "length"
                break
        if self.params.stop:
            self._apply_stop_strings(before, tokenizer)
        if len(self.generated) < before:
            raise AssertionError("stop handling removed committed tokens")
        return len(self.generated) - before

    def _apply_stop_strings(self, before: int, tokenizer: PreTrainedTokenizerBase) -> None:
        """Cut after the first token whose text completes a stop string; the text ends before the stop string (after
        it with ``include_stop_str_in_output``: vLLM's). Of stop strings found at once, the first to start wins.

        Incremental: each token is decoded once, and only text that the new token could complete is searched (a
        stop string found now must end in the token's text, else an earlier token would have ended the sequence).
        """
        if self.text is None:
            self.text = IncrementalDecoder(tokenizer)
        stops = self.params.stop
        longest = max(len(stop) for stop in stops)
        for end in range(before, len(self.generated)):
            start = max(0, len(self.text.text) - longest + 1)
            self.text.push([self.generated[end]])
            hits = [(at, at + len(stop)) for stop in stops if (at := self.text.text.find(stop, start)) >= 0]
            if hits:
                del self.generated[end + 1 :], self.accepted[end + 1 :]
                at, after = min(hits, key=lambda hit: hit[0])
                self.stop_text = self.text.text[: after if self.params.include_stop_str_in_output else at]
                self.stop_reason = self.text.text[at:after]
                self.finish_reason = "stop"
                return

    def result(self, tokenizer: PreTrainedTokenizerBase, max_depth: int) -> GenerationResult:
        text = self.stop_text
        if not self.params.detokenize:
            text = ""
        elif text is None:
            # vLLM's rule: the token that stopped the sequence (EOS, stop_token_ids) is not part of its text unless
            # include_stop_str_in_output (it shows only where special tokens are kept).
            ended_by_token = self.finish_reason == "stop" and self.generated and self.generated[-1] in self.stop_ids
            shown = self.generated[:-1] if ended_by_token and not self.params.include_stop_str_in_output else (
                self.generated)
            text = tokenizer.decode(shown, skip_special_tokens=self.params.skip_special_tokens)
        return GenerationResult(
            id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids, token_ids=self.generated,
            text=text, finish_reason=self.finish_reason or "length", error=self.error,
            time_taken=time.perf_counter() - self.started, token_accepted=self.accepted,
            per_step_drafted=self.per_step_drafted, per_step_accepted=self.per_step_accepted,
            num_target_forwards=self.forwards,
            acceptance_histogram=acceptance_histogram(self.per_step_drafted, self.per_step_accepted, max_depth),
            token_stats=self.token_stats,
            logprobs=self.logprobs[: len(self.generated)] if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            num_grammar_forced_tokens=self.grammar_forced,
            num_cached_tokens=self.cached_tokens,
            stop_reason=self.stop_reason,
            lora=self.lora,
        )


def error_result(request_id: str, prompt: Any, message: str, started: float, max_depth: int) -> GenerationResult:
    """The result of a request that generated nothing, the one shape of an error row whichever adapter makes it
    (the engine, the pipeline actor): ``prompt`` as given when it is text (else empty), every list empty but the
    acceptance histogram, which has the engine's ``max_depth + 1`` bins like every other result, and the seconds
    since ``started`` (a ``time.perf_counter`` reading)."""
    return GenerationResult(
        id=request_id, prompt=prompt if isinstance(prompt, str) else "", prompt_token_ids=[], token_ids=[], text="",
        finish_reason="error", error=message, time_taken=time.perf_counter() - started, token_accepted=[],
        per_step_drafted=[], per_step_accepted=[], num_target_forwards=0,
        acceptance_histogram=acceptance_histogram([], [], max_depth),
    )


# A request ready to join the batch, or the error result it already is.
Prepared = Sequence | GenerationResult


class Contexts(SequenceABC[list[int]]):
    """Each row's committed tokens, built only for a drafter that reads them (n-gram lookup)."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, row):  # type: ignore[override]
        if isinstance(row, slice):
            return [seq.context for seq in self._seqs[row]]
        return self._seqs[row].context

    def tail(self, row: int, start: int) -> tuple[int, list[int]]:
        """(row's context length, its context from ``start`` on), without building the whole context."""
        seq = self._seqs[row]
        prompt, generated = seq.prompt_ids, seq.generated
        length = len(prompt) + len(generated) - 1
        if start < len(prompt):
            return length, prompt[start:] + generated[:-1]
        return length, generated[start - len(prompt) : -1]


def input_bytes(request: Request) -> int:
    """UTF-8 bytes of a request's text: its prompt, or its messages' contents (given token ids: 0)."""
    if request.prompt_token_ids is not None:
        return 0
    if isinstance(request.messages, list):
        texts = [m.get("content") for m in request.messages if isinstance(m, dict)]
    else:
        texts = [request.prompt]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound of the UTF-8 bytes one token spells: its longest vocabulary entry's (a byte-level vocabulary
    writes a byte as one or two characters, so this may count up to twice the bytes; never fewer)."""
    return max(len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab())


def encode_request(tokenizer: PreTrainedTokenizerBase, request: Request) -> tuple[str, list[int]]:
    """Prompt text and token ids (docs/reference.md, "Input"): ``prompt`` exactly as ``tokenizer(prompt)`` does,
    ``messages`` through the chat template (the request's or the tokenizer's) with the generation prompt unless the
    request continues its final message, or ``prompt_token_ids`` as given."""
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        return (request.prompt if isinstance(request.prompt, str) else tokenizer.decode(ids)), ids
    special = request.add_special_tokens
    if request.messages is not None:
        prompt = render_messages(tokenizer, request)
        return prompt, tokenizer(prompt, add_special_tokens=bool(special))["input_ids"]
    if isinstance(request.prompt, str):
        return request.prompt, tokenizer(request.prompt, add_special_tokens=special is not False)["input_ids"]
    raise EngineError(f"prompt must be a string, got {type(request.prompt).__name__}")


def render_messages(tokenizer: PreTrainedTokenizerBase, request: Request) -> str:
    """``request.messages`` as prompt text: through the chat template (the request's or the tokenizer's), with the
    generation prompt unless the request continues its final message."""
    if request.add_generation_prompt and request.continue_final_message:
        raise EngineError("add_generation_prompt and continue_final_message cannot both be true")
    options = {"chat_template": request.chat_template, "add_generation_prompt": request.add_generation_prompt,
               "continue_final_message": request.continue_final_message, "tools": request.tools or None}
    tool_turns = any(message.get("tool_calls") or message["role"] == "tool" for message in request.messages)
    if (request.tools or tool_turns) and not supports_tools(request.chat_template or tokenizer.chat_template):
        given = "tools" if request.tools else "messages with tool calls or results"
        raise EngineError(f"{given} need a chat template that renders them, and this model's has no tool support: "
                          f"set chat_template (for a ChatML model: chat_template: hermes, the built-in one)")
    try:
        return tokenizer.apply_chat_template(
            request.messages, **{**(request.chat_template_kwargs or {}), **options, "tokenize": False}
        )
    except Exception as exc:  # templates raise many types on malformed messages
        raise EngineError(f"cannot render messages with the chat template: {exc}") from exc


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    """Tokens that end a sequence: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


