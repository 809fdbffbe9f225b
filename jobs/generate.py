"""``specbatch generate`` / ``python -m jobs.generate``: batch generation over a prompt dataset with Ray Data.

Without RAY_ADDRESS it starts a local Ray cluster; under ``ray job submit`` it joins the job's cluster.
With no arguments it runs the bundled sample prompts on the default model into ./specbatch-out.
"""

from __future__ import annotations

import argparse
import errno
import importlib.resources
import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

from decoding.config import ConfigError
from jobs.common import parse_with_config, setup_logging

if TYPE_CHECKING:
    from pipeline.progress import Progress

SAMPLE_PROMPTS = importlib.resources.files("jobs").joinpath("data/sample_prompts.jsonl")
# Without a terminal, one progress line at most this often.
PLAIN_EVERY_SECONDS = 30.0


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """One progress display: a bar on a terminal, else a plain line every ``PLAIN_EVERY_SECONDS``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        # sys.stderr as it is now, not as it was when this module was imported (a test's captured stream, since
        # closed, made every later run fail with "I/O operation on closed file").
        stream = stream or sys.stderr
        self.stream = stream
        self.bar: tqdm | None = tqdm(total=None, unit="row", file=stream, dynamic_ncols=True,
                                     bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]",
                                     desc="generating") if stream.isatty() else None
        self.last: Progress | None = None
        self.printed_at = 0.0

    def __call__(self, progress: Progress) -> None:
        self.last = progress
        status = (f"{progress.tokens_per_second:.1f} tokens/s, acceptance length "
                  f"{progress.mean_acceptance_length:.2f}, ETA {_clock(progress.eta_seconds)}"
                  if progress.engine_ready is not None else "building the engines")
        if self.bar is not None:
            self.bar.total = progress.rows_total
            self.bar.n = progress.rows_done
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.refresh()
            return
        if progress.now - self.printed_at >= PLAIN_EVERY_SECONDS:
            self.printed_at = progress.now
            total = "?" if progress.rows_total is None else progress.rows_total
            print(f"rows {progress.rows_done}/{total}, {progress.generated_tokens} tokens; {status}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps: Ray Data re-raises a write task's error) is a full disk or quota."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and (exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc)):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch generate",
        description="Generate for every row of a prompt dataset; any config field can be overridden, "
        "e.g. --speculative.num_candidates 3 --sampling.max_tokens 64",
    )
    parser.add_argument("--input", help="Parquet/JSONL/CSV file, directory or glob; a local path or any pyarrow URI "
                        "(s3://, gs://, hdfs://) (default: bundled samples)")
    parser.add_argument("--output", default="specbatch-out", help="output directory or URI; re-running resumes")
    parser.add_argument("--verbose", action="store_true",
                        help="Ray's and transformers' logs, Ray Data's progress bars and the engine actors' output")
    args, config = parse_with_config(parser, sys.argv[1:] if argv is None else argv)
    # Ray, Ray Data and the engine load after the config is read: a bad config is refused in well under a second.
    from pipeline.io import InputError
    from pipeline.job import run
    from pipeline.summary import summary_line

    setup_logging()
    if not args.verbose:
        # By the environment: the driver never imports transformers, and a cluster it starts inherits this.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        logging.getLogger("decoding").setLevel(logging.WARNING)
    display = ProgressDisplay()
    try:
        summary = run(config, args.input or str(SAMPLE_PROMPTS), args.output, progress=display,
                      verbose=args.verbose)
    except (InputError, ConfigError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except Exception as exc:
        if not _out_of_space(exc):
            raise
        parser.exit(1, f"{parser.prog}: error: output {args.output}: no space left on the device; the parts written "
                       "so far are kept: free space (or move the directory) and run the same command to resume\n")
    finally:
        display.close()
    print(summary_line(summary, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
