"""Scale-out of the batch pipeline: the same prompts on a Ray cluster of one node of one CPU, then of two such nodes.

Both clusters are started on this machine with ``ray.cluster_utils.Cluster`` (one raylet per node, ``num_cpus=1``
each); the job runs with one actor per node (``concurrency`` = nodes, ``num_cpus`` 1, so one torch thread each).
Prints a table of tokens/s and the speedup over one node, and which nodes' actors produced the parts (from the
parts' commit markers). Default prompts: pipeline_throughput's XSum chat prompts; any config field can be
overridden:

    python -m jobs.scale_out [--rows 64] [--nodes 1,2] [--input PROMPTS] [--config F] [--sampling.max_tokens 64]

Needs at least as many free cores as the largest cluster has nodes for the figure to mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from decoding.config import Config
from jobs.common import parse_with_config, setup_logging
from jobs.pipeline_throughput import XSUM, load_rows
from pipeline.job import run
from pipeline.store import OutputStore

DEFAULTS = {"batch_size": "8", "sampling.max_tokens": "64"}


class _CurrentCluster:
    """Ray's ``ray_current_cluster`` file, which a bare ``ray.init()`` anywhere on this machine joins. ``Cluster``
    names its head there (a job started meanwhile ran on the simulated nodes and died with them) and its shutdown
    deletes it (a `ray start` cluster's too): ``restore`` puts back what was there before."""

    def __init__(self) -> None:
        from ray._common.utils import get_ray_address_file

        self.path = Path(get_ray_address_file(None))
        self.before = self.path.read_text() if self.path.exists() else None

    def restore(self) -> None:
        if self.before is None:
            self.path.unlink(missing_ok=True)
        else:
            self.path.write_text(self.before)


def run_on_cluster(nodes: int, config: Config, source: str, output: str) -> dict[str, Any]:
    """``run`` on a fresh local cluster of ``nodes`` one-CPU nodes; the summary plus the parts' producing nodes."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)  # never the caller's cluster
    current = _CurrentCluster()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    current.restore()
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        cluster_nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        summary = run(config.model_copy(update={"concurrency": nodes, "num_cpus": 1.0}), source, output)
    finally:
        ray.shutdown()
        cluster.shutdown()
        current.restore()
    producers = sorted({marker["node"] for marker in OutputStore(output).markers()})
    return {**summary, "cluster_nodes": cluster_nodes, "producer_nodes": producers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.scale_out", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--nodes", default="1,2", help="cluster sizes to run, comma-separated")
    parser.add_argument("--input", help="prompt file (Parquet, JSONL or CSV); default: --rows XSum chat prompts")
    parser.add_argument("--data", type=Path, default=XSUM, help="JSONL with id and document (XSum)")
    parser.add_argument("--json", action="store_true", help="also print each run's result as a JSON line")
    args, config = parse_with_config(parser, sys.argv[1:] if argv is None else argv, DEFAULTS)
    setup_logging()
    with tempfile.TemporaryDirectory() as tmp:
        source = args.input
        if source is None:
            source = f"{tmp}/prompts.jsonl"
            Path(source).write_text("".join(json.dumps(r) + "\n" for r in load_rows(args.data, args.rows)))
        print(f"{config.model}, method {config.speculative.method}, batch_size {config.batch_size}, "
              f"max_tokens {config.sampling.max_tokens}, {source}")
        print("| nodes (1 CPU each) | rows | tokens | seconds | tokens/s | vs 1 node | nodes producing parts |")
        print(f"|{'-' * 20}|------|--------|---------|----------|-----------|{'-' * 23}|", flush=True)
        base = None
        for nodes in (int(n) for n in args.nodes.split(",")):
            result = run_on_cluster(nodes, config, source, f"{tmp}/out-{nodes}")
            rate = result["tokens_per_second"]
            base = base or rate
            print(f"| {nodes:>18} | {result['rows']:>4} | {result['generated_tokens']:>6} | "
                  f"{result['wall_seconds']:>7.1f} | {rate:>8.1f} | {rate / base:>9.2f} | "
                  f"{len(result['producer_nodes'])} of {len(result['cluster_nodes'])} |", flush=True)
            if args.json:
                print(json.dumps({"nodes": nodes, **{k: result[k] for k in (
                    "rows", "errors", "generated_tokens", "wall_seconds", "tokens_per_second",
                    "cluster_nodes", "producer_nodes")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
