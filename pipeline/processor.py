"""``build_processor``: the engine as a stage of one's own Ray Data pipeline, with Ray Data LLM's semantics
(docs/reference.md, "Python API").

    processor = build_processor(ProcessorConfig(model_source="smollm2-135m-instruct", batch_size=32),
                                preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"]}]},
                                postprocess=lambda row: {"answer": row["generated_text"], **row})
    ds = processor(ray.data.read_parquet("s3://bucket/questions/"))

Rows as Ray Data LLM treats them: what ``preprocess`` returns is merged into the input row, so every input column
reaches ``postprocess``; the engine adds the output columns (no ``id`` needed, none added); rows that end in
``finish_reason: "error"`` bypass ``postprocess``. ``config`` is a ``ProcessorConfig`` (Ray Data LLM's
``vLLMEngineProcessorConfig`` fields) or a ``Config`` (specbatch's own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.data

from decoding.config import Config, load_config
from frontend.resources import check_cluster
from pipeline.processor_config import ProcessorConfig
from pipeline.schema import INFERENCE_ERROR, RowOptions

Row = dict[str, Any]
log = logging.getLogger(__name__)

# Ray Data batches an actor works on at once with a ``Config``. Their rows share one engine, so while one batch's
# last sequences finish, the next batch's rows already fill the freed engine rows.
CALLS_PER_ACTOR = 4


def rows_per_block(config: Config) -> int:
    """Half an engine batch: an actor works on several blocks at once (``CALLS_PER_ACTOR``), so its engine stays
    full, and the blocks spread evenly over actors that start at different times. The processor's own batches;
    ``specbatch generate`` reads its own blocks (``pipeline.job.rows_per_part``)."""
    return max(1, -(-config.batch_size // 2))


def light_tasks(config: Config) -> int:
    """Tasks in flight at once of a stage that asks for no CPU (reading files, postprocessing rows, writing parts):
    one per actor, two at least. Unbounded, Ray starts a worker process for each task that finds none idle while
    workers start: a job of 100 small files started 96 processes (2 cores: 222 s; 40 s bounded)."""
    return max(2, config.concurrency_range[1])


@dataclass(frozen=True)
class StageOptions:
    """How the engine stage maps over a Dataset: Ray Data's batching and actor pool, and what rows mean."""

    rows_per_batch: int | None  # None: the blocks as they come
    calls_per_actor: int = CALLS_PER_ACTOR
    tasks_in_flight_per_actor: int | None = CALLS_PER_ACTOR  # None: Ray Data's default
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    resources: dict[str, float] | None = None  # custom resources each actor reserves
    rows: RowOptions = field(default_factory=RowOptions)
    preprocess_map_kwargs: dict[str, Any] = field(default_factory=dict)
    postprocess_map_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, config: ProcessorConfig, preprocess_map_kwargs: dict[str, Any] | None = None,
           postprocess_map_kwargs: dict[str, Any] | None = None) -> StageOptions:
        return cls(
            rows_per_batch=config.batch_size, calls_per_actor=config.max_concurrent_batches,
            tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor,
            accelerator_type=config.accelerator_type, runtime_env=config.runtime_env,
            resources=config.actor_resources().get("resources"),
            rows=RowOptions(
                continue_on_error=config.should_continue_on_error, error_column=config.should_continue_on_error,
                detokenize=config.detokenize, apply_chat_template=config.apply_chat_template,
                continue_assistant=True, metrics=config.log_engine_metrics,
                max_pending=config.max_pending_requests, ray_data_llm_rows=True,
            ),
            preprocess_map_kwargs=preprocess_map_kwargs or {}, postprocess_map_kwargs=postprocess_map_kwargs or {},
        )


def _runtime_env(user: dict[str, Any] | None) -> dict[str, Any]:
    """The user's runtime_env with the engine's environment variables merged in (the user's win)."""
    from pipeline.actor import ENGINE_RUNTIME_ENV

    user = dict(user or {})
    return {**user, "env_vars": {**ENGINE_RUNTIME_ENV["env_vars"], **(user.get("env_vars") or {})}}


