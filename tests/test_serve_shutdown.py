"""`specbatch serve` as a process: its replica holds hundreds of streams and still answers /health; SIGTERM with
requests in flight drains them, and nothing is left running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from test_pipeline import REPO, unused_ports

KEY = "sk-drain-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


# Long requests: enough tokens that ten of them, one at a time, outlast the grace period on any machine (the
# tiny test model decodes a few thousand tokens a second on a fast CPU).
LONG_TOKENS = 2000


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, tokenizer, target) -> str:
    """The tiny target with room for ``LONG_TOKENS`` (rotary positions need no weights)."""
    path = tmp_path_factory.mktemp("long-context") / "target"
    target.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(path)


# Each test stops its server with signals, so each has a server and a Ray cluster of its own. The two start
# together, when the first test asks for its own: most of a start is waiting on Ray's daemons and Serve's actors
# coming up, which they then do at once.
SERVERS = {"drain": 1.0, "patient": 600.0}  # name -> grace period (s)


class Servers:
    """`python -m jobs.serve` processes, each on its own local Ray cluster with one engine row (requests queue
    behind each other), its grace period, and the API key from the environment."""

    def __init__(self, model: str, root: Path) -> None:
        ports = unused_ports(len(SERVERS))
        self.started = {name: _start(model, root / name, grace, port)
                        for (name, grace), port in zip(SERVERS.items(), ports)}

    def take(self, name: str) -> tuple[subprocess.Popen, str, Path]:
        """The named server once it answers /health."""
        process, url, log = self.started[name]
        for _ in range(600):
            if process.poll() is not None:
                pytest.fail(f"specbatch serve exited with {process.returncode}:\n{log.read_text()[-5000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return process, url, log
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"specbatch serve did not come up:\n{log.read_text()[-5000:]}")

    def stop(self) -> None:
        for process, _, _ in self.started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def servers(long_context_model, tmp_path_factory):
    started = Servers(long_context_model, tmp_path_factory.mktemp("servers"))
    yield started
    started.stop()


def _start(long_context_model: str, directory: Path, grace: float, port: int) -> tuple[subprocess.Popen, str, Path]:
    directory.mkdir(parents=True)
    config = directory / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": long_context_model, "speculative": {"method": "none"}, "batch_size": 1,
        "sampling": {"max_tokens": 8}, "graceful_shutdown_timeout_s": grace,
    }))
    log = directory / "serve.log"
    # A cluster of its own: the signal stops it, and every process it started must be gone afterwards.
    env = {**os.environ, "RAY_ADDRESS": "local", "SPECBATCH_API_KEY": KEY}
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "jobs.serve", "--config", str(config), "--port", str(port)],
                                   cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}", log


def _outcome(response_status: int, headers: dict[str, str], lines: list[str], stream: bool) -> str:
    """'done' (completed), 'ended' (an error event closed the stream) or 'refused' (a clean 503); asserts the
    response is one of these."""
    if response_status == 503:
        body = json.loads("".join(lines))
        assert body["error"]["type"] == "server_error" and headers.get("retry-after"), (headers, body)
        return "refused"
    assert response_status == 200, (response_status, lines)
    if not stream:
        body = json.loads("".join(lines))
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        return "done"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][len("data: "):])
    if "error" in last:
        assert "shutting down" in last["error"]["message"]
        return "ended"
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    return "done"


def _drain_signal_processes(process: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if "DrainSignal" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def test_sigterm_drains_requests_in_flight_even_after_the_drain_actor_died(servers):
    """20 requests in flight (10 streamed; half of each kind long): after SIGTERM, new requests get 503 with
    Retry-After; each request in flight completes or gets a clean 503, each stream ends with [DONE] (after its
    last chunk or an error event); the command exits 0 and every process it started (Ray's daemons and agents)
    is gone. The drain actor is killed first (as Ray's memory monitor kills a worker): SIGTERM used to shut Serve
    down at once then, cutting every request in flight, and exit with a traceback; Ray restarts the actor and the
    replicas register again, so the drain is the one an untouched server does, behind one restart more."""
    serve_process = servers.take("drain")
    process, _, log = serve_process
    (signal_actor,) = _drain_signal_processes(process)
    signal_actor.kill()
    for _ in range(100):  # restarted by Ray (the drain below is the test: an actor that stays dead fails it)
        if [p for p in _drain_signal_processes(process) if p.pid != signal_actor.pid]:
            break
        time.sleep(0.1)
    time.sleep(1.0)  # the replicas' waits reach it
    _drain_under_sigterm(serve_process)
    assert "Traceback" not in Path(log).read_text()


def test_health_answers_while_200_streams_are_in_flight(servers):
    """Requests wait in the engine's queue, not in Serve's: the replica answers /health while it holds 200
    streams. With 4 x batch_size slots, Serve held the rest back and /health queued behind them.

    One engine row and 4,000-token streams: the server finishes a stream every few seconds, so the count reaches
    its peak however slowly the streams arrive on a busy machine; leaving the streams then aborts them, which
    frees every row (the next test drains this server)."""
    _, url, _ = servers.take("patient")
    streams = 200
    held = streams - 10  # the peak asserted: a stream may finish while the last ones arrive

    async def scenario() -> tuple[int, list[int], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=300, headers=AUTH,
                                     limits=httpx.Limits(max_connections=2 * streams)) as client:

            async def stream() -> int:
                body = {"prompt": "the cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
                    return response.status_code

            async def health() -> dict[str, Any]:
                body = (await client.get("/health")).json()
                assert body["status"] == "ok"
                return body

            tasks = [asyncio.create_task(stream()) for _ in range(streams)]
            most, deadline = 0, time.monotonic() + 120  # held back by Serve, the count would stay at 4
            while most < held and time.monotonic() < deadline:
                body = await health()
                most = max(most, body["running"] + body["waiting"])
                await asyncio.sleep(0.05)
            finished = [task.result() for task in tasks if task.done()]
            for task in tasks:  # leaving a stream aborts its sequence
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while (settled := await health())["running"] + settled["waiting"]:
                await asyncio.sleep(0.05)
            return most, finished, settled

    most, finished, settled = asyncio.run(scenario())
    assert most >= held, most
    assert finished == [200] * len(finished)
    assert settled["running"] == settled["waiting"] == 0


def test_a_second_sigterm_stops_at_once(servers):
    """Requests queued for minutes and a ten-minute grace period: the first SIGTERM starts the drain, a second one
    stops the server within seconds (no wait for the requests, none for Serve's graceful shutdown); the requests
    still in flight are cut, and every process the command started is gone."""
    process, url, log = servers.take("patient")
    requests = 40

    async def scenario() -> tuple[float, list[bool]]:
        async with httpx.AsyncClient(base_url=url, timeout=600, headers=AUTH) as client:
            async def request() -> bool:
                """Whether the request completed."""
                body = {"prompt": "the cat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        lines = [line async for line in response.aiter_lines() if line]
                except httpx.HTTPError:
                    return False
                return len(lines) > 2 and '"finish_reason":"length"' in lines[-2].replace(" ", "")

            tasks = [asyncio.create_task(request()) for _ in range(requests)]
            for _ in range(600):
                health = (await client.get("/health")).json()
                if health["running"] + health["waiting"] >= requests:
                    break
                await asyncio.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            for _ in range(500):
                if (await client.get("/health")).status_code == 503:
                    break
                await asyncio.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            await asyncio.to_thread(process.wait, 120)
            stopped = time.monotonic() - started
            return stopped, list(await asyncio.gather(*tasks))

    descendants = psutil.Process(process.pid).children(recursive=True)
    stopped, completed = asyncio.run(scenario())
    assert process.returncode == 0, log.read_text()[-5000:]
    # 4 s here on an idle machine; waiting for Serve's graceful shutdown instead took its controller's 30 s timeout.
    assert stopped < 25, f"{stopped:.1f} s from the second SIGTERM to the exit"
    assert completed.count(False) >= requests // 2  # the drain was cut, not waited for
    assert "stopping now" in log.read_text()
    left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.name() for p in left]


def _drain_under_sigterm(serve_process) -> None:
    process, url, log = serve_process

    async def scenario() -> tuple[list[str], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as client:
            assert (await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401

            async def request(i: int) -> str:
                stream = i % 2 == 0
                body: dict[str, Any] = {"prompt": "the cat", "stream": stream}
                if i % 4 >= 2:
                    body.update(max_tokens=LONG_TOKENS, ignore_eos=True)
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                    return _outcome(response.status_code, dict(response.headers), lines, stream)

            tasks = [asyncio.create_task(request(i)) for i in range(20)]
            for _ in range(600):  # all 20 answered or held by the replica (one running, the rest in its queue)
                health = (await client.get("/health")).json()
                if health["running"] + health["waiting"] + sum(t.done() for t in tasks) >= 20:
                    break
                await asyncio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            for _ in range(500):
                health = await client.get("/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            late = await client.post("/v1/completions", json={"prompt": "the cat"})
            return list(await asyncio.gather(*tasks)), health, late

    descendants = psutil.Process(process.pid).children(recursive=True)
    assert any("raylet" in p.name() for p in descendants)
    outcomes, health, late = asyncio.run(scenario())
    assert health.status_code == 503 and health.headers["retry-after"]
    assert late.status_code == 503 and late.headers["retry-after"], late.text
    assert late.json()["error"]["code"] == "service_unavailable"
    assert process.wait(timeout=120) == 0, log.read_text()[-5000:]
    summary = {kind: outcomes.count(kind) for kind in ("done", "ended", "refused")}
    print("outcomes after SIGTERM:", summary)
    assert sum(summary.values()) == 20
    # One engine row and long requests: the queue cannot empty within the one-second grace period.
    assert summary["ended"] + summary["refused"] >= 1, summary
    left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]
    assert "draining" in Path(log).read_text()
