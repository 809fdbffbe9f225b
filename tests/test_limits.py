"""Bounded work for every request and row: what one request sends (a grammar, a prompt, constraints, a chat
template) or a config asks of the cluster fails that request, row or command alone, in bounded time and memory.

Cases that once took a node down run in a subprocess watched from here: it is killed past a time or memory
bound, so a regression fails the test instead of the machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from decoding.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    LimitsConfig,
    SamplingParams,
    load_config,
)
from decoding.params import resolve_sampling
from frontend.requests import RequestError, parse_request
from frontend.resources import check_cluster, shortfall, shortfall_together

TESTS = str(Path(__file__).parent)


def watched(script: str, *, seconds: float = 900.0, rss_bytes: int = 3 << 30) -> tuple[dict, int]:
    """Run ``script`` (Python) in a subprocess; its last stdout line is JSON. Returns that and the process's peak
    RSS as seen every 50 ms. The process is killed, and the test fails, past ``seconds`` or ``rss_bytes``: the
    memory bound is what catches the failures here (each grew past 3 GB within a minute); the time bound only
    stops a hang, generous enough for a loaded machine."""
    process = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS!r})\n" + script],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher, peak, started = psutil.Process(process.pid), 0, time.monotonic()
    while process.poll() is None:
        try:
            peak = max(peak, watcher.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if peak > rss_bytes or time.monotonic() - started > seconds:
            process.kill()
            process.wait()
            pytest.fail(f"killed: {peak >> 20} MiB RSS after {time.monotonic() - started:.0f} s")
        time.sleep(0.05)
    out, err = process.communicate()
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), peak


# A tiny model over SmolLM2's tokenizer (JSON needs its punctuation), with the n-gram drafter, whose drafts take the
# grammar's forced text.
ENGINE = textwrap.dedent("""
    import json, resource, psutil
    from tiny import tiny_model
    from decoding import Engine, Request
    from decoding.config import Config
    from decoding.model.loading import DEFAULT_MODEL, load_tokenizer
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    target = tiny_model(vocab_size=len(tokenizer))
    config = Config.model_validate({"model": "in-memory", "batch_size": 2, "speculative": {"method": "ngram"},
                                    "sampling": {"max_tokens": 12}, "limits": LIMITS})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    built = psutil.Process().memory_info().rss
""")


def test_a_grammar_without_end_drafts_in_bounded_time_and_memory() -> None:
    """`root ::= "a" root` (and a schema that requires itself) force an endless text: its drafts are cut, the row
    runs to max_tokens."""
    itself = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    script = ENGINE.replace("LIMITS", "{}") + textwrap.dedent(f"""
        requests = [
            Request("grammar", prompt="x", sampling={{"structured_outputs": {{"grammar": 'root ::= "a" root'}}}}),
            Request("schema", prompt="x", sampling={{"structured_outputs": {{"json": {json.dumps(itself)!r},
                                                                             "disable_any_whitespace": True}}}}),
        ]
        results = engine.generate(requests)
        print(json.dumps([[r.finish_reason, r.text, sum(r.per_step_drafted)] for r in results]))
    """)
    results, peak = watched(script, rss_bytes=3 << 30)
    (grammar_reason, grammar_text, drafted), (schema_reason, schema_text, _) = results
    assert grammar_reason == "length" and grammar_text == "a" * len(grammar_text) and len(grammar_text) >= 12
    assert drafted > 0  # the grammar's text was drafted (cut to the step's depth)
    assert schema_reason == "length" and schema_text.startswith('{"next"')
    assert peak < 2 << 30


def test_an_oversized_prompt_is_refused_before_it_is_tokenized() -> None:
    """A 48 MB prompt is refused by its bytes; tokenizing it whole took a replica to a 9.3 GB peak."""
    script = ENGINE.replace("LIMITS", "{}") + textwrap.dedent("""
        prompt = "the cat sat on the mat. " * 2_000_000
        before = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, built)  # the build's peak
        result = engine.prepare(Request("big", prompt=prompt))
        messages = engine.prepare(Request("chat", messages=[{"role": "user", "content": prompt}]))
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # how far preparing raised it
        print(json.dumps([result.finish_reason, result.error, messages.error, grown, engine.max_prompt_bytes]))
    """)
    (reason, error, chat_error, grown, limit), _ = watched(script, rss_bytes=4 << 30)
    assert reason == "error" and "limits.max_prompt_bytes" in error and "48000000 bytes" in error
    assert "messages' text" in chat_error
    assert len(error) < 300 and limit < 48_000_000
    assert grown < 400 << 20, grown >> 20  # at most the prompt and its UTF-8 copy: no tokenization


def _laughs(section: str) -> str:
    """YAML's "billion laughs" under ``section``: nine levels of nine aliases, a few hundred bytes that hold 9**9
    strings once expanded."""
    lines = [f"{section}:", f"  a: &a [{', '.join(['lol'] * 9)}]"]
    lines += [f"  {name}: &{name} [{', '.join(['*' + below] * 9)}]" for name, below in zip("bcdefghi", "abcdefgh")]
    return "\n".join(lines) + "\n"


GENERATE = textwrap.dedent("""
    import contextlib, io, json
    from jobs.generate import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(ARGS)
            code = 0
        except SystemExit as exc:
            code = exc.code
    print(json.dumps([code, err.getvalue()]))
