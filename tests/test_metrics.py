"""vLLM's engine metrics (frontend.metrics) as the runner records them: per step, aborted requests included."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future

import pytest

from decoding.config import Config
from decoding.engine import Engine, GenerationResult, Request
from decoding.engine.runner import EngineRunner
from frontend.metrics import FINISHED_REASONS, EngineMetrics, MetricSpec


class Memory:
    """A backend keeping what was recorded: counters' sums, gauges' values, histograms' observations."""

    def __init__(self, model_name: str = "m") -> None:
        self.model_name = model_name
        self.values: dict[str, list[float]] = defaultdict(list)

    def __call__(self, spec: MetricSpec):
        values, model_name = self.values, self.model_name

        class Metric:
            def record(self, value: float, tags: dict[str, str]) -> None:
                assert set(tags) == set(spec.labels) and tags["model_name"] == model_name and tags["engine"] == "0"
                assert value > 0 or spec.kind != "counter"  # as Ray's counters require
                values[spec.name].append(value)

        return Metric()

    def total(self, name: str) -> float:
        return sum(self.values[name])


def test_counters_move_per_step_and_count_an_aborted_requests_tokens(tokenizer, target, draft):
    config = Config.model_validate({
        "model": "in-memory", "batch_size": 4, "sampling": {"max_tokens": 16},
        "speculative": {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": 3,
                        "length_policy": "static"},
    })
    memory = Memory()
    runner = EngineRunner(lambda: Engine(config, target=target, tokenizer=tokenizer, draft=draft), 1,
                          observer=EngineMetrics([memory], "m"))
    prompts = {"a": "the cat sat", "b": "a dog ran far away", "aborted": "on a mat"}
    results: dict[str, Future] = {key: Future() for key in prompts}
    delivered: dict[str, int] = defaultdict(int)
    first_step_seen = threading.Event()

    def sink_for(key: str):
        def sink(event) -> None:
            if isinstance(event, GenerationResult):
                results[key].set_result(event)
            elif isinstance(event, list):
                delivered[key] += len(event)
                if key == "aborted" and not first_step_seen.is_set():
                    first_step_seen.set()
                    runner.abort(key)  # dropped before the next step: its tokens so far were counted
        return sink

    prompt_tokens = 0
    for key, prompt in prompts.items():
        request = Request(key, prompt=prompt)
        prepared = runner.prepare(request)
        prompt_tokens += len(prepared.prompt_ids)
        runner.submit(request, prepared, sink_for(key))
    finished = [results[key].result(timeout=120) for key in ("a", "b")]
    runner.close()
    assert not results["aborted"].done() and 0 < delivered["aborted"] < 16
    assert memory.total("vllm:prompt_tokens") == prompt_tokens
    assert memory.total("vllm:generation_tokens") == sum(len(r.token_ids) for r in finished) + delivered["aborted"]
    assert memory.total("vllm:spec_decode_num_drafts") > sum(r.stats.num_spec_steps for r in finished)
    assert len(memory.values["vllm:time_to_first_token_seconds"]) == 3  # the aborted one's first tokens too
    assert len(memory.values["vllm:e2e_request_latency_seconds"]) == 2
    assert memory.values["vllm:num_requests_running"][-1] == 0 and memory.values["vllm:kv_cache_usage_perc"][-1] == 0


def test_prefix_cache_counters_are_recorded_per_step(tokenizer, target):
    """vLLM's prefix_cache_queries / prefix_cache_hits: the prompt tokens of the rows that joined a step, and those
    found cached; the second row of a shared 3-block prefix finds 48 of them."""
    config = Config.model_validate({"model": "in-memory", "batch_size": 1, "sampling": {"max_tokens": 4},
                                    "speculative": {"method": "none"}})
    memory = Memory()
    runner = EngineRunner(lambda: Engine(config, target=target, tokenizer=tokenizer), 1,
                          observer=EngineMetrics([memory], "m"))
    shared = "the quick brown fox jumps over the lazy dog and "  # 3 full blocks
    futures, prompt_tokens = [], 0
    for key, prompt in (("first", shared + "runs"), ("second", shared + "sleeps")):
        request, future = Request(key, prompt=prompt), Future()
        prepared = runner.prepare(request)
        prompt_tokens += len(prepared.prompt_ids)
        runner.submit(request, prepared, lambda event, future=future: future.set_result(event)
                      if isinstance(event, GenerationResult) else None)
        futures.append(future)
    results = [future.result(timeout=120) for future in futures]
    runner.close()
    assert memory.values["vllm:prefix_cache_queries"] == [len(r.prompt_token_ids) for r in results]  # one a step
    assert memory.total("vllm:prefix_cache_queries") == prompt_tokens
    assert memory.values["vllm:prefix_cache_hits"] == [48] == [results[1].num_cached_tokens]


