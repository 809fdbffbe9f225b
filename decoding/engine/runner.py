"""One engine, stepped continuously by its own thread, fed from any other thread: the loop both adapters share.

The Ray Data actor (``pipeline.actor``) and the Serve replica (``deploy.engine_loop``) differ only in how events
reach their callers (futures, asyncio queues). Everything else is here, free of Ray:

- one thread builds the engine and is the only one to touch it afterwards (torch's thread pool is per thread,
  see ``models.worker_threads``);
- ``prepare`` validates and tokenizes a request on the caller's thread, with a tokenizer of that thread's own
  (fast tokenizers must not be shared between threads), so a megabyte prompt never stalls the batch; large
  inputs take turns (a megabyte takes seconds to tokenize, and several at once would starve the engine thread
  of cores), small ones never wait for them. ``in_pool`` runs such work on the runner's own preparing threads,
  which keep their tokenizers (a copy costs ~100 ms, a short prompt's tokenizing ~0.1 ms): one pool for small
  inputs, a smaller one for large inputs, so a short request never queues behind megabyte prompts;
- ``submit`` hands a prepared request to the engine thread through an inbox; the thread admits inbox items
  between steps, blocks on the inbox when idle, and sends each request's events to its ``sink``: new token ids
  (``NewTokens``, with their logprobs when asked for) after a step, then the finished ``GenerationResult`` (a
  result supersedes its last tokens, which may pass a stop string), or an exception (``RequestRejected`` for
  that request alone, the engine's failure otherwise);
- ``abort`` drops a request between steps;
- a step that raises fails only the requests that make it fail: the runner rebuilds the engine and reruns the
  requests that were in flight, halving the group that fails until each failing request is alone (and a canary
  request shows that the engine itself works); the others finish as if nothing had happened (a stream resumes where
  it was). Only an engine that cannot be rebuilt, or fails even the canary, fails every request (``failure``);
- a watchdog thread bounds each step (``step_timeout_s``): past it, while the step works on one request's
  constraint (``ConstraintWork``), it stops the step by raising ``StepTimedOut`` in the engine thread; that request
  fails alone and the others rerun as above. A step stuck elsewhere (or inside one call that never returns to
  Python) is only reported: ``step_running_for`` (a server then turns unhealthy and is replaced).
"""

from __future__ import annotations

import collections
import copy
import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from decoding.config import SamplingParams
from decoding.engine.engine import Engine, GenerationResult, Prepared, Request, StepOutput
from decoding.engine.sequence import input_bytes
from decoding.model.loading import use_torch_threads

log = logging.getLogger(__name__)
T = TypeVar("T")


class NewTokens(list[int]):
    """A step's new token ids of one sequence; ``logprobs``: their entries, when its request asked for them;
    ``num_prompt_tokens``: its prompt's length (a stream's usage before the result); ``prompt_token_ids``: its
    prompt (a stream's first chunk, where token ids are asked for)."""

    logprobs: list[dict[str, Any]] | None = None
    num_prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None


Event = NewTokens | GenerationResult | BaseException
Sink = Callable[[Event], None]


# Inputs longer than this (UTF-8 bytes) are tokenized a few at a time.
LARGE_INPUT_BYTES = 1 << 16
# Preparing threads for small inputs: tokenizing a short prompt holds the GIL for well under a millisecond, so a few
# threads keep up with hundreds of requests a second; each holds one tokenizer copy.
SMALL_INPUT_THREADS = 4


class StepObserver(Protocol):
    """Told of each request's arrival, every step and each abort (metrics): ``submitted`` on the caller's thread,
    the others on the engine thread."""

    def submitted(self, request_id: str, prompt_tokens: int) -> None: ...

    def stepped(self, output: StepOutput) -> None: ...

    def aborted(self, request_id: str) -> None: ...


class RequestRejected(ValueError):
    """Preparing or admitting this request raised (their contract is to never raise): only this request fails."""


class StepTimedOut(Exception):
    """Raised in the engine thread by the watchdog: the step ran past ``step_timeout_s`` in one request's constraint
    work (the runner knows which)."""


def _raise_in(thread: threading.Thread, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in ``thread`` at its next Python instruction (None: drop one raised and not yet delivered)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(exc) if exc is not None else None)


class StreamLost(RuntimeError):
    """After an engine failure, the rerun of a streamed request produced other tokens than those already sent."""