""")


@pytest.mark.parametrize(("text", "override", "words"), [
    (_laughs("chat_template_kwargs"), [], "expands past 1048576 bytes with its aliases"),
    (_laughs("sampling"), [], "expands past 1048576 bytes with its aliases"),
    ("chat_template_kwargs:\n  x: " + "[" * 100_000 + "]" * 100_000 + "\n", [], "nests deeper than 64 levels"),
    ("chat_template_kwargs:\n  x: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n", [], "nests deeper than 64"),
    ("", ["--sampling.stop", "[" * 10_000 + "]" * 10_000], "override --sampling.stop nests deeper than 64"),
], ids=["laughs-chat_template_kwargs", "laughs-sampling", "deep-lists", "deep-maps", "deep-override"])
def test_a_config_file_is_bounded_in_size_aliases_and_depth(tmp_path, text, override, words) -> None:
    """`specbatch generate --config bomb.yaml` exits 2 with one line naming the file and the bound, having
    expanded nothing: the laughs under chat_template_kwargs grew for 240 s to a 4 GB limit (writing the config out
    expanded them), under sampling they were refused after 48 s and 3 GB, and the deep documents escaped as a
    RecursionError traceback."""
    config, prompts = tmp_path / "bomb.yaml", tmp_path / "prompts.jsonl"
    config.write_text(text)
    prompts.write_text('{"prompt": "x"}\n')
    args = ["--config", str(config), "--input", str(prompts), "--output", str(tmp_path / "out"), *override]
    (code, err), _ = watched(GENERATE.replace("ARGS", repr(args)), seconds=300, rss_bytes=1 << 30)
    errors = [line for line in err.splitlines() if line.startswith("specbatch generate: error: ")]
    assert code == 2 and len(errors) == 1 and words in errors[0], err[-2000:]
    assert override or f"config file {config}" in errors[0]
    assert len(errors[0]) < 300 and not (tmp_path / "out").exists()


def test_a_config_file_larger_than_its_bound_is_refused_unread(tmp_path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("chat_template: " + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {big} is larger than {MAX_CONFIG_BYTES} bytes")):
        load_config(big)
    small = tmp_path / "small.yaml"
    small.write_text(_laughs("chat_template_kwargs").replace("  i: &i", "  # i:"))  # 9**8 values: still too many
    with pytest.raises(ConfigError, match="expands past"):
        load_config(small)
    fine = tmp_path / "fine.yaml"
    fine.write_text("chat_template_kwargs:\n  a: &a [1, 2]\n  b: [*a, *a]\nsampling: {stop: [x]}\n")
    config = load_config(fine)
    assert config.chat_template_kwargs == {"a": [1, 2], "b": [[1, 2], [1, 2]]} and config.sampling.stop == ["x"]


def test_a_nested_value_is_quoted_without_its_whole_repr() -> None:
    """A list holding another nine times, nine levels deep (what YAML aliases make): its repr is 9**9 items long."""
    script = textwrap.dedent("""
        import json
        from decoding.config import quote
        value = ["lol"]
        for _ in range(9):
            value = [value] * 9
        print(json.dumps(quote(value)))
    """)
    quoted, _ = watched(script, seconds=300, rss_bytes=1 << 30)
    assert quoted.startswith("[[[") and len(quoted) < 100


def test_error_messages_quote_a_short_prefix_of_a_bad_value() -> None:
    """1 MB in, 1 MB out, before: pydantic's messages quote the value given."""
    for sampling, field in (({"stop": ["x" * (1 << 20)]}, "stop"), ({"top_p": "y" * (1 << 20)}, "top_p"),
                            ({"logit_bias": {"1": "z" * (1 << 20)}}, "logit_bias")):
        with pytest.raises(RequestError) as caught:
            resolve_sampling(sampling, SamplingParams(), 64, {2})
        assert field in str(caught.value) and len(str(caught.value)) < 400, str(caught.value)[:500]


