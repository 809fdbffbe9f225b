"""``specbatch report DIR``: summary table and PNG charts of an output directory, as report.html.

    specbatch report specbatch-out [--output DIR] [--baseline BASELINE_DIR]

``--baseline`` names an output directory of the same prompts decoded with ``speculative.method: none``; the
per-prompt speedup then compares seconds per token row by row instead of counting target forwards.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specbatch report", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="an output directory of specbatch generate (outputs/, token_stats/)")
    parser.add_argument("--output", help="where report.html and report_files/ go (default: DIRECTORY)")
    parser.add_argument("--baseline", help="output directory of the same prompts with method none")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = write_report(args.directory, args.output, args.baseline)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(report.text)
    print(f"wrote {report.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
