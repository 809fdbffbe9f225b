"""Throughput of the batch pipeline against calling the engine directly (docs/performance.md).

64 XSum articles as "Summarize the following article in one sentence: ..." chat prompts, batch_size 8, the
default model and speculative configuration: ``Engine.generate`` in this process, then ``pipeline.run`` with
concurrency 1 and 2 on a local Ray cluster started beforehand (so the pipeline's time includes its actors'
start and model loading, not the cluster's). Prints a table with two references: ``Engine.generate`` alone, and
``Engine(config)`` + ``generate`` (model loading counted on both sides); and ``Engine.generate`` once more in this
process while the cluster is up and idle, which tells what Ray's own processes cost the engine on this machine
apart from what the pipeline adds. Any config field can be overridden:

    python -m jobs.pipeline_throughput [--rows 64] [--concurrency 1,2] [--data PATH] [--no-ray-idle] [--config F]
        [--sampling.max_tokens 64] [--num_gpus 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from decoding.config import Config
from decoding.engine import Engine, Request
from decoding.stats import SpecDecodeStats
from jobs.common import parse_with_config, setup_logging
from pipeline.job import ray_session, run

XSUM = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "xsum_200.jsonl"
INSTRUCTION = "Summarize the following article in one sentence: "
# The benchmark's own defaults; command-line overrides replace them.
DEFAULTS = {"batch_size": "8", "sampling.max_tokens": "64"}


def load_rows(path: Path, count: int) -> list[dict]:
    articles = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [{"id": a["id"], "messages": [{"role": "user", "content": INSTRUCTION + a["document"]}]} for a in articles]


@dataclass(frozen=True)
class DirectRun:
    rows: int
    tokens: int
    seconds: float  # generation alone, the engine built
    acceptance: float  # mean acceptance length


def generate_directly(config: Config, rows: list[dict]) -> tuple[float, DirectRun]:
    """(seconds to build the engine, its ``generate`` on every row) with a fresh engine in this process."""
    start = time.perf_counter()
    engine = Engine(config)
    built = time.perf_counter()
    results = engine.generate([Request(r["id"], messages=r["messages"]) for r in rows])
    seconds = time.perf_counter() - built
    return built - start, DirectRun(len(results), sum(len(r.token_ids) for r in results), seconds,
                                    SpecDecodeStats.total(r.stats for r in results).mean_acceptance_length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.pipeline_throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--concurrency", default="1,2", help="pipeline concurrencies to run, comma-separated")
    parser.add_argument("--data", type=Path, default=XSUM, help="JSONL with id and document (XSum)")
    parser.add_argument("--no-ray-idle", action="store_true",
                        help="skip the Ray-idle reference (it measures Ray's daemons sharing the engine's cores)")
    args, config = parse_with_config(parser, sys.argv[1:] if argv is None else argv, DEFAULTS)
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    setup_logging()
    rows = load_rows(args.data, args.rows)
    print(f"{config.model}, method {config.speculative.method}, batch_size {config.batch_size}, "
          f"max_tokens {config.sampling.max_tokens}, {len(rows)} prompts")
    print(f"| {'setup':<26} | rows | tokens | seconds | tokens/s | vs direct | vs direct + build "
          "| mean acceptance length |")
    print(f"|{'-' * 28}|------|--------|---------|----------|-----------|-------------------|"
          "------------------------|", flush=True)

    build_seconds, alone = generate_directly(config, rows)
    references = alone.tokens / alone.seconds, alone.tokens / (alone.seconds + build_seconds)
    print_row("Engine.generate (direct)", alone.rows, alone.tokens, alone.seconds, references, alone.acceptance)
    print_row("Engine(config) + generate", alone.rows, alone.tokens, alone.seconds + build_seconds, references,
              alone.acceptance)

    # The cluster starts before the pipeline runs (their time includes their actors' start, not the cluster's),
    # as ``specbatch generate`` starts it: the actors' engine progress lines show in this output.
    with ray_session(), tempfile.TemporaryDirectory() as tmp:
        # Ray's daemons (GCS, raylet, dashboard, log monitor) share the cores even when idle: the engine alone with
        # them running, a fresh engine as above.
        if not args.no_ray_idle:
            _, idle = generate_directly(config, rows)
            print_row("Engine.generate, Ray idle", idle.rows, idle.tokens, idle.seconds, references, idle.acceptance)
        source = Path(tmp) / "xsum.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for concurrency in concurrencies:
            setup = config.model_copy(update={"concurrency": concurrency})
            summary = run(setup, str(source), f"{tmp}/c{concurrency}")
            print_row(f"pipeline, concurrency {concurrency}", summary["rows"], summary["generated_tokens"],
                      summary["wall_seconds"], references, summary["mean_acceptance_length"])
    return 0


def print_row(
    name: str, count: int, tokens: int, seconds: float, references: tuple[float, float], acceptance: float
) -> None:
    """One table row as soon as it is measured (a run cut short still reports what it finished)."""
    rate = tokens / seconds
    direct, with_build = references
    print(f"| {name:<26} | {count:>4} | {tokens:>6} | {seconds:>7.1f} | {rate:>8.1f} | {rate / direct:>9.2f} "
          f"| {rate / with_build:>17.2f} | {acceptance:>22.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
