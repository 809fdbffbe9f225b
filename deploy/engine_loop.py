"""Continuous batching for one replica: ``decoding.engine.runner``'s engine thread, seen from asyncio.

Requests join between steps (the engine prefills them into free rows), finished ones leave at once, and each
caller receives its sequences' events as they happen. Requests are validated and tokenized on the runner's
preparing threads, never on the event loop nor on the engine's stepping thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from decoding.engine import Engine, GenerationResult, Request
from decoding.engine.runner import EngineRunner, RequestRejected, StepObserver

# Ray starts workers at niceness 15 to keep its own daemons responsive; an engine replica on a CPU node would
# then yield its cores to every daemon wake-up (see pipeline.actor, which sets the same for its actors).
# env_vars merge with the application's runtime_env.
REPLICA_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}

# What a caller receives per sequence: new token ids after each step, then (instead of the last step's tokens)
# the finished result.
Event = list[int] | GenerationResult

__all__ = ["REPLICA_RUNTIME_ENV", "Draining", "EngineFailure", "EngineLoop", "Event", "RequestRejected"]


class EngineFailure(RuntimeError):
    """The engine loop died; the replica is unhealthy until Serve replaces it."""


class Draining(RuntimeError):
    """The server is shutting down and this request did not finish within the grace period."""


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], torch_threads: int | None = None,
                 observer: StepObserver | None = None, step_timeout_s: float = float("inf")) -> None:
        """``step_timeout_s``: a step running longer in one request's constraint work fails that request alone
        (``EngineRunner``'s watchdog); one running longer elsewhere makes the replica unhealthy (``check_health``
        raises), so Serve replaces it instead of a hung engine answering /health with ok."""
        self.step_timeout_s = step_timeout_s
        # A step that fails is rerun without the requests that make it fail (decoding.engine.runner); only an engine
        # that cannot recover fails the replica, which Serve then replaces.
        self.runner = EngineRunner(make_engine, torch_threads, observer, step_timeout_s)
        # Each generate call's event queue, so that a shutdown can end the requests still running.
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ended: BaseException | None = None

    @property
    def engine(self) -> Engine:
        return self.runner.engine  # rebuilt after a failed step

    @property
    def steps(self) -> int:
        return self.runner.steps

    @property
    def failure(self) -> BaseException | None:
        return self.runner.failure

    def check_health(self) -> None:
        if self.failure is not None:
            raise EngineFailure(f"engine loop failed: {self.failure!r}") from self.failure
        running = self.runner.step_running_for()
        if running > self.step_timeout_s:
            raise EngineFailure(f"an engine step has run for {running:.0f} s, more than limits.step_timeout_s "
                                f"({self.step_timeout_s:g} s)")

    def end_all(self, reason: BaseException) -> None:
        """End every request still running, and every later one, with ``reason`` (any thread)."""
        self._ended = reason
        for loop, events in list(self._routes.values()):
            with contextlib.suppress(RuntimeError):  # that request's event loop is gone
                loop.call_soon_threadsafe(events.put_nowait, (-1, reason))

    @property
    def running_requests(self) -> int:
        return len(self._routes)

    async def generate(
        self, requests: list[Request], *, stream: bool = False
    ) -> AsyncGenerator[tuple[int, Event], None]:
        """Run ``requests`` in the shared batch; yields ``(index in requests, event)`` until all finish.
        ``stream``: token events go to a client as they come (see ``EngineRunner.submit``).

        Closing the iterator early aborts the unfinished sequences, freeing their batch rows.
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()
        route = id(events)
        self._routes[route] = (loop, events)
        pending = {request.id for request in requests}
        try:
            if self._ended is not None:
                raise self._ended
            prepared = await asyncio.wrap_future(self.runner.prepare_in_pool(requests))
            for index, (request, ready) in enumerate(zip(requests, prepared)):
                def sink(event: Event | BaseException, index: int = index) -> None:
                    with contextlib.suppress(RuntimeError):  # the request's event loop is gone
                        loop.call_soon_threadsafe(events.put_nowait, (index, event))

                self.runner.submit(request, ready, sink, streamed=stream)
            while pending:
                index, event = await events.get()
                if isinstance(event, RequestRejected | Draining):
                    raise event
                if isinstance(event, BaseException):
                    raise EngineFailure(f"engine loop failed: {event!r}") from event
                if isinstance(event, GenerationResult):
                    pending.discard(event.id)
                yield index, event
        finally:
            self._routes.pop(route, None)
            for request_id in pending:  # the engine thread drops them before its next step
                self.runner.abort(request_id)
