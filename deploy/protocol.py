"""OpenAI-shaped request and response models of the HTTP endpoint (SPEC "HTTP").

Requests are validated strictly (``"10"`` is not a number, unknown fields are rejected) so that a client
mistake is a 400 with the offending parameter named, never a silently different generation.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# The one request validation, shared with the pipeline.
from decoding.requests import ChatMessage, TextPart  # noqa: F401

# Context keys the server passes to ``model_validate_json`` (limits only a loaded model knows).
MAX_CONTEXT = "max_context"

_INT64 = 2**63


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class GenerationRequest(_Request):
    model: str | None = Field(None, description="served model id; defaults to the only model served")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="extension (vLLM): 0 disables top-k")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted for compatibility; unused")

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        return value

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

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields, to be merged onto the configured defaults by the engine."""
        fields = self.model_dump(include={"temperature", "top_p", "top_k", "seed"}, exclude_none=True)
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.output_limit is not None:
            fields["max_tokens"] = self.output_limit
        return fields


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must be a string or a non-empty list of strings")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------------------------------------ responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodeMetrics(BaseModel):
    """The ``spec_decode`` struct of SPEC's output rows, summed over the response's choices."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """A whole completion, or (with ``stream: true``) one chunk of it: OpenAI uses the same object for both."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "specbatch"
    max_model_len: int


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
