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
    offered = _offered(nodes)
    if gpus > 0 and not any(node.get("GPU", 0) > 0 for node in nodes):
        field, need = "num_gpus", f"num_gpus {gpus:g} per {what[:-1]}, and the cluster has no GPU"
    elif not any(_fits([node], cpus, gpus) for node in nodes):
        field = "num_gpus" if gpus > 0 and all(node.get("CPU", 0) >= cpus for node in nodes) else "num_cpus"
        need = f"{cpus:g} CPUs and {gpus:g} GPUs per {what[:-1]}, more than any node has"
    else:
        field, need = "concurrency", f"{low} {what} of {cpus:g} CPUs and {gpus:g} GPUs each"
    return f"invalid {field}: {need}; the cluster's nodes offer {offered}"


def _offered(nodes: list[dict[str, float]]) -> str:
    return ", ".join(f"{node.get('CPU', 0):g} CPUs and {node.get('GPU', 0):g} GPUs" for node in nodes) or "none"


def _place(nodes: list[dict[str, float]], actors: list[tuple[float, float]]) -> bool:
    """Whether ``actors`` (CPUs, GPUs each) fit the nodes together: first fit, largest first (Ray packs no better
    than a bin-packing's first fit, and the check must not refuse what Ray would place)."""
    room = [[node.get("CPU", 0.0), node.get("GPU", 0.0)] for node in nodes]
    for cpus, gpus in sorted(actors, key=lambda actor: (actor[1], actor[0]), reverse=True):
        free = next((free for free in room if free[0] + 1e-9 >= cpus and free[1] + 1e-9 >= gpus), None)
        if free is None:
            return False
        free[0] -= cpus
        free[1] -= gpus
    return True


def shortfall_together(configs: dict[str, Config], what: str, nodes: list[dict[str, float]]) -> str | None:
    """``shortfall`` of several models' ``what`` sharing one cluster (a router's models): each alone, then all of
    them together; None when they fit."""
    for name, config in configs.items():
        if (reason := shortfall(config, what, nodes)) is not None:
            return reason if len(configs) == 1 else f"model {name}: {reason}"
    needs = {name: (config.concurrency_range[0], 1.0 if config.num_cpus is None else config.num_cpus,
                    config.num_gpus) for name, config in configs.items()}
    if _place(nodes, [(cpus, gpus) for low, cpus, gpus in needs.values() for _ in range(low)]):
        return None
    asked = ", ".join(f"{name} {low} x ({cpus:g} CPUs, {gpus:g} GPUs)" for name, (low, cpus, gpus) in needs.items())
    return (f"invalid num_replicas: the models' {what} do not fit the cluster together ({asked}); the cluster's nodes "
            f"offer {_offered(nodes)}")


def alive_nodes() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def check_cluster(config: Config | dict[str, Config], what: str,
                  nodes: Callable[[], list[dict[str, float]]] = alive_nodes,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """``ConfigError`` naming the field when the connected cluster cannot hold the ``what`` (``actors``,
    ``replicas``) of ``config`` (or of several models' configs together, by name), after waiting up to the longest
    ``resource_wait_s`` for nodes to join. Nothing is checked without a connection (Ray Data connects later and
    checks nothing itself)."""
    if not ray.is_initialized():
        return
    configs = config if isinstance(config, dict) else {"": config}
    wait_s = max(each.resource_wait_s for each in configs.values())
    deadline = time.monotonic() + wait_s
    while (reason := shortfall_together(configs, what, nodes())) is not None:
        if time.monotonic() >= deadline:
            waited = f" (after waiting {wait_s:g} s for nodes)" if wait_s else ""
            raise ConfigError(reason + waited)
        sleep(POLL_S)
