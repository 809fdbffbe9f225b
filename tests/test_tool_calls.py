"""Tools (frontend/tool_calls.py, frontend/tool_parsers.py, decoding/chat_templates.py): each parser on the call
formats its model family emits, streamed deltas concatenating to the whole response's calls; messages and tools as
OpenAI and vLLM take them, bad ones refused naming the field; the built-in ``hermes`` template; and ``tool_choice``
required or named as a constraint under which speculative decoding stays lossless (greedy identity, chi-square)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_cases import chi_square_pvalue, make_config, reference_warp
from tiny import noisy_copy, tiny_model
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from decoding import Engine, Request
from decoding.chat_templates import HERMES
from decoding.config import Config, StructuredOutputs
from decoding.constraints.grammar import compiler_for
from decoding.engine.sequence import EngineError, render_messages
from decoding.model.loading import DEFAULT_MODEL, load_tokenizer
from frontend.requests import RequestError, parse_request
from frontend.tool_calls import MAX_TOOLS, NamedToolChoice, ToolDefinition, tool_use
from frontend.tool_parsers import PARSERS, ToolCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]

NESTED = {"city": "Zürich", "filters": {"days": [1, 2], "hint": "a \"quoted\" }{ brace"}, "emoji": "☀️"}

# Each parser's formats as its model family emits them (vLLM's docs and tests): several calls, nested JSON and
# unicode arguments, text before the call. Expected: (content, [(name, arguments)]).
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("Let me check both.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": NESTED},
                                                          ensure_ascii=False)
         + '\n</tool_call>\n<tool_call>\n{"name": "search_web", "arguments": {"query": "Zürich"}}\n</tool_call>',
         "Let me check both.\n", [("get_weather", NESTED), ("search_web", {"query": "Zürich"})]),
        # a model that stops right after the object, without the closing tag
        ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}}', None, [("search_web", {"query": "x"})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(NESTED, ensure_ascii=False)
         + '}; {"name": "search_web", "parameters": {"query": "é"}}', None,
         [("get_weather", NESTED), ("search_web", {"query": "é"})]),
        ('Sure, calling it: {"name": "search_web", "arguments": {"query": "Paris"}}', "Sure, calling it: ",
         [("search_web", {"query": "Paris"})]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "search_web", "arguments": ' + json.dumps(NESTED, ensure_ascii=False) + "}]", None,
         [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search_web", NESTED)]),
        ('I will look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
         '[TOOL_CALLS]search_web[ARGS]' + json.dumps(NESTED, ensure_ascii=False), "I will look. ",
         [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search_web", NESTED)]),
    ],
    "pythonic": [
        ("[get_weather(city='San Francisco', unit='celsius'), register_user(name='John Doe', age=37, "
         "address={'city': 'San Francisco', 'state': 'CA'}, role=None, passed_test=True, aliases=['John', 'Johnny'])]",
         None, [("get_weather", {"city": "San Francisco", "unit": "celsius"}),
                ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                                   "role": None, "passed_test": True, "aliases": ["John", "Johnny"]})]),
        ("Checking now. [search_web(query=\"Zürich ☀️ (today)\")]", "Checking now. ",
         [("search_web", {"query": "Zürich ☀️ (today)"})]),
        ("<|python_start|>[get_weather(city='Oslo', unit='celsius')]<|python_end|>", None,
         [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ],
}
PARSER_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSER_CASES)
def test_each_parser_reads_its_model_familys_calls(parser, text, content, calls) -> None:
    parsed = PARSERS[parser]().parse(text)
    assert parsed.content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls


def _streamed(parser, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream of ``text`` in pieces of ``size`` characters makes, checking that each call's
    first delta has its id, type and name before any fragment of its arguments."""
    use = tool_use([ToolDefinition.model_validate(t) for t in TOOLS], "auto", None).parsed_by(parser)
    stream, content, calls = use.stream(), "", {}
    for start in range(0, len(text), size):
        delta, deltas = stream.push(text[start:start + size], final=start + size >= len(text))
        content += delta
        for call in deltas:
            if call["index"] not in calls:
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSER_CASES)
def test_streamed_deltas_concatenate_to_the_whole_responses_calls(parser, text, content, calls) -> None:
    whole = PARSERS[parser]().parse(text)
    for size in (1, 2, 5, 13, len(text)):
        streamed_content, streamed_calls = _streamed(parser, text, size)
        assert streamed_content == (whole.content or ""), size
        assert streamed_calls == [(call.name, call.arguments) for call in whole.calls], size


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_text_that_is_not_a_complete_call_is_content(parser) -> None:
    for text in ["Just an answer, no call.", "The set {1, 2} and the list [3] are fine.", ""]:
        assert PARSERS[parser]().parse(text).calls == []
        assert PARSERS[parser]().parse(text).content == (text or None)
        assert _streamed(parser, text, 3)[0] == text if text else True
    truncated = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                 "llama3_json": '{"name": "get_weather", "parameters": {"city": ',
                 "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
                 "pythonic": "[get_weather(city='Par"}[parser]
    not_arguments = {"hermes": '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
                     "llama3_json": '{"name": "f", "parameters": "x"}',
                     "mistral": "[TOOL_CALLS]f[ARGS][1]",
                     "pythonic": "[f(1, 2)]"}[parser]
    for text in (truncated, not_arguments):
        parsed = PARSERS[parser]().parse(text)
        assert (parsed.content, parsed.calls) == (text, []), text


