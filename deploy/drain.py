"""Draining on shutdown: ``specbatch serve`` tells every replica to stop admitting, waits for them to finish what
they hold (up to the grace period), then shuts Serve down.

The command creates one named ``DrainSignal`` actor before deploying. Each replica long-polls it from a thread
(``watch``); when the signal comes, the replica answers new requests 503 with ``Retry-After``, lets the requests
it holds finish until the grace period ends, ends the rest (a 503, or an error event closing a stream), and
reports back. The command then waits for the HTTP proxies to finish forwarding those answers before it shuts
Serve down. Under ``serve run`` or a Serve config file there is no signal actor: Serve's own graceful shutdown
(``graceful_shutdown_timeout_s``) applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import ray

# How often a stopping replica (or router) checks for requests still in flight; Serve's 2 s made each stop 2 s longer.
SHUTDOWN_WAIT_LOOP_S = 0.5

log = logging.getLogger(__name__)

NAMESPACE = "specbatch"


def signal_name(app: str) -> str:
    return f"drain-{app}"


# Seconds a restarted signal gives the replicas to register again before it counts who has drained.
REREGISTER_S = 2.0


# Restarted by Ray if its process dies (the memory monitor kills it like any worker), and every call to it is
# retried on the restarted actor: the replicas' pending ``wait`` calls register them again, the command's ``drain``
# reaches it. Before, a dead signal made SIGTERM shut Serve down at once, cutting the requests in flight.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class DrainSignal:
    """Replicas wait on it; the command starts the drain and waits until every replica that waited is done."""

    def __init__(self) -> None:
        self._started = asyncio.Event()
        self._all_done = asyncio.Event()
        self._grace = 0.0
        self._replicas: set[str] = set()
        self._done: set[str] = set()

    async def wait(self, replica: str) -> float:
        """A replica registers and waits; returns the grace period in seconds once the drain starts."""
        self._replicas.add(replica)
        await self._started.wait()
        return self._grace

    def done(self, replica: str) -> None:
        self._done.add(replica)
        self._check()

    async def drain(self, grace: float, timeout: float) -> list[str]:
        """Start draining and wait up to ``timeout`` seconds for the replicas; those that did not report back."""
        self._grace = grace
        if ray.get_runtime_context().was_current_actor_reconstructed:
            await asyncio.sleep(REREGISTER_S)  # the replicas' retried waits are still coming in
        self._started.set()
        self._check()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._all_done.wait(), timeout)
        return sorted(self._replicas - self._done)

    def _check(self) -> None:
        if self._started.is_set() and self._done >= self._replicas:
            self._all_done.set()


def watch(app: str, replica: str, start: Callable[[], None], busy: Callable[[], int],
          end: Callable[[float], None]) -> None:
    """In a thread of the replica: on the drain signal, ``start()`` (refuse new requests), wait while ``busy()``
    (requests held) until the grace period ends, then ``end(grace)`` (end those left) and wait for their answers
    to go out. Does nothing when no signal actor exists (the application was deployed by other means)."""
    try:
        signal = ray.get_actor(signal_name(app), namespace=NAMESPACE)
    except ValueError:
        return

    def run() -> None:
        try:
            grace = ray.get(signal.wait.remote(replica))
        except ray.exceptions.RayError:  # the command is gone: nothing to drain for
            return
        log.info("draining: refusing new requests, %d in flight, %.0f s to finish them", busy(), grace)
        start()
        for seconds in (grace, 5.0):  # then a little time for the ended requests' answers to go out
            deadline = time.monotonic() + seconds
            while busy() and time.monotonic() < deadline:
                time.sleep(0.05)
            if busy() and seconds == grace:
                log.warning("draining: %d requests did not finish within %.0f s; ending them", busy(), grace)
                end(grace)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(signal.done.remote(replica))

    threading.Thread(target=run, name="drain", daemon=True).start()
