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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

# Deepest nesting accepted in a request value (messages with text parts need 4; sampling_params 2, plus a JSON
# schema's own). Deeper values are refused before pydantic, Arrow or the chat template recurse into them.
from decoding.chat_templates import builtin_template
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
from frontend.tool_calls import ToolChoice, ToolDefinition, Tools, ToolUse, tool_use


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


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message as OpenAI's and vLLM's chat APIs take it: an assistant's may hold ``tool_calls`` instead of
    content; a ``tool`` message answers one of them by its ``tool_call_id``."""

    # In this order: each field's check sees those before it.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: list[MessageToolCall] | None, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {info.data.get('role')} message")
        return value

    @field_validator("tool_call_id", mode="after")
    @classmethod
    def _answers_are_tools(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if "role" in info.data and (value is None) == (role == "tool"):
            raise ValueError("a tool message needs tool_call_id" if role == "tool"
                             else f"tool_call_id belongs to tool messages, not to a {role} message")
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_calls(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and "role" in info.data and not (role == "assistant" and info.data.get("tool_calls")):
            article = "an" if role == "assistant" else "a"
            raise ValueError(f"{article} {role} message needs content (only an assistant's with tool_calls may "
                             "omit it)")
        return value

    def rendered(self) -> dict[str, Any]:
        """The dict a chat template expects: text parts joined; a call's arguments as an object, as templates read
        them (vLLM passes them so too)."""
        content = self.content if not isinstance(self.content, list) else "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text  # as sent: the template shows what the model was given


def check_history(messages: list[ChatMessage]) -> None:
    """``ValueError`` naming the message whose ``tool_call_id`` answers no earlier assistant call."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        if message.tool_calls:
            called.update(call.id for call in message.tool_calls)
        if message.tool_call_id is not None and message.tool_call_id not in called:
            raise ValueError(f"messages[{index}].tool_call_id {message.tool_call_id!r} matches no earlier assistant "
                             "tool call")


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
        the request's own is refused unless ``config.trust_request_chat_template`` (vLLM's server option); a built-in
        one's name (``decoding.chat_templates``) is taken."""
        builtin = builtin_template(self.chat_template)  # trusted: it ships with the engine
        template = builtin or self.chat_template
        if template is not None and builtin is None and template != config.chat_template and (
                not config.trust_request_chat_template):
            raise RequestError("invalid chat_template: a request's own chat template is refused (it runs as code "
                               "in the server with no cost limit); set trust_request_chat_template: true to allow it")
        add, continue_final = self.add_generation_prompt, self.continue_final_message
        if add is None and continue_final is None and continue_assistant and messages and (
                messages[-1]["role"] == "assistant"):
            add, continue_final = False, True
        return {
            "chat_template": template or config.chat_template,
            "chat_template_kwargs": {**config.chat_template_kwargs, **(self.chat_template_kwargs or {})} or None,
            "add_generation_prompt": True if add is None else add,
            "continue_final_message": bool(continue_final),
        }


class _Inputs(ChatOptions):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: dict[str, Any] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

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
        if self.messages:
            check_history(self.messages)
        if self.prompt is not None and (self.tools or self.tool_choice not in (None, "none", "auto")):
            raise ValueError("tools apply to messages (through the chat template), not to a prompt")
        return self


@dataclass
class ParsedRequest:
    prompt: str | None
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any] | None
    chat: ChatOptions
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self, parser: str | None) -> ToolUse | None:
        """The row's ``frontend.tool_calls.ToolUse`` with the configured ``tool_call_parser``."""
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
            return use.parsed_by(parser) if use is not None else None
        except ValueError as exc:
            raise RequestError(f"invalid tool_choice: {exc}") from None


def _without_nulls(value: Any) -> Any:
    # Arrow gives every struct row all fields of its column, null where that row had none.
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _without_nested_nulls(value: Any) -> Any:
    """``_without_nulls`` at every depth: tools' schemas in an Arrow column hold every row's properties (a schema's
    own null, e.g. ``default: null``, survives only as JSON text)."""
    if isinstance(value, dict):
        return {k: _without_nested_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nested_nulls(v) for v in value] if isinstance(value, list) else value


def parse_request(prompt: Any = None, messages: Any = None, sampling_params: Any = None, tools: Any = None,
                  tool_choice: Any = None, parallel_tool_calls: Any = None, **chat: Any) -> ParsedRequest:
    """A row's or body's inputs, validated; ``RequestError`` with a message naming the field otherwise.
    ``messages``, ``sampling_params``, ``tools``, ``tool_choice`` and ``chat_template_kwargs`` may be JSON text; null
    struct fields count as absent. ``chat``: the ``ChatOptions`` fields."""
    messages = parse_json(messages, "messages")
    tools = _without_nested_nulls(parse_json(tools, "tools"))
    tool_choice = _without_nested_nulls(_json_or_word(tool_choice, "tool_choice"))
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
            if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
                m["tool_calls"] = [_without_nested_nulls(call) for call in m["tool_calls"]]
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise RequestError(f"invalid sampling_params: expected an object, got {type(sampling_params).__name__}")
    try:
        inputs = _Inputs.model_validate(
            {**chat, "prompt": prompt, "messages": messages, "sampling_params": sampling_params, "tools": tools,
             "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls})
    except ValidationError as exc:
        raise RequestError(_message(exc)) from None
    rendered = None if inputs.messages is None else [m.rendered() for m in inputs.messages]
    options = ChatOptions.model_validate(inputs.model_dump(include=set(ChatOptions.model_fields)))
    return ParsedRequest(inputs.prompt, rendered, inputs.sampling_params, options, inputs.tools, inputs.tool_choice,
                         inputs.parallel_tool_calls)


def _json_or_word(value: Any, field: str) -> Any:
    """``tool_choice`` as a row holds it: a word (auto, none, required), an object, or the object's JSON text."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return parse_json(value, field)
    return value


def _message(exc: ValidationError) -> str:
    # A model-level or prompt-type error reads best as its own sentence, without pydantic's "Value error, ".
    errors = exc.errors()
    if len(errors) == 1 and errors[0]["type"] == "value_error" and errors[0]["loc"] in ((), ("prompt",)):
        return str(errors[0]["ctx"]["error"])
    return format_validation_error(exc)
