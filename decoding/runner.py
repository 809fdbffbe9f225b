"""One engine, stepped continuously by its own thread, fed from any other thread: the loop both adapters share.

The Ray Data actor (``pipeline.actor``) and the Serve replica (``deploy.engine_loop``) differ only in how events
reach their callers (futures, asyncio queues) and in what an engine failure means (rebuild and isolate the
failing request, or report the replica unhealthy). Everything else is here, free of Ray:

- one thread builds the engine and is the only one to touch it afterwards (torch's thread pool is per thread,
  see ``models.worker_threads``);
- ``prepare`` validates and tokenizes a request on the caller's thread, with a tokenizer of that thread's own
  (fast tokenizers must not be shared between threads), so a megabyte prompt never stalls the batch; large
  inputs take turns (a megabyte takes seconds to tokenize, and several at once would starve the engine thread
  of cores), small ones never wait for them;
- ``submit`` hands a prepared request to the engine thread through an inbox; the thread admits inbox items
  between steps, blocks on the inbox when idle, and sends each request's events to its ``sink``: new token ids
  after a step, then the finished ``GenerationResult`` (a result supersedes its last tokens, which may pass a
  stop string), or an exception (``RequestRejected`` for that request alone, the engine's failure otherwise);
- ``abort`` drops a request between steps.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass

from decoding.engine import Engine, GenerationResult, Prepared, Request, StepOutput
from decoding.models import use_torch_threads

log = logging.getLogger(__name__)

Event = list[int] | GenerationResult | BaseException
Sink = Callable[[Event], None]


# Inputs longer than this (characters) are tokenized a few at a time.
LARGE_INPUT_CHARS = 1 << 16


def _input_chars(request: Request) -> int:
    if isinstance(request.prompt, str) and request.prompt_token_ids is None:
        return len(request.prompt)
    if isinstance(request.messages, list):
        return sum(len(str(m.get("content", ""))) for m in request.messages if isinstance(m, dict))
    return 0


class RequestRejected(ValueError):
    """Preparing or admitting this request raised (their contract is to never raise): only this request fails."""


class EngineFailed(RuntimeError):
    """The engine failed and the runner does not recover (see ``EngineRunner(recover=...)``)."""


@dataclass
class _Job:
    request: Request  # kept to rerun it after an engine failure
    prepared: Prepared
    sink: Sink


_STOP = object()


class _Progress:
    """Logs what the engine did since the last line, every ``EVERY_SECONDS`` while busy and when it goes idle:
    steps, tokens per second, and how full its batch was (rows in use per step; a pipeline that feeds its engine
    too slowly shows here)."""

    EVERY_SECONDS = 30.0

    def __init__(self) -> None:
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since, self.steps, self.tokens, self.row_steps = now, 0, 0, 0

    def before_step(self) -> None:
        if not self.steps:  # the first step after idle starts the period (idle time is not engine time)
            self.since = time.perf_counter()

    def step(self, output: StepOutput) -> None:
        self.steps += 1
        self.row_steps += len(output.new_tokens)
        self.tokens += sum(len(tokens) for tokens in output.new_tokens.values())
        if time.perf_counter() - self.since >= self.EVERY_SECONDS:
            self.log(idle=False)

    def log(self, idle: bool) -> None:
        now = time.perf_counter()
        if self.steps:
            seconds = now - self.since
            log.info("engine: %d steps in %.1f s, %d tokens (%.1f tokens/s), %.1f rows per step%s", self.steps,
                     seconds, self.tokens, self.tokens / seconds, self.row_steps / self.steps,
                     "; idle" if idle else "")
        self._reset(now)


class EngineRunner:
    """``recover``: after a failed step, rebuild the engine and rerun the requests in flight one at a time, so
    only a request that fails on its own gets an error result (a batch job must lose no rows); otherwise the
    failure goes to every request in flight and to later ones (a server replica is then replaced)."""

    def __init__(
        self, make_engine: Callable[[], Engine], torch_threads: int | None = None, *, recover: bool = False
    ) -> None:
        self._make_engine = make_engine
        self._recover = recover
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._local = threading.local()  # each preparing thread's own tokenizer
        self._large_inputs = threading.BoundedSemaphore(max(1, (os.cpu_count() or 2) // 2))
        self.failure: BaseException | None = None
        self.steps = 0
        self._progress = _Progress()
        ready: Future[Engine] = Future()
        self._thread = threading.Thread(target=self._run, args=(ready, torch_threads), name="engine", daemon=True)
        self._thread.start()
        self.engine: Engine = ready.result()  # a failure to build (bad model path, ...) raises here

    # ------------------------------------------------------------------------------------- any thread
    def prepare(self, request: Request) -> Prepared:
        """Validate and tokenize ``request`` on the calling thread (never call it on the engine thread)."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.engine.tokenizer)
        try:
            with self._large_inputs if _input_chars(request) > LARGE_INPUT_CHARS else nullcontext():
                return self.engine.prepare(request, tokenizer)
        except Exception as exc:
            log.exception("prepare raised for request %s", request.id)
            raise RequestRejected(f"invalid request: {exc}") from exc

    def submit(self, request: Request, prepared: Prepared, sink: Sink) -> None:
        """Queue a prepared request; its events go to ``sink``, called on the engine thread."""
        if self.failure is not None:
            sink(self.failure)
            return
        self._inbox.put(_Job(request, prepared, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def close(self) -> None:
        """Stop the engine thread after its current step (requests in flight get no more events)."""
        self._inbox.put(_STOP)
        self._thread.join()

    # ---------------------------------------------------------------------------------- engine thread
    def _run(self, ready: Future, torch_threads: int | None) -> None:
        use_torch_threads(torch_threads)
        started = time.perf_counter()
        try:
            self.engine = self._make_engine()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        log.info("engine built in %.1f s (%s threads)", time.perf_counter() - started, torch_threads or "all")
        ready.set_result(self.engine)
        while self._take_inbox():
            self._progress.before_step()
            try:
                output = self.engine.step()
            except Exception as exc:
                if not self._recover:
                    self._fail(exc)
                    return
                self._rerun_one_by_one()
                continue
            self.steps += 1
            self._progress.step(output)
            self._deliver(output)

    def _take_inbox(self) -> bool:
        """Admit what arrived (waiting for work when the engine is idle); False when asked to stop."""
        block = not self.engine.has_unfinished()
        if block:
            self._progress.log(idle=True)
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, str):
                self.engine.abort(item)
                self._jobs.pop(item, None)
                continue
            self._jobs[item.request.id] = item
            try:
                self.engine.add_prepared(item.prepared)
            except Exception as exc:  # one request's input must not take the whole batch down
                log.exception("add_prepared raised for request %s", item.request.id)
                self._jobs.pop(item.request.id)
                item.sink(RequestRejected(f"invalid request: {exc}"))
            if not self.engine.has_unfinished():
                block = True  # e.g. every item so far was an abort: wait for real work

    def _deliver(self, output: StepOutput) -> None:
        finished = {result.id for result in output.finished}
        for request_id, tokens in output.new_tokens.items():
            job = self._jobs.get(request_id)
            if job is not None and request_id not in finished:
                job.sink(tokens)
        for result in output.finished:
            job = self._jobs.pop(result.id, None)
            if job is not None:
                job.sink(result)

    def _fail(self, exc: BaseException) -> None:
        log.exception("engine step failed")
        self.failure = exc
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.sink(exc)
        while True:  # requests that raced the failure
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if isinstance(item, _Job):
                item.sink(exc)

    def _rerun_one_by_one(self) -> None:
        """Rebuild the engine and rerun its requests one at a time: only a request that fails on its own becomes
        an error result. (Rare path: these requests are prepared again here, on the engine thread.)"""
        log.exception("engine step failed with %d requests in flight; rerunning them one by one", len(self._jobs))
        jobs, self._jobs = list(self._jobs.values()), {}
        self.engine = self._make_engine()
        for job in jobs:
            try:
                result = self.engine.generate([job.request])[0]
            except Exception as solo_exc:
                log.exception("request failed on its own")
                result = self.engine._error_result(
                    job.request.id, job.request.prompt if isinstance(job.request.prompt, str) else "",
                    f"engine failure: {solo_exc!r}", time.perf_counter(),
                )
                self.engine = self._make_engine()
            job.sink(result)