class _Preprocess:
    """Ray Data LLM's preprocess: the user function's output merged into the input row."""

    def __init__(self, fn: Callable[[Row], Row]) -> None:
        self.fn = fn

    def __call__(self, row: Row) -> Row:
        return {**row, **self.fn(row)}


class _Postprocess:
    """Ray Data LLM's postprocess: error rows bypass the user function and keep every column; with
    ``error_column`` every row gets ``__inference_error__`` (empty, or the error)."""

    def __init__(self, fn: Callable[[Row], Row] | None, error_column: bool) -> None:
        self.fn, self.error_column = fn, error_column

    def __call__(self, row: Row) -> Row:
        if row.get("finish_reason") == "error":
            return {**row, INFERENCE_ERROR: row.get("error") or ""} if self.error_column else row
        result = self.fn(row) if self.fn is not None else row
        return {**result, INFERENCE_ERROR: ""} if self.error_column else result


# The engine stage's input columns, as ``Processor.log_input_column_names`` reports them.
REQUIRED_COLUMNS = {"prompt or messages": "the text to continue, or the chat (OpenAI's message shape)"}
OPTIONAL_COLUMNS = {
    "sampling_params": "vLLM's SamplingParams fields (an object or its JSON text)",
    "tools": "OpenAI's function tools, rendered by the chat template",
    "tool_choice": "auto, none, required or {type: function, function: {name}}",
    "chat_template_kwargs": "variables the chat template reads",
    "add_generation_prompt / continue_final_message": "how the last message renders",
}


class Processor:
    """A callable ``Dataset -> Dataset``; see ``build_processor``. Also a context manager: ``close()`` (or leaving
    the ``with`` block) ends its use, after which calling it is refused. Its engines live in the actor pool of the
    dataset each call returns and are released when that dataset finishes executing."""

    def __init__(self, config: Config, preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None, token_stats: bool = False,
                 options: StageOptions | None = None) -> None:
        self.config, self.preprocess, self.postprocess, self.token_stats = config, preprocess, postprocess, token_stats
        self.options = options or StageOptions(rows_per_block(config))
        self.closed = False

    def __enter__(self) -> Processor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True

    def list_stage_names(self) -> list[str]:
        """Ray Data LLM's stage names, in order, of the stages this processor runs."""
        return [name for name, runs in (("Preprocess", self.preprocess is not None), ("vLLMEngineStage", True),
                                        ("Postprocess", self.postprocess is not None)) if runs]

    def log_input_column_names(self) -> str:
        """Logs (and returns) the first stage and the columns it reads, as Ray Data LLM's processor does: a dataset
        without them needs a ``preprocess`` that makes them."""
        lines = [f"The first stage of the processor is {self.list_stage_names()[0]}."]
        if self.preprocess is None:
            lines += ["Required input columns:", *(f"\t{k}: {v}" for k, v in REQUIRED_COLUMNS.items()),
                      "Optional input columns:", *(f"\t{k}: {v}" for k, v in OPTIONAL_COLUMNS.items())]
        else:
            lines.append("Its input columns are whatever preprocess reads; preprocess's output columns: "
                         + ", ".join([*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS]))
        message = "\n".join(lines)
        log.info(message)
        return message

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        if self.closed:
            raise RuntimeError("this processor is closed (close() or its with block ended): build another")
        # The engine's side (torch, transformers) loads here, in the driver: Ray Data's tasks that run this module's
        # preprocess and postprocess do without it (5 s of CPU for each of their worker processes).
        from pipeline.actor import GenerationActor

        options = self.options
        if self.preprocess is not None:
            ds = ds.map(_Preprocess(self.preprocess), **options.preprocess_map_kwargs)
        check_cluster(self.config, "actors")
        low, high = self.config.concurrency_range
        # ``map_batches`` refuses whole blocks (batch_size None) to an actor that asks for GPUs, so the job's GPU
        # actors failed before any row ran (seen on an H200); its DeveloperAPI twin, which Ray Data LLM's
        # processors and ``map_groups`` call for the same reason, takes the same arguments without that check.
        ds = ds.map_batches_internal(
            GenerationActor,
            fn_constructor_kwargs={"config": self.config.model_dump(mode="json"), "actors_per_node": high,
                                   "token_stats": self.token_stats, "options": options.rows},
            batch_size=options.rows_per_batch,
            batch_format="pyarrow",
            zero_copy_batch=True,  # the actor only reads its batch
            compute=ray.data.ActorPoolStrategy(
                min_size=low, max_size=high, max_concurrent_calls_per_actor=options.calls_per_actor,
                # With a Config, no queue beyond the calls an actor runs: otherwise the first ready actor takes
                # most blocks of a small job and the others idle.
                max_tasks_in_flight_per_actor=options.tasks_in_flight_per_actor, enable_true_multi_threading=True,
            ),
            num_gpus=self.config.num_gpus,
            num_cpus=self.config.num_cpus,  # None: Ray Data's default of one logical CPU per actor
            accelerator_type=options.accelerator_type,
            runtime_env=_runtime_env(options.runtime_env),
            **({"resources": options.resources} if options.resources else {}),
        )
        if self.postprocess is not None or options.rows.error_column:
            # Light per-row work after the actors, which may hold every CPU: it must not wait for one.
            postprocess = _Postprocess(self.postprocess, options.rows.error_column)
            kwargs = options.postprocess_map_kwargs
            bound = {} if {"compute", "concurrency"} & kwargs.keys() else {"concurrency": light_tasks(self.config)}
            ds = ds.map(postprocess, **{"num_cpus": 0, **bound, **kwargs})
        return ds


