"""Continuous batching for one replica: a single task steps the engine while any request is pending.

Requests join between steps (the engine prefills them into free rows), finished ones leave at once, and each
caller receives its sequences' events as they happen. Steps run in one dedicated thread so the event loop
keeps serving HTTP meanwhile; only that thread touches the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from decoding.engine import Engine, GenerationResult, Request, StepOutput
from decoding.models import use_torch_threads

log = logging.getLogger(__name__)

# What a caller receives per sequence: new token ids after each step, then (instead of the last step's tokens)
# the finished result.
Event = list[int] | GenerationResult


class EngineFailure(RuntimeError):
    """The engine loop died; the replica is unhealthy until Serve replaces it."""


class RequestRejected(ValueError):
    """``add_request`` raised for this request (its contract is to never raise): fail only this request."""


@dataclass
class _Route:
    queue: asyncio.Queue[tuple[int, Event] | BaseException]
    index: int


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], torch_threads: int | None = None) -> None:
        # One dedicated thread builds the engine and steps it, with these torch threads (see worker_threads).
        self._executor = ThreadPoolExecutor(1, "engine", initializer=use_torch_threads, initargs=(torch_threads,))
        self.engine = self._executor.submit(make_engine).result()
        self.steps = 0
        self.failure: BaseException | None = None
        self._incoming: list[Request] = []
        self._aborted: list[str] = []
        self._routes: dict[str, _Route] = {}
        self._task: asyncio.Task[None] | None = None

    def check_health(self) -> None:
        if self.failure is not None:
            raise EngineFailure(f"engine loop failed: {self.failure!r}") from self.failure

    async def generate(self, requests: list[Request]) -> AsyncGenerator[tuple[int, Event], None]:
        """Run ``requests`` in the shared batch; yields ``(index in requests, event)`` until all finish.

        Closing the iterator early aborts the unfinished sequences, freeing their batch rows.
        """
        self.check_health()
        queue: asyncio.Queue[tuple[int, Event] | BaseException] = asyncio.Queue()
        for index, request in enumerate(requests):
            self._routes[request.id] = _Route(queue, index)
        self._incoming.extend(requests)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        pending = {request.id for request in requests}
        try:
            while pending:
                item = await queue.get()
                if isinstance(item, RequestRejected):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineFailure(f"engine loop failed: {item!r}") from item
                if isinstance(item[1], GenerationResult):
                    pending.discard(item[1].id)
                yield item
        finally:
            self._incoming = [r for r in self._incoming if r.id not in pending]
            self._aborted.extend(pending)  # the loop thread drops them from the engine before its next step
            for request in requests:
                self._routes.pop(request.id, None)

    async def _run(self) -> None:
        try:
            while self._incoming or self.engine.has_unfinished():
                joining, self._incoming = self._incoming, []
                aborted, self._aborted = self._aborted, []
                rejected, output = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._step, joining, aborted
                )
                self.steps += 1
                for request_id, error in rejected.items():
                    self._send(request_id, error)
                finished = {result.id for result in output.finished}
                for request_id, tokens in output.new_tokens.items():
                    if request_id not in finished:  # a result supersedes its last tokens (they may pass a stop)
                        self._send(request_id, tokens)
                for result in output.finished:
                    self._send(result.id, result)
        except Exception as exc:
            log.exception("engine loop failed")
            self.failure = exc
            for route in self._routes.values():
                route.queue.put_nowait(exc)

    def _step(self, joining: list[Request], aborted: list[str]) -> tuple[dict[str, RequestRejected], StepOutput]:
        for request_id in aborted:
            self.engine.abort(request_id)
        rejected = {}
        for request in joining:
            try:
                self.engine.add_request(request)
            except Exception as exc:  # one request's input must not take the whole batch down
                log.exception("add_request raised for request %s", request.id)
                rejected[request.id] = RequestRejected(f"invalid request: {exc}")
        return rejected, self.engine.step()

    def _send(self, request_id: str, event: Event | RequestRejected) -> None:
        route = self._routes.get(request_id)
        if route is None:  # its caller went away
            return
        route.queue.put_nowait(event if isinstance(event, RequestRejected) else (route.index, event))
