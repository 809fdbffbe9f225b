"""One HTTP request run through an ASGI app in-process, its response yielded as it is sent: how the router of a
several-model app (``deploy.router``) hands a request to a model's replica through a Serve DeploymentHandle, every
route, check and error of the replica's own API applying unchanged."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

# The first item a call yields: the response's status and headers, the body sent with them (``body``) and whether
# that is all of it (``complete``); then the rest of the body as bytes, each item all that was sent since the last
# (through a DeploymentHandle every item is an object of its own, and a 64-choice stream sends ~13,000 chunks).
ResponseStart = dict[str, Any]

# A body larger than this is refused before it is read whole (a prompt longer than the context is refused anyway).
MAX_BODY_BYTES = 64 << 20


async def call(app: Any, method: str, path: str, headers: list[tuple[str, str]], body: bytes
               ) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``method path`` with ``headers`` and ``body`` through ``app``. Closing the iterator early is the client
    going away: the app sees ``http.disconnect`` (a stream stops and releases what it holds) and is cancelled."""
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method.upper(), "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(),
        "headers": [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers],
        "client": ("router", 0), "server": ("replica", 0),
    }
    pending: collections.deque[dict[str, Any]] = collections.deque()
    woken = asyncio.Event()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pending.append(message)
        woken.set()

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: woken.set())

    async def sent_since() -> list[dict[str, Any]]:
        """Every message the app sent since the last call, waiting for one; none once the app has ended."""
        while not pending:
            if task.done():
                task.result()  # the app's own exception, if it raised
                return []
            woken.clear()
            await woken.wait()
        messages = list(pending)
        pending.clear()
        return messages

    complete = False
    try:
        while not complete:
            messages = await sent_since()
            if not messages:
                return
            bodies = [message for message in messages if message["type"] == "http.response.body"]
            chunk = b"".join(message.get("body", b"") for message in bodies)
            complete = any(not message.get("more_body", False) for message in bodies)
            start = next((message for message in messages if message["type"] == "http.response.start"), None)
            if start is not None:
                yield {"status": start["status"], "body": chunk, "complete": complete,
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", [])]}
            elif chunk:
                yield chunk
    finally:
        disconnected.set()
        if complete:
            with contextlib.suppress(Exception):
                await task  # the response is sent: the app only finishes its bookkeeping
        elif not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
