"""Tools in a request, as OpenAI's and vLLM's chat APIs take them, shared by the batch pipeline and the server.

``tools`` are function definitions (a name and a JSON schema of its parameters) that the chat template shows the
model; ``tool_choice`` says what to do with them (``ToolUse``):

- ``auto`` (the default when tools are given): free text, read into calls by the configured ``tool_call_parser``
  (``frontend.tool_parsers``); without a parser, vLLM's answer: refused, naming ``tool_call_parser``;
- ``none``: the tools are shown, nothing is parsed;
- ``required`` or a named function: decoding is constrained to valid calls, as vLLM does it: a JSON list of
  ``{"name", "parameters"}`` objects (one at most with ``parallel_tool_calls: false``), or the named function's
  arguments object. The constraint is an ordinary structured-outputs JSON schema, so it is lossless and drafted
  under as any constraint is, and the text is read into calls by that format, whatever the parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from frontend.tool_parsers import (
    PARSERS,
    Parsed,
    Scan,
    ScannedCall,
    ToolCall,
    ToolParser,
    _array_calls,
    _skip_ws,
    value_end,
)

# OpenAI's limit on a request's tools; each one's schema is also a grammar to build when a call is required.
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                jsonschema.validators.validator_for(value).check_schema(value)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"parameters is not a JSON schema: {exc.message}") from None
        return value


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def count_tools(tools: Any) -> Any:
    """``tools`` before each is validated: at most ``MAX_TOOLS`` (a schema check each costs ~0.4 ms)."""
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    return tools


def check_tools(tools: list[ToolDefinition]) -> list[ToolDefinition]:
    """``tools`` with no name twice; ``ValueError`` naming the problem otherwise."""
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"tool names must be unique: {', '.join(twice)} given more than once")
    return tools


# A request's or row's ``tools``: counted before any is validated, then checked as a whole.
Tools = Annotated[list[ToolDefinition], BeforeValidator(count_tools), AfterValidator(check_tools)]


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _call_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of ``tool_choice: required``: a list of calls, each one of the tools with its parameters."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                "parameters": _parameters(tool)},
              "required": ["name", "parameters"]} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools mean for its generation: what the template shows (``tools``), the output constraint
    (``constraint``), and how the generated text becomes calls (``extract``, ``stream``)."""

    tools: list[dict[str, Any]]  # as the chat template gets them
    choice: str  # auto, none, required, or "function" (named)
    parser: ToolParser | None  # None: nothing is parsed
    constraint: dict[str, Any] | None = None  # structured_outputs fields
    parallel: bool = True

    def parsed_by(self, parser: str | None) -> ToolUse:
        """This use with the configured ``tool_call_parser`` reading ``auto``'s text; ``ValueError`` when auto has
        none (vLLM's answer)."""
        if self.choice != "auto":
            return self
        if parser is None:
            raise ValueError('tool_choice "auto" reads calls from the text with a parser: set tool_call_parser in the '
                             'config (specbatch serve --tool-call-parser), or send tool_choice "none"')
        return replace(self, parser=PARSERS[parser]() if self.parallel else _OneCall(PARSERS[parser]()))

    def extract(self, text: str) -> Parsed:
        """The text as the message's content and its calls (none where the text is not calls)."""
        return self.parser.parse(text) if self.parser is not None else Parsed(text or None, [])

    def stream(self) -> ToolStream:
        return ToolStream(self.parser)

    def sampling(self, sampling: dict[str, Any] | None) -> dict[str, Any] | None:
        """``sampling`` (vLLM's names) with this use's constraint, and special tokens kept where the parser's markers
        are special tokens; ``ValueError`` when the request has a constraint of its own."""
        keep_special = self.parser is not None and self.choice == "auto" and self.parser.keeps_special_tokens
        if self.constraint is None and not keep_special:
            return sampling
        sampling = dict(sampling or {})
        if self.constraint is not None:
            if sampling.get("structured_outputs") is not None:
                raise ValueError(f"tool_choice {self.choice} constrains the output to tool calls; it cannot be "
                                 "combined with structured outputs (response_format, structured_outputs, guided_*)")
            sampling["structured_outputs"] = self.constraint
        if keep_special:
            sampling["skip_special_tokens"] = False
        return sampling


