"""vLLM's engine metrics, with vLLM's names, labels and buckets, recorded as the engine steps.

Both adapters hand an ``EngineMetrics`` to their ``EngineRunner``, which calls it when a request arrives, after
every engine step and when a request is aborted; so counters move while requests run, and an aborted stream's
tokens are counted. The metrics go to one or more backends: Ray's metrics export (``ray_backend``: names as vLLM's
own Ray wrapper registers them, ``vllm:`` sanitized to ``vllm_``, plus its ``ReplicaId`` label; Ray prefixes
``ray_``), and a replica's own ``prometheus_client`` registry (``prometheus_backend``: vLLM's names as its
server's ``/metrics`` shows them).

- ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
  ``..._num_accepted_tokens_per_pos`` (label ``position``): each row that drafted in a step is one draft.
- ``vllm:prompt_tokens``, ``vllm:generation_tokens``: tokens prefilled (at a request's first step) and emitted.
- ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``: after each step.
- ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``: prompt tokens of the rows that joined a step, and of
  those the tokens found in the prefix cache (zero queries where caching is off).
- ``vllm:time_to_first_token_seconds``: arrival (submission to the runner) to the first tokens;
  ``vllm:time_per_output_token_seconds``: after the first tokens, each step's wait for a request's new tokens
  over their count; ``vllm:e2e_request_latency_seconds``: arrival to the finished result.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from decoding.engine import StepOutput

LABELS = ("model_name", "engine")
Kind = Literal["counter", "gauge", "histogram"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = LABELS
    buckets: tuple[float, ...] = ()


SPECS = {spec.name: spec for spec in (
    MetricSpec("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
    MetricSpec("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens."),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
               (*LABELS, "position")),
    MetricSpec("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    MetricSpec("vllm:prefix_cache_queries", "counter",
               "Prefix cache queries, in terms of number of queried tokens."),
    MetricSpec("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    MetricSpec("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    MetricSpec("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
               buckets=TTFT_BUCKETS),
    MetricSpec("vllm:time_per_output_token_seconds", "histogram", "Histogram of time per output token in seconds.",
               buckets=TPOT_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
               buckets=E2E_BUCKETS),
)}


class Metric(Protocol):
    def record(self, value: float, tags: dict[str, str]) -> None:
        """Counter: add ``value``; gauge: set it; histogram: observe it."""


Backend = Callable[[MetricSpec], Metric]


class _Ray:
    def __init__(self, spec: MetricSpec, replica_id: str) -> None:
        from ray.util import metrics

        name = re.sub(r"[^a-zA-Z0-9_]", "_", spec.name)  # as vLLM's Ray wrapper: OpenTelemetry's name rules
        keys = (*spec.labels, "ReplicaId")
        if spec.kind == "histogram":
            self.metric = metrics.Histogram(name, spec.description, list(spec.buckets), tag_keys=keys)
        else:
            self.metric = (metrics.Counter if spec.kind == "counter" else metrics.Gauge)(name, spec.description,
                                                                                         tag_keys=keys)
        self.method, self.replica_id = {"counter": "inc", "gauge": "set", "histogram": "observe"}[spec.kind], replica_id

    def record(self, value: float, tags: dict[str, str]) -> None:
        getattr(self.metric, self.method)(value, {**tags, "ReplicaId": self.replica_id})


def ray_backend(replica_id: str = "") -> Backend:
    """Ray's metrics export (every process of a node, scraped at the node's metrics port)."""
    return lambda spec: _Ray(spec, replica_id)


class _Prometheus:
    def __init__(self, spec: MetricSpec, registry: Any) -> None:
        import prometheus_client

        kwargs: dict[str, Any] = {"labelnames": spec.labels, "registry": registry}
        if spec.kind == "histogram":
            kwargs["buckets"] = spec.buckets
        kind = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge,
                "histogram": prometheus_client.Histogram}[spec.kind]
        self.metric, self.method = kind(spec.name, spec.description, **kwargs), {
            "counter": "inc", "gauge": "set", "histogram": "observe"}[spec.kind]

    def record(self, value: float, tags: dict[str, str]) -> None:
        getattr(self.metric.labels(**tags), self.method)(value)


def prometheus_backend(registry: Any) -> Backend:
    """A ``prometheus_client`` registry (a replica's own ``/metrics``)."""
    return lambda spec: _Prometheus(spec, registry)


@dataclass
class _Timing:
    arrived: float
    prompt_tokens: int
    last_tokens: float | None = None


class EngineMetrics:
    """The metrics of one engine; the ``decoding.engine.runner.EngineRunner`` observer protocol."""

    def __init__(self, backends: Sequence[Backend], model_name: str, engine: str = "0") -> None:
        self.tags = {"model_name": model_name, "engine": engine}
        self.metrics = {name: [backend(spec) for backend in backends] for name, spec in SPECS.items()}
        self._timings: dict[str, _Timing] = {}
        self._lock = threading.Lock()  # arrivals come from callers' threads, steps from the engine thread

    def _record(self, name: str, value: float, **labels: str) -> None:
        if SPECS[name].kind == "counter" and not value:
            return  # Ray's counters take positive increments only
        for metric in self.metrics[name]:
            metric.record(value, {**self.tags, **labels})

    # --------------------------------------------------------------------------------- observer protocol
    def submitted(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self._timings[request_id] = _Timing(time.perf_counter(), prompt_tokens)

    def aborted(self, request_id: str) -> None:
        with self._lock:
            self._timings.pop(request_id, None)

    def stepped(self, output: StepOutput) -> None:
        now = time.perf_counter()
        spec = output.spec_decode
        self._record("vllm:spec_decode_num_drafts", spec.num_spec_steps)
        self._record("vllm:spec_decode_num_draft_tokens", spec.num_draft_tokens)
        self._record("vllm:spec_decode_num_accepted_tokens", spec.num_accepted_draft_tokens)
        for position, count in enumerate(spec.accepted_per_pos):
            self._record("vllm:spec_decode_num_accepted_tokens_per_pos", count, position=str(position))
        self._record("vllm:num_requests_running", output.num_running)
        self._record("vllm:num_requests_waiting", output.num_waiting)
        self._record("vllm:kv_cache_usage_perc", output.kv_cache_usage)
        self._record("vllm:prefix_cache_queries", output.prefix_cache_queries)
        self._record("vllm:prefix_cache_hits", output.prefix_cache_hits)
        prompt_tokens = 0
        with self._lock:
            for request_id, tokens in output.new_tokens.items():
                timing = self._timings.get(request_id)
                if timing is None or not tokens:
                    continue
                if timing.last_tokens is None:
                    prompt_tokens += timing.prompt_tokens
                    self._record("vllm:time_to_first_token_seconds", now - timing.arrived)
                else:
                    self._record("vllm:time_per_output_token_seconds", (now - timing.last_tokens) / len(tokens))
                timing.last_tokens = now
            finished = [self._timings.pop(result.id, None) for result in output.finished]
        self._record("vllm:prompt_tokens", prompt_tokens)
        self._record("vllm:generation_tokens", sum(len(tokens) for tokens in output.new_tokens.values()))
        for timing in finished:
            if timing is not None and timing.last_tokens is not None:
                self._record("vllm:e2e_request_latency_seconds", now - timing.arrived)
