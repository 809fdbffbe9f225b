"""vLLM's engine metrics, with vLLM's names, types, labels and buckets, recorded as the engine steps.

Matched against vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and ``vllm/v1/metrics/stats.py``
as of v0.15 (January 2026: ``vllm:time_per_output_token_seconds``, deprecated in v0.11, removed by PR #32661).

Both adapters hand an ``EngineMetrics`` to their ``EngineRunner``, which calls it when a request arrives, after
every engine step and when a request is aborted; so counters move while requests run, and an aborted stream's
tokens are counted. The metrics go to one or more backends: Ray's metrics export (``ray_backend``: names as vLLM's
own Ray wrapper registers them, ``vllm:`` sanitized to ``vllm_``, plus its ``ReplicaId`` label; Ray prefixes
``ray_``; a counter appears there once it has moved), and a replica's own ``prometheus_client`` registry
(``prometheus_backend``: vLLM's names as its server's ``/metrics`` shows them, every series from the start, as
vLLM declares them: ``request_success`` for each finish reason, ``num_preemptions`` at 0).

Per step, as vLLM records its iteration stats:

- ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
  ``..._num_accepted_tokens_per_pos`` (label ``position``): each row that drafted in a step is one draft.
- ``vllm:prompt_tokens``, ``vllm:generation_tokens``: tokens prefilled (at a request's first step) and emitted;
  ``vllm:iteration_tokens_total``: the two summed over one step.
- ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``: after each step.
- ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``: prompt tokens of the rows that joined a step, and of
  those the tokens found in the prefix cache (zero queries where caching is off).
- ``vllm:lora_requests_info`` (with LoRA adapters): the step's time, labelled with ``max_lora`` and the adapters of
  the running and of the waiting requests (``running_lora_adapters``, ``waiting_lora_adapters``, comma-separated).
- ``vllm:num_preemptions``: this engine never preempts a request (a row keeps its KV blocks until it finishes).
- ``vllm:time_to_first_token_seconds``: arrival (submission to the runner, after tokenization) to the first
  tokens; ``vllm:inter_token_latency_seconds``: after the first tokens, the time between a request's successive
  steps that emitted tokens (one observation per step, however many tokens it accepted: vLLM's ITL).

When a request finishes (vLLM's finished-request stats; vLLM's event names: arrival is also QUEUED, the start of
the step the request joined the batch in is SCHEDULED, the steps that emitted its tokens are NEW_TOKENS):

- ``vllm:request_success`` (label ``finished_reason``: ``stop``, ``length``, ``error``; ``abort`` when a client
  went away before the end, which counts nothing else at its end);
- ``vllm:e2e_request_latency_seconds`` (arrival to the last tokens), ``vllm:request_queue_time_seconds``
  (arrival to SCHEDULED), ``vllm:request_prefill_time_seconds`` (SCHEDULED to the first tokens),
  ``vllm:request_decode_time_seconds`` (first to last tokens), ``vllm:request_inference_time_seconds``
  (SCHEDULED to the last tokens), ``vllm:request_time_per_output_token_seconds`` (decode time over the tokens
  after the first);
- ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``, ``vllm:request_prefill_kv_computed_tokens``
  (prompt tokens not found in the prefix cache), ``vllm:request_params_max_tokens``;
- per parent request (the ``n`` choices of one prompt, ``EngineMetrics.parent``; else the request alone), when its
  last choice finishes: ``vllm:request_params_n`` and ``vllm:request_max_num_generation_tokens`` (its longest
  choice). A parent a choice of which was aborted or refused records neither, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from decoding.engine import StepOutput

LABELS = ("model_name", "engine")
Kind = Literal["counter", "gauge", "histogram"]

# vLLM's FinishReason (vllm/v1/engine/__init__.py, FINISH_REASON_STRINGS): request_success's series.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (``build_1_2_5_buckets(100)``: 1, 2, 5, 10, 20, 50, 100)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = LABELS
    buckets: tuple[float, ...] = ()
    # Buckets up to the context length (known once the engine is built: ``EngineMetrics.bind``).
    context_buckets: bool = False


def _counter(name: str, description: str, labels: tuple[str, ...] = LABELS) -> MetricSpec:
    return MetricSpec(name, "counter", description, labels)


def _histogram(name: str, description: str, buckets: tuple[float, ...] | None) -> MetricSpec:
    """``buckets`` None: vLLM's 1-2-5 series up to the context length (a token-count histogram)."""
    return MetricSpec(name, "histogram", description, buckets=buckets or (), context_buckets=buckets is None)


