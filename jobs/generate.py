"""``specbatch generate`` / ``python -m jobs.generate``: batch generation over a prompt dataset with Ray Data.

Without RAY_ADDRESS it starts a local Ray cluster; under ``ray job submit`` it joins the job's cluster.
With no arguments it runs the bundled sample prompts on the default model into ./specbatch-out.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys

from jobs.common import parse_with_config, setup_logging
from pipeline.io import InputError
from pipeline.job import run
from pipeline.summary import summary_line

SAMPLE_PROMPTS = importlib.resources.files("jobs").joinpath("data/sample_prompts.jsonl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch generate",
        description="Generate for every row of a prompt dataset; any config field can be overridden, "
        "e.g. --speculative.num_candidates 3 --sampling.max_tokens 64",
    )
    parser.add_argument("--input", help="Parquet/JSONL/CSV file, directory or glob; a local path or any pyarrow URI "
                        "(s3://, gs://, hdfs://) (default: bundled samples)")
    parser.add_argument("--output", default="specbatch-out", help="output directory or URI; re-running resumes")
    args, config = parse_with_config(parser, sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        summary = run(config, args.input or str(SAMPLE_PROMPTS), args.output)
    except InputError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(summary_line(summary, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
