"""What every training command shares: its output directory, resumable work files, metrics and progress.

An artifact directory is *finished* once its marker file exists (written last, after the weights). Until then,
``.specbatch-work/`` holds the run's config and checkpoints; re-running the same command resumes from them, and
a different config is refused rather than silently mixed in.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from decoding.model.loading import check_same_tokenizer

log = logging.getLogger("training")

METRICS_FILE = "training_metrics.jsonl"


class RunError(RuntimeError):
    """A run that cannot start or continue as asked; the message says what to do."""


class RunDir:
    def __init__(self, output: str | Path, config: BaseModel, marker: str, overwrite: bool = False) -> None:
        self.path = Path(output)
        self.work = self.path / ".specbatch-work"
        self.marker = self.path / marker
        if self.marker.exists() and not overwrite:
            raise RunError(f"{self.path} already holds a finished artifact; use another --output or pass --overwrite")
        if overwrite and self.path.exists():
            shutil.rmtree(self.path)
        self.config = config.model_dump(mode="json")
        saved = self.work / "run_config.json"
        if saved.exists():
            previous = json.loads(saved.read_text())
            if previous != self.config:
                changed = sorted(k for k in {*previous, *self.config} if previous.get(k) != self.config.get(k))
                raise RunError(
                    f"{self.path} holds an unfinished run with a different config (changed: {', '.join(changed)}); "
                    "re-run with the same options to resume, or pass --overwrite to start over"
                )
            log.info("resuming the unfinished run in %s", self.path)
        self.work.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(self.config, indent=2))

    def save_state(self, name: str, state: Any) -> None:
        """Atomically replace a work file, so an interruption mid-write never corrupts the last good state."""
        partial = self.work / (name + ".partial")
        torch.save(state, partial)
        os.replace(partial, self.work / name)

    def load_state(self, name: str) -> Any | None:
        path = self.work / name
        return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None

    def log_metrics(self, **record: Any) -> None:
        with open(self.path / METRICS_FILE, "a") as sink:
            sink.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


class Progress:
    """Log ``phase: done/total`` with rate and ETA, at most every ``every`` seconds (and at the end)."""

    def __init__(self, phase: str, total: int, every: float = 10.0, done: int = 0) -> None:
        self.phase, self.total, self.every = phase, total, every
        self.start_done = done
        self.started = self.last = time.perf_counter()

    def update(self, done: int, **metrics: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < self.total:
            return
        self.last = now
        rate = (done - self.start_done) / max(now - self.started, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        log.info("%s: %d/%d (%.0f%%) %.3g/s eta %.0fs %s", self.phase, done, self.total,
                 100 * done / max(self.total, 1), rate, eta, shown)


def require_same_tokenizer(target: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, name: str) -> None:
    """Training for a target must refuse a model with another vocabulary before spending any compute."""
    try:
        check_same_tokenizer(target, other, name)
    except ValueError as exc:
        raise RunError(str(exc)) from exc


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
    log.info("torch uses %d CPU threads", torch.get_num_threads())