def test_required_and_named_choices_read_their_constrained_formats() -> None:
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    required = tool_use(tools, "required", None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, ' \
           '{"name": "search_web", "parameters": {"query": "snow"}}]'
    assert required.extract(text).calls == [ToolCall("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                                            ToolCall("search_web", '{"query": "snow"}')]
    schema = required.constraint["json"]
    jsonschema.validate(json.loads(text), schema)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert tool_use(tools, "required", False).constraint["json"]["maxItems"] == 1  # parallel_tool_calls: false
    named = tool_use(tools, {"type": "function", "function": {"name": "search_web"}}, None)
    assert named.constraint == {"json": SEARCH["function"]["parameters"]}
    assert named.extract('{"query": "snow"}').calls == [ToolCall("search_web", '{"query": "snow"}')]
    assert _constraint_streams(named, ' {"query": "snow"}') == [("search_web", '{"query": "snow"}')]
    assert _constraint_streams(required, text) == [(c.name, c.arguments) for c in required.extract(text).calls]
    one = tool_use(tools, "auto", False).parsed_by("hermes")  # auto with parallel_tool_calls: false: the first
    assert len(one.extract("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>" * 2).calls) == 1


def _constraint_streams(use, text: str) -> list[tuple[str, str]]:
    stream, calls = use.stream(), {}
    for start in range(0, len(text), 4):
        for call in stream.push(text[start:start + 4], final=start + 4 >= len(text))[1]:
            calls.setdefault(call["index"], [call["function"].get("name"), ""])[1] += call["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


# ---------------------------------------------------------------------------------------------------- requests
TRACE = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "in Oslo?"}],
     "name": "ana"},
]


def test_agent_traces_parse_with_tool_turns_and_tools_given_as_rows_hold_them() -> None:
    parsed = parse_request(messages=json.dumps(TRACE), tools=json.dumps(TOOLS), tool_choice="required")
    assert parsed.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert parsed.messages[3] == {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}
    assert parsed.messages[4] == {"role": "user", "content": "And in Oslo?", "name": "ana"}
    assert parsed.tool_use(None).choice == "required"
    # Arrow hands struct rows every field of their column: nulls (a schema's properties of other tools) are dropped.
    arrow_tools = [{"type": "function", "function": {**SEARCH["function"], "parameters": {
        **SEARCH["function"]["parameters"], "properties": {"query": {"type": "string", "enum": None}, "city": None}},
        "strict": None}}]
    named = parse_request(messages=TRACE, tools=arrow_tools, tool_choice='{"type": "function", '
                                                                        '"function": {"name": "search_web"}}')
    assert named.tool_use(None).constraint["json"]["properties"] == {"query": {"type": "string"}}


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "parameters is not a JSON schema"),
    ({"tools": [WEATHER, WEATHER]}, "get_weather given more than once"),
    ({"tools": [SEARCH] * 10_000}, f"at most {MAX_TOOLS} tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_call_parser"),  # no parser configured
    ({"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[0].tool_call_id 'call_9' matches no earlier assistant tool call"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool message needs tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": TRACE[2]["tool_calls"]}]},
     "tool_calls belong to assistant messages"),
]


@pytest.mark.parametrize(("fields", "named"), BAD, ids=[named for _, named in BAD])
def test_bad_tools_and_tool_turns_are_refused_naming_the_field(fields, named) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(RequestError, match=named.replace("[", r"\[").replace("(", r"\(")):
        parse_request(**row).tool_use(None)