SPECS = {spec.name: spec for spec in (
    _counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    _counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    _counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    _counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
             (*LABELS, "position")),
    MetricSpec("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    _counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
    _counter("vllm:generation_tokens", "Number of generation tokens processed."),
    _counter("vllm:request_success", "Count of successfully processed requests.", (*LABELS, "finished_reason")),
    _histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    _histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    _histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
               ITERATION_TOKENS_BUCKETS),
    _histogram("vllm:request_max_num_generation_tokens",
               "Histogram of maximum number of requested generation tokens.", None),
    _histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    _histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
    _histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    _histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    _histogram("vllm:request_time_per_output_token_seconds",
               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    _histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
               REQUEST_LATENCY_BUCKETS),
    _histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
               REQUEST_LATENCY_BUCKETS),
    _histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
               REQUEST_LATENCY_BUCKETS),
    _histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
               REQUEST_LATENCY_BUCKETS),
    _histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
               REQUEST_LATENCY_BUCKETS),
    _histogram("vllm:request_prefill_kv_computed_tokens",
               "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None),
    MetricSpec("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
               (*LABELS, "max_lora", "waiting_lora_adapters", "running_lora_adapters")),
)}


class Metric(Protocol):
    def record(self, value: float, tags: dict[str, str]) -> None:
        """Counter: add ``value``; gauge: set it; histogram: observe it."""

    # Optional: ``declare(tags)`` makes the series exist (at zero) before anything is recorded in it.


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
        ascii_tags = {key: ray_tag(tag) for key, tag in tags.items()}
        getattr(self.metric, self.method)(value, {**ascii_tags, "ReplicaId": self.replica_id})


@functools.lru_cache(maxsize=256)
def ray_tag(value: str) -> str:
    """``value`` as Ray's metrics export takes a tag: ASCII, any other character written as its Python escape
    (``模型`` is ``\\u6a21\\u578b``); Ray encodes tags as ASCII and raised on a model named otherwise."""
    return value.encode("ascii", "backslashreplace").decode("ascii")


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

    def declare(self, tags: dict[str, str]) -> None:
        self.metric.labels(**tags)

    def record(self, value: float, tags: dict[str, str]) -> None:
        getattr(self.metric.labels(**tags), self.method)(value)


def prometheus_backend(registry: Any) -> Backend:
    """A ``prometheus_client`` registry (a replica's own ``/metrics``)."""
    return lambda spec: _Prometheus(spec, registry)


@dataclass
class _Timing:
    """One request's timestamps (``time.perf_counter`` readings) and counts, as vLLM's ``RequestStateStats``."""

    arrived: float  # submitted to the runner: vLLM's arrival and QUEUED
    prompt_tokens: int
    scheduled: float | None = None  # the start of the step it joined the batch in
    max_tokens: int = 0
    first_tokens: float | None = None
    last_tokens: float | None = None
    generated: int = 0


@dataclass
class _Parent:
    """vLLM's ``ParentRequest``: the choices of one prompt, observed once when the last one finishes."""

    n: int
    pending: int
    longest: int = 0
    dropped: bool = False  # a choice was aborted or refused


