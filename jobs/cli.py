"""The ``specbatch`` console script: one subcommand per module under ``jobs/``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("jobs.generate", "batch generation over a prompt dataset (Ray Data)"),
    "serve": ("jobs.serve", "OpenAI-compatible HTTP endpoint (Ray Serve)"),
    "train-draft": ("jobs.train_draft", "distil a small draft model for a target"),
    "train-head": ("jobs.train_head", "train the SpecDec++ acceptance head (length_policy: threshold)"),
    "train-decision": ("jobs.train_decision", "train the early-stop decision model (length_policy: decision)"),
    "bench": ("jobs.bench", "side-by-side throughput table against plain decoding and transformers"),
    "report": ("jobs.report", "summary tables and plots of an output directory"),
}


def usage() -> str:
    lines = ["usage: specbatch <command> [options]", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "run `specbatch <command> --help` for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"specbatch: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
