"""``specbatch train-head`` / ``python -m jobs.train_head``: the SpecDec++ acceptance head for a draft.

    specbatch train-head --draft D --data PATH [--target T] [--output DIR] [--field VALUE ...]

Runs the engine (target + draft) over the prompts, then fits the head ``length_policy: threshold`` loads from
``speculative.acceptance_head``. The output defaults to ``<draft>/acceptance_head``. Fields of
``training.signals.SignalTrainingConfig`` can be set with ``--config`` or ``--field VALUE``.
Collection is saved in shards, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from decoding.model.loading import DEFAULT_MODEL, resolve_model_path
from jobs.train_draft import build_config, run_training, training_parser
from training.signals import SignalTrainingConfig, train_signal_model

DESCRIPTIONS = {
    "acceptance_head": "Train the SpecDec++ acceptance-prediction head (length_policy: threshold).",
    "decision_model": "Train the early-stop decision model of Lu et al. (length_policy: decision).",
}


def signal_main(argv: list[str] | None, kind: str, prog: str) -> int:
    parser = training_parser(prog, DESCRIPTIONS[kind])
    parser.add_argument("--draft", help="draft model directory or alias (e.g. made by specbatch train-draft)")

    def fill(data: dict[str, Any], args: argparse.Namespace) -> None:
        data["kind"] = kind
        data.setdefault("target", DEFAULT_MODEL)
        if args.draft:
            data["draft"] = args.draft
        if "output" not in data and "draft" in data:
            data["output"] = str(Path(resolve_model_path(data["draft"])) / kind)

    args, config = build_config(parser, sys.argv[1:] if argv is None else argv, SignalTrainingConfig, fill)
    return run_training(train_signal_model, config, args.overwrite, args.num_cpus, parser.prog)


def main(argv: list[str] | None = None) -> int:
    return signal_main(argv, "acceptance_head", "specbatch train-head")


if __name__ == "__main__":
    sys.exit(main())
