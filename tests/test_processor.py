"""``specbatch.build_processor`` (SPEC "Python API"): user rows in, user columns plus SPEC's output columns out,
no id needed, no internal columns, token statistics opt-in; and docs/generate.md's example, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import ray
import yaml
from test_pipeline import REPO

import specbatch
from decoding.engine import Engine, Request
from pipeline.schema import OUTPUT_SCHEMA, TOKEN_STAT

QUESTIONS = [{"question": "the cat sat", "topic": "cats", "n": 1}, {"question": "dogs run", "topic": "dogs", "n": 2},
             {"question": "", "topic": "empty", "n": 3}, {"question": "on a mat", "topic": "mats", "n": 4}]


@pytest.fixture(scope="module")
def config(tiny_dirs) -> specbatch.Config:
    return specbatch.Config.model_validate({
        "model": tiny_dirs["target"],
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "num_candidates": 2, "length_policy": "static"},
        "sampling": {"temperature": 0.0, "max_tokens": 10},
        "batch_size": 2,
    })


def test_user_columns_plus_output_columns_no_id_no_internals(ray_cluster, config):
    processor = specbatch.build_processor(
        config, preprocess=lambda row: {"prompt": row["question"], "topic": row["topic"], "n": row["n"]})
    rows = sorted(processor(ray.data.from_items(QUESTIONS)).take_all(), key=lambda row: row["n"])
    expected = [name for name in OUTPUT_SCHEMA.names if name != "id"] + ["topic", "n"]
    assert all(sorted(row) == sorted(expected) for row in rows), sorted(rows[0])
    assert [row["topic"] for row in rows] == ["cats", "dogs", "empty", "mats"]
    assert rows[2]["finish_reason"] == "error" and rows[2]["error"] == "empty prompt"
    direct = Engine(config).generate([Request(str(q["n"]), prompt=q["question"]) for q in QUESTIONS if q["question"]])
    assert [r.token_ids for r in direct] == [row["generated_tokens"] for row in rows if row["n"] != 3]
    assert sum(row["spec_decode"]["num_draft_tokens"] for row in rows) > 0


def test_token_stats_opt_in_and_postprocess(ray_cluster, config):
    processor = specbatch.build_processor(
        config.model_dump(mode="json"), token_stats=True,
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"] or "x"}], "n": row["n"]},
        postprocess=lambda row: {"n": row["n"], "drafted": row["spec_decode"]["num_draft_tokens"],
                                 "accepted": row["spec_decode"]["num_accepted_draft_tokens"],
                                 "stats": row["token_stats"]},
    )
    rows = processor(ray.data.from_items(QUESTIONS)).take_all()
    assert len(rows) == len(QUESTIONS)
    for row in rows:
        assert set(row) == {"n", "drafted", "accepted", "stats"}
        assert len(row["stats"]) == row["drafted"] > 0
        assert sum(stat["accepted"] for stat in row["stats"]) == row["accepted"]
        assert set(row["stats"][0]) == set(TOKEN_STAT.names)


def test_docs_example_runs_as_written(ray_cluster, config, tmp_path):
    doc = (REPO / "docs" / "generate.md").read_text()
    section = doc[doc.index("## Python API"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = pq.read_table(tmp_path / "answers").to_pylist()
    assert sorted(row["topic"] for row in answers) == ["geography", "math"]
    assert all(set(row) == {"topic", "answer", "accepted_draft_tokens"} for row in answers)
    assert "'topic': 'geography'" in done.stdout
