"""The Ray Data actor: one engine per actor, fed continuously by every batch the actor is working on.

Ray Data runs several ``__call__``s of one actor at once (``max_concurrent_calls_per_actor``); each
tokenizes its rows on its own thread and queues them, while the engine thread (``decoding.runner``) admits
queued requests into free rows between steps. So the engine's batch stays full across Ray Data batches
instead of draining at the end of each one.
"""

from __future__ import annotations

import itertools
import json
import logging
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from decoding.config import Config
from decoding.engine import Engine, GenerationResult, Request
from decoding.models import worker_threads
from decoding.runner import EngineRunner, Event, RequestRejected
from pipeline.schema import READ_ERROR, output_block

log = logging.getLogger(__name__)

# Ray starts workers at niceness 15 to keep its own daemons responsive. An engine on a CPU node then yields its
# cores to every wake-up of the driver and daemons, and its OpenMP team stalls on the preempted thread: on 2
# cores the pipeline ran 25% slower than the engine called directly. Engine actors run at normal priority, as
# Ray runs job drivers; env_vars merge with the job's runtime_env (working_dir etc. stay).
ENGINE_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}


class RowError(ValueError):
    """An input row that cannot become a request; it becomes an error row."""


def _json_value(value: Any, column: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise RowError(f"invalid {column}: not JSON ({exc})") from exc


def _without_nulls(record: dict[str, Any]) -> dict[str, Any]:
    # Arrow gives every struct row all fields of the column, null where that row had none.
    return {key: value for key, value in record.items() if value is not None}


def request_from_row(key: str, row: dict[str, Any]) -> Request:
    """An input row (SPEC "Input") as an engine request; ``RowError`` when it cannot be one. The engine
    itself rejects what it can judge: empty, over-long or non-string prompts, invalid sampling values."""
    if row.get(READ_ERROR):
        raise RowError(row[READ_ERROR])
    prompt, messages = row.get("prompt"), row.get("messages")
    sampling = _json_value(row.get("sampling_params"), "sampling_params")
    if sampling is not None:
        if not isinstance(sampling, dict):
            raise RowError(f"invalid sampling_params: expected an object, got {type(sampling).__name__}")
        sampling = _without_nulls(sampling)
    if messages is None:
        return Request(key, prompt=prompt, sampling=sampling)
    if prompt is not None:
        raise RowError("a row has either a prompt or messages, not both")
    messages = _json_value(messages, "messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RowError("invalid messages: expected a list of {role, content} objects")
    return Request(key, messages=[_without_nulls(m) for m in messages], sampling=sampling)


def error_result(request_id: str, prompt: Any, message: str) -> GenerationResult:
    return GenerationResult(
        id=request_id, prompt=prompt if isinstance(prompt, str) else "", prompt_token_ids=[], token_ids=[],
        text="", finish_reason="error", error=message, time_taken=0.0, token_accepted=[],
        per_step_drafted=[], per_step_accepted=[], num_target_forwards=0, acceptance_histogram=[],
    )


class GenerationActor:
    """``map_batches`` callable class: Arrow batch of input rows -> output block (see pipeline.schema)."""

    def __init__(self, config: dict[str, Any], actors_per_node: int = 1) -> None:
        self.config = Config.model_validate(config)
        # Ray sets OMP_NUM_THREADS=1 in workers: a CPU actor uses its num_cpus, else its share of the node.
        self.torch_threads = worker_threads(self.config.num_cpus, actors_per_node)
        self._keys = itertools.count()  # engine ids (input ids need not be unique); next() is atomic across calls
        # An engine failure must not lose rows or stop the job: the runner reruns the requests in flight one by
        # one and only a request that fails on its own becomes an error row. A failure to build the engine (bad
        # model path, ...) fails the actor here.
        self.runner = EngineRunner(lambda: Engine(self.config), self.torch_threads, recover=True)
        spec = self.runner.engine.config.speculative  # as resolved: the default draft may have fallen back to ngram
        self.provenance = {
            "target_model": self.config.model,
            "draft_model": spec.model if spec.method == "draft_model" else None,
        }

    def __call__(self, batch: pa.Table) -> pa.Table:
        futures = [self._submit(row) for row in batch.to_pylist()]
        return output_block(batch, [future.result() for future in futures], self.provenance)

    def _submit(self, row: dict[str, Any]) -> Future:
        future: Future = Future()
        key = str(next(self._keys))
        try:
            request = request_from_row(key, row)
            prepared = self.runner.prepare(request)  # on this call's thread, not the engine's
        except (RowError, RequestRejected) as exc:
            future.set_result(error_result(key, row.get("prompt"), str(exc)))
            return future

        def sink(event: Event) -> None:
            if isinstance(event, GenerationResult):
                future.set_result(event)
            elif isinstance(event, BaseException):
                future.set_result(error_result(key, row.get("prompt"), f"engine failure: {event!r}"))

        self.runner.submit(request, prepared, sink)
        return future
