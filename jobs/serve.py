"""``specbatch serve``: the OpenAI-compatible endpoint (docs/reference.md) on Ray Serve, until SIGTERM or SIGINT.

On the first signal the server drains (``deploy.drain``): new requests get 503, the requests in flight finish
within ``graceful_shutdown_timeout_s``, the rest are ended cleanly; then Serve shuts down, and so does the Ray
cluster the command started, with every process it started. A second signal stops at once: no drain and no
graceful shutdown of Serve, only the cluster the command started and its processes, stopped (later signals are
ignored while they are).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import ray
from ray import serve
from ray.serve import Application

from decoding.config import Config, ConfigError, LoraConfig
from deploy.drain import NAMESPACE, DrainSignal, signal_name
from deploy.server import make_app
from frontend.tool_parsers import PARSERS
from jobs.common import parse_with_config, setup_logging

log = logging.getLogger(__name__)

APP_NAME = "specbatch"
# How long the processes of a cluster this command started get to exit after ray.shutdown before they are killed
# (Ray's dashboard and runtime-env agents outlived the command by minutes).
REAP_TIMEOUT_S = 10.0
# How long the drain waits, after the replicas have answered everything they held, for the HTTP proxies to forward
# the last chunks (an error event and [DONE]); Serve's shutdown would cut them off (a client saw a truncated
# stream when the proxy stopped 1 s after the replica's last answer, on a loaded 2-core machine).
PROXY_DRAIN_TIMEOUT_S = 15.0
PROXY_ACTOR_PREFIX = "SERVE_PROXY_ACTOR"  # Serve's proxies, one per node, named in its namespace "serve"


def wait_for_proxies(timeout: float) -> bool:
    """Put every Serve HTTP proxy in draining mode (only its health route changes: it answers 503) and wait until
    each has no request in flight; whether all did within ``timeout`` seconds."""
    proxies = [ray.get_actor(actor["name"], namespace=actor["namespace"])
               for actor in ray.util.list_named_actors(all_namespaces=True)
               if actor["name"].startswith(PROXY_ACTOR_PREFIX)]
    ray.get([proxy.update_draining.remote(True) for proxy in proxies], timeout=timeout)
    deadline = time.monotonic() + timeout
    while proxies and time.monotonic() < deadline:
        drained = ray.get([proxy.is_drained.remote() for proxy in proxies], timeout=timeout)
        proxies = [proxy for proxy, done in zip(proxies, drained) if not done]
        time.sleep(0.05)
    return not proxies


def start(app: Application, host: str, port: int) -> str:
    """Start Serve's HTTP proxy and deploy ``app`` (waits until its replicas are up); returns the API's base URL."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}/v1"


@contextmanager
def ray_session() -> Iterator[None]:
    """Join the cluster Ray would join (RAY_ADDRESS, a `ray start` cluster), else start a local one; at the end,
    disconnect, and make sure every process this command started (a local cluster's daemons and agents) is gone."""
    # Serve's controller gives the HTTP proxy 5 s to answer its readiness check, three times, then replaces it, and
    # serve.start fails on the replaced proxy: on a busy 2-core machine a starting proxy took longer. The cluster
    # this command starts (its processes inherit the environment) gives it 30 s; one it joins keeps its own setting.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    # A draining proxy reports drained once it forwards nothing and this period has passed (Ray's default, 30 s, is
    # for a load balancer to notice): the drain waits on it (``wait_for_proxies``).
    os.environ.setdefault("RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S", "0.1")
    ray.init(namespace="serve")
    try:
        yield
    finally:
        started = psutil.Process().children(recursive=True)
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=REAP_TIMEOUT_S)
        for process in alive:
            log.warning("stopping %s (pid %d), left behind by the Ray cluster", process.name(), process.pid)
            process.terminate()
        _, alive = psutil.wait_procs(alive, timeout=3)
        for process in alive:
            process.kill()


def serve_until_signalled(app: Application, host: str, port: int, grace: float, stop: threading.Event) -> None:
    drain = DrainSignal.options(name=signal_name(APP_NAME), namespace=NAMESPACE).remote()
    interrupted = False
    try:
        url = start(app, host, port)
        log.info("serving at %s (Ctrl-C or SIGTERM to stop)", url)
        stop.wait()
        log.info("draining: new requests get 503, requests in flight have %.0f s to finish", grace)
        try:
            left = ray.get(drain.drain.remote(grace, grace + 15.0), timeout=grace + 30.0)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # the signal actor cannot come back
            log.warning("draining through the signal actor failed (%s); Serve's own graceful shutdown "
                        "(graceful_shutdown_timeout_s) applies", type(exc).__name__)
        else:
            if left:
                log.warning("replicas that did not report back from draining: %s", ", ".join(left))
            try:
                if not wait_for_proxies(PROXY_DRAIN_TIMEOUT_S):
                    log.warning("the HTTP proxies still forward answers after %.0f s; stopping them",
                                PROXY_DRAIN_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("waiting for the HTTP proxies failed (%s)", type(exc).__name__)
    except KeyboardInterrupt:  # a second signal: Serve's graceful shutdown would wait for the requests again
        interrupted = True
        raise
    finally:
        if not interrupted:
            serve.shutdown()


def lora_module(value: str) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` entry: ``name=path``, or JSON ``{"name": ..., "path": ...}``."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"{value!r}: expected {{\"name\": ..., \"path\": ...}} ({exc})") from None
    name, equals, path = value.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace, Config]:
    """The command's options and the configuration they make (the file, dotted overrides, then the flags)."""
    parser = argparse.ArgumentParser(prog="specbatch serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                        help="vLLM's: how tool_choice auto reads calls from the text (config: tool_call_parser)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, accepted: tool_choice auto is on whenever a tool-call parser is set")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", type=lora_module, default=[],
                        help="vLLM's: LoRA adapters served by name, a PEFT folder or URI each (config: lora.modules)")
    parser.add_argument("--enable-lora", action="store_true", help="vLLM's: requests may name adapters (lora.enable)")
    args, config = parse_with_config(parser, argv)
    if args.tool_call_parser is not None:
        config = config.model_copy(update={"tool_call_parser": args.tool_call_parser})  # argparse checked the name
    if args.lora_modules or args.enable_lora:
        lora = config.lora.model_dump()
        lora.update(enable=True, modules={**lora["modules"], **dict(args.lora_modules)})
        config = config.model_copy(update={"lora": LoraConfig.model_validate(lora)})
    return parser, args, config


def main(argv: list[str] | None = None) -> int:
    parser, args, config = parse(argv)
    setup_logging()
    stop = threading.Event()

    def on_signal(signum: int, _: object) -> None:
        if stop.is_set():  # a second signal: stop now; the cleanup of the cluster must not be interrupted in turn
            log.warning("received %s again: stopping now, requests in flight are cut", signal.Signals(signum).name)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    try:
        with ray_session():
            # After ray.init, whose own SIGTERM handler (a stack dump, then death) would replace these.
            signal.signal(signal.SIGTERM, on_signal)  # ray job stop, docker stop, kubernetes
            signal.signal(signal.SIGINT, on_signal)
            serve_until_signalled(make_app(config), args.host, args.port, config.graceful_shutdown_timeout_s, stop)
    except KeyboardInterrupt:
        # A second signal: the cluster and its processes are stopped; the interpreter's own teardown (Ray's and
        # gRPC's native threads) took 5-8 s more, with nothing left to do.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except ConfigError as exc:  # what the cluster cannot hold (frontend.resources)
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