@dataclass
class _Job:
    request: Request  # kept to rerun it after an engine failure
    prepared: Prepared
    sink: Sink
    # Streamed: tokens already delivered are not delivered again when the request is rerun, and must be reproduced.
    streamed: bool = False
    sent: list[int] = field(default_factory=list)
    position: int = 0  # tokens of the current run so far (below len(sent) while a rerun replays them)

    def tokens(self, tokens: list[int]) -> list[int] | None:
        """The part of a step's tokens to deliver; None when a rerun departs from what was sent."""
        if not self.streamed:
            return tokens
        replayed = min(len(tokens), len(self.sent) - self.position)
        if tokens[:replayed] != self.sent[self.position : self.position + replayed]:
            return None
        fresh = tokens[replayed:]
        self.sent += fresh
        self.position += len(tokens)
        return fresh


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
    def __init__(self, make_engine: Callable[[], Engine], torch_threads: int | None = None,
                 observer: StepObserver | None = None, step_timeout_s: float = float("inf")) -> None:
        """``step_timeout_s``: the watchdog's bound on one step (module docstring)."""
        self._make_engine = make_engine
        self.step_timeout_s = step_timeout_s
        self._step_lock = threading.Lock()  # the watchdog raises in a step only while it runs
        self._timed_out: tuple[str, float] | None = None  # the request the watchdog stopped a step for, and when
        self._observer = observer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: collections.deque = collections.deque()  # inbox items held back while recovering
        self._jobs: dict[str, _Job] = {}
        self._local = threading.local()  # each preparing thread's own tokenizer
        large_turns = max(1, (os.cpu_count() or 2) // 2)
        self._large_inputs = threading.BoundedSemaphore(large_turns)
        self._pools = (ThreadPoolExecutor(SMALL_INPUT_THREADS, thread_name_prefix="prepare"),
                       ThreadPoolExecutor(large_turns, thread_name_prefix="prepare-large"))
        self.failure: BaseException | None = None
        self.observer_failures = 0  # calls of the observer that raised (see _observe)
        self._step_started: float | None = None
        self.steps = 0
        self.rebuilds = 0
        self._progress = _Progress()
        ready: Future[Engine] = Future()
        self._thread = threading.Thread(target=self._run, args=(ready, torch_threads), name="engine", daemon=True)
        self._thread.start()
        self.engine: Engine = ready.result()  # a failure to build (bad model path, ...) raises here
        if step_timeout_s != float("inf"):
            threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    # ------------------------------------------------------------------------------------- any thread
    def thread_tokenizer(self) -> PreTrainedTokenizerBase:
        """The calling thread's own copy of the engine's tokenizer (never call it on the engine thread)."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return tokenizer

    def with_tokenizer(self, work: Callable[[PreTrainedTokenizerBase], T], size: int) -> T:
        """``work`` given the calling thread's own tokenizer (``thread_tokenizer``); an input of more than
        ``LARGE_INPUT_BYTES`` (``size``: its UTF-8 bytes) waits its turn among the large ones, as ``prepare``'s do."""
        tokenizer = self.thread_tokenizer()
        with self._large_inputs if size > LARGE_INPUT_BYTES else nullcontext():
            return work(tokenizer)

    def in_pool(self, work: Callable[[PreTrainedTokenizerBase], T], size: int) -> Future[T]:
        """``with_tokenizer(work, size)`` on one of the runner's preparing threads (the small or the large inputs'
        pool, by ``size``), which keep their tokenizers between calls."""
        return self._pools[size > LARGE_INPUT_BYTES].submit(self.with_tokenizer, work, size)

    def prepare_in_pool(self, requests: list[Request]) -> Future[list[Prepared]]:
        """``prepare`` each of ``requests`` on a preparing thread (``in_pool``, sized by their inputs together)."""
        size = sum(input_bytes(request) for request in requests)
        return self._pools[size > LARGE_INPUT_BYTES].submit(lambda: [self.prepare(request) for request in requests])

    def prepare(self, request: Request) -> Prepared:
        """Validate and tokenize ``request`` on the calling thread (never call it on the engine thread)."""
        try:
            return self.with_tokenizer(lambda tokenizer: self.engine.prepare(request, tokenizer), input_bytes(request))
        except Exception as exc:
            log.exception("prepare raised for request %s", request.id)
            raise RequestRejected(f"invalid request: {exc}") from exc

    def submit(self, request: Request, prepared: Prepared, sink: Sink, *, streamed: bool = False) -> None:
        """Queue a prepared request; its events go to ``sink``, called on the engine thread. ``streamed``: its
        token events reach a client as they come (a rerun after an engine failure must then reproduce them)."""
        if self.failure is not None:
            sink(self.failure)
            return
        if not isinstance(prepared, GenerationResult):
            self._observe("submitted", request.id, len(prepared.prompt_ids))
        self._inbox.put(_Job(request, prepared, sink, streamed))

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def _observe(self, event: str, *args: Any) -> None:
        """Tell the observer (metrics) of ``event``. Its failure (an export refusing a value) never fails a request
        or a step: the first is logged with its traceback, every one is counted in ``observer_failures``."""
        if self._observer is None:
            return
        try:
            getattr(self._observer, event)(*args)
        except Exception:
            self.observer_failures += 1
            if self.observer_failures == 1:
                log.exception("the step observer (metrics) failed in %s; later failures are only counted", event)

    def step_running_for(self) -> float:
        """Seconds the engine's current step has run; 0 between steps (a watchdog reads it from any thread)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def close(self) -> None:
        """Stop the engine thread after its current step (requests in flight get no more events)."""
        self._inbox.put(_STOP)
        self._thread.join()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        """The watchdog: stops a step past ``step_timeout_s`` while it works on one request's constraint."""
        period = min(1.0, self.step_timeout_s / 4)
        while self._thread.is_alive():
            time.sleep(period)
            with self._step_lock:
                running = self.step_running_for()
                owner = self.engine.constraints.work.owner(self._thread.ident or 0)
                if running > self.step_timeout_s and owner is not None and self._timed_out is None:
                    log.error("an engine step has run for %.0f s, past limits.step_timeout_s, in the constraint of "
                              "request %s: stopping it", running, owner)
                    self._timed_out = (owner, running)
                    _raise_in(self._thread, StepTimedOut)

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
        try:
            self._loop()
        except Exception as exc:  # outside a step (delivering, observing): nobody must wait for this thread
            log.exception("the engine thread failed")
            self._fail(exc, [])

    def _loop(self) -> None:
        while self._take_inbox():
            self._progress.before_step()
            try:
                output = self._step()
            except Exception as exc:
                self._step_started = None  # a watchdog's exception may have cut _step's own cleanup short
                if not self._recover(exc):
                    return
                continue
            self.steps += 1
            self._progress.step(output)
            self._observe("stepped", output)
            self._deliver(output)

    def _step(self) -> StepOutput:
        self._step_started = time.monotonic()
        timed_out = False
        try:
            return self.engine.step()
        except StepTimedOut:
            timed_out = True
            raise
        finally:
            with self._step_lock:
                self._step_started = None
                if not timed_out:  # the watchdog raised as the step ended: that belongs to no step
                    _raise_in(self._thread, None)
                    self._timed_out = None

    def _next_item(self, block: bool) -> object:
        if self._deferred:
            return self._deferred.popleft()
        return self._inbox.get(block=block)

    def _take_inbox(self) -> bool:
        """Admit what arrived (waiting for work when the engine is idle); False when asked to stop."""
        block = not self.engine.has_unfinished()
        if block:
            self._progress.log(idle=True)
        while True:
            try:
                item = self._next_item(block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, str):
                self.engine.abort(item)
                self._jobs.pop(item, None)
                self._observe("aborted", item)
                continue
            self._admit(item, item.prepared)
            if not self.engine.has_unfinished():
                block = True  # e.g. every item so far was an abort: wait for real work

    def _admit(self, job: _Job, prepared: Prepared) -> None:
        self._jobs[job.request.id] = job
        try:
            self.engine.add_prepared(prepared)
        except Exception as exc:  # one request's input must not take the whole batch down
            log.exception("add_prepared raised for request %s", job.request.id)
            self._jobs.pop(job.request.id)
            job.sink(RequestRejected(f"invalid request: {exc}"))

    def _deliver(self, output: StepOutput) -> None:
        finished = {result.id for result in output.finished}
        for request_id, tokens in output.new_tokens.items():
            job = self._jobs.get(request_id)
            if job is None:
                continue
            fresh = job.tokens(tokens)
            if fresh is None:
                self._drop(job, StreamLost("the engine failed and was rebuilt; the rerun of this request departed "
                                           "from the tokens already streamed"))
            elif request_id not in finished and fresh:
                event = NewTokens(fresh)
                event.num_prompt_tokens = len(job.prepared.prompt_ids)
                event.prompt_token_ids = job.prepared.prompt_ids
                if (logprobs := output.new_logprobs.get(request_id)) is not None:
                    event.logprobs = logprobs[len(logprobs) - len(fresh):]
                job.sink(event)
        for result in output.finished:
            job = self._jobs.pop(result.id, None)
            if job is not None:
                job.sink(result)

    def _drop(self, job: _Job, event: BaseException) -> None:
        self._jobs.pop(job.request.id, None)
        self.engine.abort(job.request.id)
        job.sink(event)

    def _fail(self, exc: BaseException, jobs: list[_Job]) -> None:
        """The engine is broken: ``jobs``, those in flight and every later request get ``exc``."""
        log.error("engine failed: %r", exc)
        self.failure = exc
        jobs, self._jobs = jobs + list(self._jobs.values()), {}
        for job in jobs:
            job.sink(exc)
        while True:  # requests that raced the failure
            try:
                item = self._next_item(block=False)
            except queue.Empty:
                return
            if isinstance(item, _Job):
                item.sink(exc)

    # ------------------------------------------------------------------------------- after a failed step
    def _recover(self, exc: Exception) -> bool:
        """Rerun the requests in flight on a rebuilt engine, halving each group that fails again, until every
        request has finished or failed alone; False when the engine itself is broken (then everything failed)."""
        log.exception("engine step failed with %d requests in flight; rerunning them on a rebuilt engine",
                      len(self._jobs))
        groups = [self._without_timed_out(list(self._jobs.values()))]
        self._jobs = {}
        while groups:
            group = groups.pop()
            try:
                failed = self._run_group(group)
            except Exception as rebuild_exc:  # the engine cannot even be rebuilt
                self._fail(rebuild_exc, group + [job for g in groups for job in g])
                return False
            # The watchdog named the request: it fails alone, the rest rerun whole (none left: the rerun still
            # rebuilds the engine the stopped step left broken).
            if self._timed_out is not None:
                groups.append(self._without_timed_out(failed))
                continue
            if not failed:
                continue
            if len(failed) > 1:
                half = len(failed) // 2
                groups += [failed[half:], failed[:half]]
                continue
            [job] = failed
            if not self._canary_runs():  # the engine fails on its own, not because of this request
                self._fail(exc, [job] + [job for g in groups for job in g])
                return False
            log.error("request %s fails the engine step on its own; it alone gets the error", job.request.id)
            job.sink(RequestRejected(f"the engine failed on this request: {exc!r}"))
        return True

    def _without_timed_out(self, jobs: list[_Job]) -> list[_Job]:
        """``jobs`` but the one the watchdog stopped a step for, which gets its error."""
        if self._timed_out is None:
            return jobs
        (owner, seconds), self._timed_out = self._timed_out, None
        for job in jobs:
            if job.request.id == owner:
                job.sink(RequestRejected(
                    f"the work on this request's structured_outputs constraint kept an engine step busy for "
                    f"{seconds:.0f} s, past limits.step_timeout_s ({self.step_timeout_s:g} s)"))
        return [job for job in jobs if job.request.id != owner]

    def _rebuild(self) -> None:
        run_seed = self.engine.run_seed
        self.engine = self._make_engine()
        self.engine.run_seed = run_seed  # unseeded rows draw the same streams on a rerun
        self.rebuilds += 1

    def _run_group(self, group: list[_Job]) -> list[_Job]:
        """Run ``group`` alone on a rebuilt engine until it finishes; the jobs unfinished when a step fails.
        Meanwhile new requests wait (aborts are applied)."""
        self._rebuild()
        for job in group:
            job.position = 0
            try:
                prepared = self.engine.prepare(job.request)
            except Exception as exc:
                job.sink(RequestRejected(f"invalid request: {exc}"))
                continue
            self._admit(job, prepared)
        while self._jobs:
            while True:
                try:
                    item = self._inbox.get(block=False)
                except queue.Empty:
                    break
                if isinstance(item, str) and item in self._jobs:
                    self.engine.abort(item)
                    self._jobs.pop(item)
                else:
                    self._deferred.append(item)
            try:
                output = self._step()
            except Exception:
                self._step_started = None
                log.exception("engine step failed again with %d of a group of %d in flight", len(self._jobs),
                              len(group))
                unfinished, self._jobs = list(self._jobs.values()), {}
                return unfinished
            self.steps += 1
            self._deliver(output)
        return []

    def _canary_runs(self) -> bool:
        """Whether a rebuilt engine decodes a one-token request: if not, the engine is broken, not a request."""
        try:
            self._rebuild()
            canary = Request("engine-canary", prompt_token_ids=[0], sampling=SamplingParams(max_tokens=1))
            [result] = self.engine.generate([canary])
            return result.finish_reason != "error"
        except Exception:
            log.exception("the rebuilt engine fails a one-token request too")
            return False