def test_a_schema_that_cannot_compile_is_refused_when_a_call_is_required() -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    use = parse_request(messages=[{"role": "user", "content": "hi"}], tools=[broken],
                        tool_choice="required").tool_use(None)
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputs.model_validate(use.constraint)


# ---------------------------------------------------------------------------------------------------- templates
@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(DEFAULT_MODEL)


def test_the_hermes_template_renders_tools_calls_and_results_with_chatml_tokens(smollm2) -> None:
    parsed = parse_request(messages=TRACE, tools=TOOLS, tool_choice="none",
                           chat_template="hermes")
    fields = parsed.chat.request_fields(Config())
    assert fields["chat_template"] == HERMES
    text = render_messages(smollm2, Request("r", messages=parsed.messages, tools=TOOLS, **fields))
    assert text.startswith("<|im_start|>system\nYou are a weather assistant.\n\n# Tools\n")
    assert json.dumps(WEATHER) in text and json.dumps(SEARCH) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>\n') in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\nAnd in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    # Without tools it is plain ChatML, as the model's own template renders a conversation with a system turn.
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_messages(smollm2, Request("p", messages=plain, chat_template=HERMES)) == \
        smollm2.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def test_the_embedded_models_own_template_refuses_tools_and_tool_turns_naming_the_fix(smollm2) -> None:
    for request in (Request("t", messages=[{"role": "user", "content": "hi"}], tools=TOOLS),
                    Request("h", messages=parse_request(messages=TRACE).messages)):
        with pytest.raises(EngineError, match="no tool support: set chat_template .*chat_template: hermes"):
            render_messages(smollm2, request)


# ---------------------------------------------------------------------------------------------- lossless decoding
@pytest.fixture(scope="module")
def json_models(smollm2):
    target = tiny_model(seed=5, vocab_size=len(smollm2))
    return target, noisy_copy(target, 0.3, seed=6)


def test_greedy_under_required_and_named_tool_choices_equals_plain_constrained_decoding(smollm2, json_models):
    target, draft = json_models
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    choices = ["required", {"type": "function", "function": {"name": "get_weather"}}]
    batch = []
    for index, choice in enumerate(choices * 3):
        use = tool_use(tools, choice if isinstance(choice, str) else
                       NamedToolChoice.model_validate(choice), index % 3 != 1)
        # A bare prompt: the tiny model's context (256) cannot hold the tools' system turn; the constraint is the point.
        batch.append(Request(str(index), prompt=f"Call number {index}:",
                             sampling=use.sampling({"temperature": 0.0, "max_tokens": 48})))
    outputs = {}
    for method, width, batch_size in [("none", 1, 1), ("ngram", 2, 4), ("draft_model", 2, 6)]:
        config = make_config(method=method, num_candidates=width, candidate_init="target", length_policy="static",
                             batch_size=batch_size)
        results = Engine(config, target=target, tokenizer=smollm2,
                         draft=draft if method == "draft_model" else None).generate(batch)
        assert all(r.finish_reason in ("stop", "length") for r in results), [r.error for r in results]
        outputs[method] = [r.token_ids for r in results]
        if method != "none":
            assert sum(sum(r.per_step_drafted) for r in results) > 0  # speculation really happened
    assert outputs["ngram"] == outputs["none"] and outputs["draft_model"] == outputs["none"]


# A vocabulary in which a required call is a handful of tokens: the law of whole calls can be enumerated.
CALL_VOCAB = ["<pad>", "<s>", "</s>", '[{"name": "', "f", "g", '", "parameters": {}}', "]", ', {"name": "']
CALL_END = len(CALL_VOCAB)  # after EOS


def call_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(CALL_VOCAB)}, unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def required_call_law(model, tokenizer, prompt: list[int], constraint: dict, length: int) -> dict:
    """Exact law of the first ``length`` generated tokens (CALL_END after EOS) under ``constraint``: each prefix's
    logits masked by a fresh xgrammar matcher walked along it."""
    compiled = compiler_for(tokenizer, len(CALL_VOCAB)).compile(StructuredOutputs.model_validate(constraint).constraint)
    law: dict[tuple[int, ...], float] = {}

    def extend(prefix: list[int], weight: float) -> None:
        if len(prefix) == length or (prefix and prefix[-1] == 2):
            law[tuple(prefix + [CALL_END] * (length - len(prefix)))] = weight
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
        assert all(matcher.accept_token(t) for t in prefix)
        mask = xgr.allocate_token_bitmask(1, len(CALL_VOCAB))
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask[0])
        probabilities = reference_warp(logits, temperature=1.0, top_k=0, top_p=1.0)
        for token in range(len(CALL_VOCAB)):
            if probabilities[token] > 0:
                extend(prefix + [token], weight * float(probabilities[token]))

    extend([], 1.0)
    return law