def test_compiled_grammars_are_bounded_in_bytes_size_and_time() -> None:
    """Ten distinct 4,000-entry choice lists (~20 MB compiled each): the cache keeps 32 MiB of them, not all."""
    script = textwrap.dedent("""
        import json, psutil
        from decoding.config import Constraint
        from decoding.constraints.grammar import GrammarBudget, GrammarCompiler, GrammarError
        from decoding.model.loading import DEFAULT_MODEL, load_tokenizer
        tokenizer = load_tokenizer(DEFAULT_MODEL)
        budget = GrammarBudget(max_constraint_bytes=1 << 20, grammar_compile_timeout_s=60,
                               max_grammar_bytes=64 << 20, grammar_cache_bytes=32 << 20)
        compiler = GrammarCompiler(tokenizer, len(tokenizer), budget)
        before = psutil.Process().memory_info().rss
        sizes = []
        for n in range(10):
            choices = [f"label {n} number {i} of the list" for i in range(4000)]
            sizes.append(compiler.compile(Constraint("choice", json.dumps(choices))).memory_size_bytes)
        grown = psutil.Process().memory_info().rss - before
        errors = []
        for limits, choices in ((dict(max_constraint_bytes=1000), 100), (dict(max_grammar_bytes=64 << 10), 2000),
                                (dict(grammar_compile_timeout_s=0.001), 3000)):
            small = GrammarCompiler(tokenizer, len(tokenizer), GrammarBudget(**limits))
            try:
                small.compile(Constraint("choice", json.dumps([f"other {i} of the list" for i in range(choices)])))
            except GrammarError as exc:
                errors.append(str(exc))
        print(json.dumps([sizes, compiler.cached_bytes(), grown, errors]))
    """)
    (sizes, cached, grown, errors), _ = watched(script, rss_bytes=4 << 30)
    assert min(sizes) > 8 << 20 and sum(sizes) > 3 * (32 << 20)  # the cache had to drop some
    assert cached <= 32 << 20
    assert grown < 32 * (1 << 20) + 2 * max(sizes) + (64 << 20), (grown >> 20, [s >> 20 for s in sizes])
    assert len(errors) == 3
    assert "limits.max_constraint_bytes" in errors[0] and "structured_outputs.choice" in errors[0]
    assert "limits.max_grammar_bytes" in errors[1]
    assert "limits.grammar_compile_timeout_s" in errors[2]


def test_a_request_chat_template_is_refused_unless_trusted() -> None:
    """vLLM's trust_request_chat_template: a template is code with no cost bound (`'x' * 300000000` added 860 MB)."""
    bomb = "{% set s = 'x' * 300000000 %}{{ s }}"
    messages = [{"role": "user", "content": "hi"}]
    parsed = parse_request(messages=messages, chat_template=bomb)
    with pytest.raises(RequestError, match="trust_request_chat_template"):
        parsed.chat.request_fields(Config())
    trusted = parsed.chat.request_fields(Config(trust_request_chat_template=True))
    assert trusted["chat_template"] == bomb
    # The configured template is the operator's: a request naming it again is not refused.
    configured = Config(chat_template="{{ messages }}")
    assert parse_request(messages=messages, chat_template="{{ messages }}").chat.request_fields(configured)


def test_limits_are_config_fields_with_documented_defaults() -> None:
    limits = Config().limits
    assert limits == LimitsConfig() and limits.max_prompt_bytes is None
    with pytest.raises(ValueError, match="max_constraint_bytes"):
        Config.model_validate({"limits": {"max_constraint_bytes": 0}})


