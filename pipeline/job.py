"""The batch generation job: input files -> Ray Data -> engine actors -> output directory (SPEC "Output directory")."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow.compute as pc
import ray
import ray.data

from decoding.config import Config
from pipeline.actor import ENGINE_RUNTIME_ENV, GenerationActor
from pipeline.io import list_input_files, read_prompts
from pipeline.store import OutputStore
from pipeline.summary import RunStats, summarize

log = logging.getLogger(__name__)

# Ray Data batches an actor works on at once. Their rows share one engine, so while one batch's last
# sequences finish, the next batch's rows already fill the freed engine rows.
CALLS_PER_ACTOR = 4


@contextmanager
def ray_session() -> Iterator[None]:
    """Use the connected cluster; else join RAY_ADDRESS's (as under `ray job submit`), else start a local one."""
    if ray.is_initialized():
        yield
        return
    ray.init()
    try:
        yield
    finally:
        ray.shutdown()


def generate(ds: ray.data.Dataset, config: Config) -> ray.data.Dataset:
    """Rows with ``id`` and ``prompt`` or ``messages`` -> output blocks (``pipeline.schema.output_block``)."""
    low, high = config.concurrency_range
    return ds.map_batches(
        GenerationActor,
        fn_constructor_kwargs={"config": config.model_dump(mode="json"), "actors_per_node": high},
        batch_size=config.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(
            min_size=low, max_size=high, max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
            # No queue beyond the calls an actor runs: otherwise the first ready actor takes most blocks of
            # a small job and the others idle.
            max_tasks_in_flight_per_actor=CALLS_PER_ACTOR, enable_true_multi_threading=True,
        ),
        num_gpus=config.num_gpus,
        num_cpus=config.num_cpus,  # None: Ray Data's default of one logical CPU per actor
        runtime_env=ENGINE_RUNTIME_ENV,
    )


def run(config: Config, input_path: str, output_dir: str) -> dict[str, Any]:
    """Generate for every input row not yet in ``output_dir``; write parts as they finish, then summary.json."""
    started = time.perf_counter()
    files, base = list_input_files(input_path)
    store = OutputStore(output_dir)
    done = store.prepare()
    if done:
        log.info("resuming: %d rows already in %s are skipped", len(done), store.outputs)
    rows = tokens = 0
    with ray_session():
        ds = read_prompts(files, base, skip=frozenset(done), rows_per_block=config.batch_size)
        for block in generate(ds, config).iter_batches(batch_size=None, batch_format="pyarrow"):
            outputs = store.write(block)
            rows += outputs.num_rows
            tokens += int(pc.sum(outputs["num_generated_tokens"]).as_py() or 0)
    summary = summarize(store, config, RunStats(rows, tokens, time.perf_counter() - started), input_path)
    store.write_summary(summary)
    return summary
