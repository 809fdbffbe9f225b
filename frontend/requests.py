"""The one validation of a generation request's inputs, shared by the batch pipeline and the HTTP server.

A request is a ``prompt`` or chat ``messages`` (roles, content as a string or a list of text parts) plus
optional ``sampling_params`` overrides, each of which may arrive as JSON text. Both front ends call
``parse_request`` (the pipeline per row) or use ``ChatMessage`` (the server's OpenAI body), so they accept and
refuse the same things with the same words. Values are checked for nesting depth before anything recurses
into them: a row of ten thousand nested lists is an error row, not a RecursionError that kills the job.
The sampling parameters' values are checked by ``decoding.params.resolve_sampling``, which the engine shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

# Deepest nesting accepted in a request value (messages with text parts need 4; sampling_params 2, plus a JSON
# schema's own). Deeper values are refused before pydantic, Arrow or the chat template recurse into them.
from decoding.config import (
    MAX_DEPTH,
    Config,
    SamplingParams,
    StructuredOutputs,
    format_validation_error,
    too_deep,
)

# The one error of a request's inputs, sampling parameters included (decoding.params.resolve_sampling raises it).
from decoding.params import RequestError


def parse_json(text: Any, field: str, limit: int = MAX_DEPTH) -> Any:
    """``text`` decoded when it is a string (JSON text), as is otherwise; refused when nested too deep."""
    if isinstance(text, str | bytes):
        try:
            text = json.loads(text)
        except RecursionError:  # json recurses per level: a deep enough document exhausts the stack
            raise RequestError(f"invalid {field}: nested deeper than {limit} levels") from None
        except ValueError as exc:
            raise RequestError(f"invalid {field}: not JSON ({exc})") from exc
    if too_deep(text, limit):
        raise RequestError(f"invalid {field}: nested deeper than {limit} levels")
    return text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def rendered(self) -> dict[str, str]:
        """The ``{role, content}`` dict a chat template expects, text parts joined."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


def _current_constraint(sampling: dict[str, Any]) -> dict[str, Any]:
    """``sampling`` under vLLM's current names (``SamplingParams.current_names``), its constraint checked: a
    schema, regex or grammar that does not parse is refused when the row is read, naming the field."""
    sampling = SamplingParams.current_names(sampling)
    constraint = sampling.get("structured_outputs")
    if constraint is not None:
        try:
            StructuredOutputs.model_validate(constraint)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, "structured_outputs")) from None
    return sampling


class ChatOptions(_Strict):
    """How messages render, as vLLM's chat requests take it: each field overrides the config's (``None``: unset)."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def request_fields(self, config: Config, *, continue_assistant: bool = False,
                       messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """``decoding.engine.engine.Request``'s rendering fields: these options over ``config``'s, with vLLM's defaults
        (generation prompt added, final message not continued). With ``continue_assistant`` (Ray Data LLM's rule),
        messages ending with the assistant's are continued instead, unless the options say otherwise. A template of
        the request's own is refused unless ``config.trust_request_chat_template`` (vLLM's server option)."""
        if self.chat_template is not None and self.chat_template != config.chat_template and (
                not config.trust_request_chat_template):
            raise RequestError("invalid chat_template: a request's own chat template is refused (it runs as code "
                               "in the server with no cost limit); set trust_request_chat_template: true to allow it")
        add, continue_final = self.add_generation_prompt, self.continue_final_message
        if add is None and continue_final is None and continue_assistant and messages and (
                messages[-1]["role"] == "assistant"):
            add, continue_final = False, True
        return {
            "chat_template": self.chat_template or config.chat_template,
            "chat_template_kwargs": {**config.chat_template_kwargs, **(self.chat_template_kwargs or {})} or None,
            "add_generation_prompt": True if add is None else add,
            "continue_final_message": bool(continue_final),
        }


class _Inputs(ChatOptions):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: dict[str, Any] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompt(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"prompt must be a string, got {type(value).__name__}")
        return value

    @field_validator("sampling_params")
    @classmethod
    def _sampling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else _current_constraint(value)

    @model_validator(mode="after")
    def _one_source(self) -> _Inputs:
        if self.messages is not None and self.prompt is not None:
            raise ValueError("a row has either a prompt or messages, not both")
        if self.messages is None and self.prompt is None:
            raise ValueError("a row needs a prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


@dataclass
class ParsedRequest:
    prompt: str | None
    messages: list[dict[str, str]] | None
    sampling: dict[str, Any] | None
    chat: ChatOptions


def _without_nulls(value: Any) -> Any:
    # Arrow gives every struct row all fields of its column, null where that row had none.
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def parse_request(prompt: Any = None, messages: Any = None, sampling_params: Any = None, **chat: Any) -> ParsedRequest:
    """A row's or body's inputs, validated; ``RequestError`` with a message naming the field otherwise.
    ``messages``, ``sampling_params`` and ``chat_template_kwargs`` may be JSON text; null struct fields count as
    absent. ``chat``: the ``ChatOptions`` fields."""
    messages = parse_json(messages, "messages")
    if chat.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = _without_nulls(parse_json(chat["chat_template_kwargs"], "chat_template_kwargs"))
    sampling_params = _without_nulls(parse_json(sampling_params, "sampling_params"))
    if isinstance(sampling_params, dict):
        sampling_params = {k: _without_nulls(v) for k, v in sampling_params.items()}
    if isinstance(messages, list):
        messages = [_without_nulls(m) for m in messages]
        for m in messages:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = [_without_nulls(part) for part in m["content"]]
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise RequestError(f"invalid sampling_params: expected an object, got {type(sampling_params).__name__}")
    try:
        inputs = _Inputs.model_validate(
            {**chat, "prompt": prompt, "messages": messages, "sampling_params": sampling_params})
    except ValidationError as exc:
        raise RequestError(_message(exc)) from None
    rendered = None if inputs.messages is None else [m.rendered() for m in inputs.messages]
    options = ChatOptions.model_validate(inputs.model_dump(include=set(ChatOptions.model_fields)))
    return ParsedRequest(inputs.prompt, rendered, inputs.sampling_params, options)


def _message(exc: ValidationError) -> str:
    # A model-level or prompt-type error reads best as its own sentence, without pydantic's "Value error, ".
    errors = exc.errors()
    if len(errors) == 1 and errors[0]["type"] == "value_error" and errors[0]["loc"] in ((), ("prompt",)):
        return str(errors[0]["ctx"]["error"])
    return format_validation_error(exc)
