"""One HTTP request run through an ASGI app in-process, its response yielded as it is sent: how the router of a
several-model app (``deploy.router``) hands a request to a model's replica through a Serve DeploymentHandle, every
route, check and error of the replica's own API applying unchanged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

# The first item a call yields: the response's status and headers; then its body chunks as bytes.
ResponseStart = dict[str, Any]


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
    messages: asyncio.Queue = asyncio.Queue()
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
        await messages.put(message)

    finished, complete = object(), False
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(finished))
    try:
        while True:
            message = await messages.get()
            if message is finished:
                task.result()  # the app's own exception, if it raised before answering
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body"):
                    complete = True
                    return
    finally:
        disconnected.set()
        if complete:
            with contextlib.suppress(Exception):
                await task  # the response is sent: the app only finishes its bookkeeping
        elif not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
