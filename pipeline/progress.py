"""A running job's progress, read from what it committed: rows, tokens and acceptance of this run's parts.

The driver polls the commit markers the write tasks leave (``pipeline.store``), the same small files resume and
``summary.json`` read, so progress costs no output row passing through the driver. Each marker also says when
the engine that produced its part was built, so the generation's throughput excludes model loading and
compilation.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.io import FORMATS, count_records
from pipeline.store import OutputStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    rows_done: int
    rows_total: int | None  # this run's rows, once counted
    generated_tokens: int
    num_spec_steps: int
    num_accepted_draft_tokens: int
    started: float  # wall clock (time.time()) of the run's start
    engine_ready: float | None  # wall clock of the first engine built, from the parts
    now: float

    @property
    def generation_seconds(self) -> float:
        return self.now - self.engine_ready if self.engine_ready is not None else 0.0

    @property
    def tokens_per_second(self) -> float:
        seconds = self.generation_seconds
        return self.generated_tokens / seconds if seconds > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps if self.num_spec_steps else 1.0

    @property
    def eta_seconds(self) -> float | None:
        """At the rows' rate since the first engine was built."""
        if not self.rows_total or not self.rows_done or not self.generation_seconds:
            return None
        return max(0.0, self.rows_total - self.rows_done) * self.generation_seconds / self.rows_done


def count_rows(fs: pafs.FileSystem, files: list[str]) -> int:
    """The rows the job's reader makes of the input files, without making them: Parquet's metadata, JSON Lines'
    and CSV's records. A Parquet file without a readable footer counts as the one error row the reader makes of
    it."""
    total = 0
    for path in files:
        kind = FORMATS[posixpath.splitext(path)[1]]
        if kind == "parquet":
            with fs.open_input_file(path) as f:
                try:
                    total += pq.ParquetFile(f).metadata.num_rows
                except pa.ArrowInvalid:  # "Parquet magic bytes not found", a truncated footer, an empty file
                    total += 1
            continue
        with fs.open_input_stream(path) as f:
            total += count_records(f.read(), kind)
    return total


class ProgressWatcher:
    """Polls ``store``'s commit markers of run ``run_id`` every ``interval`` seconds on a thread of its own and
    calls ``report`` with a ``Progress``; ``total`` (a callable, run on the thread) counts this run's rows."""

    def __init__(self, store: OutputStore, run_id: str, report: Callable[[Progress], None],
                 total: Callable[[], int] | None = None, interval: float = 2.0) -> None:
        self.store, self.run_id, self.report, self.count, self.interval = store, run_id, report, total, interval
        self.started = time.time()
        self.rows_total: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self) -> ProgressWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self._poll()  # the final state

    def _run(self) -> None:
        if self.count is not None:
            try:
                self.rows_total = self.count()
            except Exception as exc:  # a progress display never fails the job, nor prints a thread's traceback
                log.debug("cannot count the input rows: %s", exc)
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self) -> None:
        try:
            markers = [m for m in self.store.markers() if m.get("run") == self.run_id]
        except OSError as exc:
            log.debug("cannot list the commit markers: %s", exc)
            return
        ready = [m["engine_ready"] for m in markers if m.get("engine_ready")]
        self.report(Progress(
            rows_done=sum(m["rows"] for m in markers), rows_total=self.rows_total,
            generated_tokens=sum(m.get("num_generated_tokens") or 0 for m in markers),
            num_spec_steps=sum(m.get("num_spec_steps") or 0 for m in markers),
            num_accepted_draft_tokens=sum(m.get("num_accepted_draft_tokens") or 0 for m in markers),
            started=self.started, engine_ready=min(ready) if ready else None, now=time.time(),
        ))
