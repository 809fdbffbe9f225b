"""OpenAI-shaped request and response models of the HTTP endpoint (docs/reference.md, "HTTP API").

Requests are validated strictly (``"10"`` is not a number, unknown fields are rejected) so that a client
mistake is a 400 with the offending parameter named, never a silently different generation. The models declare
the sampling fields' types only: their values are checked by ``decoding.params.resolve_sampling``, with the same
limits as the pipeline's rows and the engine's requests (``GenerationRequest.sampling`` gives it the fields).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from decoding.config import StructuredOutputs, format_validation_error

# The one request validation, shared with the pipeline.
from frontend.requests import MAX_DEPTH, ChatMessage, ChatOptions, TextPart, check_history, too_deep  # noqa: F401
from frontend.tool_calls import ToolChoice, Tools, ToolUse, tool_use

# Context keys the server passes to ``model_validate_json`` (limits only a loaded model knows).
MAX_CONTEXT = "max_context"

# Sequences one request may ask for (prompts times n): each is a row of the engine's batch or its queue.
MAX_SEQUENCES = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries the usage so far (its choice's tokens).
    continuous_usage_stats: bool = False


# OpenAI fields that clients send with default or neutral values: accepted with those values, refused (by name)
# with any other, since the engine could not honour it.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "guided_whitespace_pattern": (None,),
    "priority": (None, 0),  # vLLM refuses others unless its scheduler orders by priority; this one does not
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "audio": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "mm_processor_kwargs": (None, {}),
}


def _neutral(value: Any, info: ValidationInfo) -> Any:
    allowed = _NEUTRAL[info.field_name]
    if value not in allowed:
        shown = " or ".join(json.dumps(a) for a in allowed)
        raise ValueError(f"{info.field_name} is not supported here; only {shown} is accepted")
    return value


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``. The output always follows the schema (``strict`` or not)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def constraint(self) -> dict[str, Any]:
        """The ``structured_outputs`` fields it stands for (none for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema.schema_} if self.json_schema is not None else {}