def build_processor(
    config: ProcessorConfig | Config | dict[str, Any] | str | Path,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
    builder_kwargs: dict[str, Any] | None = None,
    *,
    token_stats: bool = False,
    should_continue_on_error: bool = True,
) -> Processor:
    """A processor generating for every row of a Dataset, Ray Data LLM's ``build_processor`` in signature and row
    semantics.

    ``config``: a ``ProcessorConfig`` (Ray Data LLM's ``vLLMEngineProcessorConfig`` fields and meanings), or a
    ``Config``, its dict form or a YAML file (specbatch's own; the engine's ``batch_size`` then sets the Ray
    batches too). ``preprocess`` maps a user row to the columns to add: ``prompt`` or ``messages``, optionally
    ``sampling_params`` and the chat template options; its output is merged into the row. ``postprocess`` maps
    each output row (the input columns, the output columns) to the row to keep; rows whose ``finish_reason`` is
    "error" bypass it. ``builder_kwargs``: ``chat_template_kwargs`` for every row, as Ray Data LLM's.

    Errors: a ``ProcessorConfig`` has Ray Data LLM's ``should_continue_on_error`` (default false: a row that
    fails fails the dataset; true: it becomes an error row, with ``__inference_error__`` holding the reason on
    every row, empty when it succeeded). With a ``Config``, ``should_continue_on_error`` is this function's
    keyword, default true: a row that cannot be generated becomes an output row with ``finish_reason`` "error"
    and the reason in ``error``, as in ``specbatch generate``."""
    builder_kwargs = dict(builder_kwargs or {})
    chat_template_kwargs = builder_kwargs.pop("chat_template_kwargs", None)
    if builder_kwargs:
        raise TypeError(f"unknown builder_kwargs {sorted(builder_kwargs)} (accepted: chat_template_kwargs)")
    if isinstance(config, ProcessorConfig):
        options = StageOptions.of(config, preprocess_map_kwargs, postprocess_map_kwargs)
        config = config.engine_config()
    else:
        if isinstance(config, str | Path):
            config = load_config(str(config))
        elif not isinstance(config, Config):
            config = Config.model_validate(config)
        options = StageOptions(
            rows_per_block(config), rows=RowOptions(continue_on_error=should_continue_on_error),
            preprocess_map_kwargs=preprocess_map_kwargs or {}, postprocess_map_kwargs=postprocess_map_kwargs or {},
        )
    if chat_template_kwargs:
        config = config.model_copy(update={
            "chat_template_kwargs": {**chat_template_kwargs, **config.chat_template_kwargs}})
    return Processor(config, preprocess, postprocess, token_stats, options)


# Ray Data LLM's older name of its builder.
build_llm_processor = build_processor
