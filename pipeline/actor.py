"""The Ray Data actor: one engine per actor, fed continuously by every batch the actor is working on.

Ray Data runs several ``__call__``s of one actor at once (``max_concurrent_calls_per_actor``); each
tokenizes its rows on its own thread and queues them, while the engine thread (``decoding.engine.runner``) admits
queued requests into free rows between steps. So the engine's batch stays full across Ray Data batches
instead of draining at the end of each one.

The engine stack (torch, transformers: 6-7 CPU-seconds to import) loads where an actor builds its engine and uses
it, never at import: the job's driver imports this module only to name the class.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray

from decoding.config import Config
from decoding.params import resolve_sampling
from frontend.remote import localize_models
from frontend.requests import ChatOptions, RequestError, parse_request
from frontend.tool_calls import ToolUse, call_id
from pipeline.schema import ENGINE_READY, PRODUCER_NODE, READ_ERROR, RowOptions, output_block

if TYPE_CHECKING:
    from decoding.engine import Engine, GenerationResult, Request
    from decoding.engine.runner import Event

log = logging.getLogger(__name__)
DEFAULT_ROWS = RowOptions()

# Ray starts workers at niceness 15 to keep its own daemons responsive. An engine on a CPU node then yields its
# cores to every wake-up of the driver and daemons, and its OpenMP team stalls on the preempted thread: on 2
# cores the pipeline ran 25% slower than the engine called directly. Engine actors run at normal priority, as
# Ray runs job drivers; env_vars merge with the job's runtime_env (working_dir etc. stay).
ENGINE_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}

# Row columns that set how a row's messages render (frontend.requests.ChatOptions), and its tools.
CHAT_COLUMNS = tuple(ChatOptions.model_fields)
TOOL_COLUMNS = ("tools", "tool_choice", "parallel_tool_calls")
# The row columns a request is made of; the others only pass through to the output.
REQUEST_COLUMNS = frozenset({"id", "prompt", "messages", "sampling_params", READ_ERROR, *CHAT_COLUMNS,
                             *TOOL_COLUMNS, "lora", "model"})


class RowFailed(RuntimeError):
    """A row could not be generated and the processor does not continue on errors."""


def request_from_row(key: str, row: dict[str, Any], engine: Engine, options: RowOptions = DEFAULT_ROWS,
                     base_names: frozenset[str] = frozenset()) -> tuple[Request, ToolUse | None]:
    """An input row (docs/reference.md, "Input") as an engine request, with what its tools mean for its output;
    ``RequestError`` when it cannot be one. Rows are validated as the server validates its requests
    (frontend.requests), sampling parameters with every bound and against the model; the engine itself rejects what
    only tokenizing shows: empty or over-long prompts and messages its chat template cannot render, and adapters it
    cannot load. ``base_names``: what a Ray Data LLM row's ``model`` holds to mean the base model."""
    if row.get(READ_ERROR):
        raise RequestError(row[READ_ERROR])
    chat = {name: row[name] for name in CHAT_COLUMNS if row.get(name) is not None}
    prompt, messages = row.get("prompt"), row.get("messages")
    if options.ray_data_llm_rows and prompt is not None and messages is not None:
        # Ray Data LLM's stages: the chat template renders messages into the prompt (a user's prompt column is
        # overwritten); without it, the prompt is generated from and messages are carried.
        prompt, messages = (None, messages) if options.apply_chat_template else (prompt, None)
    tools = {name: row[name] for name in TOOL_COLUMNS if row.get(name) is not None}
    parsed = parse_request(prompt, messages, row.get("sampling_params"), **tools, **chat)
    if parsed.messages is not None and not options.apply_chat_template:
        raise RequestError("a row with messages needs the chat template (apply_chat_template is false)")
    sampling = parsed.sampling
    if options.ray_data_llm_rows and sampling and isinstance(sampling.get("n"), int) and sampling["n"] > 1:
        # Ray Data LLM keeps a request's first completion (outputs[0]): one sample has that law, so one is made.
        sampling = {**sampling, "n": 1}
    rendering = parsed.chat.request_fields(engine.config, continue_assistant=options.continue_assistant,
                                           messages=parsed.messages)
    use = parsed.tool_use(engine.config.tool_call_parser)
    if use is not None:
        try:
            sampling = use.sampling(sampling)
        except ValueError as exc:
            raise RequestError(f"invalid tool_choice: {exc}") from None
    from decoding.engine import Request

    sampling = resolve_sampling(sampling, engine.config.sampling, engine.target.config.vocab_size, engine.eos_ids)
    request = Request(key, prompt=parsed.prompt, messages=parsed.messages, sampling=sampling,
                      tools=use.tools if use is not None else None, lora=_row_adapter(row, engine, options, base_names),
                      **rendering)
    return request, use