NODE = {"CPU": 2.0, "memory": 1e9}


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"num_cpus": 64}, "num_cpus", "more than any node has"),
    ({"num_gpus": 0.5}, "num_gpus", "the cluster has no GPU"),
    ({"concurrency": 64}, "concurrency", "64 actors of 1 CPUs"),
    ({"concurrency": [3, 8]}, "concurrency", "3 actors"),
])
def test_resources_the_cluster_cannot_hold_are_named(fields, field, words) -> None:
    reason = shortfall(Config.model_validate(fields), "actors", [NODE])
    assert reason is not None and reason.startswith(f"invalid {field}:") and words in reason
    assert "2 CPUs and 0 GPUs" in reason


def test_resources_the_cluster_can_hold_pass() -> None:
    two_nodes = [NODE, {"CPU": 8.0, "GPU": 1.0}]
    for fields in ({}, {"concurrency": 2}, {"concurrency": [2, 64]}, {"num_gpus": 0.5, "concurrency": 2},
                   {"num_cpus": 4, "concurrency": 2}):
        assert shortfall(Config.model_validate(fields), "actors", two_nodes) is None, fields
    assert shortfall(Config.model_validate({"num_cpus": 4, "concurrency": 3}), "actors", two_nodes) is not None


def test_a_routers_models_are_checked_together() -> None:
    """Three one-replica models on a 2-CPU node each fit alone, not together: named with what each asks (a router
    of them used to wait forever with one replica STARTING)."""
    models = {name: Config.model_validate({"num_cpus": 1}) for name in ("chat", "code", "math")}
    reason = shortfall_together(models, "replicas", [NODE])
    assert reason is not None and reason.startswith("invalid num_replicas:"), reason
    assert all(f"{name} 1 x (1 CPUs, 0 GPUs)" in reason for name in models) and "2 CPUs and 0 GPUs" in reason
    assert shortfall_together({name: models[name] for name in ("chat", "code")}, "replicas", [NODE]) is None
    assert shortfall_together(models, "replicas", [NODE, {"CPU": 1.0}]) is None  # spread over two nodes
    # first fit, largest first: a 2-CPU replica takes the 2-CPU node, the 1-CPU ones the others
    mixed = {"big": Config.model_validate({"num_cpus": 2}), **models}
    assert shortfall_together(mixed, "replicas", [{"CPU": 1.0}, NODE, {"CPU": 2.0}]) is None
    alone = shortfall_together({"huge": Config.model_validate({"num_cpus": 64}), **models}, "replicas", [NODE])
    assert alone is not None and alone.startswith("model huge: invalid num_cpus:"), alone


def test_a_router_whose_models_do_not_fit_together_is_refused_before_it_deploys(ray_cluster, tiny_dirs) -> None:
    """The session's cluster has 4 CPUs: three models of two one-CPU replicas each (six) are refused at build."""
    from deploy.router import build_openai_app

    configs = [{"model_loading_config": {"model_id": name, "model_source": tiny_dirs["target"]},
                "deployment_config": {"num_replicas": 2}} for name in ("chat", "code", "math")]
    with pytest.raises(ConfigError, match=r"invalid num_replicas: the models' replicas do not fit") as refused:
        build_openai_app({"llm_configs": configs})
    assert "chat 2 x (1 CPUs, 0 GPUs), code 2 x" in str(refused.value)


def test_unsatisfiable_resources_fail_fast_on_a_live_cluster(ray_cluster) -> None:
    """The session's cluster has 4 CPUs and no GPU: asking for more fails at once (it used to wait forever)."""
    import ray.data

    from pipeline.processor import Processor

    started = time.monotonic()
    for fields in ({"num_cpus": 64}, {"num_gpus": 0.5}, {"concurrency": 64}):
        config = Config.model_validate({"model": "in-memory", **fields})
        with pytest.raises(ConfigError, match="invalid"):
            Processor(config)(ray.data.from_items([{"prompt": "x"}]))
    assert time.monotonic() - started < 120  # no wait for resources (a loaded machine's bound)
    check_cluster(Config(), "actors")  # what fits passes


def test_an_autoscaling_cluster_is_waited_for_within_resource_wait_s(monkeypatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    config = Config.model_validate({"num_gpus": 1, "resource_wait_s": 5})
    looks = iter([[NODE], [NODE], [NODE, {"CPU": 4.0, "GPU": 1.0}]])
    slept: list[float] = []
    check_cluster(config, "actors", lambda: next(looks), slept.append)
    assert len(slept) == 2
    with pytest.raises(ConfigError, match=r"after waiting 5 s"):
        check_cluster(config, "actors", lambda: [NODE], lambda _: time.sleep(0.5))

