"""Whether the cluster can hold the engine actors (pipeline) or replicas (server) a config asks for, checked before
they are requested: Ray waits forever for resources no node has ("may hang forever"), so a job asking for 64
CPUs on a 2-core node, or for a GPU where there is none, fails at once with what the cluster offers.

On an autoscaling cluster the nodes may come: ``resource_wait_s`` waits that long for them before failing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import ray

from decoding.config import Config, ConfigError

# Seconds between looks at the cluster while waiting for nodes.
POLL_S = 2.0


def _fits(nodes: list[dict[str, float]], cpus: float, gpus: float) -> int:
    """How many actors of ``cpus`` CPUs and ``gpus`` GPUs the nodes hold together."""
    total = 0
    for node in nodes:
        room = [math.floor(node.get(name, 0.0) / need + 1e-9) for name, need in (("CPU", cpus), ("GPU", gpus))
                if need > 0]
        total += min(room) if room else 1 << 30
    return total


def shortfall(config: Config, what: str, nodes: list[dict[str, float]]) -> str | None:
    """Why ``nodes`` (each node's total resources) cannot hold the fewest ``what`` (actors, replicas) ``config``
    starts with; None when they can."""
    low = config.concurrency_range[0]
    cpus = 1.0 if config.num_cpus is None else config.num_cpus  # Ray Data's and Serve's default: one CPU each
    gpus = config.num_gpus
    if _fits(nodes, cpus, gpus) >= low:
        return None
    offered = ", ".join(f"{node.get('CPU', 0):g} CPUs and {node.get('GPU', 0):g} GPUs" for node in nodes) or "none"
    if gpus > 0 and not any(node.get("GPU", 0) > 0 for node in nodes):
        field, need = "num_gpus", f"num_gpus {gpus:g} per {what[:-1]}, and the cluster has no GPU"
    elif not any(_fits([node], cpus, gpus) for node in nodes):
        field = "num_gpus" if gpus > 0 and all(node.get("CPU", 0) >= cpus for node in nodes) else "num_cpus"
        need = f"{cpus:g} CPUs and {gpus:g} GPUs per {what[:-1]}, more than any node has"
    else:
        field, need = "concurrency", f"{low} {what} of {cpus:g} CPUs and {gpus:g} GPUs each"
    return f"invalid {field}: {need}; the cluster's nodes offer {offered}"


def alive_nodes() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def check_cluster(config: Config, what: str, nodes: Callable[[], list[dict[str, float]]] = alive_nodes,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """``ConfigError`` naming the field when the connected cluster cannot hold the ``what`` (``actors``,
    ``replicas``) of ``config``, after waiting up to ``config.resource_wait_s`` for nodes to join. Nothing is
    checked without a connection (Ray Data connects later and checks nothing itself)."""
    if not ray.is_initialized():
        return
    deadline = time.monotonic() + config.resource_wait_s
    while (reason := shortfall(config, what, nodes())) is not None:
        if time.monotonic() >= deadline:
            waited = f" (after waiting {config.resource_wait_s:g} s for nodes)" if config.resource_wait_s else ""
            raise ConfigError(reason + waited)
        sleep(POLL_S)
