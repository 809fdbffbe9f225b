"""The OpenAI-compatible endpoint over real HTTP, against a local Ray Serve instance running the tiny models."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml

from decoding.config import Config, load_config
from decoding.engine import Engine, GenerationResult, Request
from deploy.detokenize import IncrementalText
from deploy.engine_loop import EngineFailure, EngineLoop, RequestRejected
from deploy.server import OpenAIServer, build_app, deployment_options

MAX_TOKENS = 12
MODEL = "tiny-llm"  # served_model_name
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"]


# LoRA adapters of the tiny target (PEFT's, random weights) the server is configured with.
ADAPTERS = {"qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            "rs16": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear", "use_rslora": True}}


@pytest.fixture(scope="module")
def adapter_dirs(target, tmp_path_factory) -> dict[str, str]:
    from test_lora import _make_adapter

    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        _make_adapter(target, fields, root / name, seed)
    _make_adapter(target, {"r": 4, "target_modules": ["o_proj"]}, root / "late", 9)  # loaded at run time
    return {name: str(root / name) for name in (*ADAPTERS, "late")}


@pytest.fixture(scope="module")
def config_file(tiny_dirs, adapter_dirs, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve") / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "model": tiny_dirs["target"],
        "served_model_name": MODEL,
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "length_policy": "static"},  # deterministic statistics, compared with the engine's
        "sampling": {"max_tokens": MAX_TOKENS},
        "trust_request_chat_template": True,  # test_chat_template_options_reach_the_template sends its own
        "lora": {"enable": True, "modules": {name: adapter_dirs[name] for name in ADAPTERS},
                 "allow_runtime_lora_updating": True},
    }))
    return str(path)


@pytest.fixture(scope="module")
def config(config_file) -> Config:
    return load_config(config_file, {"batch_size": "8"})


@pytest.fixture(scope="module")
def server(ray_cluster, config_file) -> str:
    """Base URL of a Serve app built the way a Serve YAML does it: ``build_app`` with a config file + overrides."""
    from ray import serve
    from test_pipeline import unused_ports

    from jobs.serve import start

    port = unused_ports(1)[0]  # below the ephemeral ports the session's cluster keeps binding
    start(build_app({"config": config_file, "batch_size": 8}), "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(config, target, tokenizer, draft):
    """Expected outputs: the same engine in-process (temperature 0 is deterministic)."""
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    counter = itertools.count()

    def generate(sampling: dict[str, Any] | None = None, **inputs: Any) -> GenerationResult:
        return engine.generate([Request(id=str(next(counter)), sampling=sampling, **inputs)])[0]

    return generate


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed request; asserts the ``data:`` framing and the final ``[DONE]``."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in events[:-1]]


# ------------------------------------------------------------------------------------------------- endpoints
def test_models_and_health(client, config):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["parent"]) for m in models["data"]] == [(MODEL, None), ("qv8", MODEL), ("rs16", MODEL)]
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"


def test_completion_matches_engine(client, config, reference, tokenizer):
    body = _post(client, "/v1/completions", {"model": MODEL, "prompt": "the cat sat", "temperature": 0})
    expected = reference(prompt="the cat sat")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    [choice] = body["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, expected.text, expected.finish_reason)
    prompt_tokens = len(tokenizer("the cat sat")["input_ids"])
    completion_tokens = len(expected.token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},  # a prompt shorter than a cache block: nothing cached
    }
    spec = body["metrics"]["speculative_decoding"]
    assert spec == expected.spec_decode  # one definition, computed in one place (decoding.stats)
    assert spec["num_spec_steps"] == sum(1 for drafted in expected.per_step_drafted if drafted) > 0
    accepted, steps = spec["num_accepted_draft_tokens"], spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["tokens_per_forward"] == pytest.approx(completion_tokens / expected.num_target_forwards)
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]


def test_prompt_list_gives_one_choice_per_prompt(client, reference):
    prompts = ["a dog", "far away home"]
    body = _post(client, "/v1/completions", {"prompt": prompts, "max_tokens": 6})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    expected = [reference(prompt=p, sampling={"max_tokens": 6}).text for p in prompts]
    assert [c["text"] for c in body["choices"]] == expected
    assert body["usage"]["completion_tokens"] <= 12


def test_chat_completion_matches_engine(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    body = _post(client, "/v1/chat/completions", {"messages": messages, "seed": 3})
    expected = reference(messages=messages)
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text, "tool_calls": []}  # vLLM's shape
    assert choice["finish_reason"] == expected.finish_reason
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["metrics"]["speculative_decoding"]["num_spec_steps"] >= 1
    # OpenAI's list-of-parts content is the same conversation.
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             messages[1]]
    assert _post(client, "/v1/chat/completions", {"messages": parts})["choices"][0]["message"] == choice["message"]


def _streamed_text(path: str, chunks: list[dict[str, Any]]) -> str:
    if path == "/v1/completions":
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("use_stop", [False, True], ids=["no-stop", "stop"])
@pytest.mark.parametrize(
    ("path", "inputs"),
    [
        ("/v1/completions", {"prompt": "and the dog"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a dog ran far"}]}),
    ],
    ids=["completions", "chat"],
)
def test_stream_concatenates_to_the_non_streamed_text(client, path, inputs, use_stop):
    body = {**inputs, "temperature": 0, "max_tokens": MAX_TOKENS}
    whole = _post(client, path, body)
    if use_stop:  # a multi-token stop string from inside the output: the stream must hold its start back
        text = whole["choices"][0]["text" if path == "/v1/completions" else "message"]
        text = text if isinstance(text, str) else text["content"]
        assert len(text) >= 6, text
        stop = text[3:5]
        body["stop"] = [stop, "zzzz"] if path == "/v1/completions" else stop  # OpenAI takes a list or a string
        whole = _post(client, path, body)
        assert whole["choices"][0]["finish_reason"] == "stop"
    expected = whole["choices"][0]["text"] if path == "/v1/completions" else whole["choices"][0]["message"]["content"]
    if use_stop:
        assert expected == text[: text.find(stop)]

    chunks = _stream(client, path, {**body, "stream_options": {"include_usage": True}})
    assert _streamed_text(path, chunks) == expected
    if not use_stop:  # really incremental (12 tokens take several steps), not one chunk at the end
        assert len([c for c in chunks if c["choices"]]) > 2
    *choice_chunks, usage_chunk = chunks
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert usage_chunk["choices"] == []
    # The same counts, but the stream's prompt was cached by the first request (``prompt_tokens_details``).
    assert {**usage_chunk["usage"], "prompt_tokens_details": None} == {**whole["usage"], "prompt_tokens_details": None}
    assert len({c["id"] for c in chunks}) == 1
    if path == "/v1/chat/completions":
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # Without stream_options there is no usage chunk.
    assert all(c["choices"] for c in _stream(client, path, body))


CHAT = {"messages": [{"role": "user", "content": "x"}]}

BAD_REQUESTS = [
    ("invalid-json", "/v1/completions", b'{"prompt": "ab",', None),
    ("not-an-object", "/v1/completions", ["ab"], None),
    ("missing-prompt", "/v1/completions", {"max_tokens": 4}, "prompt"),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("prompt-not-string", "/v1/completions", {"prompt": 5}, "prompt"),
    ("prompt-token-beyond-vocab", "/v1/completions", {"prompt": [1, 99]}, "prompt"),
    ("prompt-token-negative-stream", "/v1/completions", {"prompt": [-1, 3], "stream": True}, "prompt"),
    ("prompt-token-lists-one-beyond-vocab", "/v1/completions", {"prompt": [[3, 4], [5, 2**40]]}, "prompt"),
    ("prompt-token-list-empty", "/v1/completions", {"prompt": [[3], []]}, "prompt"),
    ("prompt-token-float", "/v1/completions", {"prompt": [3, 4.5]}, "prompt"),
    ("prompt-token-bool", "/v1/completions", {"prompt": [True]}, "prompt"),
    ("prompt-tokens-mixed", "/v1/completions", {"prompt": ["ab", 3]}, "prompt"),
    ("prompt-tokens-too-many", "/v1/completions", {"prompt": [3] * 1000}, "prompt"),
    ("echo-with-logprobs", "/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1}, "echo"),
    ("echo-not-bool", "/v1/completions", {"prompt": "ab", "echo": "yes"}, "echo"),
    ("prompt-empty-list", "/v1/completions", {"prompt": []}, "prompt"),
    ("prompt-empty", "/v1/completions", {"prompt": ""}, "prompt"),
    ("messages-not-list", "/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, "messages"),
    ("message-bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("max-tokens-negative", "/v1/completions", {"prompt": "ab", "max_tokens": -1}, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "ab", "max_tokens": 0}, "max_tokens"),
    ("max-tokens-absurd", "/v1/completions", {"prompt": "ab", "max_tokens": 10**12}, "max_tokens"),
    ("max-tokens-string", "/v1/completions", {"prompt": "ab", "max_tokens": "4"}, "max_tokens"),
    ("max-tokens-float", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5},
     "max_tokens"),
    ("temperature-negative", "/v1/completions", {"prompt": "ab", "temperature": -1}, "temperature"),
    ("temperature-string", "/v1/completions", {"prompt": "ab", "temperature": "hot"}, "temperature"),
    ("top-p-zero", "/v1/completions", {"prompt": "ab", "top_p": 0}, "top_p"),
    ("seed-huge", "/v1/completions", {"prompt": "ab", "seed": 2**70}, "seed"),
    ("stop-not-string", "/v1/completions", {"prompt": "ab", "stop": 3}, "stop"),
    ("stream-not-bool", "/v1/completions", {"prompt": "ab", "stream": "yes"}, "stream"),
    ("seed-negative", "/v1/completions", {"prompt": "ab", "seed": -1}, "seed"),
    ("n-zero", "/v1/completions", {"prompt": "ab", "n": 0}, "n"),
    ("unknown-field", "/v1/completions", {"prompt": "ab", "best_of_all": 2}, "best_of_all"),
    ("logit-bias-beyond-vocab", "/v1/completions", {"prompt": "ab", "logit_bias": {"35": 10}}, "logit_bias"),
    ("logit-bias-not-a-token", "/v1/completions", {"prompt": "ab", "logit_bias": {"a": 10}}, "logit_bias"),
    ("logit-bias-not-a-number", "/v1/completions", {"prompt": "ab", "logit_bias": {"5": "x"}}, "logit_bias"),
    ("min-p-big", "/v1/completions", {"prompt": "ab", "min_p": 1.5}, "min_p"),
    ("allowed-token-ids-empty", "/v1/completions", {"prompt": "ab", "allowed_token_ids": []}, "allowed_token_ids"),
    ("allowed-token-ids-beyond-vocab", "/v1/chat/completions", {**CHAT, "allowed_token_ids": [3, 35]},
     "allowed_token_ids"),
    ("bad-words-blank", "/v1/completions", {"prompt": "ab", "bad_words": [" "]}, "bad_words"),
    ("bad-words-string", "/v1/completions", {"prompt": "ab", "bad_words": "ab"}, "bad_words"),
    ("allowed-token-ids-all-banned", "/v1/completions", {"prompt": "ab", "allowed_token_ids": [2], "min_tokens": 1},
     "allowed_token_ids"),
    ("prompt-logprobs-big", "/v1/completions", {"prompt": "ab", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("include-stop-int", "/v1/completions", {"prompt": "ab", "include_stop_str_in_output": 1},
     "include_stop_str_in_output"),
    ("tools-set", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("presence-penalty-big", "/v1/completions", {"prompt": "ab", "presence_penalty": 3}, "presence_penalty"),
    ("top-logprobs-big", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("prompt-too-long", "/v1/completions", {"prompt": "a" * 300}, "prompt"),
    ("prompt-too-long-stream", "/v1/completions", {"prompt": "a" * 300, "stream": True}, "prompt"),
    ("prompt-list-one-too-long", "/v1/completions", {"prompt": ["ab", "a" * 300]}, "prompt"),
    ("messages-too-long-stream", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a" * 300}], "stream": True}, "messages"),
    # Every sampling field is bounded before the engine sees it, and errors name the field.
    ("top-k-overflow", "/v1/completions", {"prompt": "ab", "top_k": 2**63, "temperature": 1}, "top_k"),
    ("top-k-huge-stream", "/v1/completions", {"prompt": "ab", "top_k": 10**30, "stream": True}, "top_k"),
    ("stop-token-negative", "/v1/completions", {"prompt": "ab", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop-token-beyond-vocab", "/v1/completions", {"prompt": "ab", "stop_token_ids": [35]}, "stop_token_ids"),
    ("stop-token-huge", "/v1/completions", {"prompt": "ab", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ("stop-tokens-too-many", "/v1/completions", {"prompt": "ab", "stop_token_ids": [3] * 2000}, "stop_token_ids"),
    ("stop-tokens-ban-everything", "/v1/completions",
     {"prompt": "ab", "stop_token_ids": list(range(35)), "min_tokens": 2}, "stop_token_ids"),
    ("min-tokens-huge", "/v1/completions", {"prompt": "ab", "min_tokens": 10**9}, "min_tokens"),
    ("min-tokens-above-max", "/v1/completions", {"prompt": "ab", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("min-tokens-above-configured-max", "/v1/completions", {"prompt": "ab", "min_tokens": 100}, "min_tokens"),
    ("max-tokens-bool", "/v1/completions", {"prompt": "ab", "max_tokens": True}, "max_tokens"),
    ("max-tokens-4.0", "/v1/completions", {"prompt": "ab", "max_tokens": 4.0}, "max_tokens"),
    ("temperature-overflow", "/v1/completions", b'{"prompt": "ab", "temperature": 1e400}', "temperature"),
    ("top-p-nan", "/v1/completions", b'{"prompt": "ab", "top_p": NaN}', "top_p"),
    ("repetition-penalty-tiny", "/v1/completions", {"prompt": "ab", "repetition_penalty": 1e-300},
     "repetition_penalty"),
    ("stop-too-many", "/v1/completions", {"prompt": "ab", "stop": ["zz"] * 65}, "stop"),
    ("stop-too-long", "/v1/completions", {"prompt": "ab", "stop": "z" * 5000}, "stop"),
    ("ignore-eos-int", "/v1/completions", {"prompt": "ab", "ignore_eos": 1}, "ignore_eos"),
    ("too-many-sequences", "/v1/completions", {"prompt": ["ab"] * 20, "n": 128}, "prompt"),
    ("prompt-list-huge", "/v1/completions", {"prompt": ["ab"] * 5000}, "prompt"),
    ("seed-float", "/v1/completions", {"prompt": "ab", "seed": 1.5}, "seed"),
    ("user-not-string", "/v1/completions", {"prompt": "ab", "user": {"x": 1}}, "user"),
    # vLLM's /tokenize and /detokenize: bounded as prompts are, errors naming the field.
    ("tokenize-nothing", "/tokenize", {}, "prompt"),
    ("tokenize-both", "/tokenize", {"prompt": "ab", **CHAT}, "messages"),
    ("tokenize-prompt-not-string", "/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("tokenize-prompt-too-long", "/tokenize", {"prompt": "a" * 300}, "prompt"),
    ("tokenize-messages-too-long", "/tokenize", {"messages": [{"role": "user", "content": "a" * 300}]}, "messages"),
    ("tokenize-chat-field-on-prompt", "/tokenize", {"prompt": "ab", "add_generation_prompt": False},
     "add_generation_prompt"),
    ("tokenize-continue-and-add", "/tokenize", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("tokenize-unknown-field", "/tokenize", {"prompt": "ab", "tokens": [1]}, "tokens"),
    ("tokenize-tools", "/tokenize", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("tokenize-bad-role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("detokenize-missing", "/detokenize", {}, "tokens"),
    ("detokenize-beyond-vocab", "/detokenize", {"tokens": [1, 99]}, "tokens"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize-not-ints", "/detokenize", {"tokens": ["a"]}, "tokens"),
    ("detokenize-too-many", "/detokenize", {"tokens": [3] * 5000}, "tokens"),
]

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# Each names the field at fault in its message: (id, path, body, param, named).
BAD_CONSTRAINTS = [
    ("regex-invalid", "/v1/completions", {"prompt": "ab", "guided_regex": "(a"}, None, "structured_outputs.regex"),
    ("schema-invalid", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "bogus"}}}}, None,
     "structured_outputs.json"),
    ("schema-missing", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format", "json_schema"),
    ("two-constraints", "/v1/completions", {"prompt": "ab", "guided_regex": "a", "structured_outputs": {
        "choice": ["b"]}}, None, "exactly one"),
    ("whitespace-pattern", "/v1/completions", {"prompt": "ab", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "guided_whitespace_pattern"),
    ("other-backend", "/v1/completions", {"prompt": "ab", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend", "xgrammar"),
    # The tiny vocabulary has no "{": a valid JSON constraint it cannot spell is refused by the engine, named.
    ("json-object", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "messages",
     "structured_outputs.json_object cannot be spelled"),
    ("json-schema", "/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}}, "messages",
     "structured_outputs.json cannot be spelled"),
]
BAD_REQUESTS += [case[:4] for case in BAD_CONSTRAINTS]


@pytest.mark.parametrize(("path", "body", "named"), [(c[1], c[2], c[4]) for c in BAD_CONSTRAINTS],
                         ids=[c[0] for c in BAD_CONSTRAINTS])
def test_constraints_are_checked_and_named(client, path, body, named):
    response = client.post(path, json=body)
    assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_a_400_with_an_openai_error(client, path, body, param):
    response = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    assert client.get("/health").status_code == 200  # the replica survives


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "properties": {"a": {"type": "string"}}}}}
UNCOMPILABLE = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
# (id, body, the error's param, what its message says): each a 400, bounded, and the replica unharmed.
BAD_TOOLS = [
    ("not-a-schema", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools", "not a JSON schema"),
    ("duplicate-names", {**CHAT, "tools": [TOOL, TOOL]}, "tools", "f given more than once"),
    ("ten-thousand", {**CHAT, "tools": [TOOL] * 10_000}, "tools", "at most 128 tools"),
    ("schema-cannot-compile", {**CHAT, "tools": [UNCOMPILABLE], "tool_choice": "required"}, "tool_choice",
     "structured_outputs.json"),
    ("call-id-unmatched", {"messages": [{"role": "user", "content": "x"},
                                        {"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
     "messages", "messages[1].tool_call_id 'call_9' matches no earlier assistant tool call"),
    ("named-not-among-tools", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, "tool_choice", "'g', which is not among tools (f)"),
    ("auto-without-parser", {**CHAT, "tools": [TOOL]}, "tool_choice", "set tool_call_parser"),
    ("template-without-tools", {**CHAT, "tools": [TOOL], "tool_choice": "none"}, "messages", "no tool support"),
    ("with-response-format", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
]


@pytest.mark.parametrize(("body", "param", "named"), [c[1:] for c in BAD_TOOLS], ids=[c[0] for c in BAD_TOOLS])
def test_bad_tools_are_400s_naming_the_field(client, body, param, named):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], named in error["message"]) == (param, True), error
    assert client.get("/health").status_code == 200


# (path, body, the same constraint as structured_outputs, a pattern every complete output matches)
CONSTRAINED = [
    ("/v1/completions", {"prompt": "the cat", "guided_choice": ["a cat sat", "the dog"]},
     {"choice": ["a cat sat", "the dog"]}, "a cat sat|the dog"),
    ("/v1/completions", {"prompt": "a dog", "structured_outputs": {"regex": "(ran|sat) (far|home)\\."}},
     {"regex": "(ran|sat) (far|home)\\."}, "(ran|sat) (far|home)\\."),
    ("/v1/chat/completions", {**CHAT, "guided_grammar": 'root ::= "on " ("a mat" | "the mat") "."'},
     {"grammar": 'root ::= "on " ("a mat" | "the mat") "."'}, "on (a|the) mat\\."),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "[a-c]{3,}"}, {"regex": "[a-c]{3,}"}, "[a-c]{3,}"),
]


@pytest.mark.parametrize(("path", "body", "constraint", "pattern"), CONSTRAINED,
                         ids=["guided-choice", "structured-outputs", "guided-grammar", "guided-regex"])
def test_constrained_requests_follow_their_constraint_as_the_engine_does(client, reference, path, body, constraint,
                                                                         pattern):
    """Greedy and speculative (the server drafts with a model): the engine's plain constrained output, in full or
    cut by max_tokens; sampled choices follow the constraint too."""
    inputs = {key: value for key, value in body.items() if key in ("prompt", "messages")}
    expected = reference(sampling={"structured_outputs": constraint}, **inputs)
    response = _post(client, path, {**body, "temperature": 0})
    [choice] = response["choices"]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert (text, choice["finish_reason"]) == (expected.text, expected.finish_reason)
    assert re.fullmatch(pattern, text) if expected.finish_reason == "stop" else len(expected.token_ids) == MAX_TOKENS
    sampled = _post(client, path, {**body, "temperature": 1.0, "seed": 7, "n": 4, "max_tokens": 64})
    for choice in sampled["choices"]:
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "length" or re.fullmatch(pattern, text), text


def test_a_body_sent_as_text_or_form_is_refused_and_an_untyped_one_read_as_json(client):
    body = json.dumps({"prompt": "ab", "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = client.post("/v1/completions", content=body, headers={"Content-Type": content_type})
        assert response.status_code == 400, (content_type, response.text)
        assert "application/json" in response.json()["error"]["message"]
    for headers in ({}, {"Content-Type": "application/json; charset=utf-8"}):
        assert client.post("/v1/completions", content=body, headers=headers).status_code == 200


def test_an_oversized_body_is_refused_before_it_is_read(client):
    from deploy.asgi import MAX_BODY_BYTES

    response = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}',
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200


def test_tiny_temperatures_and_top_p_are_the_greedy_output(client):
    """vLLM's rule: a temperature below 1e-5 is greedy; top_p keeps the most likely token however small. Before,
    1e-38 and top_p 1e-46 emitted the vocabulary's last token every step."""
    body = {"prompt": "the cat sat", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    greedy = _post(client, "/v1/completions", {**body, "temperature": 0})["choices"][0]["text"]
    assert greedy
    for extreme in ({"temperature": 1e-38}, {"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-46}):
        assert _post(client, "/v1/completions", {**body, **extreme})["choices"][0]["text"] == greedy, extreme


def test_an_overflowing_top_k_is_a_400_while_six_requests_in_flight_complete(client, server, reference):
    """top_k >= 2**63 used to raise inside the engine step: the replica answered 503 to everyone in flight and
    /health failed until Serve replaced it."""
    prompts = [" ".join(WORDS[i : i + 3]) for i in range(6)]

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as aclient:
            others = [asyncio.create_task(aclient.post("/v1/completions", json={"prompt": p, "temperature": 0}))
                      for p in prompts]
            await asyncio.sleep(0.2)
            bad = await aclient.post("/v1/completions",
                                     json={"prompt": "hi", "top_k": 9223372036854775808, "temperature": 1})
            return list(await asyncio.gather(*others)), bad

    others, bad = asyncio.run(scenario())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
    assert [r.status_code for r in others] == [200] * 6
    assert [r.json()["choices"][0]["text"] for r in others] == [reference(prompt=p).text for p in prompts]
    assert client.get("/health").status_code == 200


def test_a_stream_keeping_special_tokens_concatenates_to_the_non_streamed_text(client, tokenizer):
    """With skip_special_tokens false (a tool parser's markers may be special tokens) the stream's text keeps them
    as the whole response does, and neither shows the token that ended the sequence (EOS, a stop_token_ids
    entry), as vLLM's text does not."""
    stopped = 0
    for prompt in ("the cat", "a dog ran", "on a mat and"):
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 40, "skip_special_tokens": False}
        whole = _post(client, "/v1/completions", body)["choices"][0]
        ids = _post(client, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]["token_ids"]
        assert _streamed_text("/v1/completions", _stream(client, "/v1/completions", body)) == whole["text"]
        if whole["finish_reason"] == "stop":
            stopped += 1
            assert whole["text"] == tokenizer.decode(ids[:-1], skip_special_tokens=False)
        # Stopping on a token of the text: that token's text is left out, streamed or not.
        token = ids[len(ids) // 2]
        cut = _post(client, "/v1/completions", {**body, "stop_token_ids": [token]})["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["stop_reason"] == token
        streamed = _streamed_text("/v1/completions", _stream(client, "/v1/completions", {**body,
                                                                                          "stop_token_ids": [token]}))
        assert streamed == cut["text"] == tokenizer.decode(ids[:ids.index(token)], skip_special_tokens=False)
    assert stopped  # some ended with EOS


def test_a_replica_killed_mid_request_is_an_openai_503_and_ends_streams_with_an_error_event(server, config_file):
    """The replica dies under a plain and a streamed request: the plain one gets an OpenAI-shaped 503 (Serve's
    proxy alone answered a plain-text 500), the stream an error event and [DONE] (it ended without either); until
    Serve's new replica answers, requests are 503s, never hangs."""
    import ray
    from ray import serve

    with pytest.MonkeyPatch.context() as patch:
        for name in ("SPECBATCH_API_KEY", "VLLM_API_KEY"):
            patch.delenv(name, raising=False)
        # Its own model name: the module's metrics tests count tiny-llm's series.
        serve.run(build_app({"config": config_file, "batch_size": 32, "served_model_name": "tiny-killed"}),
                  name="killed", route_prefix="/killed")
    try:
        replicas = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
                    if actor["name"].startswith("SERVE_REPLICA::killed#OpenAIServer#")]
        assert len(replicas) == 1
        long = {"prompt": "the cat", "max_tokens": 240, "n": 16, "ignore_eos": True}

        async def scenario() -> tuple[httpx.Response, list[str]]:
            async with httpx.AsyncClient(base_url=f"{server}/killed", timeout=120) as aclient:
                plain = asyncio.create_task(aclient.post("/v1/completions", json=long))
                async with aclient.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                    assert response.status_code == 200
                    lines = aiter(line async for line in response.aiter_lines() if line.startswith("data: "))
                    await anext(lines)  # under way
                    # Both requests' 32 sequences decode (one batch) before the kill, whichever came first.
                    while (await aclient.get("/health")).json()["running"] < 32:
                        assert not plain.done(), plain.result().text
                        await asyncio.sleep(0.05)
                    for actor in replicas:
                        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
                    rest = [line async for line in lines]
                return await plain, rest

        plain, rest = asyncio.run(scenario())
        assert plain.status_code == 503 and plain.headers["retry-after"], plain.text
        assert plain.json()["error"]["code"] == "service_unavailable"
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "service_unavailable"
        deadline = time.monotonic() + 120
        while (answer := httpx.post(f"{server}/killed/v1/completions", json={"prompt": "ab", "max_tokens": 2},
                                    timeout=60)).status_code != 200:
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "service_unavailable", answer.text
            assert time.monotonic() < deadline
            time.sleep(1)
    finally:
        serve.delete("killed")


@pytest.fixture(scope="module")
def keyed_server(server, config_file, ray_cluster, monkeypatch_module) -> str:
    """A second application, behind an API key from the environment, under its own route prefix."""
    from ray import serve

    monkeypatch_module.setenv("SPECBATCH_API_KEY", "sk-test-key")
    serve.run(build_app({"config": config_file, "batch_size": 2, "lora": {"allow_runtime_lora_updating": False}}),
              name="keyed", route_prefix="/keyed")
    yield f"{server}/keyed"
    serve.delete("keyed")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_an_api_key_guards_every_route_but_health_ping_and_metrics(keyed_server):
    routes = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
              ("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
              ("POST", "/tokenize", {"prompt": "ab"}), ("POST", "/detokenize", {"tokens": [3]}),
              ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
              ("POST", "/v1/unload_lora_adapter", {"lora_name": "qv8"}),
              ("GET", "/version", None), ("GET", "/v1/nothing", None)]
    with httpx.Client(base_url=keyed_server, timeout=60) as client:
        assert client.get("/health").status_code == 200
        # Open, as vLLM leaves them: liveness, and the metrics a scraper reads (metrics_require_api_key guards them).
        assert [client.request(m, p).status_code for m, p in (("GET", "/ping"), ("POST", "/ping"),
                                                               ("GET", "/metrics"))] == [200, 200, 200]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-key"},
                        {"Authorization": "Basic sk-test-key"}):
            for method, path, body in routes:
                response = client.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
                assert "sk-test-key" not in response.text
        good = {"Authorization": "Bearer sk-test-key"}
        # The adapter routes are off on this server (lora.allow_runtime_lora_updating: false): 404 behind the key.
        assert [client.request(m, p, json=b, headers=good).status_code for m, p, b in routes] == [
            200, 200, 200, 200, 200, 200, 404, 404, 200, 404]
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sk-test-key", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="ab", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="nope", max_retries=0).models.list()


def test_models_by_id_and_unknown_models_are_404s(client, config):
    card = client.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL
    for response in (client.get("/v1/models/gpt-4"),
                     client.post("/v1/completions", json={"prompt": "ab", "model": "gpt-4"}),
                     client.post("/v1/completions", json={"prompt": "ab", "model": config.model})):  # the path
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"]


def _prometheus(client: httpx.Client) -> dict[tuple[str, str], float]:
    """The replica's vLLM counters and histogram counts: (name without ``vllm:``, position label) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name.removeprefix("vllm:"), sample.labels.get("position", "")): sample.value
        for family in text_string_to_metric_families(response.text) for sample in family.samples
        if sample.name.startswith("vllm:") and sample.name.endswith(("_total", "_count"))
    }


METRICS_REQUESTS = [  # 6 sequences, no stop strings: every emitted token is a completion token
    ("/v1/completions", {"prompt": ["the cat sat on", "a dog ran far"], "max_tokens": 10, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "home"}], "max_tokens": 9}),
    ("/v1/completions", {"prompt": "a mat and", "max_tokens": 8, "temperature": 1.0}),
]


def _check_vllm_metrics(delta: dict[tuple[str, str], float], responses: list[dict[str, Any]]) -> None:
    """vLLM's counters (names without ``vllm:`` / ``ray_vllm_``) against the responses' usage and metrics."""
    specs = [r["metrics"]["speculative_decoding"] for r in responses]
    sequences = sum(len(r["choices"]) for r in responses)
    assert delta[("prompt_tokens_total", "")] == sum(r["usage"]["prompt_tokens"] for r in responses)
    assert delta[("generation_tokens_total", "")] == sum(r["usage"]["completion_tokens"] for r in responses)
    assert delta[("time_to_first_token_seconds_count", "")] == sequences
    assert delta[("e2e_request_latency_seconds_count", "")] == sequences
    assert delta[("inter_token_latency_seconds_count", "")] > 0  # vLLM's name (time_per_output_token is gone)
    assert delta[("spec_decode_num_drafts_total", "")] == sum(s["num_spec_steps"] for s in specs)
    assert delta[("spec_decode_num_draft_tokens_total", "")] == sum(s["num_draft_tokens"] for s in specs)
    assert delta[("spec_decode_num_accepted_tokens_total", "")] == sum(s["num_accepted_draft_tokens"] for s in specs)


def test_prometheus_totals_equal_the_sum_of_per_response_metrics(client):
    before = _prometheus(client)
    responses = [_post(client, path, body) for path, body in METRICS_REQUESTS]
    after = _prometheus(client)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    _check_vllm_metrics(delta, responses)
    specs = [r["metrics"]["speculative_decoding"] for r in responses]
    assert sum(s["num_spec_steps"] for s in specs) > 0
    # Per position: the steps whose accepted run reached it, from the responses' histograms.
    for position in range(3):
        reached = sum(sum(s["acceptance_histogram"][position + 1 :]) for s in specs)
        assert delta.get(("spec_decode_num_accepted_tokens_per_pos_total", str(position)), 0.0) == reached


def _settled(read, what: str) -> dict[tuple[str, str], float]:
    """``read()`` once two reads seconds apart agree (processes report to Ray's export every second here)."""
    last = read()
    for _ in range(20):
        time.sleep(3)
        now = read()
        if now == last:
            return now
        last = now
    pytest.fail(f"{what} kept changing for a minute")


def test_ray_metrics_export_has_vllms_names_labels_and_totals(client, ray_cluster):
    from conftest import scrape_ray_metrics

    def read() -> dict[tuple[str, str], float]:
        scraped = scrape_ray_metrics(ray_cluster, model_name=MODEL, engine="0")
        return {(name.removeprefix("ray_vllm_"), position): value for (name, position), value in scraped.items()}

    before = _settled(read, "Ray's metrics export")
    responses = [_post(client, path, body) for path, body in METRICS_REQUESTS]
    after = _settled(read, "Ray's metrics export")
    _check_vllm_metrics({key: after[key] - before.get(key, 0.0) for key in after}, responses)
    # Gauges, set after every step: the replica exports their last values every second, and Ray's agent drops a
    # gauge that no export refreshed within two seconds, so beside a CPU-heavy job one late export hid them from a
    # scrape. They must come back with the next one.
    gauges = [("ray_vllm_" + name, "")
              for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
    for _ in range(30):
        scraped = scrape_ray_metrics(ray_cluster, model_name=MODEL)
        if all(gauge in scraped for gauge in gauges):
            break
        time.sleep(1)
    assert all(gauge in scraped for gauge in gauges), sorted(scraped)
    # vLLM's Ray wrapper labels each series with the Serve replica's id.
    assert not scrape_ray_metrics(ray_cluster, model_name=MODEL, ReplicaId="")


def test_a_replica_hands_the_router_what_was_sent_at_once_as_one_item():
    """asgi.call: the body sent with the status line travels with it (a whole JSON response is one item, answered
    by the router without streaming), and body chunks sent together are one item (one Ray object each, not one per
    choice's chunk); a chunk sent later is an item of its own; the app's failure mid-body reaches the caller."""
    from deploy import asgi

    async def items(path: str) -> list:
        later = asyncio.Event()

        async def app(scope, receive, send) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
            for part in (b"a", b"b", b"c"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await later.wait()
            await send({"type": "http.response.body", "body": b"d", "more_body": path == "/fails"})
            if path == "/fails":
                raise RuntimeError("gone")

        stream = asgi.call(app, "POST", path, [], b"{}")
        got = [await anext(stream)]
        later.set()
        try:
            async for item in stream:
                got.append(item)
        except RuntimeError as exc:
            got.append(exc)
        return got

    start, *rest = asyncio.run(items("/ok"))
    assert (start["status"], start["headers"], start["body"], start["complete"], rest) == (
        200, [("x-a", "1")], b"abc", False, [b"d"])
    assert [type(item) for item in asyncio.run(items("/fails"))[1:]] == [bytes, RuntimeError]

    async def whole(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": {}}'})

    async def collect() -> list:
        return [item async for item in asgi.call(whole, "GET", "/x", [], b"")]

    assert asyncio.run(collect()) == [{"status": 404, "headers": [], "body": b'{"error": {}}', "complete": True}]


def test_unknown_route_has_an_openai_error_body(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_client_leaving_a_stream_does_not_disturb_the_replica(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "the cat", "max_tokens": 200, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert _post(client, "/v1/completions", {"prompt": "ab", "max_tokens": 4})["choices"][0]["finish_reason"]
    # The engine cannot abort: the abandoned sequence decodes to its end, unread, then leaves the batch.
    for _ in range(300):
        health = client.get("/health").json()
        if health["running"] == health["waiting"] == 0:
            break
        time.sleep(0.1)
    assert health == {**health, "status": "ok", "running": 0, "waiting": 0}


def _steps(client: httpx.Client) -> int:
    return client.get("/health").json()["steps"]


def test_vllms_request_fields_have_vllms_meaning(client, reference):
    """request_id names the response, priority 0 is accepted and any other a 400 (no priority scheduling, as vLLM's
    default scheduler answers), vllm_xargs is accepted and ignored (no custom logits processors run), and
    return_token_ids puts the prompt's and the choice's ids beside the text, whole or streamed."""
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 0}
    expected = reference(prompt="the cat", sampling={"max_tokens": 8})
    answer = _post(client, "/v1/completions", {**body, "request_id": "job-7", "priority": 0,
                                               "vllm_xargs": {"a": 1, "b": [1.5, "x"]}, "return_token_ids": True})
    assert answer["id"] == "cmpl-job-7"
    choice = answer["choices"][0]
    assert choice["text"] == expected.text
    assert choice["token_ids"] == expected.token_ids and choice["prompt_token_ids"] == expected.prompt_token_ids
    assert _post(client, "/v1/completions", body)["choices"][0]["token_ids"] is None  # only when asked for
    chunks = _stream(client, "/v1/completions", {**body, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == expected.prompt_token_ids  # a first chunk of its own
    assert [t for chunk in chunks for c in chunk["choices"] for t in c["token_ids"]] == expected.token_ids
    refused = client.post("/v1/completions", json={**body, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    # Input options reach the engine (decoding.engine.Request; their meaning is tested there).
    cut = _post(client, "/v1/completions", {**body, "truncate_prompt_tokens": 2, "add_special_tokens": False,
                                            "cache_salt": "tenant-1", "return_token_ids": True})
    assert cut["choices"][0]["prompt_token_ids"] == expected.prompt_token_ids[-2:]
    for field, value in (("truncate_prompt_tokens", 0), ("cache_salt", "")):
        refused = client.post("/v1/completions", json={**body, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text

    messages = [{"role": "user", "content": "a cat"}]
    whole = _post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                   "return_token_ids": True, "request_id": "chat-1"})
    assert whole["id"] == "chatcmpl-chat-1"
    chunks = _stream(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                      "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"] and whole["prompt_token_ids"]
    streamed = [t for chunk in chunks for c in chunk["choices"] for t in c["token_ids"] or []]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == whole["usage"]["completion_tokens"]
    text = "".join(c["delta"]["content"] or "" for chunk in chunks for c in chunk["choices"])
    assert text == whole["choices"][0]["message"]["content"]

    # Chat echo: a last assistant message (continued here) leads each choice's content, whole or streamed.
    prefix = [*messages, {"role": "assistant", "content": "the dog"}]
    continued = {"messages": prefix, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False,
                 "continue_final_message": True, "n": 2}
    bare = _post(client, "/v1/chat/completions", continued)["choices"][0]["message"]["content"]
    echoed = _post(client, "/v1/chat/completions", {**continued, "echo": True})["choices"]
    assert [c["message"]["content"] for c in echoed] == ["the dog" + bare] * 2
    streamed = _stream(client, "/v1/chat/completions", {**continued, "echo": True, "n": 1})
    assert "".join(c["delta"]["content"] or "" for chunk in streamed for c in chunk["choices"]) == "the dog" + bare
    plain = _post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                   "echo": True})  # the last message is the user's: nothing led
    assert plain["choices"][0]["message"]["content"] == _post(client, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 4, "temperature": 0})["choices"][0]["message"]["content"]


def test_stop_reason_names_what_stopped_a_choice_and_usage_counts_cached_prompt_tokens(client, reference):
    """vLLM's stop_reason: the stop string or the stop token id that ended a choice, null for a length (or EOS)
    ending, streamed with the last chunk; usage.prompt_tokens_details.cached_tokens counts the prompt tokens the
    prefix cache held."""
    expected = reference(prompt="the cat", sampling={"max_tokens": 12, "ignore_eos": True})
    assert len(expected.token_ids) == 12
    token = expected.token_ids[3]
    stop_text = expected.text[len(expected.text) // 2:][:2]
    body = {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert _post(client, "/v1/completions", body)["choices"][0]["stop_reason"] is None  # ended by length
    by_token = _post(client, "/v1/completions", {**body, "stop_token_ids": [token]})["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == token
    by_text = _post(client, "/v1/completions", {**body, "stop": ["zzzz", stop_text]})["choices"][0]
    assert by_text["finish_reason"] == "stop" and by_text["stop_reason"] == stop_text
    chunks = _stream(client, "/v1/completions", {**body, "stop": [stop_text]})
    assert [c["stop_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == [stop_text]

    long = {"prompt": " ".join(WORDS[i % len(WORDS)] for i in range(40)), "max_tokens": 2, "temperature": 0}
    first = _post(client, "/v1/completions", long)["usage"]
    again = _post(client, "/v1/completions", long)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] <= again["prompt_tokens"]


def test_32_concurrent_requests_match_sequential_and_share_steps(client, server, reference):
    prompts = [" ".join(WORDS[(i * k) % len(WORDS)] for k in (1, 3, 7)) + f" {WORDS[i // 12]}" for i in range(32)]
    # Each request lives ~30 steps: longer than its 32 arrivals take through Serve's proxy and the router (seconds
    # on 2 cores, while the first arrivals already step with few rows), so the steps they share dominate.
    bodies = [{"prompt": p, "max_tokens": 60 + i % 5, "temperature": 0, "ignore_eos": True}
              for i, p in enumerate(prompts)]
    # One at a time (the same engine in-process): each request's text, and the steps it needs alone.
    alone = [reference(prompt=b["prompt"], sampling={"max_tokens": b["max_tokens"], "ignore_eos": True})
             for b in bodies]

    async def concurrent() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as aclient:
            return await asyncio.gather(*(aclient.post("/v1/completions", json=b) for b in bodies))

    before = _steps(client)
    responses = asyncio.run(concurrent())
    concurrent_steps = _steps(client) - before
    assert [r.status_code for r in responses] == [200] * 32
    assert [r.json()["choices"][0]["text"] for r in responses] == [result.text for result in alone]
    # One at a time, every request needs its own steps; batched (8 rows) they share them.
    sequential_steps = sum(result.spec_decode["num_spec_steps"] for result in alone)
    assert concurrent_steps * 3 < sequential_steps, (concurrent_steps, sequential_steps)


def test_official_openai_client(server, config, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert MODEL in [m.id for m in client.models.list()]

    completion = client.completions.create(model=MODEL, prompt="the dog ran", max_tokens=8, temperature=0)
    assert completion.choices[0].text == reference(prompt="the dog ran", sampling={"max_tokens": 8}).text
    expected = reference(prompt="the dog ran", sampling={"max_tokens": 8}).spec_decode
    assert completion.model_extra["metrics"]["speculative_decoding"] == expected

    messages = [{"role": "user", "content": "a cat"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == reference(messages=messages, sampling={"max_tokens": 8}).text

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="a" * 300)


def test_streaming_with_logprobs_through_the_official_openai_client(server):
    """vLLM's chunk format: each chunk carries the logprobs of the tokens whose text it carries; together they are
    the whole response's."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "the cat"}]
    fields = {"model": MODEL, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2,
              "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(messages=messages, **fields).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **fields))
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert len(whole) == 10 and sum(1 for c in chunks if c.choices and c.choices[0].logprobs) > 1
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in whole]
    # the second request finds the prompt's blocks cached and prefills fewer tokens: a GEMM of another shape may
    # round the last bits differently (seen on AMD EPYC: -0.6830951 against -0.6830959)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], rel=1e-5, abs=1e-6)
    assert [t.logprob for e in streamed for t in e.top_logprobs] == pytest.approx(
        [t.logprob for e in whole for t in e.top_logprobs], rel=1e-5, abs=1e-6)
    assert all(len(e.top_logprobs) == 2 for e in streamed)

    fields = {"model": MODEL, "prompt": "a dog ran", "max_tokens": 10, "temperature": 0, "logprobs": 2,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**fields).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields)
             if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [x for p in parts for x in p.token_logprobs] == whole.token_logprobs
    assert [x for p in parts for x in p.text_offset] == whole.text_offset
    assert [x for p in parts for x in p.top_logprobs] == whole.top_logprobs


def test_vllms_sampling_extensions_reach_the_engine(client, server, reference, tokenizer):
    """min_p, logit_bias (OpenAI's string keys), allowed_token_ids, bad_words, include_stop_str_in_output and
    prompt_logprobs, as the official client sends them (extra_body): the engine's outputs, streamed the same."""
    openai_client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    a, t, space = (tokenizer.convert_tokens_to_ids(c) for c in "at ")
    fields = {"logit_bias": {str(a): 3.0, str(t): -100}, "bad_words": ["ee", "o"], "min_p": 0.2,
              "allowed_token_ids": list(range(2, 20)) + [space], "prompt_logprobs": 2}
    expected = reference(prompt="the dog ran", sampling={"max_tokens": 8, **fields})
    plain = reference(prompt="the dog ran", sampling={"max_tokens": 8})
    assert expected.token_ids != plain.token_ids
    completion = openai_client.completions.create(model=MODEL, prompt="the dog ran", max_tokens=8, temperature=0,
                                                  extra_body=fields)
    [choice] = completion.choices
    assert choice.text == expected.text and "t" not in choice.text and "o" not in choice.text
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(expected.prompt_token_ids)
    for position, entry in zip(prompt_logprobs[1:], expected.prompt_logprobs[1:], strict=True):
        first = position[str(entry["token_id"])]
        assert (first["logprob"], first["rank"]) == (pytest.approx(entry["logprob"]), entry["rank"])
        assert first["decoded_token"] == tokenizer.decode([entry["token_id"]])
        assert {str(alt["token_id"]) for alt in entry["top_logprobs"]} <= set(position)

    # include_stop_str_in_output: the stop string stays in the text, streamed or not.
    stop = expected.text[2:4]
    body = {"prompt": "the dog ran", "max_tokens": 8, "temperature": 0, "stop": [stop], **fields}
    whole = {flag: _post(client, "/v1/completions", {**body, "include_stop_str_in_output": flag})
             for flag in (False, True)}
    end = expected.text.index(stop)
    assert whole[False]["choices"][0]["text"] == expected.text[:end]
    assert whole[True]["choices"][0]["text"] == expected.text[: end + len(stop)]
    chunks = _stream(client, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert _streamed_text("/v1/completions", chunks) == expected.text[: end + len(stop)]
    assert chunks[-1]["choices"][0]["prompt_logprobs"] == whole[True]["choices"][0]["prompt_logprobs"]
    chat = _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "prompt_logprobs": 1})
    assert chat["prompt_logprobs"][0] is None and all(len(entry) <= 2 for entry in chat["prompt_logprobs"][1:])


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if enable_thinking %}think: {% endif %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_chat_template_options_reach_the_template(server, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": "the"}]
    for options in ({"chat_template": THINKING_TEMPLATE, "chat_template_kwargs": {"enable_thinking": True}},
                    {"chat_template": THINKING_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}},
                    {"continue_final_message": True, "add_generation_prompt": False}):
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body=options)
        expected = reference(messages=messages, sampling={"max_tokens": 8}, **options)
        assert chat.choices[0].message.content == expected.text
        assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)
        thinking = options.get("chat_template_kwargs", {}).get("enable_thinking", False)
        assert expected.prompt.endswith("think: assistant: ") == thinking
        assert expected.prompt.endswith("assistant: the") == ("continue_final_message" in options)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})


def test_official_openai_client_with_vllm_sampling_fields(server, config, reference, tokenizer):
    """n, logprobs/top_logprobs, penalties (neutral and not), seed and max_completion_tokens as clients send them."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "the cat"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, logprobs=True, top_logprobs=2, frequency_penalty=0,
        presence_penalty=0.5, max_completion_tokens=8, temperature=0, response_format={"type": "text"},
    )
    expected = reference(messages=messages, sampling={"max_tokens": 8, "presence_penalty": 0.5, "logprobs": 2})
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:  # greedy: both choices are the penalized greedy output
        assert choice.message.content == expected.text
        content = choice.logprobs.content
        assert [tokenizer.decode([e["token_id"]]) for e in expected.logprobs] == [t.token for t in content]
        for token, entry in zip(content, expected.logprobs, strict=True):
            assert token.logprob == pytest.approx(entry["logprob"], abs=1e-4)
            assert len(token.top_logprobs) == 2
            assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
    assert chat.usage.completion_tokens == 2 * len(expected.token_ids)

    # Sampled: a seed reproduces the n choices, and the choices differ from one another.
    def sampled(seed: int) -> list[str]:
        completion = client.completions.create(model=MODEL, prompt="the dog", n=4, seed=seed, temperature=1.0,
                                               max_tokens=10, logprobs=1)
        assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in completion.choices)
        return [c.text for c in completion.choices]

    first = sampled(5)
    assert first == sampled(5) and len(set(first)) > 1
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=MODEL, prompt="the dog", seed=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="the dog")


JSON_MODEL = "tiny-json"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{0,6}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
                   "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99999}},
                               "required": ["zip"]}},
    "required": ["name", "age", "pets", "address"],
}


@pytest.fixture(scope="module")
def json_server(server, ray_cluster, tmp_path_factory) -> str:
    """A second application over a tiny random target with SmolLM2's vocabulary (the tiny one cannot spell JSON),
    drafting with n-gram lookup and the grammar's forced tokens, under its own route prefix."""
    from ray import serve
    from tiny import tiny_model

    from decoding.model.loading import DEFAULT_MODEL, load_tokenizer

    root = tmp_path_factory.mktemp("json-model")
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    tiny_model(seed=5, vocab_size=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "serve.yaml").write_text(yaml.safe_dump({
        "model": str(root / "model"), "served_model_name": JSON_MODEL,
        "speculative": {"method": "ngram", "num_speculative_tokens": 4}, "sampling": {"max_tokens": 96},
    }))
    with pytest.MonkeyPatch.context() as patch:  # no API key, whichever application was built before
        for name in ("SPECBATCH_API_KEY", "VLLM_API_KEY"):
            patch.delenv(name, raising=False)
        serve.run(build_app({"config": str(root / "serve.yaml"), "batch_size": 4}), name="json",
                  route_prefix="/json")
    yield f"{server}/json"
    serve.delete("json")


TOOLS_MODEL = "smollm2-tools"


@pytest.fixture(scope="module")
def tools_server(server, ray_cluster, tmp_path_factory) -> str:
    """The real default model with the built-in hermes template and parser and the default self-draft, as a third
    application under its own route prefix; on its float32 weights, whose int4 self-draft speculates (over the
    GGUF's own blocks, the default on a CPU, the self-draft is the target itself), at a static length: the online
    policy prices drafts with timings taken beside the other test worker, and on a slow machine it may not draft
    at all in a short answer, where these tests check calls made under speculation."""
    from ray import serve

    path = tmp_path_factory.mktemp("tools") / "serve.yaml"
    path.write_text(yaml.safe_dump({"served_model_name": TOOLS_MODEL, "chat_template": "hermes", "dtype": "float32",
                                    "tool_call_parser": "hermes", "sampling": {"max_tokens": 128},
                                    "speculative": {"length_policy": "static"}}))
    with pytest.MonkeyPatch.context() as patch:
        for name in ("SPECBATCH_API_KEY", "VLLM_API_KEY"):
            patch.delenv(name, raising=False)
        serve.run(build_app({"config": str(path), "batch_size": 4}), name="tools", route_prefix="/tools")
    yield f"{server}/tools"
    serve.delete("tools")


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat's content, its calls assembled from OpenAI's deltas (id, type and name first, then argument
    fragments), and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.type == "function" and call.function.name
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_openai_client_required_and_named_tool_choices_answer_valid_calls_on_the_default_model(tools_server):
    from concurrent.futures import ThreadPoolExecutor

    from test_tool_calls import TOOLS

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    client = openai.OpenAI(base_url=f"{tools_server}/v1", api_key="unused", max_retries=0)

    def ask(question: str, choice: str | dict) -> int:
        """The call asked for, streamed and not; returns the tokens drafted."""
        asked = {"model": TOOLS_MODEL, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                 "tool_choice": choice, "temperature": 0}
        chat = client.chat.completions.create(**asked)
        message, finish = chat.choices[0].message, chat.choices[0].finish_reason
        assert finish == "tool_calls" and message.tool_calls and not message.content, (question, choice, chat)
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice != "required":
            assert [call.function.name for call in message.tool_calls] == ["get_weather"]
        content, calls, finish = _streamed_calls(client.chat.completions.create(**asked, stream=True))
        assert (content, finish) == ("", "tool_calls")
        assert calls == [(call.function.name, call.function.arguments) for call in message.tool_calls]
        return chat.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"]

    # The two questions at once: their rows share the replica's steps (each answer is its own row's either way).
    with ThreadPoolExecutor(2) as pool:
        drafted = sum(pool.map(ask, ["Search the web for the latest news about Mars.",
                                     "What's the weather like in Paris today?"],
                               ["required", {"type": "function", "function": {"name": "get_weather"}}]))
    assert drafted > 0  # the self-draft drafted under the tool-call constraint


def test_tool_choice_auto_returns_what_the_parser_reads_from_the_text(tools_server):
    from concurrent.futures import ThreadPoolExecutor

    from test_tool_calls import TOOLS, TRACE  # an agent trace: a call, its result, a new question

    from frontend.tool_parsers import PARSERS

    client = openai.OpenAI(base_url=f"{tools_server}/v1", api_key="unused", max_retries=0)
    asked = {"model": TOOLS_MODEL, "messages": TRACE, "tools": TOOLS, "temperature": 0, "max_tokens": 24}
    with ThreadPoolExecutor(3) as pool:  # the three at once, sharing the replica's steps
        none = pool.submit(client.chat.completions.create, **asked, tool_choice="none")
        auto = pool.submit(client.chat.completions.create, **asked, tool_choice="auto")
        streamed = pool.submit(lambda: _streamed_calls(client.chat.completions.create(**asked, stream=True)))
    parsed = PARSERS["hermes"]().parse(none.result().choices[0].message.content)  # tools are shown with none too
    chat = auto.result()
    message = chat.choices[0].message
    assert message.content == parsed.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (call.name, call.arguments) for call in parsed.calls]
    assert (chat.choices[0].finish_reason == "tool_calls") == bool(parsed.calls)
    content, calls, _ = streamed.result()
    assert (content or None, calls) == (parsed.content, [(call.name, call.arguments) for call in parsed.calls])


def test_official_openai_client_with_a_json_schema_response_format(json_server):
    client = openai.OpenAI(base_url=f"{json_server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "A person as JSON, please."}]
    forced = 0
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(
            model=JSON_MODEL, messages=messages, temperature=temperature, seed=3, n=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}},
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},  # a random model's spaces never end
        )
        for choice in chat.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        forced += chat.model_extra["metrics"]["speculative_decoding"]["num_grammar_forced_tokens"]
    assert forced > 0  # keys, braces and quotes the schema allows alone were free drafts
    # vLLM's older field and the completions endpoint: the same constraint.
    completion = client.completions.create(model=JSON_MODEL, prompt="{", temperature=0,
                                           extra_body={"guided_json": PERSON, "structured_outputs": {
                                               "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


# ------------------------------------------------------------------------- vLLM's metrics and extra routes
def _documented_metrics() -> list[str]:
    """The metric names docs/serve.md's metrics table lists."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    return re.findall(r"^\| `(vllm:[a-z0-9_]+)` \|", text[text.index("### Metrics"):], re.M)


def _metric_totals(base_url: str, names: list[str]) -> dict[str, float]:
    """``/metrics`` scraped without an Authorization header: per metric of the served model, its counters' sum over
    series, its histograms' observation count, its gauges' value; absent metrics are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", timeout=60)
    assert response.status_code == 200, response.text
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    totals = {}
    for name in names:
        family = families.get(name)
        suffix = {"histogram": "_count", "counter": "_total"}.get(family.type, "") if family else ""
        values = [sample.value for sample in (family.samples if family else [])
                  if sample.labels.get("model_name") == MODEL and sample.name == name + suffix]
        if values:
            totals[name] = sum(values)
    return totals


def test_metrics_need_no_api_key_and_every_documented_metric_moves(keyed_server):
    """vLLM leaves /metrics open: scraped without the key (the keyed application), it shows every metric the docs
    list (and the docs list every metric exported), each counter and histogram moving with a few requests but
    num_preemptions (this engine never preempts), which exists at 0."""
    from frontend.metrics import SPECS

    documented = _documented_metrics()
    assert sorted(documented) == sorted(SPECS) and len(documented) == len(set(documented))
    before = _metric_totals(keyed_server, documented)
    shared = "the quick brown fox jumps over the lazy dog and "  # 3 full blocks: the second choice finds them cached
    with httpx.Client(base_url=keyed_server, timeout=60, headers={"Authorization": "Bearer sk-test-key"}) as client:
        _post(client, "/v1/completions", {"prompt": [shared + "runs", "a dog"], "n": 2, "max_tokens": 10})
        _post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "home"}], "max_tokens": 8})
        _stream(client, "/v1/completions", {"prompt": "the cat", "max_tokens": 6})
    after = _metric_totals(keyed_server, documented)
    assert [name for name in documented if name not in after] == []
    gauges = {name for name, spec in SPECS.items() if spec.kind == "gauge"}
    still = [name for name in documented if name not in gauges and after[name] == before.get(name, 0.0)]
    assert still == ["vllm:num_preemptions"] and after["vllm:num_preemptions"] == 0
    text = httpx.get(f"{keyed_server}/metrics", timeout=60).text
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} ', text, re.M)
    assert "vllm:time_per_output_token_seconds" not in text


def test_the_metrics_switch_puts_metrics_behind_the_api_key():
    from deploy.gate import Gate

    gate = Gate()
    gate.api_key = b"sk-test-key"
    scope = {"type": "http", "headers": []}
    assert gate.is_open("/metrics") and gate.is_open("/ping") and gate.is_open("/health/")
    assert not gate.is_open("/tokenize") and not gate.is_open("/version")
    gate.metrics_require_api_key = True
    assert not gate.is_open("/metrics") and gate.is_open("/health") and gate.is_open("/ping")
    assert gate.refusal(scope).status_code == 401
    assert gate.refusal({**scope, "headers": [(b"authorization", b"Bearer sk-test-key")]}) is None
    assert Config.model_validate({"metrics_require_api_key": True}).metrics_require_api_key
    assert not Config().metrics_require_api_key


def test_tokenize_detokenize_version_and_ping_have_vllms_shapes(client, reference, tokenizer):
    import importlib.metadata

    max_model_len = client.get(f"/v1/models/{MODEL}").json()["max_model_len"]
    ids = tokenizer("the cat sat")["input_ids"]
    plain = _post(client, "/tokenize", {"model": MODEL, "prompt": "the cat sat"})
    assert plain == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}  # vLLM's fields, no others
    with_strs = _post(client, "/tokenize", {"prompt": "the cat sat", "return_token_strs": True,
                                            "add_special_tokens": False})
    assert with_strs["tokens"] == tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(with_strs["tokens"])
    messages = [{"role": "user", "content": "a cat"}, {"role": "assistant", "content": "the"}]
    for options in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        chat = _post(client, "/tokenize", {"messages": messages, **options})
        expected = reference(messages=messages, sampling={"max_tokens": 1}, **options)
        assert chat["tokens"] == expected.prompt_token_ids and chat["count"] == len(expected.prompt_token_ids)
    assert _post(client, "/tokenize", {"prompt": ""})["count"] == 0
    assert _post(client, "/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": "the cat sat"}
    assert _post(client, "/detokenize", {"tokens": []}) == {"prompt": ""}
    unknown = client.post("/tokenize", json={"model": "gpt-4", "prompt": "ab"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert client.get("/version").json() == {"version": importlib.metadata.version("specbatch")}
    for method in ("GET", "POST"):
        ping = client.request(method, "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "ok"


def test_token_id_prompts_run_as_their_text_does(client, server, reference, tokenizer):
    prompts = ["the cat sat", "a dog ran far"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    expected = [reference(prompt=p) for p in prompts]
    one = _post(client, "/v1/completions", {"prompt": ids[0], "temperature": 0})
    assert one["choices"][0]["text"] == expected[0].text and one["usage"]["prompt_tokens"] == len(ids[0])
    both = _post(client, "/v1/completions", {"prompt": ids, "temperature": 0, "n": 2})
    assert [c["text"] for c in both["choices"]] == [e.text for e in expected for _ in range(2)]
    assert _streamed_text("/v1/completions", _stream(client, "/v1/completions", {"prompt": ids[1]})) == \
        expected[1].text
    official = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert official.completions.create(model=MODEL, prompt=ids[0], temperature=0).choices[0].text == expected[0].text


def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(client, reference, tokenizer):
    expected = reference(prompt="the cat sat")
    ids = tokenizer("a dog ran")["input_ids"]
    whole = _post(client, "/v1/completions", {"prompt": ["the cat sat", "a dog ran"], "echo": True, "temperature": 0})
    assert whole["choices"][0]["text"] == "the cat sat" + expected.text
    assert whole["choices"][1]["text"] == "a dog ran" + reference(prompt="a dog ran").text
    assert whole["usage"]["completion_tokens"] == len(expected.token_ids) + len(reference(prompt="a dog ran").token_ids)
    from_ids = _post(client, "/v1/completions", {"prompt": [ids], "echo": True, "temperature": 0})
    assert from_ids["choices"][0]["text"] == whole["choices"][1]["text"]  # the token ids decoded
    streamed = _stream(client, "/v1/completions", {"prompt": ids, "echo": True, "temperature": 0})
    assert streamed[0]["choices"][0]["text"].startswith("a dog ran")
    for n in (1, 2):
        chunks = _stream(client, "/v1/completions", {"prompt": "the cat sat", "echo": True, "temperature": 0, "n": n})
        for index in range(n):
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            assert texts[0].startswith("the cat sat") and "".join(texts) == "the cat sat" + expected.text
    plain = _post(client, "/v1/completions", {"prompt": "the cat sat", "echo": False, "temperature": 0})
    assert plain["choices"][0]["text"] == expected.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, path):
    body = {**({"prompt": "the cat"} if path == "/v1/completions" else CHAT), "max_tokens": 12, "n": 2,
            "ignore_eos": True}
    chunks = _stream(client, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
    assert all(c["usage"] is not None for c in choice_chunks)
    for index in range(2):
        usages = [c["usage"] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert {u["prompt_tokens"] for u in usages} == {final["usage"]["prompt_tokens"] // 2}
        generated = [u["completion_tokens"] for u in usages]
        assert generated == sorted(generated) and generated[-1] == 12
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
        if path == "/v1/chat/completions":  # the role chunk comes before any token
            assert generated[0] == 0
    # vLLM's rule: continuous_usage_stats without include_usage adds nothing.
    alone = _stream(client, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None and c["choices"] for c in alone)


# --------------------------------------------------------------------------------------- replica internals
@pytest.fixture
def engine(config, target, tokenizer, draft) -> Engine:
    return Engine(config, target=target, tokenizer=tokenizer, draft=draft)


async def _drain(loop: EngineLoop, requests: list[Request]) -> list[Any]:
    return [event async for event in loop.generate(requests)]


def test_engine_failure_makes_the_replica_unhealthy(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    loop = EngineLoop(lambda: engine)
    with pytest.raises(EngineFailure, match="device lost"):
        asyncio.run(_drain(loop, [Request(id="a", prompt="ab")]))
    with pytest.raises(EngineFailure):
        OpenAIServer.func_or_class.check_health(SimpleNamespace(loop=loop))  # Serve's probe restarts the replica
    with pytest.raises(EngineFailure):  # and new requests are refused until then
        asyncio.run(_drain(loop, [Request(id="b", prompt="ab")]))


def test_a_step_running_past_its_bound_makes_the_replica_unhealthy(engine, monkeypatch):
    """A hung step (a grammar search that never returned kept /health at ok while every request stopped): past
    limits.step_timeout_s the replica's probe and /health fail, so Serve replaces it; a step that ends in time
    leaves it healthy."""
    release = threading.Event()
    step = engine.step

    def hung_step():
        release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", hung_step)
    loop = EngineLoop(lambda: engine, step_timeout_s=0.3)
    loop.runner.submit(Request(id="a", prompt="ab"), loop.runner.prepare(Request(id="a", prompt="ab")), lambda _: None)
    time.sleep(0.1)
    OpenAIServer.func_or_class.check_health(SimpleNamespace(loop=loop))  # within its bound
    time.sleep(0.4)
    with pytest.raises(EngineFailure, match=r"limits.step_timeout_s \(0.3 s\)"):
        OpenAIServer.func_or_class.check_health(SimpleNamespace(loop=loop))
    release.set()
    for _ in range(100):
        if loop.runner.step_running_for() == 0.0:
            break
        time.sleep(0.05)
    monkeypatch.setattr(engine, "step", step)
    OpenAIServer.func_or_class.check_health(SimpleNamespace(loop=loop))  # the step ended: healthy again
    loop.runner.close()


def test_a_step_that_fails_on_one_request_fails_it_alone_and_the_others_finish_unchanged(
    config, target, tokenizer, draft, monkeypatch
):
    """If something a request carries still makes a step raise, the engine is rebuilt and the requests in flight
    are rerun, halving the group that fails until the culprit is alone: only it fails; the others finish with the
    outputs they would have had, and a stream continues where it was, without repeating a token."""
    def make() -> Engine:
        return Engine(config, target=target, tokenizer=tokenizer, draft=draft)

    prompts = ["the cat sat", "a dog ran", "far away home", "and the mat"]
    samplings = [{"max_tokens": 12, "ignore_eos": True}, {"max_tokens": 12, "ignore_eos": True, "temperature": 1.0,
                                                          "seed": 3}]
    requests = [Request(id=f"ok{i}", prompt=p, sampling=samplings[i % 2]) for i, p in enumerate(prompts)]
    expected = {r.id: r.token_ids for r in make().generate(requests)}
    original = Engine.step

    def step(self):
        if any("boom" in seq.prompt for seq in self.running):
            raise RuntimeError("kaboom")
        return original(self)

    monkeypatch.setattr(Engine, "step", step)
    loop = EngineLoop(make)

    async def consume(request: Request, stream: bool, started: asyncio.Event) -> tuple[list[int], Any]:
        streamed: list[int] = []
        async for _, event in loop.generate([request], stream=stream):
            if isinstance(event, GenerationResult):
                return streamed, event
            streamed += event
            started.set()
        raise AssertionError("no result")

    async def scenario():
        started = [asyncio.Event() for _ in requests]
        good = [asyncio.create_task(consume(r, i < 2, started[i])) for i, r in enumerate(requests)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all mid-way
        bad = asyncio.create_task(consume(Request(id="bad", prompt="boom boom"), True, asyncio.Event()))
        return await asyncio.gather(*good), await asyncio.gather(bad, return_exceptions=True)

    good, (bad,) = asyncio.run(scenario())
    assert isinstance(bad, RequestRejected) and "kaboom" in str(bad)
    for i, (request, (streamed, result)) in enumerate(zip(requests, good)):
        assert result.finish_reason == "length" and result.token_ids == expected[request.id]
        if i < 2:  # the streamed ones: resumed where they were, nothing sent twice
            assert streamed == result.token_ids[: len(streamed)] and streamed
    assert loop.runner.rebuilds >= 2  # the reruns, and the canary that cleared the engine
    loop.check_health()
    monkeypatch.setattr(Engine, "step", original)
    [(_, after)] = [e for e in asyncio.run(_drain(loop, [requests[0]])) if isinstance(e[1], GenerationResult)]
    assert after.token_ids == expected["ok0"]


def test_draining_ends_the_requests_left_and_refuses_new_ones(engine):
    from deploy.engine_loop import Draining

    loop = EngineLoop(lambda: engine)

    async def scenario():
        stream = loop.generate([Request(id="long", prompt="abc", sampling={"max_tokens": 200, "ignore_eos": True})])
        first = await anext(stream)
        loop.end_all(Draining("shutting down"))
        with pytest.raises(Draining):
            async for _ in stream:
                pass
        with pytest.raises(Draining):
            await _drain(loop, [Request(id="late", prompt="ab")])
        return first

    assert isinstance(asyncio.run(scenario())[1], list)
    for _ in range(100):  # the engine dropped the ended request
        if not engine.has_unfinished():
            break
        time.sleep(0.05)
    assert not engine.has_unfinished()


def test_a_request_add_request_chokes_on_fails_alone(engine, monkeypatch):
    """Preparing (off the engine thread) or admitting (on it) may raise for one request: only it fails."""
    prepare, add_prepared = engine.prepare, engine.add_prepared

    def picky_prepare(request: Request, tokenizer=None):
        if request.id == "bad":
            raise OverflowError("seed out of range")
        return prepare(request, tokenizer)

    def picky_add_prepared(prepared) -> None:
        if getattr(prepared, "request_id", None) == "worse":
            raise OverflowError("seed out of range")
        add_prepared(prepared)

    monkeypatch.setattr(engine, "prepare", picky_prepare)
    monkeypatch.setattr(engine, "add_prepared", picky_add_prepared)
    loop = EngineLoop(lambda: engine)

    async def three() -> list[Any]:
        return await asyncio.gather(
            _drain(loop, [Request(id="good", prompt="ab")]), _drain(loop, [Request(id="bad", prompt="ab")]),
            _drain(loop, [Request(id="worse", prompt="ab")]), return_exceptions=True,
        )

    good, bad, worse = asyncio.run(three())
    assert isinstance(bad, RequestRejected) and isinstance(worse, RequestRejected)
    assert isinstance(good[-1][1], GenerationResult) and good[-1][1].finish_reason in ("stop", "length")
    loop.check_health()


def test_leaving_a_stream_aborts_its_sequence(engine):
    loop = EngineLoop(lambda: engine)

    async def leave_early() -> None:
        stream = loop.generate([Request(id="gone", prompt="abc", sampling={"max_tokens": 40})])
        await anext(stream)
        await stream.aclose()
        # Another request keeps the loop stepping; by the time it finishes the left one must be gone.
        await _drain(loop, [Request(id="stays", prompt="ab", sampling={"max_tokens": 3})])

    asyncio.run(leave_early())
    assert not engine.has_unfinished() and not engine.running


def test_a_short_request_is_not_stalled_by_long_prompts(engine, monkeypatch):
    """Eight 100 KB prompts arrive just before a short request: they are tokenized (and refused as too long) off
    the engine's stepping thread, which never runs the tokenizer, a few at a time, so the short request is
    answered before any of them is tokenized. Their tokenizing is held until the short request's result has come
    (no clock involved): on the stepping thread, or with the short request queued behind them, it would hold the
    short request too (tokenizing on the stepping thread took ~3 s per prompt, all before the short request's
    first step)."""
    import decoding.engine.engine as engine_module

    tokenizing_threads: list[str] = []
    encode = engine_module.encode_request
    release = threading.Event()
    held: list[str] = []  # big prompts whose tokenizing began, held until the short request's result
    tokenized: list[str] = []

    def recording(tokenizer, request):
        tokenizing_threads.append(threading.current_thread().name)
        if request.id.startswith("big"):
            held.append(request.id)
            release.wait(timeout=120)
            tokenized.append(request.id)
        return encode(tokenizer, request)

    monkeypatch.setattr(engine_module, "encode_request", recording)
    # Tokenized whole, as a limits.max_prompt_bytes above their size lets them be (the tiny model's default refuses
    # them by their bytes before tokenizing).
    monkeypatch.setattr(engine, "max_prompt_bytes", 1 << 30)
    loop = EngineLoop(lambda: engine)

    async def scenario():
        alone_events = await _drain(loop, [Request(id="alone", prompt="ab", sampling={"max_tokens": 8})])
        big = [asyncio.create_task(_drain(loop, [Request(id=f"big{i}", prompt="ab " * 35_000)])) for i in range(8)]
        async def tokenizing() -> None:  # the long prompts' tokenizing has begun
            while not held:
                await asyncio.sleep(0.01)

        try:
            await asyncio.wait_for(tokenizing(), timeout=60)
            events = await asyncio.wait_for(
                _drain(loop, [Request(id="short", prompt="ab", sampling={"max_tokens": 8})]), timeout=60)
            done_before = len(tokenized)
        finally:
            release.set()
        return alone_events, events, done_before, await asyncio.gather(*big)

    alone_events, events, done_before, big = asyncio.run(scenario())
    assert done_before == 0  # the short request was answered before any long prompt was tokenized
    assert events[-1][1].token_ids == alone_events[-1][1].token_ids and len(events[-1][1].token_ids) == 8
    assert all(b[-1][1].finish_reason == "error" and "context" in b[-1][1].error for b in big)
    assert len(tokenizing_threads) == 10 and "engine" not in tokenizing_threads
    assert threading.current_thread().name not in tokenizing_threads  # nor the event loop's


def test_requests_are_prepared_on_a_few_threads_that_keep_their_tokenizers(engine, monkeypatch):
    """Forty requests at once are tokenized on the runner's preparing threads, each copying the tokenizer once: a
    thread of its own per request copied it every time (~100 ms a copy, 7-9 requests a second on a replica)."""
    import copy

    import decoding.engine.runner as runner_module

    copied_on: list[str] = []

    def deepcopy(value: Any) -> Any:
        copied_on.append(threading.current_thread().name)
        return copy.deepcopy(value)

    monkeypatch.setattr(runner_module, "copy", SimpleNamespace(deepcopy=deepcopy))
    loop = EngineLoop(lambda: engine)

    async def scenario():
        return await asyncio.gather(*[
            _drain(loop, [Request(id=f"r{i}", prompt="the cat", sampling={"max_tokens": 2})]) for i in range(40)])

    done = asyncio.run(scenario())
    assert all(events[-1][1].finish_reason == "length" for events in done)
    assert 1 <= len(copied_on) <= runner_module.SMALL_INPUT_THREADS, copied_on
    assert len(set(copied_on)) == len(copied_on) and all(name.startswith("prepare") for name in copied_on)


class _Chunked:
    """A request body arriving in 64 KiB chunks (Starlette's ``Request`` as ``_json_body`` reads it)."""

    def __init__(self, data: bytes) -> None:
        self.headers = {"content-type": "application/json"}
        self.data, self.read = data, 0

    async def stream(self):
        for at in range(0, len(self.data), 1 << 16):
            self.read = at + (1 << 16)
            yield self.data[at : at + (1 << 16)]


def test_a_body_of_more_token_ids_than_any_valid_request_is_refused_before_it_is_read_whole():
    """The 256-token tiny model takes at most 1024 prompts of 256 ids: a body of 600,000 ids is refused while it
    arrives, its values counted, before any of it is parsed (ten million ids once took 9.5 s and 3.3 GB)."""
    from deploy.server import ApiError, _json_body, max_body_values

    body = _Chunked(json.dumps({"prompt": list(range(600_000)), "max_tokens": 4}).encode())
    with pytest.raises(ApiError) as refused:
        asyncio.run(_json_body(body, max_body_values(256)))
    assert refused.value.status == 413 and "more than 524288 JSON values" in str(refused.value)
    assert body.read < len(body.data)
    fits = _Chunked(json.dumps({"prompt": [list(range(256))] * 1024}).encode())  # the most a valid body holds
    assert asyncio.run(_json_body(fits, max_body_values(256))) == fits.data


def test_a_large_body_is_parsed_off_the_event_loop_one_at_a_time(monkeypatch):
    """A body over LARGE_BODY_BYTES is parsed on the parse lane (its parse holds the GIL: /health waits for one
    parse at most, not for the event loop's), a small one on the event loop; each as the union of prompt forms
    takes it, token ids first."""
    import deploy.server as server_module
    from deploy.protocol import CompletionRequest

    parsed_on: list[str] = []
    parse = server_module._parse

    def recording(*args: Any) -> Any:
        parsed_on.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(server_module, "_parse", recording)
    replica = SimpleNamespace(loop=SimpleNamespace(engine=SimpleNamespace(max_context=256)),
                              _check_model=lambda name: None)
    large = json.dumps({"prompt": [list(range(1000, 1256))] * 1000}).encode()
    assert len(large) > server_module.LARGE_BODY_BYTES
    for data in (large, b'{"prompt": [1, 2, 3]}'):
        body = asyncio.run(OpenAIServer.func_or_class._parse(replica, _Chunked(data), CompletionRequest))
        assert body.prompts == json.loads(data)["prompt"] if data is large else [[1, 2, 3]]
    assert parsed_on[0].startswith("parse") and parsed_on[1] == threading.current_thread().name


class _ByteTokenizer:
    """Token ids are UTF-8 bytes, decoded like a byte-level BPE tokenizer decodes a partial character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_holds_back_partial_characters_and_stop_prefixes():
    text = IncrementalText(_ByteTokenizer(), stop=["ab"])
    assert text.push(list("xé".encode())[:2]) == "x"  # half of é
    assert text.push(list("é".encode())[1:]) == "é"
    assert text.push(list(b"ya")) == "y"  # "a" may start the stop string "ab"
    assert text.push(list(b"c")) == "ac"
    assert text.push(list(b"a")) == ""
    assert text.finish("xéyaca") == "a"  # the engine's final text, cut before the stop string
    assert text.sent == "xéyaca"


def test_deployment_options_follow_the_config():
    fixed = deployment_options(Config(concurrency=2, num_gpus=0.5, batch_size=4))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    # Replicas run at normal priority (Ray's workers default to niceness 15; see pipeline.actor).
    assert fixed["ray_actor_options"] == {"num_gpus": 0.5, "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}
    assert fixed["max_ongoing_requests"] >= 4
    scaled = deployment_options(Config(concurrency=(1, 3)))
    assert "num_replicas" not in scaled
    assert (scaled["autoscaling_config"]["min_replicas"], scaled["autoscaling_config"]["max_replicas"]) == (1, 3)


# ----------------------------------------------------------------------------------------------- LoRA adapters
def test_each_adapter_answers_through_the_openai_client_streamed_and_not(server, reference):
    """The base and two adapters of one replica, by name and as Ray Serve LLM's ``base:adapter``: each answer is
    the engine's under that adapter (temperature 0), and names the model asked for."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    answers = set()
    for model, adapter in ((MODEL, None), ("qv8", "qv8"), (f"{MODEL}:rs16", "rs16")):
        expected = reference(prompt="the cat sat", lora=adapter)
        completion = client.completions.create(model=model, prompt="the cat sat", temperature=0)
        assert completion.model == model and completion.choices[0].text == expected.text, model
        chunks = list(client.completions.create(model=model, prompt="the cat sat", temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert {c.model for c in chunks} == {model}
        messages = [{"role": "user", "content": "hi"}]
        chat = reference(messages=messages, lora=adapter)
        streamed = client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.text
        answers.add(expected.text)
    assert len(answers) == 3  # each adapter changed the answer
    # vLLM's adapter gauge: one series per set of adapters seen running after a step.
    metrics = httpx.get(f"{server}/metrics").text
    series = re.findall(r'^vllm:lora_requests_info\{(.*)\} ', metrics, re.M)
    assert any('max_lora="4"' in labels and 'running_lora_adapters="qv8"' in labels for labels in series), series


def test_an_unknown_adapter_is_a_404_naming_it(client):
    for model in ("nope", f"{MODEL}:nope", "other:qv8"):
        response = client.post("/v1/completions", json={"prompt": "ab", "model": model})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and f"`{model}`" in error["message"]
    assert client.get("/v1/models/rs16").json()["parent"] == MODEL
    assert client.get("/v1/models/nope").status_code == 404


def test_adapters_load_and_unload_at_run_time_where_the_config_allows(client, adapter_dirs, keyed_server):
    before = client.post("/v1/completions", json={"prompt": "ab", "model": "late", "temperature": 0})
    assert before.status_code == 404
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter_dirs["late"]})
    assert loaded.status_code == 200 and "late" in loaded.text
    assert ("late", MODEL) in [(m["id"], m["parent"]) for m in client.get("/v1/models").json()["data"]]
    answer = client.post("/v1/completions", json={"prompt": "ab", "model": "late", "temperature": 0})
    assert answer.status_code == 200 and answer.json()["model"] == "late"
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter_dirs["late"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "adapter_config.json not found" in bad.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "ab", "model": "late"}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    # Off unless the configuration allows it (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), as behind the API key.
    keyed = httpx.Client(base_url=keyed_server, timeout=60, headers={"Authorization": "Bearer sk-test-key"})
    refused = keyed.post("/v1/unload_lora_adapter", json={"lora_name": "qv8"})
    assert refused.status_code == 404 and "allow_runtime_lora_updating" in refused.json()["error"]["message"]
    assert keyed.post("/v1/completions", json={"prompt": "ab", "model": "qv8", "max_tokens": 2}).status_code == 200
