"""The batch generation job: input files -> Ray Data -> engine actors -> output directory (docs/reference.md).

``specbatch generate`` is the processor of ``build_processor`` between a reader that numbers rows and skips the
finished ones, and a datasink whose write tasks write the parts on the workers: no output row passes through
the driver, which only lists commit markers (resume) and adds them up (summary.json).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.data

from decoding.config import Config
from pipeline.io import InputError, list_input_files, read_prompts, rows_left, without_output
from pipeline.processor import CALLS_PER_ACTOR, Processor, StageOptions, light_tasks, rows_per_block
from pipeline.progress import Progress, ProgressWatcher, count_rows
from pipeline.store import Lease, LeaseLost, OutputSink, OutputStore, new_run_id
from pipeline.summary import RunStats, summarize

# How long a job starting several actors waits for them to build their engines (model download and load
# included) before failing with Ray Data's "Timed out while starting actors" (a cluster without the resources the
# actors ask for).
ACTOR_START_TIMEOUT_S = 1800

log = logging.getLogger(__name__)


@contextmanager
def ray_session(verbose: bool = True) -> Iterator[None]:
    """Use the connected cluster; else join RAY_ADDRESS's (as under `ray job submit`), else start a local one.
    ``verbose``: Ray's and Ray Data's logs and progress bars and the workers' output reach the driver's (the engine
    actors' build time and progress lines, decoding.engine.runner); otherwise only warnings do, and errors."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = context.print_on_execution_start = verbose
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    # News for --verbose only: a local cluster's start saying that Ray turned token authentication on (its default),
    # Ray Data saying that the progress bars this run turned off are off.
    for name in ("ray._private.authentication", "ray.data._internal.progress"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    # A failed task's traceback, logged by Ray Data before it re-raises the error to the job, which reports it.
    for name in ("ray.data._internal.execution.streaming_executor_state", "ray.data.exceptions"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.CRITICAL)
    if ray.is_initialized():
        yield
        return
    ray.init(logging_config=ray.LoggingConfig(encoding="TEXT", log_level="INFO" if verbose else "WARNING"),
             log_to_driver=verbose)
    if not verbose:
        _spend_actor_restart_warning()
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0, resources={"specbatch_never_scheduled": 1}, max_restarts=1)
class _NeverScheduled:
    def __init__(self, argument: object) -> None:
        del argument


def _spend_actor_restart_warning() -> None:
    """Ray's core worker logs an error, once per process, when an actor that may restart has a constructor argument
    in the object store; Ray Data's map actors always have one (their context and function), harmless while the
    driver holds them (ray-project/ray#57733), and it was the one error line of a successful first run. The once is
    spent on an actor that is never scheduled, with the driver's stderr closed for that call."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        actor = _NeverScheduled.remote(ray.put(None))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    ray.kill(actor)


# A generous size of an input row, to guess from the files' sizes how many rows a job has: a guess too small
# only gives a small job smaller blocks.
ROW_BYTES_GUESS = 1024


# Generated tokens one part may hold (its rows times their max_tokens), which bounds a part's time: about 27 s
# at batch 64 on a 2-core CPU with the default model (~600 tokens/s).
PART_TOKENS = 16384


def rows_per_part(config: Config, input_bytes: int | None = None) -> int:
    """Rows of one block of the job's reader, which is one output part: at most four engine batches of one file,
    and at most ``PART_TOKENS`` tokens of output at the configured ``max_tokens`` (not below half a batch).
    A block is committed as soon as its rows are done, so a job commits from its first blocks on and an
    interruption loses at most the blocks in flight (``CALLS_PER_ACTOR`` per actor, which keep the engine full).
    Each block costs an actor call and a write task: 22,000 two-token rows of a tiny model at batch_size 16 took
    119 s in 695 parts of two batches, 38 s in 353 parts of four, 28 s in 89 parts of sixteen (2 cores). A small
    job (``input_bytes``, its files' size) gets smaller blocks, down to half a batch, so that every actor gets some:
    the first actor up takes the first blocks, up to its calls in flight (two one-CPU nodes, 24 rows in 3 blocks:
    one node did all)."""
    most = min(4 * config.batch_size, max(rows_per_block(config), PART_TOKENS // config.sampling.max_tokens))
    if input_bytes is None:
        return most
    calls = config.concurrency_range[1] * CALLS_PER_ACTOR
    return max(rows_per_block(config), min(most, -(-input_bytes // ROW_BYTES_GUESS) // calls))


def generate(ds: ray.data.Dataset, config: Config) -> ray.data.Dataset:
    """Rows with ``id`` and ``prompt`` or ``messages``, in blocks (``read_prompts``) -> output blocks
    with nested token statistics (``pipeline.schema.output_block``), one per input block."""
    # Blocks are not re-batched: two files' blocks may differ in column types, and concatenating them would fail.
    return Processor(config, token_stats=True, options=StageOptions(rows_per_batch=None))(ds)


def run(config: Config, input_path: str, output_dir: str, *, progress: Callable[[Progress], None] | None = None,
        verbose: bool = True) -> dict[str, Any]:
    """Generate for every input row not yet in ``output_dir``; write parts as they finish, then summary.json.
    ``progress`` is called every few seconds, on a thread of its own, with what the run has committed so far;
    ``verbose``: Ray's own logs and progress bars (see ``ray_session``)."""
    fs, files, base = list_input_files(input_path)
    files = without_output(fs, files, input_path, output_dir)
    store = OutputStore(output_dir)
    lease = Lease(store)
    try:
        lease.acquire()
    except OSError as exc:  # an existing file, a read-only file system, no permission
        raise InputError(f"output {output_dir}: cannot write there ({exc})") from None
    started = time.perf_counter()  # after the lease's fixed one-second pause (see Lease)
    started_at = time.time()
    try:
        try:
            markers = store.prepare()
        except OSError as exc:
            raise InputError(f"output {output_dir}: cannot write there ({exc})") from None
        done = frozenset(row_id for marker in markers for row_id in marker["ids"])
        if done:
            log.info("resuming: %d rows already in %s are skipped", len(done), output_dir)
        run_id = new_run_id()
        store.write_json(f"_runs/{run_id}.json", {"run": run_id, "started": lease.record["started"],
                                                  "input": input_path, "config": config.model_dump(mode="json")})
        sink = OutputSink(store, run_id, lease.record["owner"])
        input_rows = functools.cache(lambda: count_rows(fs, files))  # read once: here on a resume, else by the watcher
        # A finished job run again starts no engines: its rows are counted (cheap), and read only when the count
        # says they may all be done.
        finished = bool(done) and input_rows() <= len(done) and not rows_left(files, base, done, fs)
        if finished:
            log.info("every input row is already in %s: nothing to generate", output_dir)
        else:
            watcher = ProgressWatcher(store, run_id, progress, lambda: input_rows() - len(done)) \
                if progress else nullcontext()
            with ray_session(verbose), watcher:
                _write_parts(config, fs, files, base, done, sink)
        ready = [m["engine_ready"] for m in sink.written if m.get("engine_ready")]
        run_stats = RunStats(run_id, time.perf_counter() - started,
                             min(ready) - started_at if ready else None)
        summary = summarize(markers + sink.written, store.runs(), config, run_stats, input_path)
        lease.check()
        store.write_json("summary.json", summary)
    finally:
        lease.release()
    return summary


def _write_parts(config: Config, fs: pafs.FileSystem, files: list[str], base: str, done: frozenset[str],
                 sink: OutputSink) -> None:
    """The job's pipeline: the rows of ``files`` not in ``done``, through the engine actors, into ``sink``."""
    input_bytes = sum(info.size or 0 for info in fs.get_file_info(files))
    tasks = light_tasks(config)  # the read's and the writes' bound
    ds = read_prompts(files, base, skip=done, rows_per_block=rows_per_part(config, input_bytes),
                      filesystem=fs, tasks=tasks)
    # Blocks go to the least busy actor, not the one beside the block's data (a few kilobytes, against
    # seconds of generation): with locality, two one-CPU nodes' actors got 6 blocks of 4 rows, all on the
    # node that read them.
    with warnings.catch_warnings():  # deprecated in Ray 2.60 with no replacement yet; pinned below 2.61
        warnings.simplefilter("ignore", DeprecationWarning)
        ds.context.execution_options.actor_locality_enabled = False
    if config.concurrency_range[0] > 1:
        # Blocks start flowing once the pool's first actors (its minimum, Ray Data's initial size) are all
        # up: otherwise the first actor ready takes every block its calls in flight hold (concurrency 2 ran
        # at 0.57x of one actor). The wait also holds back the read, so a pool that starts with one actor
        # does without it (its first block arrives 0.1-0.5 s after the build instead of 1.4-2.3 s). An
        # actor that cannot start still fails the job: Ray Data's no-progress timeout. The dataset's own
        # context.
        ds.context.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S
    # Write tasks are I/O: they ask for no CPU, which the actors hold (see read_prompts). Unbounded, 20,000
    # short rows of a tiny model in one file started 15 worker processes for them (2 cores: 85 s, 59 s).
    try:
        with warnings.catch_warnings():  # a small job's stages get fewer blocks than their bound: fine
            warnings.filterwarnings("ignore", "The maximum number of concurrent tasks", UserWarning)
            generate(ds, config).write_datasink(sink, ray_remote_args={"num_cpus": 0},
                                                concurrency=tasks)
    except LeaseLost as exc:  # from a write task (pipeline.store.check_fence); Ray adds its traceback
        raise LeaseLost(LeaseLost.own_message(str(exc))) from None
