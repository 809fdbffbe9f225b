"""Chat templates shipped with the engine, taken by name wherever a template is (``chat_template: hermes``).

``hermes``: ChatML (``<|im_start|>role ... <|im_end|>``, the tokens of the embedded SmolLM2 and of Qwen, Hermes and
other ChatML models) with tools as NousResearch's Hermes function-calling format shows them: the tools' JSON in the
system turn between ``<tools></tools>``, calls as ``<tool_call>{"name", "arguments"}</tool_call>`` in the
assistant's turn, tool results as ``<tool_response>`` blocks in a user turn. Its calls are read by the ``hermes``
tool-call parser. Without tools it renders plain ChatML.
"""

from __future__ import annotations

HERMES = """\
{%- set system = messages[0].content if messages and messages[0].role in ('system', 'developer') else none -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if system %}{{ system + '\\n\\n' }}{% endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n' -}}
{%- elif system is not none -%}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and system is not none -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content %}{{ '\\n' + message.content }}{% endif -%}
{%- for call in message.tool_calls -%}
{%- set function = call.function if call.function is defined else call -%}
{%- set arguments = function.arguments if function.arguments is string else (function.arguments | tojson) -%}
{{- '\\n<tool_call>\\n{"name": "' + function.name + '", "arguments": ' + arguments + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}
"""

BUILTIN = {"hermes": HERMES}


def builtin_template(name: str | None) -> str | None:
    """The built-in template called ``name``; None when there is none of that name."""
    return BUILTIN.get(name) if name else None


def supports_tools(template: str | dict[str, str] | None) -> bool:
    """Whether a template renders tools and tool turns (it reads ``tools``, or HF's named ``tool_use`` template)."""
    if isinstance(template, dict):
        return "tool_use" in template or any(supports_tools(each) for each in template.values())
    return bool(template) and "tools" in template