def _row_adapter(row: dict[str, Any], engine: Engine, options: RowOptions, base_names: frozenset[str]) -> str | None:
    """The row's LoRA adapter: its ``lora`` column, else (Ray Data LLM's rows, adapters enabled) its ``model``
    unless that names the base model."""
    adapter = row.get("lora")
    if adapter is None and options.ray_data_llm_rows and engine.config.lora.enable:
        model = row.get("model")
        adapter = None if model in base_names else model
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise RequestError(f"lora must be an adapter's name (a non-empty string), got {adapter!r}")
    return adapter


def _rows(batch: pa.Table) -> list[dict[str, Any]]:
    """The columns of the batch's rows that make requests, as Python values (the others are carried through as
    Arrow data, whatever Python can make of them: a timestamp past year 9999 failed the batch). A row with a value
    Python cannot represent (a string that is not UTF-8, which Parquet does not check) carries the reason, naming
    the column, as its ``READ_ERROR`` instead of failing the whole batch."""
    batch = batch.select([name for name in batch.column_names if name in REQUEST_COLUMNS])
    try:
        return batch.to_pylist()
    except (ValueError, ArithmeticError):  # UnicodeDecodeError, OverflowError
        pass
    rows = []
    for index in range(batch.num_rows):
        row: dict[str, Any] = {}
        for name, column in zip(batch.column_names, batch.columns, strict=True):
            try:
                row[name] = column[index].as_py()
            except (ValueError, ArithmeticError) as exc:
                row = {READ_ERROR: f"undecodable row: column {name!r}: {exc}"}
                break
        rows.append(row)
    return rows


def _prompt_order(row: dict[str, Any]) -> str:
    """What orders rows by prompt: the prompt, else the messages as text (their system prompt first)."""
    prompt = row.get("prompt")
    return prompt if isinstance(prompt, str) else str(row.get("messages", ""))


