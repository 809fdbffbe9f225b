"""``build_processor``: the engine as a stage of one's own Ray Data pipeline, Ray Data LLM style (SPEC "Python API").

    processor = build_processor(config, preprocess=lambda row: {"prompt": row["question"]},
                                postprocess=lambda row: {"answer": row["generated_text"], **row})
    ds = processor(ray.data.read_parquet("s3://bucket/questions/"))

User rows in; the user's columns plus SPEC's output columns out (no ``id`` needed, none added); token
statistics, one nested list per row, only with ``token_stats=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.data

from decoding.config import Config, load_config
from pipeline.actor import ENGINE_RUNTIME_ENV, GenerationActor

Row = dict[str, Any]

# Ray Data batches an actor works on at once. Their rows share one engine, so while one batch's last
# sequences finish, the next batch's rows already fill the freed engine rows.
CALLS_PER_ACTOR = 4


def rows_per_block(config: Config) -> int:
    """Half an engine batch: an actor works on several blocks at once (``CALLS_PER_ACTOR``), so its engine stays
    full, and the blocks spread evenly over actors that start at different times. Exact for the processor's own
    batches; the job's reader only slices by it (see ``pipeline.io.read_prompts``: Ray Data joins small slices)."""
    return max(1, -(-config.batch_size // 2))


class Processor:
    """A callable ``Dataset -> Dataset``; see ``build_processor``."""

    def __init__(self, config: Config, preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None, token_stats: bool = False) -> None:
        self.config, self.preprocess, self.postprocess, self.token_stats = config, preprocess, postprocess, token_stats

    def __call__(self, ds: ray.data.Dataset, *, rebatch: bool = True) -> ray.data.Dataset:
        """Actor calls of ``rows_per_block`` rows; with ``rebatch=False`` the blocks as they come (the
        job's reader makes them batch-sized and never mixes two files, whose column types may differ, in one)."""
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        low, high = self.config.concurrency_range
        # ``map_batches`` refuses whole blocks (batch_size None) to an actor that asks for GPUs, so the job's GPU
        # actors failed before any row ran (seen on an H200); its DeveloperAPI twin, which Ray Data LLM's
        # processors and ``map_groups`` call for the same reason, takes the same arguments without that check.
        ds = ds.map_batches_internal(
            GenerationActor,
            fn_constructor_kwargs={"config": self.config.model_dump(mode="json"), "actors_per_node": high,
                                   "token_stats": self.token_stats},
            batch_size=rows_per_block(self.config) if rebatch else None,
            batch_format="pyarrow",
            zero_copy_batch=True,  # the actor only reads its batch
            compute=ray.data.ActorPoolStrategy(
                min_size=low, max_size=high, max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                # No queue beyond the calls an actor runs: otherwise the first ready actor takes most blocks of
                # a small job and the others idle.
                max_tasks_in_flight_per_actor=CALLS_PER_ACTOR, enable_true_multi_threading=True,
            ),
            num_gpus=self.config.num_gpus,
            num_cpus=self.config.num_cpus,  # None: Ray Data's default of one logical CPU per actor
            runtime_env=ENGINE_RUNTIME_ENV,
        )
        if self.postprocess is not None:
            # Light per-row work after the actors, which may hold every CPU: it must not wait for one.
            ds = ds.map(self.postprocess, num_cpus=0)
        return ds


def build_processor(config: Config | dict[str, Any] | str | Path, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None, *, token_stats: bool = False) -> Processor:
    """A processor generating for every row of a Dataset with the engine ``config`` describes.

    ``config``: a ``Config``, its dict form, or a YAML file. ``preprocess`` maps a user row to a row with
    ``prompt`` or ``messages`` and optionally ``sampling_params`` (its other columns are carried through);
    ``postprocess`` maps each output row (SPEC's output columns plus the carried ones) to the row to keep.
    A row that cannot be generated becomes an output row with ``finish_reason`` "error" and the reason in
    ``error``; it never fails the dataset."""
    if isinstance(config, str | Path):
        config = load_config(str(config))
    elif not isinstance(config, Config):
        config = Config.model_validate(config)
    return Processor(config, preprocess, postprocess, token_stats)