def tool_use(tools: list[ToolDefinition] | None, choice: ToolChoice | None,
             parallel_tool_calls: bool | None) -> ToolUse | None:
    """The request's ``ToolUse`` (None without tools), its parser still to be chosen (``ToolUse.parsed_by``);
    ``ValueError`` naming the problem when the combination cannot be served."""
    if not tools:
        if choice in (None, "auto", "none") or (choice == "required" and tools == []):
            return None  # auto, or required, with an empty list of tools chooses none (OpenAI's, vLLM's)
        raise ValueError(f"tool_choice {_shown(choice)} needs tools")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    elif choice not in ("auto", "none", "required") and not isinstance(choice, NamedToolChoice):
        raise ValueError(f"tool_choice is auto, none, required or a named function, not {_shown(choice)}")
    parallel = parallel_tool_calls is not False
    shown = [tool.model_dump(exclude_none=True) for tool in tools]
    if isinstance(choice, NamedToolChoice):
        by_name = {tool.function.name: tool for tool in tools}
        if choice.function.name not in by_name:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among tools "
                             f"({', '.join(sorted(by_name))})")
        return ToolUse(shown, "function", _NamedFunction(choice.function.name),
                       {"json": _parameters(by_name[choice.function.name])})
    if choice == "required":
        return ToolUse(shown, choice, _RequiredCalls(), {"json": _call_schema(tools, parallel)})
    return ToolUse(shown, choice, None, parallel=parallel)


def _shown(choice: Any) -> str:
    return json.dumps(choice.model_dump() if isinstance(choice, BaseModel) else choice)


class _RequiredCalls(ToolParser):
    """The constrained format of ``tool_choice: required``: a JSON list of ``{"name", "parameters"}`` objects."""

    name = "required"

    def scan(self, text: str) -> Scan:
        start = _skip_ws(text, 0)
        if start >= len(text):
            return Scan("", started=False)
        calls, _ = _array_calls(text, start, ("parameters",))
        return Scan("", calls, started=True)


class _NamedFunction(ToolParser):
    """The constrained format of a named ``tool_choice``: the text is the function's arguments object."""

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str) -> Scan:
        start = _skip_ws(text, 0)
        end = value_end(text, start)
        arguments = text[start:end] if end is not None else text[start:].rstrip()
        return Scan("", [ScannedCall(self.function, arguments, end is not None)], started=True)


class _OneCall(ToolParser):
    """A parser limited to its first call (``parallel_tool_calls: false`` with ``auto``)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser, self.name, self.keeps_special_tokens = parser, parser.name, parser.keeps_special_tokens

    def scan(self, text: str) -> Scan:
        scan = self.parser.scan(text)
        scan.calls = scan.calls[:1]
        return scan


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in OpenAI's message shape, each with a fresh id."""
    return [{"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]


@dataclass
class ToolStream:
    """One choice's stream: text deltas in, content deltas and OpenAI's tool-call deltas out (a call's id, type and
    name first, then fragments of its arguments). The deltas concatenate to what ``ToolUse.extract`` reads from
    the whole text."""

    parser: ToolParser | None
    text: str = ""
    content_sent: int = 0
    names_sent: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.names_sent)

    def push(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool-call deltas ``delta`` makes; ``final``: the text is complete."""
        self.text += delta
        if self.parser is None:
            content, self.content_sent = self.text[self.content_sent:], len(self.text)
            return content, []
        scan = self.parser.scan(self.text)
        content_end = len(scan.content)
        calls: list[ScannedCall] = scan.calls
        if final:
            parsed = self.parser.parse(self.text)
            if parsed.calls:
                calls = [ScannedCall(call.name, call.arguments, True) for call in parsed.calls]
            elif not self.called:  # no call after all: the whole text is content
                content_end, calls = len(self.text), []
        content = self.text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.names_sent):
                if call.name is None:
                    break
                self.names_sent.append(call.name)
                self.arguments_sent.append(0)
                deltas.append({"index": index, "id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            fragment = call.arguments[self.arguments_sent[index]:]
            if fragment:
                self.arguments_sent[index] = len(call.arguments)
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        return content, deltas