class GenerationActor:
    """``map_batches`` callable class: Arrow batch of input rows -> output block (see pipeline.schema)."""

    def __init__(self, config: dict[str, Any], actors_per_node: int = 1, token_stats: bool = True,
                 options: RowOptions = DEFAULT_ROWS) -> None:
        from decoding.engine import Engine
        from decoding.engine.runner import EngineRunner
        from decoding.model.loading import worker_threads
        from frontend.metrics import EngineMetrics, ray_backend

        given = Config.model_validate(config)
        self.options = options
        self.config = localize_models(given)  # model URIs (s3://...) as local copies; provenance keeps the URIs
        self.token_stats = token_stats
        # Ray sets OMP_NUM_THREADS=1 in workers: a CPU actor uses its num_cpus, else its share of the node.
        self.torch_threads = worker_threads(self.config.num_cpus, actors_per_node)
        self._keys = itertools.count()  # engine ids (input ids need not be unique); next() is atomic across calls
        # vLLM's metrics through Ray's metrics export, recorded by the runner as the engine steps.
        metrics = EngineMetrics([ray_backend()], given.served_model_name or given.model) if options.metrics else None
        # An engine failure must not lose rows or stop the job: the runner reruns the requests in flight and only
        # a request that fails on its own becomes an error row, as does one whose constraint keeps a step busy past
        # limits.step_timeout_s. A failure to build the engine (bad model path, ...) fails the actor here.
        self.runner = EngineRunner(lambda: Engine(self.config), self.torch_threads, metrics,
                                   self.config.limits.step_timeout_s)
        # Ray Data LLM's max_pending_requests: a row waits for a place before it is submitted.
        self.pending = threading.BoundedSemaphore(options.max_pending) if options.max_pending else None
        spec = self.runner.engine.config.speculative  # as resolved: the default draft may have fallen back to ngram
        # What a Ray Data LLM row's ``model`` holds to mean the base model (not an adapter).
        self.base_names = frozenset(name for name in (given.model, given.served_model_name) if name)
        self.provenance = {
            "target_model": given.model,
            "draft_model": given.speculative.model if spec.method == "draft_model" else None,
        }
        # Which node produced a block and when its engine was ready: the writer records both in the part's commit
        # marker (the job's progress and summary tell generation from build time by it).
        self.metadata = {PRODUCER_NODE: ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
                         ENGINE_READY: repr(time.time())}

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = _rows(batch)
        # Submitted in the order of their prompts, so rows sharing a prefix join the engine close together and find
        # it cached; results keep the batch's order.
        submitted = {index: self._submit(rows[index]) for index in sorted(range(len(rows)),
                                                                          key=lambda i: _prompt_order(rows[i]))}
        results = [submitted[index][0].result() for index in range(len(rows))]
        if not self.options.continue_on_error and (failed := [r for r in results if r.finish_reason == "error"]):
            raise RowFailed(f"{len(failed)} of {len(results)} rows failed, the first: {failed[0].error} "
                            "(should_continue_on_error: true makes them error rows)")
        tokenizer = self.runner.thread_tokenizer()
        if self.options.detokenize:
            for result in results:
                if not result.text and result.token_ids:  # its sampling_params had detokenize: false
                    result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        calls = [_tool_calls(result, submitted[index][1]) for index, result in enumerate(results)]
        block = output_block(batch, results, self.provenance, self.token_stats,
                             decode=lambda ids: [tokenizer.decode([token]) for token in ids],
                             python_logprobs=self.options.ray_data_llm_rows, tool_calls=calls)
        return block.replace_schema_metadata(self.metadata)

    def _submit(self, row: dict[str, Any]) -> tuple[Future, ToolUse | None]:
        """The row's result to come, and what its tools mean for it."""
        from decoding.engine import GenerationResult
        from decoding.engine.runner import RequestRejected
        from decoding.engine.sequence import error_result

        future: Future = Future()
        use = None
        if self.pending is not None:
            self.pending.acquire()
            future.add_done_callback(lambda _: self.pending.release())
        key = str(next(self._keys))
        started = time.perf_counter()
        # An error row the actor makes has the engine's shape (decoding.engine.sequence.error_result): its
        # histogram as long as the engine's, its time from the row's arrival.
        max_depth = self.runner.engine.topology.max_depth
        try:
            request, use = request_from_row(key, row, self.runner.engine, self.options, self.base_names)
            request.seed_key = str(row.get("id", key))  # a row's random stream follows its id, not its actor
            prepared = self.runner.prepare(request)  # on this call's thread, not the engine's
        except (RequestError, RequestRejected) as exc:
            future.set_result(error_result(key, row.get("prompt"), str(exc), started, max_depth))
            return future, None

        def sink(event: Event) -> None:  # called on the engine thread
            if isinstance(event, GenerationResult):
                future.set_result(event)
            elif isinstance(event, BaseException):
                future.set_result(error_result(key, row.get("prompt"), f"engine failure: {event!r}", started,
                                               max_depth))

        self.runner.submit(request, prepared, sink)
        return future, use


def _tool_calls(result: GenerationResult, use: ToolUse | None) -> list[dict[str, str]] | None:
    """The row's ``tool_calls`` column: the calls its text holds as its tools' parser reads it (null for none)."""
    if use is None or result.finish_reason == "error":
        return None
    calls = use.extract(result.text).calls
    return [{"id": call_id(), "name": call.name, "arguments": call.arguments} for call in calls] or None
