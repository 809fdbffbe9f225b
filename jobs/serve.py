"""``specbatch serve``: the OpenAI-compatible endpoint (SPEC "HTTP") on Ray Serve, until interrupted."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from ray import serve
from ray.serve import Application

from deploy.server import make_app
from jobs.common import parse_with_config, setup_logging

log = logging.getLogger(__name__)

APP_NAME = "specbatch"


def start(app: Application, host: str, port: int) -> str:
    """Start Serve's HTTP proxy and deploy ``app`` (waits until its replicas are up); returns the API's base URL."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specbatch serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    args, config = parse_with_config(parser, argv)
    setup_logging()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # ray job stop / docker stop: shut down cleanly
    try:
        url = start(make_app(config), args.host, args.port)
        log.info("serving %s at %s (Ctrl-C to stop)", config.served_model_name or config.model, url)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