class EngineMetrics:
    """The metrics of one engine; the ``decoding.engine.runner.EngineRunner`` observer protocol.

    ``max_model_len``: the engine's context, where the token-count histograms' buckets end; unknown before the
    engine is built, it can be given later (``bind``), else it is taken from the first step's output."""

    def __init__(self, backends: Sequence[Backend], model_name: str, engine: str = "0",
                 max_model_len: int | None = None) -> None:
        self.tags = {"model_name": model_name, "engine": engine}
        self._backends = list(backends)
        self.metrics: dict[str, list[Metric]] = {}
        self._create([spec for spec in SPECS.values() if not spec.context_buckets])
        self._timings: dict[str, _Timing] = {}
        self._parents: dict[str, _Parent] = {}  # by choice (engine request) id
        self._lock = threading.Lock()  # arrivals come from callers' threads, steps from the engine thread
        if max_model_len is not None:
            self.bind(max_model_len)

    def _create(self, specs: list[MetricSpec]) -> None:
        for spec in specs:
            self.metrics[spec.name] = metrics = [backend(spec) for backend in self._backends]
            if set(spec.labels) - {*LABELS, "finished_reason"}:
                continue  # a series per draft position, or per set of adapters in use, as they appear
            extra = [{"finished_reason": reason} for reason in FINISHED_REASONS] if (
                "finished_reason" in spec.labels) else [{}]
            for metric in metrics:
                declare = getattr(metric, "declare", None)
                for labels in extra if declare is not None else ():
                    declare({**self.tags, **labels})

    def bind(self, max_model_len: int) -> None:
        """Create the token-count histograms: vLLM's 1-2-5 buckets up to ``max_model_len`` (once)."""
        if "vllm:request_prompt_tokens" in self.metrics:
            return
        buckets = build_1_2_5_buckets(max_model_len)
        self._create([dataclasses.replace(spec, buckets=buckets) for spec in SPECS.values() if spec.context_buckets])

    def _record(self, name: str, value: float, **labels: str) -> None:
        if SPECS[name].kind == "counter" and not value:
            return  # Ray's counters take positive increments only
        for metric in self.metrics.get(name, ()):
            metric.record(value, {**self.tags, **labels})

    def parent(self, request_ids: Sequence[str]) -> None:
        """The engine requests that are the ``n`` choices of one prompt (vLLM's parent request): ``request_params_n``
        and ``request_max_num_generation_tokens`` are observed once for them, when the last one finishes. A request
        not named here is a parent of its own (``n`` 1). Call it before submitting them."""
        parent = _Parent(n=len(request_ids), pending=len(request_ids))
        with self._lock:
            for request_id in request_ids:
                self._parents[request_id] = parent

    # --------------------------------------------------------------------------------- observer protocol
    def submitted(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self._timings[request_id] = _Timing(time.perf_counter(), prompt_tokens)

    def aborted(self, request_id: str) -> None:
        with self._lock:
            timing = self._timings.pop(request_id, None)
            self._drop_choice(request_id)
        if timing is not None:  # it was running (else it never reached the engine, or had finished already)
            self._record("vllm:request_success", 1, finished_reason="abort")

    def _drop_choice(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            parent.pending -= 1
            parent.dropped = True

    def stepped(self, output: StepOutput) -> None:
        now = time.perf_counter()
        if output.max_context:
            self.bind(output.max_context)
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
        if output.max_lora:  # vLLM's: the step's time, labelled with the adapters in use
            self._record("vllm:lora_requests_info", time.time(), max_lora=str(output.max_lora),
                         waiting_lora_adapters=",".join(output.waiting_adapters),
                         running_lora_adapters=",".join(output.running_adapters))
        prompt_tokens, first, between, finished, parents = 0, [], [], [], []
        with self._lock:
            for request_id, max_tokens in output.scheduled.items():
                timing = self._timings.get(request_id)
                if timing is not None and timing.scheduled is None:
                    timing.scheduled, timing.max_tokens = output.started or now, max_tokens
            for request_id, tokens in output.new_tokens.items():
                timing = self._timings.get(request_id)
                if timing is None or not tokens:
                    continue
                timing.generated += len(tokens)
                if timing.first_tokens is None:
                    prompt_tokens += timing.prompt_tokens
                    first.append(now - timing.arrived)
                    timing.first_tokens = now
                else:
                    between.append(now - timing.last_tokens)
                timing.last_tokens = now
            for result in output.finished:
                timing = self._timings.pop(result.id, None)
                if timing is None:  # refused before it ran (an error result): never reached the batch
                    self._drop_choice(result.id)
                    continue
                finished.append((result, timing))
                parents.append(self._finish_choice(result.id, len(result.token_ids)))
        generated = sum(len(tokens) for tokens in output.new_tokens.values())
        self._record("vllm:prompt_tokens", prompt_tokens)
        self._record("vllm:generation_tokens", generated)
        self._record("vllm:iteration_tokens_total", prompt_tokens + generated)
        for seconds in first:
            self._record("vllm:time_to_first_token_seconds", seconds)
        for seconds in between:
            self._record("vllm:inter_token_latency_seconds", seconds)
        for result, timing in finished:
            self._finished(result, timing, now)
        for observed in parents:
            if observed is not None:
                self._record("vllm:request_params_n", observed[0])
                self._record("vllm:request_max_num_generation_tokens", observed[1])

    def _finish_choice(self, request_id: str, generated: int) -> tuple[int, int] | None:
        """(n, longest choice) to observe when ``request_id`` was its parent's last choice (under the lock)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return 1, generated
        parent.pending -= 1
        parent.longest = max(parent.longest, generated)
        return (parent.n, parent.longest) if parent.pending == 0 and not parent.dropped else None

    def _finished(self, result: Any, timing: _Timing, now: float) -> None:
        """vLLM's ``update_from_finished_request``, the intervals from the request's timestamps."""
        reason = result.finish_reason if result.finish_reason in FINISHED_REASONS else "error"
        self._record("vllm:request_success", 1, finished_reason=reason)
        prompt = len(result.prompt_token_ids)
        self._record("vllm:request_prompt_tokens", prompt)
        self._record("vllm:request_generation_tokens", len(result.token_ids))
        self._record("vllm:request_prefill_kv_computed_tokens", prompt - max(result.num_cached_tokens, 0))
        if timing.max_tokens:
            self._record("vllm:request_params_max_tokens", timing.max_tokens)
        if timing.first_tokens is None or timing.last_tokens is None:
            return  # it ended without a token (an error at its first step): no intervals
        self._record("vllm:e2e_request_latency_seconds", now - timing.arrived)
        decode = timing.last_tokens - timing.first_tokens
        self._record("vllm:request_decode_time_seconds", decode)
        self._record("vllm:request_time_per_output_token_seconds",
                     decode / (timing.generated - 1) if timing.generated > 1 else 0.0)
        if timing.scheduled is not None:
            self._record("vllm:request_queue_time_seconds", timing.scheduled - timing.arrived)
            self._record("vllm:request_prefill_time_seconds", timing.first_tokens - timing.scheduled)
            self._record("vllm:request_inference_time_seconds", timing.last_tokens - timing.scheduled)