class Labeled:
    """A backend keeping every observation with its labels beyond model_name and engine."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)

    def __call__(self, spec: MetricSpec):
        values = self.values

        class Metric:
            def record(self, value: float, tags: dict[str, str]) -> None:
                assert set(tags) == set(spec.labels) and tags["model_name"] == "m" and tags["engine"] == "0"
                assert value > 0 or spec.kind != "counter"
                extra = {k: v for k, v in tags.items() if k not in ("model_name", "engine")}
                values[spec.name].append((extra, value))

        return Metric()

    def of(self, name: str) -> list[float]:
        return [value for _, value in self.values[name]]


def test_request_metrics_follow_vllms_intervals_reasons_and_parents(tokenizer, target, draft):
    """vLLM's per-step and finished-request metrics from the requests' timestamps: one inter-token latency per step
    after a request's first, the queue / prefill / decode / inference intervals (inference = prefill + decode), a
    request_success per finished request by reason (an abort counted as such), and the n choices of one prompt
    observed once (request_params_n, request_max_num_generation_tokens)."""
    config = Config.model_validate({
        "model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 6},
        "speculative": {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": 3,
                        "length_policy": "static"},
    })
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    backend = Labeled()
    metrics = EngineMetrics([backend], "m")
    requests = [Request("gone", prompt="on a mat"), Request("a", prompt="the cat sat"),
                Request("b0", prompt="a dog ran", sampling={"max_tokens": 8, "ignore_eos": True}),
                Request("b1", prompt="a dog ran", sampling={"max_tokens": 8, "ignore_eos": True, "seed": 1,
                                                            "temperature": 1.0})]
    metrics.parent(["b0", "b1"])
    for request in requests:
        prepared = engine.prepare(request)
        engine.add_prepared(prepared)
        metrics.submitted(request.id, len(prepared.prompt_ids))
    steps_with_tokens: dict[str, int] = defaultdict(int)
    results, order = {}, []
    while engine.has_unfinished():
        output = engine.step()
        metrics.stepped(output)
        for request_id, tokens in output.new_tokens.items():
            steps_with_tokens[request_id] += bool(tokens)
        results.update({result.id: result for result in output.finished})
        order += [result.id for result in output.finished]
        if "gone" in steps_with_tokens and engine.abort("gone"):  # a client went away after its first tokens
            metrics.aborted("gone")
    finished = [results[key] for key in ("a", "b0", "b1")]
    assert "gone" not in results and steps_with_tokens["b1"] > 1
    assert sorted((labels["finished_reason"], value) for labels, value in backend.values["vllm:request_success"]) == \
        sorted([("abort", 1)] + [(r.finish_reason, 1) for r in finished])
    assert len(backend.of("vllm:time_to_first_token_seconds")) == 4
    assert len(backend.of("vllm:inter_token_latency_seconds")) == sum(steps - 1 for steps in steps_with_tokens.values())
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert len(backend.of(f"vllm:{name}")) == 3 and min(backend.of(f"vllm:{name}")) >= 0, name
    queue, prefill, decode, inference = (backend.of(f"vllm:request_{name}_time_seconds")
                                         for name in ("queue", "prefill", "decode", "inference"))
    e2e = backend.of("vllm:e2e_request_latency_seconds")
    for q, p, d, i, total in zip(queue, prefill, decode, inference, e2e, strict=True):
        assert i == pytest.approx(p + d) and total >= q + i - 1e-9
    waited = dict(zip(order, queue, strict=True))
    assert waited["b1"] > waited["a"]  # b1 waited for a row (two rows, four requests)
    finished = [results[key] for key in order]
    assert backend.of("vllm:request_prompt_tokens") == [len(r.prompt_token_ids) for r in finished]
    assert backend.of("vllm:request_generation_tokens") == [len(r.token_ids) for r in finished]
    assert backend.of("vllm:request_prefill_kv_computed_tokens") == [
        len(r.prompt_token_ids) - r.num_cached_tokens for r in finished]
    assert backend.of("vllm:request_params_max_tokens") == [6 if key == "a" else 8 for key in order]
    assert sorted(backend.of("vllm:request_params_n")) == [1, 2]
    assert sorted(zip(backend.of("vllm:request_params_n"), backend.of("vllm:request_max_num_generation_tokens"))) == [
        (1, len(results["a"].token_ids)), (2, max(len(results["b0"].token_ids), len(results["b1"].token_ids)))]
    assert sum(backend.of("vllm:iteration_tokens_total")) == (
        sum(backend.of("vllm:prompt_tokens")) + sum(backend.of("vllm:generation_tokens")))
    assert backend.of("vllm:num_preemptions") == []  # never preempts: nothing recorded


def test_the_prometheus_registry_declares_every_series_vllm_does(tokenizer, target):
    """A replica's /metrics shows every metric from the start, as vLLM's does: num_preemptions at 0, a request_success
    series per finish reason, the token-count histograms with vLLM's 1-2-5 buckets up to the context."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from frontend.metrics import FINISHED_REASONS, SPECS, build_1_2_5_buckets, prometheus_backend

    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100) and build_1_2_5_buckets(1) == (1,)
    registry = prometheus_client.CollectorRegistry()
    EngineMetrics([prometheus_backend(registry)], "m", max_model_len=128)
    families = {family.name: family for family in text_string_to_metric_families(
        prometheus_client.generate_latest(registry).decode())}
    assert {name for name in families if not name.endswith("_created")} == set(SPECS)
    assert "vllm:time_per_output_token_seconds" not in families  # vLLM removed it (inter_token_latency_seconds)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    base = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:num_preemptions_total", base)] == 0
    for reason in FINISHED_REASONS:
        assert samples[("vllm:request_success_total", tuple(sorted((*base, ("finished_reason", reason)))))] == 0
    buckets = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    assert {s.labels["le"] for s in families["vllm:inter_token_latency_seconds"].samples
            if s.name.endswith("_bucket")} >= {"0.01", "80.0"}


