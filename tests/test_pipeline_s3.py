"""The job on an S3-compatible object store: moto's server on 127.0.0.1, pyarrow's real S3 client.

Input, output directory and model paths are ``s3://`` URIs; the driver is killed midway and the run resumed, and
``specbatch report`` reads the result there; unknown schemes and missing buckets are refused by name."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import yaml
from test_pipeline import REPO, good_rows, wait_for

from decoding.config import Config
from pipeline.io import InputError, list_input_files
from pipeline.job import run
from pipeline.store import COMMITS, OUTPUTS, TOKEN_STATS, OutputStore

KEY, SECRET = "testing-key", "testing-secret"


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    fs = pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, region="us-east-1", scheme="http",
                           endpoint_override=f"127.0.0.1:{port}", allow_bucket_creation=True)
    fs.create_dir("specbatch-test")
    # Credentials and endpoint in the URI: the fs object pickled into Ray's read and write tasks carries them.
    yield fs, lambda path: f"s3://{KEY}:{SECRET}@{path}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    server.stop()


def put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def upload_dir(fs: pafs.FileSystem, local: str, remote: str) -> None:
    for file in Path(local).iterdir():
        put(fs, f"{remote}/{file.name}", file.read_bytes())


@pytest.fixture(scope="module")
def s3_config(s3, tiny_dirs) -> Config:
    """The tiny models themselves read from the bucket."""
    fs, uri = s3
    upload_dir(fs, tiny_dirs["target"], "specbatch-test/models/target")
    upload_dir(fs, tiny_dirs["draft"], "specbatch-test/models/draft")
    return Config.model_validate({
        "model": uri("specbatch-test/models/target"),
        "speculative": {"method": "draft_model", "model": uri("specbatch-test/models/draft"),
                        "num_speculative_tokens": 3, "num_candidates": 2, "length_policy": "static"},
        "sampling": {"temperature": 0.0, "max_tokens": 40},
        "batch_size": 2,
    })


def committed(fs: pafs.FileSystem, root: str) -> list[str]:
    selector = pafs.FileSelector(f"{root}/{COMMITS}", allow_not_found=True)
    return [info.path for info in fs.get_file_info(selector)]


def test_s3_generate_killed_driver_resume_every_id_once(ray_cluster, s3, s3_config, tmp_path):
    fs, uri = s3
    # 16 rows in one-row parts (batch 2) over two files: the driver dies within a part or two of the first commit
    # (polled every 0.2 s; a part takes ~40 steps), so midway with room to spare, and the resume reads both files.
    rows = good_rows(16)
    put(fs, "specbatch-test/in/a.jsonl", "".join(json.dumps(r) + "\n" for r in rows[:9]).encode())
    put(fs, "specbatch-test/in/b.jsonl", "".join(json.dumps(r) + "\n" for r in rows[9:]).encode())
    root = "specbatch-test/runs/killed"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(s3_config.model_dump(mode="json")))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / "config.yaml"),
             "--input", uri("specbatch-test/in/"), "--output", uri(root)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: committed(fs, root) or driver.poll() is not None, 180, "a committed part")
        finally:
            driver.send_signal(signal.SIGKILL)
            driver.wait()
    time.sleep(1)  # the killed job's workers go with it
    store = OutputStore(uri(root))
    done = sum(len(marker["ids"]) for marker in store.markers())
    assert 0 < done < len(rows), f"the driver was not killed midway ({done} rows done); see {tmp_path}/driver.log"

    summary = run(s3_config, uri("specbatch-test/in/"), uri(root))
    assert summary["rows_this_run"] == len(rows) - done and summary["rows"] == len(rows)
    outputs = store.read_outputs()
    assert sorted(outputs["id"].to_pylist()) == sorted(r["id"] for r in rows)
    assert set(outputs["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert set(outputs["target_model"].to_pylist()) == {s3_config.model}  # provenance names the URI
    stats = Counter(store.read_token_stats(["id"])["id"].to_pylist())
    for row in outputs.to_pylist():  # token statistics neither lost nor written twice
        assert stats[row["id"]] == row["spec_decode"]["num_draft_tokens"], row["id"]
    assert summary["num_draft_tokens"] == sum(stats.values()) > 0
    # Only committed parts remain, each with its outputs, token_stats and marker.
    names = {info.base_name for info in fs.get_file_info(pafs.FileSelector(f"{root}/{OUTPUTS}"))}
    assert names == {info.base_name for info in fs.get_file_info(pafs.FileSelector(f"{root}/{TOKEN_STATS}"))}
    assert {n + ".json" for n in names} == {p.rsplit("/", 1)[1] for p in committed(fs, root)}
    written = json.loads(fs.open_input_stream(f"{root}/summary.json").read())
    assert written["rows"] == len(rows) and len(written["runs"]) == 2
    assert sum(r["rows"] for r in written["runs"]) == len(rows)

    # specbatch report reads the directory where the job wrote it, and writes its page there.
    from jobs.report import main as report

    assert report([uri(root)]) == 0
    page = fs.open_input_stream(f"{root}/report.html").read().decode()
    assert "generated tokens" in page and page.count('<img src="report_files/') == 6
    assert fs.get_file_info(f"{root}/report_files/per_prompt_speedup.png").size > 0


def test_unknown_scheme_and_missing_bucket_are_named(s3, s3_config):
    _, uri = s3
    with pytest.raises(InputError, match="'nosuchfs://'"):
        list_input_files("nosuchfs://bucket/prompts.jsonl")
    with pytest.raises(InputError, match="bucket 'no-such-bucket' does not exist"):
        list_input_files(uri("no-such-bucket/prompts.jsonl"))
    with pytest.raises(InputError, match="bucket 'no-such-bucket' does not exist"):
        run(s3_config, uri("specbatch-test/in/"), uri("no-such-bucket/out"))


def test_cli_refuses_a_missing_bucket_with_exit_2(s3, capsys):
    from jobs.generate import main

    _, uri = s3
    with pytest.raises(SystemExit) as exit_:
        main(["--input", uri("no-such-bucket/in.jsonl")])
    assert exit_.value.code == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
