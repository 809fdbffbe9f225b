"""Several nodes: a Ray cluster of two one-CPU nodes on this machine
(``ray.cluster_utils.Cluster``, through ``jobs.scale_out``): both nodes' actors produce parts, every row once, and the
machine's current cluster is left as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from test_pipeline import REPO, good_rows, write_jsonl

from decoding.config import Config


def test_two_one_cpu_nodes_both_produce_parts(tiny_dirs, tmp_path):
    config = Config.model_validate({
        "model": tiny_dirs["target"],
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "length_policy": "static"},
        "sampling": {"temperature": 0.0, "max_tokens": 30}, "batch_size": 2,
    })
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    source = write_jsonl(tmp_path / "in.jsonl", good_rows(24))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # its own two-node cluster
    # Ray's temp root of its own (short: the nodes' socket paths live under it), holding the file that names this
    # machine's current cluster, which a bare ray.init() joins: a `ray start` cluster's, as far as Ray can tell.
    # ``Cluster`` names its head there while it runs and deletes the file at its end.
    env["RAY_TMPDIR"] = temp = tempfile.mkdtemp(prefix="sbnodes", dir="/tmp")
    current = Path(temp) / "ray" / "ray_current_cluster"
    current.parent.mkdir()
    current.write_text("127.0.0.1:6379")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jobs.scale_out", "--nodes", "2", "--input", str(source),
             "--config", str(tmp_path / "config.yaml"), "--json"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert current.read_text() == "127.0.0.1:6379"  # put back as it was
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    [result] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert result["nodes"] == 2 and len(result["cluster_nodes"]) == 2
    assert result["producer_nodes"] == result["cluster_nodes"], "one node's actor produced no part"
    assert result["rows"] == 24 and result["errors"] == 0 and result["tokens_per_second"] > 0