def test_a_model_named_in_any_characters_reaches_rays_metrics_export(ray_cluster):
    """Ray encodes tags as ASCII: a model named 模型 raised UnicodeEncodeError in the step's observer."""
    from frontend.metrics import SPECS, ray_backend, ray_tag

    assert ray_tag("模型") == "\\u6a21\\u578b" and ray_tag("m-1") == "m-1"
    for name in ("vllm:num_requests_running", "vllm:request_success"):
        extra = {"finished_reason": "stop"} if name == "vllm:request_success" else {}
        ray_backend("replica")(SPECS[name]).record(1.0, {"model_name": "模型", "engine": "0", **extra})


def test_a_models_name_is_refused_with_a_control_character():
    from specbatch.serve import LLMConfig

    assert Config(served_model_name='模型 "quoted"').served_model_name == '模型 "quoted"'
    for name in ("a\nb", "tab\there", ""):
        with pytest.raises(ValueError, match="served_model_name"):
            Config(served_model_name=name)
        with pytest.raises(ValueError, match="model_id"):
            LLMConfig(model_loading_config={"model_id": name})


def test_the_routers_merged_metrics_escape_label_values():
    """A model named with a quote, a backslash or any character stays one label value once several replicas' texts
    are merged; before, label values were written unescaped and the exposition did not parse."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from deploy.router import _merged_metrics
    from frontend.metrics import prometheus_backend

    names = ['say "hi"', "back\\slash", "模型"]
    texts = []
    for name in names:
        registry = prometheus_client.CollectorRegistry()
        EngineMetrics([prometheus_backend(registry)], name, max_model_len=64)
        texts.append(prometheus_client.generate_latest(registry).decode())
    families = {f.name: f for f in text_string_to_metric_families(_merged_metrics(texts).decode())}
    running = families["vllm:num_requests_running"].samples
    assert sorted(s.labels["model_name"] for s in running) == sorted(names)
    assert len(families["vllm:request_success"].samples) == 3 * len(FINISHED_REASONS)
