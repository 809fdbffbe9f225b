"""Load test of the HTTP endpoint: many concurrent chat requests, continuous batching vs one request at a time.

``python -m jobs.serve_load [--config F] [--requests 64] [--max-tokens 64] [overrides]`` deploys the Serve
application locally once per mode (the configured ``batch_size``, then ``batch_size: 1``, where the replica
decodes one request at a time and queues the rest), sends all requests at once, and prints requests/s,
p50/p95/p99 latency and aggregate generated tokens/s per mode. ``--batching-only`` skips the second mode (many
small requests: ``--requests 300 --max-tokens 8 --batching-only`` measures how fast a replica admits them).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time

import aiohttp
from pydantic import BaseModel
from ray import serve

from decoding.config import Config
from deploy.server import make_app
from jobs.common import parse_with_config, setup_logging
from jobs.serve import APP_NAME, start

TOPICS = [
    "the ocean", "a quiet library", "learning to ride a bike", "why the sky is blue", "coffee", "a rainy Monday",
    "the moon landing", "gardening", "a lost key", "mountains in winter", "friendship", "an old train station",
    "the first computer", "bees", "a city at night", "baking bread",
]


class ModeResult(BaseModel):
    mode: str
    batch_size: int
    requests: int
    failed: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    p50_latency_s: float
    p95_latency_s: float
    p99_latency_s: float


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prompt(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    style = ["Write a short paragraph about", "Explain briefly", "Describe in a few sentences"][i // len(TOPICS) % 3]
    return [{"role": "user", "content": f"{style} {topic}."}]


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def _one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[float, int] | None:
    body = {"messages": _prompt(i), "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            usage = (await response.json())["usage"]
    except aiohttp.ClientError:
        return None
    return time.perf_counter() - started, usage["completion_tokens"]


async def _load(url: str, requests: int, max_tokens: int) -> tuple[float, list[tuple[float, int] | None]]:
    """All requests at once from one asyncio client, so the client's own CPU stays small beside the server's on the
    same cores: aiohttp's client spends about 1 ms of CPU a request where httpx's grew with the connections open
    (23 ms a request at 1,500 at once)."""
    connector = aiohttp.TCPConnector(limit=requests)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _one(session, url, 0, 4)  # warm-up: first-request costs (lazy initialisation) are not load
        started = time.perf_counter()
        outcomes = await asyncio.gather(*[_one(session, url, i, max_tokens) for i in range(requests)])
        return time.perf_counter() - started, list(outcomes)


def run_mode(mode: str, config: Config, port: int, requests: int, max_tokens: int, routed: bool = True) -> ModeResult:
    start(make_app(config, routed=routed), "127.0.0.1", port)
    try:
        wall, outcomes = asyncio.run(_load(f"http://127.0.0.1:{port}", requests, max_tokens))
    finally:
        serve.delete(APP_NAME)
    done = [o for o in outcomes if o is not None]
    latencies = [latency for latency, _ in done] or [float("nan")]
    tokens = sum(n for _, n in done)
    return ModeResult(
        mode=mode, batch_size=config.batch_size, requests=requests, failed=requests - len(done),
        generated_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, requests_per_s=len(done) / wall,
        p50_latency_s=_percentile(latencies, 50), p95_latency_s=_percentile(latencies, 95),
        p99_latency_s=_percentile(latencies, 99),
    )


def format_table(results: list[ModeResult]) -> str:
    header = f"{'mode':<22}{'batch':>6}{'reqs':>6}{'failed':>7}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'req/s':>8}"
    header += f"{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}"
    rows = [
        f"{r.mode:<22}{r.batch_size:>6}{r.requests:>6}{r.failed:>7}{r.generated_tokens:>8}{r.wall_s:>9.1f}"
        f"{r.tokens_per_s:>9.1f}{r.requests_per_s:>8.1f}{r.p50_latency_s:>8.2f}{r.p95_latency_s:>8.2f}"
        f"{r.p99_latency_s:>8.2f}"
        for r in results
    ]
    return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.serve_load", description=__doc__)
    parser.add_argument("--requests", type=int, default=64, help="requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="0: any free port on 127.0.0.1")
    parser.add_argument("--batching-only", action="store_true", help="skip the one-request-at-a-time mode")
    parser.add_argument("--direct", action="store_true",
                        help="the replica as the HTTP ingress, without the router (build_llm_deployment's app)")
    args, config = parse_with_config(parser, argv)
    setup_logging()
    port = args.port or free_port()
    modes = [
        ("continuous batching", config),
        ("one request at a time", config.model_copy(update={"batch_size": 1})),
    ][: 1 if args.batching_only else 2]
    try:
        results = [run_mode(name, cfg, port, args.requests, args.max_tokens, not args.direct) for name, cfg in modes]
    finally:
        serve.shutdown()
    print(f"model {config.model}, speculative {config.speculative.method}, {args.requests} concurrent chat "
          f"requests, max_tokens {args.max_tokens}, temperature 0")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
