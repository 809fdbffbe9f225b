"""``specbatch train-draft`` / ``python -m jobs.train_draft``: distil a draft model for a target.

    specbatch train-draft --target T --data PATH [--data PATH ...] --output DIR [--field VALUE ...]

Any field of ``training.distill.DraftTrainingConfig`` can be set in ``--config FILE.yaml`` or overridden
as ``--field VALUE`` (``--vocab_size 4096 --layers "[0, 1]" --train_seconds 900``). Training runs as one Ray task
(a local cluster without RAY_ADDRESS, the job's cluster under ``ray job submit``), logging progress; an
interrupted run (Ctrl-C, ``ray job stop``) checkpoints, and re-running the same command resumes it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from decoding.config import ConfigError, apply_overrides, format_validation_error, read_yaml_file
from decoding.model.loading import DEFAULT_DRAFT, DEFAULT_MODEL, resolve_model_path
from jobs.common import setup_logging, split_overrides
from training.data import PromptSource
from training.runs import RunError

log = logging.getLogger("jobs.train")

Trainer = Callable[[Any, bool], Path]


def training_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Options every training command shares; the rest are ``--field VALUE`` overrides of its config."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file with the training config's fields")
    parser.add_argument("--target", help=f"target model directory, hub id or alias (default {DEFAULT_MODEL})")
    parser.add_argument("--data", action="append", help="prompt file/dir/glob (JSONL/JSON/Parquet/CSV); repeatable")
    parser.add_argument("--template", help="format rows into prompts, e.g. 'Summarize: {document}' (with --data)")
    parser.add_argument("--chat", action="store_true", help="render --data prompts with the chat template")
    parser.add_argument("--output", help="artifact directory")
    parser.add_argument("--overwrite", action="store_true", help="replace a finished or unfinished run in --output")
    parser.add_argument("--num-cpus", type=int, help="CPUs for the Ray task and torch threads (default: all)")
    return parser


def build_config(
    parser: argparse.ArgumentParser,
    argv: list[str],
    model: type[BaseModel],
    fill: Callable[[dict[str, Any], argparse.Namespace], None],
) -> tuple[argparse.Namespace, BaseModel]:
    """Config file < named options < ``--field VALUE`` overrides; ``fill`` supplies derived defaults."""
    args, unknown = parser.parse_known_args(argv)
    try:
        data: dict[str, Any] = (read_yaml_file(args.config) or {}) if args.config else {}
        for key in ("target", "output"):
            if getattr(args, key) is not None:
                data[key] = getattr(args, key)
        if args.data:
            sources = [PromptSource(path=path, template=args.template, chat=args.chat) for path in args.data]
            data["data"] = [source.model_dump() for source in sources]
        apply_overrides(data, split_overrides(unknown))
        if args.num_cpus and "num_threads" in model.model_fields:
            data.setdefault("num_threads", args.num_cpus)
        fill(data, args)
        return args, model.model_validate(data)
    except (OSError, ConfigError, ValueError) as exc:
        message = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def _task(trainer: Trainer, config: BaseModel, overwrite: bool) -> str:
    setup_logging()  # a Ray worker starts without logging configured; progress lines must reach the job log
    # ray.cancel interrupts a running task with _thread.interrupt_main(), which does nothing while SIGINT is
    # ignored, as it is in the workers of a Ray started from a nohup'd or background process: take it back.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return str(trainer(config, overwrite))


def run_training(trainer: Trainer, config: BaseModel, overwrite: bool, num_cpus: int | None, prog: str) -> int:
    """Run ``trainer`` as a Ray task; exit 0 (done), 2 (refused: bad input or output dir) or 130 (interrupted)."""
    import ray

    if not ray.is_initialized():
        ray.init(log_to_driver=True)
    cpus = num_cpus or max(1, int(ray.available_resources().get("CPU", 1)))
    if getattr(config, "num_threads", 0) is None:
        config = config.model_copy(update={"num_threads": cpus})  # Ray would otherwise pin torch to 1 thread
    task = ray.remote(num_cpus=cpus, max_retries=0)(_task).remote(trainer, config, overwrite)
    # `ray job stop` sends SIGTERM: turn it into the same clean interruption as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        path = ray.get(task)
    except KeyboardInterrupt:
        ray.cancel(task)  # raises KeyboardInterrupt inside the task, which checkpoints before exiting
        with contextlib.suppress(ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError, KeyboardInterrupt):
            ray.get(task)
        print(f"{prog}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    except (RunError, ValueError, FileNotFoundError) as exc:
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        print(f"{prog}: error: {cause}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(path)
    return 0


def _fill(data: dict[str, Any], args: argparse.Namespace) -> None:
    del args  # train-draft has no options beyond the shared ones
    data.setdefault("target", DEFAULT_MODEL)
    if "output" not in data and data["target"] == DEFAULT_MODEL:
        data["output"] = DEFAULT_DRAFT
    if data.get("output") == DEFAULT_DRAFT:
        data["output"] = resolve_model_path(DEFAULT_DRAFT, must_exist=False)


def main(argv: list[str] | None = None) -> int:
    from training.distill import DraftTrainingConfig, train_draft

    parser = training_parser("specbatch train-draft", "Distil a small draft model sharing the target's tokenizer.")
    args, config = build_config(parser, sys.argv[1:] if argv is None else argv, DraftTrainingConfig, _fill)
    setup_logging()
    return run_training(train_draft, config, args.overwrite, args.num_cpus, parser.prog)


if __name__ == "__main__":
    sys.exit(main())
