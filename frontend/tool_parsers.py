"""Generated text -> OpenAI tool calls, as vLLM's ``--tool-call-parser`` names read them.

Each parser reads the call format of one model family (docs/reference.md, "Tools"):

- ``hermes`` (Hermes, Qwen, the built-in ``hermes`` template): ``<tool_call>{"name": ..., "arguments": {...}}``
  ``</tool_call>`` blocks, text before the first one being the message's content;
- ``llama3_json`` (Llama 3.1/3.2 JSON calls): ``{"name": ..., "parameters": {...}}`` objects, optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects, or (newer tokenizers)
  by ``name[ARGS]{...}``, once per call;
- ``pythonic`` (Llama 3.2/4, ToolACE): a Python list of calls with literal keyword arguments,
  ``[get_weather(city="Paris"), now()]``, optionally between ``<|python_start|>`` and ``<|python_end|>``.

A parser scans text that may still be growing (``scan``): it reports the content that can no longer become part of a
call, and every call begun so far with its name once complete and its arguments' text so far. The arguments of a
JSON format are the generated JSON text of the value itself, so each scan's arguments are a prefix of the final ones
and streamed fragments concatenate to exactly the whole response's. ``parse`` is the final reading: calls only when
every one is complete and its arguments are a JSON object; otherwise none, and the whole text is the content.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field


@dataclass
class ScannedCall:
    name: str | None = None  # None until its name is complete
    arguments: str = ""  # the arguments' JSON text so far
    complete: bool = False


@dataclass
class Scan:
    content: str  # text that is content whatever follows
    calls: list[ScannedCall] = field(default_factory=list)
    started: bool = False  # a call format has begun (content is final)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class Parsed:
    content: str | None  # None when the text is only calls (and whitespace)
    calls: list[ToolCall]


class ToolParser:
    """A call format; subclasses implement ``scan``. ``keeps_special_tokens``: its markers are special tokens of
    its model family's tokenizer, so its requests are detokenized with them (vLLM's parsers do the same)."""

    name = ""
    keeps_special_tokens = False

    def scan(self, text: str) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        scan = self.scan(text)
        calls = []
        for call in scan.calls:
            if not call.complete or call.name is None or not _json_object(call.arguments):
                return Parsed(text or None, [])
            calls.append(ToolCall(call.name, call.arguments))
        content = scan.content if calls else text
        return Parsed(content if content.strip() else None, calls)


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------- JSON scanning
_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at ``text[i]`` (not whitespace), None when the text ends first. Strings and
    nesting are followed; the value's own validity is ``json.loads``'s to judge."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        end = _SCALAR.match(text, i).end()
        return end if end < len(text) else None  # a number may still grow
    depth, j = 0, i
    while (found := _STRUCTURE.search(text, j)) is not None:
        j, char = found.start(), found.group()
        if char == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        depth += 1 if char in "{[" else -1
        j += 1
        if depth == 0:
            return j
    return None


_SCALAR = re.compile(r"[^,}\]\s;]*")
_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def _string_end(text: str, i: int) -> int | None:
    found = _STRING.match(text, i)
    return found.end() if found else None


def object_call(text: str, i: int, argument_keys: tuple[str, ...]) -> tuple[ScannedCall, int | None]:
    """The call in the JSON object starting at ``text[i]`` (``{"name": ..., <argument key>: {...}}``) and the object's
    end (None while incomplete). The arguments are the raw text of the first of ``argument_keys`` present."""
    call = ScannedCall()
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.complete = call.name is not None and bool(call.arguments)
            return call, j + 1
        key_end = _string_end(text, j) if text[j] == '"' else None
        if key_end is None:
            return call, None
        key = text[j + 1:key_end - 1]
        j = _skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return call, None
        start = _skip_ws(text, j + 1)
        end = value_end(text, start)
        if key == "name" and end is not None:
            try:
                name = json.loads(text[start:end])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        elif key in argument_keys and not call.arguments:
            call.arguments = text[start:end] if end is not None else text[start:].rstrip(_WS)
        if end is None:
            return call, None
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip_ws(text, j + 1)
    return call, None


# The longest text held back while it may become a call's start (markers are shorter; whitespace inside one is cut).
HOLD_BACK_CHARS = 32


def held_back(text: str, could_start: re.Pattern[str]) -> int:
    """Where ``text``'s content must stop while it may still grow: at the earliest suffix that could become the start
    of a call (``could_start`` matches what such a suffix may be), else its end."""
    for i in range(max(0, len(text) - HOLD_BACK_CHARS), len(text)):
        if could_start.fullmatch(text, i):
            return i
    return len(text)


def _marker_prefixes(*markers: str) -> re.Pattern[str]:
    """A pattern matching every non-empty prefix of each marker."""
    prefixes = {marker[:k] for marker in markers for k in range(1, len(marker) + 1)}
    return re.compile("|".join(re.escape(p) for p in sorted(prefixes, key=len, reverse=True)))


def _array_calls(text: str, i: int, argument_keys: tuple[str, ...]) -> tuple[list[ScannedCall], int | None]:
    """The calls of a JSON list of call objects starting at ``text[i]`` (``[``), and the list's end."""
    calls: list[ScannedCall] = []
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return calls, j + 1
        if text[j] != "{":
            return calls, None
        call, end = object_call(text, j, argument_keys)
        calls.append(call)
        if end is None:
            return calls, None
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip_ws(text, j + 1)
    return calls, None


# ------------------------------------------------------------------------------------------------ the parsers
class HermesParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # <tool_call> is a special token of Qwen's and Hermes's tokenizers
    start, end = "<tool_call>", "</tool_call>"
    _could_start = _marker_prefixes(start)

    def scan(self, text: str) -> Scan:
        first = text.find(self.start)
        if first < 0:
            return Scan(text[:held_back(text, self._could_start)])
        scan = Scan(text[:first], started=True)
        position = first
        while (position := text.find(self.start, position)) >= 0:
            j = _skip_ws(text, position + len(self.start))
            if j >= len(text):
                scan.calls.append(ScannedCall())
                break
            call, end = object_call(text, j, ("arguments", "parameters")) if text[j] == "{" else (ScannedCall(), j)
            scan.calls.append(call)
            if end is None:
                break
            rest = _skip_ws(text, end)  # the closing tag, or the end of the text (a model that stops at the object)
            call.complete = call.complete and (text.startswith(self.end, rest) or rest == len(text))
            position = end
        return scan


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    _call_start = re.compile(r'\{\s*"name"\s*:')
    _could_start = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?|' + _marker_prefixes(python_tag).pattern)

    def scan(self, text: str) -> Scan:
        tag = text.find(self.python_tag)
        match = self._call_start.search(text, 0 if tag < 0 else tag)
        if match is None:
            return Scan(text[:held_back(text, self._could_start)] if tag < 0 else text[:tag], started=tag >= 0)
        start = tag if tag >= 0 else match.start()
        scan = Scan(text[:start], started=True)
        j = match.start()
        while j < len(text) and text[j] == "{":
            call, end = object_call(text, j, ("parameters", "arguments"))
            scan.calls.append(call)
            if end is None:
                break
            j = _skip_ws(text, end)
            if j < len(text) and text[j] == ";":
                j = _skip_ws(text, j + 1)
        return scan


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    _could_start = _marker_prefixes(marker)

    def scan(self, text: str) -> Scan:
        first = text.find(self.marker)
        if first < 0:
            return Scan(text[:held_back(text, self._could_start)])
        scan = Scan(text[:first], started=True)
        j = _skip_ws(text, first + len(self.marker))
        if j < len(text) and text[j] == "[":  # the JSON list form
            scan.calls, end = _array_calls(text, j, ("arguments", "parameters"))
            return scan
        while j < len(text):  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            args = text.find(self.args_marker, j)
            if args < 0:
                scan.calls.append(ScannedCall())
                break
            call = ScannedCall(name=text[j:args].strip() or None)
            start = _skip_ws(text, args + len(self.args_marker))
            end = value_end(text, start)
            call.arguments = text[start:end] if end is not None else text[start:].rstrip(_WS)
            call.complete = end is not None
            scan.calls.append(call)
            if end is None:
                break
            j = _skip_ws(text, end)
            if not text.startswith(self.marker, j):
                break
            j = _skip_ws(text, j + len(self.marker))
        return scan


class PythonicParser(ToolParser):
    """Arguments are Python literals; each call's arguments become one JSON object once the call is complete."""

    name = "pythonic"
    start_tag, end_tag = "<|python_start|>", "<|python_end|>"
    _call_list = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
    _could_start = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?|" + _marker_prefixes(start_tag).pattern)

    def scan(self, text: str) -> Scan:
        body_start = text.find(self.start_tag)
        match = self._call_list.search(text, 0 if body_start < 0 else body_start)
        if match is None:
            return Scan(text[:held_back(text, self._could_start)] if body_start < 0 else text[:body_start],
                        started=body_start >= 0)
        scan = Scan(text[:body_start if body_start >= 0 else match.start()], started=True)
        j = match.start() + 1
        while True:
            j = _skip_ws(text, j)
            name = re.compile(r"[A-Za-z_][\w.]*").match(text, j)
            if name is None:
                break
            open_paren = _skip_ws(text, name.end())
            call = ScannedCall(name=name.group() if open_paren < len(text) else None)  # complete once "(" follows
            scan.calls.append(call)
            close = _python_call_end(text, open_paren)
            if close is None:
                break
            call.arguments, call.complete = _python_arguments(text[name.start():close])
            j = _skip_ws(text, close)
            if j < len(text) and text[j] == ",":
                j += 1
                continue
            break
        return scan


def _python_call_end(text: str, i: int) -> int | None:
    """The end of the parenthesized call arguments starting at ``text[i]`` (``(``), None while incomplete."""
    if i >= len(text) or text[i] != "(":
        return None
    depth, j, quote = 0, i, None
    while j < len(text):
        char = text[j]
        if quote:
            if char == "\\":
                j += 1
            elif text.startswith(quote, j):
                j += len(quote) - 1
                quote = None
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, j) else char
            j += len(quote) - 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _python_arguments(call_text: str) -> tuple[str, bool]:
    """A complete call's keyword arguments as a JSON object's text; ("", False) when they are not literals."""
    try:
        call = ast.parse(call_text.strip(), mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return "", False
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
        if None in arguments:  # **kwargs
            return "", False
        return json.dumps(arguments, ensure_ascii=False), True
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return "", False


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}