def test_sampling_under_a_required_tool_choice_follows_the_constrained_target_law() -> None:
    """Two tools and parallel calls: the name (f or g) and whether another call follows are the target's choices,
    the rest of each call grammar-forced. 2,000 samples over the 6 outcomes of 5 tokens: a deviation of 0.03 in one
    outcome's probability gives a chi-square statistic near 2000 * 0.03^2 / 0.17 = 10.6 alone (p < 1e-3 at 5 degrees
    of freedom needs 20.5; the test's power is for the biases a wrong acceptance rule makes, 0.1 and more)."""
    tokenizer = call_tokenizer()
    target = tiny_model(seed=11, vocab_size=len(CALL_VOCAB))
    draft = noisy_copy(target, 0.8, seed=12)
    tools = [ToolDefinition.model_validate({"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": {}}}}) for name in ("f", "g")]
    use = tool_use(tools, "required", None)
    samples, prompt = 2000, [1, 4, 5]
    config = make_config(method="draft_model", num_candidates=2, num_speculative_tokens=3, length_policy="static",
                         batch_size=64, sampling={"max_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 1.0})
    results = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate([
        Request(id=str(i), prompt_token_ids=prompt, sampling=use.sampling({"seed": i})) for i in range(samples)])
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    assert sum(r.num_grammar_forced_tokens for r in results) > 0  # the forced tokens were free drafts
    law = required_call_law(target, tokenizer, prompt, use.constraint, 5)
    outcomes = sorted(law)
    counts = torch.zeros(len(outcomes))
    for result in results:
        counts[outcomes.index(tuple((result.token_ids + [CALL_END] * 5)[:5]))] += 1
    assert len(outcomes) == 6
    assert chi_square_pvalue(counts, torch.tensor([law[o] for o in outcomes], dtype=torch.float64)) > 1e-3
    for result in results:
        if result.finish_reason == "stop":
            assert [call.name for call in use.extract(tokenizer.decode(result.token_ids[:-1])).calls]


# ---------------------------------------------------------------------------------------------------- batch jobs
CITIES = ["Paris", "Oslo", "Lima", "Rome", "Cairo", "Tokyo", "Quito", "Delhi"]
CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto", "none"]


def agent_traces(count: int) -> list[dict]:
    """Rows replaying an agent: system, user, the assistant's call, the tool's result, a new question; each with the
    tools and a tool_choice (Ray Data LLM's row shape: ``messages``, ``tools``, ``tool_choice`` columns)."""
    rows = []
    for index in range(count):
        city, other = CITIES[index % len(CITIES)], CITIES[(index + 3) % len(CITIES)]
        messages = [
            {"role": "system", "content": "You answer weather questions with the tools."},
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{index}", "type": "function",
                                                                   "function": {"name": "get_weather", "arguments":
                                                                                json.dumps({"city": city,
                                                                                            "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": f"call_{index}", "content": json.dumps({"temperature": 10 + index})},
            {"role": "user", "content": f"And in {other}?"},
        ]
        choice = CHOICES[index % len(CHOICES)]  # a named one as JSON text: one column holds one type
        rows.append({"id": f"trace-{index}", "messages": messages, "tools": TOOLS,
                     "tool_choice": choice if isinstance(choice, str) else json.dumps(choice)})
    return rows


def assert_calls_follow_the_text(rows: list[dict]) -> None:
    """No error rows; a required or named row that stopped holds valid calls; every row's calls are what its
    text holds (the hermes parser for auto, the constrained format for required and named, none for none)."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    stopped_with_calls = 0
    for index, row in enumerate(rows):
        assert row["finish_reason"] in ("stop", "length"), row["error"]
        choice = CHOICES[index % len(CHOICES)]
        use = tool_use(tools, choice, None).parsed_by("hermes")
        expected = [(call.name, call.arguments) for call in use.extract(row["generated_text"]).calls]
        got = [(call["name"], call["arguments"]) for call in row["tool_calls"] or []]
        assert got == expected, (index, row["generated_text"])
        if choice in ("required", CHOICES[1]) and row["finish_reason"] == "stop":
            assert got, row["generated_text"]
            stopped_with_calls += 1
            for name, arguments in got:
                jsonschema.validate(json.loads(arguments), schemas[name])
            assert choice == "required" or [name for name, _ in got] == ["get_weather"]
    assert stopped_with_calls >= len(rows) // 4  # most constrained rows end in complete calls


def test_a_batch_job_over_agent_traces_writes_a_tool_calls_column(ray_cluster, tmp_path) -> None:
    import pyarrow.parquet as pq
    from test_pipeline import write_jsonl

    from pipeline.job import run
    from pipeline.schema import TOOL_CALL

    # float32: the float weights and their int4 self-draft, so this job speculates (over the GGUF's own blocks, the
    # default's target on a CPU, its drafts cost as much as the target and it decodes plainly); a static length, so
    # it drafts whatever the timings the online policy would price drafts with beside the other test worker
    config = Config.model_validate({"chat_template": "hermes", "tool_call_parser": "hermes", "batch_size": 16,
                                    "dtype": "float32", "speculative": {"length_policy": "static"},
                                    "sampling": {"max_tokens": 40, "temperature": 0.0}})
    # The 8 distinct traces (a city and a tool_choice each) three times: a whole batch of 16 and part of one.
    rows = agent_traces(24)
    # Bad rows among them are error rows naming the field; the others run.
    bad = [{"id": "bad-tools", "messages": rows[0]["messages"], "tools": [WEATHER, WEATHER]},
           {"id": "bad-call-id", "messages": rows[0]["messages"][:3] + [{**rows[0]["messages"][3],
                                                                         "tool_call_id": "nope"}], "tools": TOOLS},
           {"id": "bad-named", "messages": rows[0]["messages"], "tools": TOOLS,
            "tool_choice": json.dumps({"type": "function", "function": {"name": "nope"}})}]
    summary = run(config, str(write_jsonl(tmp_path / "traces.jsonl", rows + bad)), str(tmp_path / "out"))
    table = pq.read_table(tmp_path / "out" / "outputs")
    assert table.schema.field("tool_calls").type.value_type == TOOL_CALL
    outputs = {row["id"]: row for row in table.to_pylist()}
    assert (summary["rows"], summary["errors"], len(outputs)) == (27, 3, 27)
    for row, named in zip(bad, ["get_weather given more than once", "tool_call_id 'nope' matches no earlier",
                                "'nope', which is not among tools"]):
        assert outputs[row["id"]]["finish_reason"] == "error" and named in outputs[row["id"]]["error"]
    assert_calls_follow_the_text([outputs[row["id"]] for row in rows])
    assert sum(sum(row["per_step_drafted"]) for row in outputs.values()) > 0


def test_the_same_traces_through_build_processor_with_ray_data_llms_row_shape(ray_cluster, smollm2,
                                                                             tmp_path) -> None:
    """The rows as Ray Data LLM's processor takes them, on a tiny random model over SmolLM2's vocabulary (the batch
    job above shows the real model's calls): no error rows, and each row's calls are what its text holds."""
    import ray

    import specbatch

    model = tiny_model(seed=5, vocab_size=len(smollm2))
    model.config.max_position_embeddings = 1024  # the traces' prompts, tools included, are ~350 tokens
    model.save_pretrained(tmp_path / "model")
    smollm2.save_pretrained(tmp_path / "model")
    processor = specbatch.build_processor(
        specbatch.ProcessorConfig(model_source=str(tmp_path / "model"), batch_size=16, chat_template="hermes",
                                  engine_kwargs={"tool_call_parser": "hermes"}, should_continue_on_error=True),
        preprocess=lambda row: {"sampling_params": {"temperature": 0.0, "max_tokens": 24}})
    rows = agent_traces(64)
    outputs = {row["id"]: row for row in processor(ray.data.from_items(rows)).take_all()}
    assert len(outputs) == 64 and not any(row["__inference_error__"] for row in outputs.values())
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    for index, row in enumerate(rows):
        use = tool_use(tools, CHOICES[index % len(CHOICES)], None).parsed_by("hermes")
        expected = [(call.name, call.arguments) for call in use.extract(outputs[row["id"]]["generated_text"]).calls]
        assert [(call["name"], call["arguments"]) for call in outputs[row["id"]]["tool_calls"] or []] == expected