# vLLM's older extra fields, each one field of structured_outputs.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class GenerationRequest(_Request):
    model: str | None = Field(None, description="served model id or LoRA adapter; defaults to the only model served")
    _lora: str | None = PrivateAttr(None)  # the adapter ``model`` names (the server resolves it), None: the base
    # Sampling fields (decoding.config.SamplingParams names and limits, checked by decoding.params).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension (vLLM): 0 or -1 disables top-k")
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, description="choices per prompt")
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # vLLM's extensions
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = Field(None, description="extension (vLLM): per prompt token, in the response")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted for compatibility; unused")
    metadata: dict[str, str] | None = Field(None, description="accepted for compatibility; unused")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a decimal string) -> bias")
    store: Any = None
    service_tier: Any = None
    # vLLM's server fields: the response's id is built from request_id; vllm_xargs feeds custom logits processors,
    # none of which run here (ignored, as vLLM ignores them then); return_token_ids adds the ids to the text.
    priority: int | None = None
    request_id: str | None = Field(None, max_length=256, description="extension (vLLM): the response's id")
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    return_token_ids: bool = False
    # vLLM's input options (decoding.engine.Request): special tokens added to a text prompt (chat: by the template,
    # so none by default), the prompt cut to its last k tokens (-1: the context), a prefix-cache salt.
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _tokens_to_keep(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens is -1 (the context) or a number of tokens >= 1")
        return value

    def input_options(self) -> dict[str, Any]:
        """The engine request's input options (``decoding.engine.Request``) this body sets."""
        options = {name: getattr(self, name) for name in ("add_special_tokens", "truncate_prompt_tokens", "cache_salt")
                   if getattr(self, name) is not None}
        return {**options, "lora": self._lora} if self._lora is not None else options
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields, merged
    # into one constraint (decoding.config.StructuredOutputs); more than one constraint is refused.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    guided_whitespace_pattern: Any = None

    _check_neutral = field_validator(*_NEUTRAL, mode="before", check_fields=False)(_neutral)

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _fits_context(cls, value: int | None, info: ValidationInfo) -> int | None:
        # More new tokens than the whole context can never be produced: a client error, not a silent cap.
        limit = (info.context or {}).get(MAX_CONTEXT)
        if limit is not None and value is not None and value > limit:
            raise ValueError(f"{info.field_name} is {value}; the model's context is {limit} tokens")
        return value

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: ``continuous_usage_stats`` puts usage in every chunk when ``include_usage`` is on too."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token the response reports; None = no logprobs."""
        return None

    def constraint(self) -> StructuredOutputs | None:
        """The request's one output constraint, validated; None without one."""
        fields = dict(self.structured_outputs or {})
        for field, name in _GUIDED.items():
            if getattr(self, field) is not None:
                fields[name] = getattr(self, field)
        if self.response_format is not None:
            fields.update(self.response_format.constraint())
        return StructuredOutputs.model_validate(fields) if fields else None

    @model_validator(mode="after")
    def _one_constraint(self) -> GenerationRequest:
        try:
            self.constraint()
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, "structured_outputs")) from None
        return self

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields (decoding.config.SamplingParams names), for
        ``decoding.params.resolve_sampling`` to merge onto the configured ones and check. ``n`` is the server's:
        each choice is a sequence of its own."""
        fields = self.model_dump(include=_SAMPLING_FIELDS, exclude_none=True)
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.output_limit is not None:
            fields["max_tokens"] = self.output_limit
        if self.top_logprobs is not None:
            fields["logprobs"] = self.top_logprobs
        if (constraint := self.constraint()) is not None:
            fields["structured_outputs"] = constraint.model_dump(exclude_defaults=True)
        return fields

    def param(self, field: str | None) -> str | None:
        """This request's name of sampling field ``field`` (an error's OpenAI ``param``)."""
        return field


_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_tokens", "stop_token_ids", "ignore_eos", "skip_special_tokens", "min_p", "logit_bias", "allowed_token_ids",
    "bad_words", "include_stop_str_in_output", "prompt_logprobs",
}


# A prompt as vLLM's completions take it: text, or token ids (checked against the vocabulary by the engine).
Prompt = str | list[int]


class CompletionRequest(GenerationRequest):
    # vLLM's (and OpenAI's) forms: a string, a list of strings, a list of token ids, a list of token id lists. Tried
    # in this order, the first that fits taken: a list of ids is tried as ids at once (the smart union tried it as
    # strings first, recording an error per id: 4.3 s and 2.6 GB for ten million ids, against 0.9 s).
    prompt: Annotated[str | list[int] | list[list[int]] | list[str], Field(union_mode="left_to_right")]
    logprobs: int | None = Field(None, description="alternatives per token (legacy completions)")
    echo: bool = Field(False, description="the text of each choice starts with its prompt")
    best_of: Any = None
    suffix: Any = None

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: str | list[Any], info: ValidationInfo) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of either")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a prompt given as token ids must have at least one")
        sequences = len(_prompts(value)) * info.data.get("n", 1)
        if sequences > MAX_SEQUENCES:
            raise ValueError(f"a request decodes at most {MAX_SEQUENCES} sequences (prompts times n), not {sequences}")
        return value

    @property
    def prompts(self) -> list[Prompt]:
        return _prompts(self.prompt)


def _prompts(prompt: str | list[Any]) -> list[Prompt]:
    """The prompts of a completions body: one string, one list of token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)

    @property
    def echoed(self) -> str:
        """vLLM's chat echo: the last message's text when it is the assistant's (the role each choice continues),
        which then leads each choice's content; else nothing."""
        last = self.messages[-1].rendered()
        return last["content"] if self.echo and last["role"] == "assistant" else ""

    # vLLM's: how messages render (over the config's chat_template / chat_template_kwargs).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = Field(False, description="extension (vLLM): a last assistant message leads each choice's content")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool | None = None
    top_logprobs_: int | None = Field(None, alias="top_logprobs")
    # OpenAI's function tools (frontend/tool_calls.py): shown by the chat template; tool_choice auto reads calls
    # from the text with the configured parser, required and a named function constrain the output to calls.
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    prediction: Any = None
    audio: Any = None

    @property
    def top_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs_ or 0

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs_ and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        check_history(value)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if "tools" not in info.data:  # the tools were refused: that error names them
            return value
        use = tool_use(info.data["tools"], value, None)
        own = [name for name in ("structured_outputs", *_GUIDED) if info.data.get(name) is not None]
        if (response_format := info.data.get("response_format")) is not None and response_format.type != "text":
            own.append("response_format")
        if use is not None and use.constraint is not None and own:
            raise ValueError(f"tool_choice {use.choice} constrains the output to tool calls; it cannot be combined "
                             f"with {', '.join(own)}")
        return value

    def tool_use(self) -> ToolUse | None:
        """What the body's tools mean for its output (its parser still to be chosen by the server's config)."""
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and too_deep(value):
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        return value

    def chat_options(self) -> ChatOptions:
        return ChatOptions(chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs,
                           add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def param(self, field: str | None) -> str | None:
        if field == "logprobs":
            return "top_logprobs"
        if field == "structured_outputs" and self.constraint() is None:  # the constraint of a required call
            return "tool_choice"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return field


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize`` body, either of its two forms: ``TokenizeCompletionRequest`` (``prompt``;
    ``add_special_tokens`` defaults to true) or ``TokenizeChatRequest`` (``messages`` rendered with the chat template,
    vLLM's rendering fields; ``add_special_tokens`` defaults to false: the template adds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None
    mm_processor_kwargs: Any = None

    _check_neutral = field_validator("mm_processor_kwargs", mode="before")(_neutral)
    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and too_deep(value):
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        return value

    def problem(self) -> tuple[str, str] | None:
        """What is wrong with the body's combination of fields, and the field to blame; None when nothing."""
        if (self.prompt is None) == (self.messages is None):
            return "give either prompt or messages", "prompt" if self.messages is None else "messages"
        if self.messages is not None and not self.messages:
            return "messages must not be empty", "messages"
        if self.prompt is not None:
            for field in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
                if getattr(self, field) is not None:
                    return f"{field} applies to messages, not to a prompt", field
        if self.add_generation_prompt is not False and self.continue_final_message:
            return ("Cannot set both `continue_final_message` and `add_generation_prompt` to True (send "
                    "add_generation_prompt: false with it)", "continue_final_message")
        return None

    def chat_options(self) -> ChatOptions:
        return ChatOptions(chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs,
                           add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message)


class DetokenizeRequest(_Request):
    """vLLM's ``POST /detokenize`` body."""

    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------------------------------------ responses
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _version() -> str:
    try:
        return importlib.metadata.version("specbatch")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


# GET /version's answer (vLLM's shape: {"version": ...}), specbatch's version.
VERSION = _version()


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpecDecodeMetrics(BaseModel):
    """The ``spec_decode`` struct of the output rows over the response's choices (``decoding.stats``)."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    tokens_per_forward: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    num_grammar_forced_tokens: int  # accepted draft tokens a constraint allowed alone


class Metrics(BaseModel):
    speculative_decoding: SpecDecodeMetrics


def _created() -> int:
    return int(time.time())


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_created)
    model: str
    usage: Usage | None = None
    metrics: Metrics | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs (OpenAI): parallel lists over the generated tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Logprob(BaseModel):
    """vLLM's ``Logprob`` of one token: its log-probability, its 1-based rank in the model's law, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None (the first: nothing precedes it) or token id -> Logprob, the prompt
# token first, then the top alternatives.
PromptLogprobs = list[dict[str, Logprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids entry that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a stream's: in its first chunk)
    token_ids: list[int] | None = None  # with return_token_ids (a stream's: each chunk's new ones)


class CompletionResponse(_Response):
    """A whole completion, or (with ``stream: true``) one chunk of it: OpenAI uses the same object for both."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with prompt_logprobs (one prompt)
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """OpenAI's streamed call: its first delta has the id, type and name, the next ones fragments of arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's new ones


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: in the chunk that ends a choice
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "specbatch"
    max_model_len: int
    root: str | None = None  # vLLM's: the model's path (an adapter's folder)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (None: a base model)


class LoadLoraAdapterRequest(_Request):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(_Request):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
