"""vLLM's engine metrics (frontend.metrics) as the runner records them: per step, aborted requests included."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future

from decoding.config import Config
from decoding.engine import Engine, GenerationResult, Request
from decoding.engine.runner import EngineRunner
from frontend.metrics import EngineMetrics, MetricSpec


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
