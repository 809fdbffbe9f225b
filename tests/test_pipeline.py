"""The Ray Data batch job on a local Ray cluster with tiny models: schema, error rows, resume,
killed drivers and actors, concurrency, and `ray job submit`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import yaml

from decoding.config import Config, StructuredOutputs
from decoding.engine import Engine, Request
from pipeline.actor import GenerationActor
from pipeline.io import list_input_files, read_json_records, read_prompts, rows_left
from pipeline.job import run
from pipeline.schema import OUTPUT_SCHEMA, READ_ERROR, TOKEN_STATS_SCHEMA
from pipeline.store import OutputStore

REPO = Path(__file__).resolve().parents[1]
WORDS = ["the cat sat", "on a mat", "dogs run fast", "a bird, a tree.", "slow rivers bend", "stars are far"]


def good_rows(n: int) -> list[dict]:
    return [{"id": f"row-{i:03d}", "prompt": f"{WORDS[i % len(WORDS)]} {WORDS[(i * 5 + 1) % len(WORDS)]}", "n": i}
            for i in range(n)]


BAD_ROWS = [
    {"id": "bad-empty", "prompt": "", "n": -1},
    {"id": "bad-long", "prompt": "abc " * 100, "n": -2},  # 400 tokens; the tiny model's context is 256
    {"id": "bad-type", "prompt": 42, "n": -3},
    {"id": "bad-sampling", "prompt": "the cat", "n": -4, "sampling_params": {"temperature": -1.0}},
    {"id": "bad-sampling-json", "prompt": "the cat", "n": -5, "sampling_params": "{not json"},
    {"id": "bad-sampling-field", "prompt": "the cat", "n": -6, "sampling_params": '{"temprature": 0.5}'},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def config(tiny_dirs) -> Config:
    return Config.model_validate({
        "model": tiny_dirs["target"],
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "num_candidates": 2, "length_policy": "static"},
        "sampling": {"temperature": 0.0, "max_tokens": 12},
        "batch_size": 4,
    })


@pytest.fixture(scope="module")
def mixed_input(tmp_path_factory) -> Path:
    """Good rows, bad rows, a chat row and rows with their own sampling (one asking for logprobs): the input of
    the one job whose output the schema, error-row, statistics and logprob tests all read."""
    rows = good_rows(14)
    rows[3:3] = BAD_ROWS[:3]
    rows[9:9] = BAD_ROWS[3:]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "hello there"}], "n": 99})
    rows.append({"id": "own-sampling", "prompt": "dogs run", "n": 98, "sampling_params": {"max_tokens": 3}})
    rows.append({"id": "asks-logprobs", "prompt": "the cat sat", "n": 97,
                 "sampling_params": {"max_tokens": 4, "logprobs": 2, "prompt_logprobs": 1}})
    return write_jsonl(tmp_path_factory.mktemp("input") / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def one_actor_run(ray_cluster, config, mixed_input, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("one_actor")
    return out, run(config, str(mixed_input), str(out))


def by_id(table: pa.Table) -> dict[str, dict]:
    return {row["id"]: row for row in table.to_pylist()}


def test_logprob_columns_are_vllms_in_parquet(one_actor_run):
    """prompt_token_ids, and logprobs / prompt_logprobs as maps token id -> {logprob, rank, decoded_token}, the
    chosen token first, the prompt's first position null; rows that did not ask hold nulls."""
    out, _ = one_actor_run
    table = pq.read_table(out / "outputs")
    for name in ("logprobs", "prompt_logprobs", "prompt_token_ids"):
        assert table.schema.field(name).type == OUTPUT_SCHEMA.field(name).type
    got = {row["id"]: row for row in table.to_pylist(maps_as_pydicts="strict")}
    asks, plain = got["asks-logprobs"], got["row-000"]
    assert plain["logprobs"] is None and plain["prompt_logprobs"] is None and plain["prompt_token_ids"]
    assert len(asks["logprobs"]) == len(asks["generated_tokens"])
    for token, position in zip(asks["generated_tokens"], asks["logprobs"], strict=True):
        assert next(iter(position)) == token and 2 <= len(position) <= 3
        assert all(set(entry) == {"logprob", "rank", "decoded_token"} for entry in position.values())
    assert asks["prompt_logprobs"][0] is None and len(asks["prompt_logprobs"]) == len(asks["prompt_token_ids"])
    assert [next(iter(p)) for p in asks["prompt_logprobs"][1:]] == asks["prompt_token_ids"][1:]


def test_outputs_follow_spec_schema_one_row_per_input(one_actor_run, mixed_input):
    out, summary = one_actor_run
    outputs = pq.read_table(out / "outputs")
    expected_ids = [json.loads(line)["id"] for line in mixed_input.read_text().splitlines()]
    assert sorted(outputs["id"].to_pylist()) == sorted(expected_ids)
    # The output columns with their types first, then the carried-through input columns.
    assert outputs.schema.names[: len(OUTPUT_SCHEMA)] == OUTPUT_SCHEMA.names
    for field in OUTPUT_SCHEMA:
        assert outputs.schema.field(field.name).type == field.type, field.name
    assert set(outputs.schema.names[len(OUTPUT_SCHEMA):]) == {"n", "sampling_params", "messages"}
    assert pq.read_schema(next((out / "token_stats").glob("*.parquet"))) == TOKEN_STATS_SCHEMA

    rows = by_id(outputs)
    inputs = {json.loads(line)["id"]: json.loads(line) for line in mixed_input.read_text().splitlines()}
    assert all(rows[i]["n"] == inputs[i]["n"] for i in inputs)
    assert rows["chat"]["messages"] == inputs["chat"]["messages"]
    assert rows["chat"]["prompt"] == "user: hello there\nassistant: "
    assert rows["own-sampling"]["num_generated_tokens"] <= 3
    assert {row["target_model"] for row in rows.values()} == {outputs["target_model"][0].as_py()}
    assert outputs["draft_model"][0].as_py().endswith("draft")


def test_bad_rows_become_error_rows(one_actor_run):
    out, summary = one_actor_run
    rows = by_id(pq.read_table(out / "outputs"))
    errors = {i: row["error"] for i, row in rows.items() if row["finish_reason"] == "error"}
    assert set(errors) == {row["id"] for row in BAD_ROWS}
    assert errors["bad-empty"] == "empty prompt"
    assert "context" in errors["bad-long"]
    assert errors["bad-type"] == "prompt must be a string, got int"
    assert "temperature" in errors["bad-sampling"]
    assert "not JSON" in errors["bad-sampling-json"]
    assert "temprature" in errors["bad-sampling-field"]
    for i in errors:
        row = rows[i]
        assert row["generated_tokens"] == row["token_accepted"] == row["per_step_drafted"] == []
        assert row["generated_text"] == "" and row["num_generated_tokens"] == 0
    assert all(row["error"] is None for i, row in rows.items() if i not in errors)
    assert summary["errors"] == len(BAD_ROWS)


def test_token_stats_agree_with_outputs_and_summary(one_actor_run):
    out, summary = one_actor_run
    rows = by_id(pq.read_table(out / "outputs"))
    stats = pq.read_table(out / "token_stats").to_pylist()
    drafted, accepted = Counter(s["id"] for s in stats), Counter(s["id"] for s in stats if s["accepted"])
    assert sum(accepted.values()) > 0
    for i, row in rows.items():
        spec = row["spec_decode"]
        assert drafted[i] == spec["num_draft_tokens"] == sum(row["per_step_drafted"])
        assert accepted[i] == spec["num_accepted_draft_tokens"] == sum(row["per_step_accepted"])
        assert accepted[i] == sum(row["token_accepted"])
        if row["finish_reason"] != "error":  # spec steps are the verification steps that drafted
            assert spec["num_spec_steps"] == sum(1 for d in row["per_step_drafted"] if d)
            assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
            if spec["num_spec_steps"]:
                assert spec["mean_acceptance_length"] == pytest.approx(
                    1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])
            forwards = len(row["per_step_drafted"]) + 1  # + the prefill forward
            assert spec["tokens_per_forward"] == pytest.approx(row["num_generated_tokens"] / forwards)
    generated = sum(row["num_generated_tokens"] for row in rows.values())
    steps = sum(row["spec_decode"]["num_spec_steps"] for row in rows.values())
    prefilled = [row for row in rows.values() if row["num_generated_tokens"]]
    assert summary["prefix_cache_queries"] == sum(row["num_input_tokens"] for row in prefilled)
    assert summary["prefix_cache_hits"] == sum(row["num_cached_tokens"] for row in rows.values())
    assert summary["rows"] == summary["rows_this_run"] == len(rows)
    assert summary["generated_tokens"] == summary["generated_tokens_this_run"] == generated
    assert summary["num_spec_steps"] == steps
    assert summary["mean_acceptance_length"] == pytest.approx(1 + sum(accepted.values()) / steps)
    assert summary["draft_acceptance_rate"] == pytest.approx(sum(accepted.values()) / sum(drafted.values()))
    assert sum(summary["num_accepted_tokens_per_pos"]) == sum(accepted.values())
    assert len(summary["per_position_acceptance_rate"]) == 3
    assert summary["tokens_per_second"] > 0
    assert summary["config"]["batch_size"] == 4
    assert json.loads((out / "summary.json").read_text()) == summary


def test_pipeline_matches_engine_and_two_actors_match_one(one_actor_run, config, mixed_input, tmp_path, tiny_dirs):
    out, _ = one_actor_run
    one = {i: row["generated_tokens"] for i, row in by_id(pq.read_table(out / "outputs")).items()}
    two_config = config.model_copy(update={"concurrency": 2})
    two_out = tmp_path / "two"
    run(two_config, str(mixed_input), str(two_out))
    two = {i: row["generated_tokens"] for i, row in by_id(pq.read_table(two_out / "outputs")).items()}
    assert one == two
    # The pipeline adds nothing to decoding: the engine called directly gives the same tokens.
    good = good_rows(14)
    direct = Engine(config).generate([Request(row["id"], prompt=row["prompt"]) for row in good])
    assert {r.id: r.token_ids for r in direct} == {row["id"]: one[row["id"]] for row in good}


def test_constrained_rows_follow_the_configured_or_their_own_constraint(ray_cluster, config, tmp_path):
    """A configured choice for every row, a row's own regex (JSON text, as a dataset stores it) instead, an invalid
    one as an error row naming the field; the grammar's forced tokens counted per row and in the summary."""
    choices = ["yes it is", "no it is not"]
    constrained = config.model_copy(update={"sampling": config.sampling.model_copy(update={
        "structured_outputs": StructuredOutputs(choice=choices), "max_tokens": 24})})
    regex = "(ran|sat) (far|home)\\."
    rows = good_rows(5) + [
        {"id": "own-regex", "prompt": "a dog", "n": 0,
         "sampling_params": json.dumps({"guided_decoding": {"regex": regex}, "temperature": 1.0, "seed": 1})},
        {"id": "bad-regex", "prompt": "a dog", "n": 0, "sampling_params": {"structured_outputs": {"regex": "(a"}}},
    ]
    summary = run(constrained, str(write_jsonl(tmp_path / "in.jsonl", rows)), str(tmp_path / "out"))
    outputs = by_id(pq.read_table(tmp_path / "out" / "outputs"))
    for row in good_rows(5):
        assert outputs[row["id"]]["generated_text"] in choices, outputs[row["id"]]
    assert re.fullmatch(regex, outputs["own-regex"]["generated_text"]), outputs["own-regex"]
    assert outputs["bad-regex"]["finish_reason"] == "error"
    assert "structured_outputs.regex" in outputs["bad-regex"]["error"]
    forced = [row["spec_decode"]["num_grammar_forced_tokens"] for row in outputs.values() if not row["error"]]
    # After their first tokens the choices run alone: the masked draft drew them, the target accepted them.
    assert all(count > 0 for count in forced) and summary["num_grammar_forced_tokens"] == sum(forced)
    assert summary["grammar_forced_share"] == pytest.approx(sum(forced) / summary["generated_tokens"])


def test_resume_skips_finished_ids_and_cleans_partial_parts(ray_cluster, config, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", good_rows(6))
    out = tmp_path / "out"
    run(config, str(source), str(out))
    before = pq.read_table(out / "outputs")
    # What a run killed between its writes leaves: data files of a part whose commit marker was never written
    # (a valid one and a truncated one), and a marker torn on a local disk.
    pq.write_table(before.slice(0, 1), out / "outputs" / "part-uncommitted.parquet")
    (out / "outputs" / "part-torn.parquet").write_bytes(b"PAR1partial")
    pq.write_table(TOKEN_STATS_SCHEMA.empty_table(), out / "token_stats" / "part-orphan.parquet")
    (out / "_commits" / "part-torn.parquet.json").write_text('{"part": "part-torn.par')
    # A marker whose data files are gone (written by a write task outliving its killed driver): not complete.
    (out / "_commits" / "part-ghost.parquet.json").write_text('{"part": "part-ghost.parquet", "ids": ["row-008"]}')

    write_jsonl(source, good_rows(9))
    other = config.model_copy(update={"sampling": config.sampling.model_copy(update={"max_tokens": 7})})
    summary = run(other, str(source), str(out))  # resumed under another configuration
    assert summary["rows_this_run"] == 3 and summary["rows"] == 9
    assert [(r["rows"], r["config"]["sampling"]["max_tokens"]) for r in summary["runs"]] == [(6, 12), (3, 7)]
    outputs = pq.read_table(out / "outputs")
    assert sorted(outputs["id"].to_pylist()) == [row["id"] for row in good_rows(9)]
    assert by_id(before).items() <= by_id(outputs).items()
    leftovers = ["outputs/part-uncommitted.parquet", "outputs/part-torn.parquet", "token_stats/part-orphan.parquet",
                 "_commits/part-torn.parquet.json", "_commits/part-ghost.parquet.json"]
    assert not [name for name in leftovers if (out / name).exists()]
    assert {p.name for p in (out / "outputs").iterdir()} == {p.name for p in (out / "token_stats").iterdir()}
    assert {p.name + ".json" for p in (out / "outputs").iterdir()} == {p.name for p in (out / "_commits").iterdir()}

    # Every row done: the run is recorded, and no pipeline (no engine) starts.
    monkeypatch.setattr("pipeline.job._write_parts", lambda *args: pytest.fail("a finished job started its engines"))
    summary = run(config, str(source), str(out))
    assert summary["rows_this_run"] == 0 and summary["rows"] == 9 and len(summary["runs"]) == 3


def test_rows_left_reads_ids_not_counts(tmp_path):
    """A finished job is told by its rows' ids: as many rows as are done, with an id that is not, is work left."""
    import pyarrow.fs as pafs

    source = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    fs = pafs.LocalFileSystem()
    ids = frozenset(row["id"] for row in good_rows(3))
    assert not rows_left([str(source)], str(tmp_path), ids, fs)
    assert rows_left([str(source)], str(tmp_path), ids - {"row-001"} | {"row-999"}, fs)
    write_jsonl(source, [{"prompt": "no id"}])  # a derived id (file:row) is matched as the reader makes it
    assert not rows_left([str(source)], str(tmp_path), frozenset({"in.jsonl:0"}), fs)


def _parts(out: Path) -> list[tuple[float, pa.Table]]:
    """Each committed part's commit time (its marker's) and its outputs, in commit order."""
    markers = sorted((out / "_commits").iterdir(), key=lambda marker: marker.stat().st_mtime)
    return [(marker.stat().st_mtime, pq.read_table(out / "outputs" / json.loads(marker.read_text())["part"]))
            for marker in markers]


def test_many_short_rows_commit_their_first_part_within_the_first_fifth_of_the_run(ray_cluster, tiny_dirs, tmp_path):
    """Parts hold at most four engine batches and are committed as they finish. Before, 20,000 rows came out as 4
    parts of 5,000, the first committed 185 s into a 201 s run: a kill before then lost everything. A smaller job
    gets smaller parts (63 parts of 32 rows, half a batch, for these 2,000), so it makes the same point. The run is
    counted from its first row's start (the first part's commit less its slowest row's time), so that the actor's
    start, which depends on the machine's load, is not part of it."""
    from pipeline.job import rows_per_part

    rows = 2_000
    config = Config.model_validate({"model": tiny_dirs["target"], "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 12, "ignore_eos": True}, "batch_size": 64})
    source = write_jsonl(tmp_path / "big.jsonl",
                         [{"id": f"big-{i}", "prompt": WORDS[i % len(WORDS)]} for i in range(rows)])
    out = tmp_path / "out"
    summary = run(config, str(source), str(out))
    assert summary["rows"] == rows and summary["errors"] == 0
    parts = _parts(out)
    size = rows_per_part(config, source.stat().st_size)
    assert size <= 4 * config.batch_size and len(parts) == -(-rows // size)
    assert all(part.num_rows <= size for _, part in parts)
    first_commit, first_part = parts[0]
    started = first_commit - max(first_part["time_taken_llm"].to_pylist())
    first, last = first_commit - started, parts[-1][0] - started
    print(f"{len(parts)} parts; the first committed {first:.1f} s into {last:.1f} s of generation")
    assert first <= 0.2 * last, (first, last)


def test_parts_are_bounded_by_generated_tokens_as_well_as_rows(tiny_dirs):
    """A part's time grows with its rows' max_tokens: long outputs get fewer rows a part, down to half a batch."""
    from pipeline.job import PART_TOKENS, rows_per_part

    def size(batch_size: int, max_tokens: int) -> int:
        return rows_per_part(Config.model_validate({"model": tiny_dirs["target"], "batch_size": batch_size,
                                                    "sampling": {"max_tokens": max_tokens}}))

    assert size(16, 256) == 64 == 4 * 16  # the defaults: four batches, 16,384 tokens
    assert size(64, 16) == 256  # short outputs: four batches
    assert size(64, 256) == PART_TOKENS // 256 == 64
    assert size(64, 1024) == 32  # half a batch at least, so the engine stays full
    assert all(size(b, t) * t <= PART_TOKENS or size(b, t) == b // 2 for b in (8, 32, 64) for t in (64, 512, 4096))


def test_parts_hold_one_files_rows_with_its_types(ray_cluster, tiny_dirs, tmp_path):
    """Ten files of 20 rows whose `extra` column is int in some and text in others: each part holds one file's
    rows and keeps that file's type (a file spans several parts, the last one partly full). Before, a read task's
    files were joined into one block (a part held three files' rows) and, with clashing types, the job failed."""
    from pipeline.job import rows_per_part

    config = Config.model_validate({"model": tiny_dirs["target"], "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 2}, "batch_size": 16})
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(10):
        write_jsonl(folder / f"f{k}.jsonl", [{"prompt": WORDS[i % 6], "extra": i if k % 2 else f"s{i}"}
                                             for i in range(20)])
    out = tmp_path / "out"
    assert run(config, str(folder), str(out))["rows"] == 200
    parts = _parts(out)
    size = rows_per_part(config, sum(path.stat().st_size for path in folder.iterdir()))
    for _, part in parts:
        [name] = {row_id.split(":")[0] for row_id in part["id"].to_pylist()}
        assert part.num_rows <= size
        assert part.schema.field("extra").type == (pa.int64() if int(name[1]) % 2 else pa.string())
    assert 20 % size and len(parts) == 10 * -(-20 // size)
    ids = OutputStore(str(out)).read_outputs(["id"])["id"].to_pylist()
    assert sorted(ids) == sorted(f"f{k}.jsonl:{i}" for k in range(10) for i in range(20))


def test_a_job_of_many_small_files_starts_a_few_worker_processes(ray_cluster, tiny_dirs, tmp_path):
    """Reads and writes ask for no CPU, so nothing but their bound (``light_tasks``) limits how many run at once:
    unbounded, Ray started a worker process for nearly every file of a job of many small files."""
    import threading

    import psutil

    from pipeline.processor import light_tasks

    config = Config.model_validate({"model": tiny_dirs["target"], "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 2}, "batch_size": 4})
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(60):
        write_jsonl(folder / f"f{k:02d}.jsonl", [{"prompt": WORDS[(k + i) % 6]} for i in range(2)])
    started, done, seen = time.time(), threading.Event(), {}

    def watch() -> None:  # Ray's worker processes (``ray::...``) started during the run
        while not done.is_set():
            for process in psutil.process_iter(["pid", "name", "create_time"]):
                if (process.info["name"] or "").startswith("ray::") and process.info["create_time"] >= started:
                    seen.setdefault(process.info["pid"], set()).add(process.info["name"])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert run(config, str(folder), str(tmp_path / "out"), verbose=False)["rows"] == 120
    finally:
        done.set()
        watcher.join()
    # The actor, Ray Data's stats actor, light_tasks each of read, repartition and write tasks, and three to spare
    # for the idle workers Ray stops and starts again (unbounded: 64 processes for these 60 files).
    assert 1 <= len(seen) <= 2 + 3 * light_tasks(config) + 3, seen


def test_an_output_path_that_cannot_be_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    from jobs.generate import main

    source = write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    existing = tmp_path / "a-file"
    existing.write_text("not a directory")
    for output in (existing, existing / "below", Path("/sys/specbatch-out")):  # /sys: not writable
        with pytest.raises(SystemExit) as exit_:
            main(["--input", str(source), "--output", str(output)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"output {output}: cannot write there" in err, err


def assert_each_id_once(out: Path, ids: list[str]) -> None:
    outputs = pq.read_table(out / "outputs")
    assert sorted(outputs["id"].to_pylist()) == sorted(ids)
    stats = Counter(pq.read_table(out / "token_stats", columns=["id"])["id"].to_pylist())
    for row in outputs.to_pylist():  # no token statistics are lost or written twice either
        assert stats[row["id"]] == row["spec_decode"]["num_draft_tokens"], row["id"]


GPU_DRIVER = """
import json, sys
import ray
from decoding.config import Config, StructuredOutputs
from pipeline.job import run
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)  # one GPU as far as Ray knows
print(json.dumps(run(Config.model_validate_json(sys.argv[1]), sys.argv[2], sys.argv[3])))
"""


def test_gpu_actors_take_the_jobs_blocks_whole(config, tmp_path):
    """Actors that ask for a GPU (`num_gpus: 1`): Ray Data's public `map_batches` refuses them the whole blocks
    the job hands over (blocks of two files must not be joined: their columns may differ in type), and the job
    failed before any row ran. Ray is told of one GPU that this machine lacks; the engine runs on what torch has."""
    source = tmp_path / "in"
    source.mkdir()
    first, second = good_rows(10)[:5], good_rows(10)[5:]
    write_jsonl(source / "a.jsonl", [{**row, "extra": i} for i, row in enumerate(first)])
    write_jsonl(source / "b.jsonl", [{**row, "extra": f"x{i}"} for i, row in enumerate(second)])
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, with a GPU
    setup = config.model_copy(update={"num_gpus": 1.0})
    done = subprocess.run(
        [sys.executable, "-c", GPU_DRIVER, setup.model_dump_json(), str(source), str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 10 and summary["errors"] == 0
    parts = [pq.read_table(part) for part in (tmp_path / "out" / "outputs").iterdir()]  # each its file's types
    assert sorted(row["id"] for part in parts for row in part.to_pylist()) == [row["id"] for row in good_rows(10)]
    assert {str(part.schema.field("extra").type) for part in parts} == {"int64", "string"}


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def long_config(config: Config) -> Config:
    """Many small parts, slow enough to be interrupted midway."""
    sampling = config.sampling.model_copy(update={"max_tokens": 40})
    return config.model_copy(update={"batch_size": 2, "sampling": sampling})


def test_killed_driver_then_resume_yields_every_id_once(ray_cluster, config, tmp_path):
    # 20 rows of two-row parts: the driver is killed within a part or two of ~10 (polled every 0.2 s; a part
    # takes ~40 steps), so it dies midway with room to spare, and the resume has the rest to do.
    rows = good_rows(20)
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    slow = long_config(config)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(slow.model_dump(mode="json")))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / "config.yaml"),
             "--input", str(source), "--output", str(out)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            # A complete marker, not just its file: a marker being written reads back empty and counts nothing.
            wait_for(lambda: (any((out / "_commits").glob("*.json")) and bool(OutputStore(str(out)).markers()))
                     or driver.poll() is not None, 600, "a committed part")  # a bound against a hang only
        finally:
            driver.send_signal(signal.SIGKILL)
            driver.wait()
    done = sum(len(marker["ids"]) for marker in OutputStore(str(out)).markers())
    assert 0 < done < len(rows), f"the driver was not killed midway ({done} rows done); see {tmp_path}/driver.log"
    summary = run(slow, str(source), str(out))
    assert summary["rows_this_run"] == len(rows) - done
    assert_each_id_once(out, [row["id"] for row in rows])


def test_killed_actor_is_restarted_and_its_batches_retried(ray_cluster, config, tmp_path):
    from ray._private import state  # the actor table without the dashboard the test cluster lacks

    def generation_actors() -> dict[str, dict]:
        actors = state.actors(job_id=ray_cluster.get_runtime_context().job_id, actor_state_name="ALIVE")
        return {key: a for key, a in actors.items() if "GenerationActor" in a["ActorClassName"]}

    rows = good_rows(24)
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    earlier = generation_actors()  # an earlier test's pool may still be shutting down (seen on a loaded machine)
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(run, long_config(config), str(source), str(out))
        try:
            # Bounds against a hang only, generous for a loaded machine (beside a busy loop 120 s was too short).
            wait_for(lambda: any((out / "outputs").glob("*.parquet")) or job.done(), 600, "a part")
            [actor] = [a for key, a in generation_actors().items() if key not in earlier]
            assert not job.done(), "the job finished before its actor could be killed"
            os.kill(actor["Pid"], signal.SIGKILL)
        finally:
            job.result(timeout=900)
    assert state.actors(actor_id=actor["ActorID"])["NumRestarts"] == 1
    assert_each_id_once(out, [row["id"] for row in rows])


def test_engine_failure_fails_only_the_request_that_causes_it(config, monkeypatch):
    original = Engine.step

    def step(self):
        if any("boom" in seq.prompt for seq in self.running):
            raise RuntimeError("kaboom")
        return original(self)

    monkeypatch.setattr(Engine, "step", step)
    actor = GenerationActor(config.model_dump(mode="json"))
    batch = pa.table({"id": ["a", "b", "c"], "prompt": ["the cat", "boom boom", "dogs run"]})
    rows = by_id(actor(batch))
    assert rows["b"]["finish_reason"] == "error" and "kaboom" in rows["b"]["error"]
    monkeypatch.setattr(Engine, "step", original)
    expected = Engine(config).generate([Request("a", prompt="the cat"), Request("c", prompt="dogs run")])
    assert [rows["a"]["generated_tokens"], rows["c"]["generated_tokens"]] == [r.token_ids for r in expected]


def test_rows_sharing_a_prefix_run_together_and_keep_their_order(config):
    """The actor submits a batch's rows in prompt order, so rows sharing a prefix find it cached even when a batch
    of rows ahead of them would have evicted it; the output rows keep the batch's order and content."""
    shared = "the quick brown fox jumps over the lazy dog and "  # 3 full blocks of the tiny tokenizer
    prompts = [shared + "runs" if i % 2 else f"{'abcdefgh'[i]} " * 12 + "dogs" for i in range(8)]
    ids = [f"r{i}" for i in range(8)]
    small = config.model_copy(update={"batch_size": 1, "num_kv_blocks": 8})
    block = GenerationActor(small.model_dump(mode="json"))(pa.table({"id": ids, "prompt": prompts}))
    assert block["id"].to_pylist() == ids
    expected = Engine(small.model_copy(update={"enable_prefix_caching": False})).generate(
        [Request(i, prompt=p) for i, p in zip(ids, prompts)])
    assert block["generated_tokens"].to_pylist() == [r.token_ids for r in expected]
    cached = block["num_cached_tokens"].to_pylist()
    assert sum(cached[1::2]) == 3 * 16 * 3  # rows 3, 5 and 7 found the prefix the first one cached


def test_inputs_parquet_csv_jsonl_dirs_globs_and_derived_ids(ray_cluster, tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(pa.table({
        "prompt": ["a b", "c d"],
        "sampling_params": [{"temperature": 0.5, "max_tokens": None}, {"temperature": None, "max_tokens": 3}],
    }), folder / "sub" / "p.parquet")
    pa_csv.write_csv(pa.table({"id": ["007", ""], "prompt": ["42", "x"]}), folder / "c.csv")
    write_jsonl(folder / "j.jsonl", [{"prompt": "hi", "k": 1}, {"id": 5, "prompt": "yo", "k": "one"}])
    (folder / "notes.txt").write_text("ignored in a directory")

    fs, files, base = list_input_files(str(folder))
    rows = {row["id"]: row for row in read_prompts(files, base, skip=frozenset(), rows_per_block=1).take_all()}
    assert set(rows) == {"sub/p.parquet:0", "sub/p.parquet:1", "007", "c.csv:1", "j.jsonl:0", "5"}
    assert rows["007"]["prompt"] == "42"  # CSV text stays text
    assert rows["sub/p.parquet:1"]["sampling_params"] == {"temperature": None, "max_tokens": 3}
    assert rows["5"]["k"] == "one" and rows["j.jsonl:0"]["k"] == "1"  # a mixed-type column becomes JSON text

    fs, files, base = list_input_files(str(folder / "*.csv"))
    again = read_prompts(files, base, skip=frozenset({"007"}), rows_per_block=4).take_all()
    assert [row["id"] for row in again] == ["c.csv:1"]


def test_undecodable_json_records_become_row_errors():
    table = read_json_records(b'{"prompt": "ok"}\nnot json\n[1]\n{"prompt": 7}\n\n{"prompt": "\xff"}\n')
    assert table.num_rows == 5
    assert table["prompt"].to_pylist() == ["ok", None, None, None, None]
    errors = table[READ_ERROR].to_pylist()
    assert errors[0] is None and "record 2" in errors[1] and "got list" in errors[2]
    assert errors[3] == "prompt must be a string, got int"
    assert "record 5" in errors[4] and "utf-8" in errors[4]
    array = read_json_records(b'[{"prompt": "a"}, {"prompt": "b"}]')
    assert array["prompt"].to_pylist() == ["a", "b"] and array[READ_ERROR].null_count == 2


def test_generate_cli_names_the_bad_field_and_value(capsys):
    from jobs.generate import main

    with pytest.raises(SystemExit) as exit_:
        main(["--speculative.num_candidates", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "speculative.num_candidates" in err and "0" in err
    with pytest.raises(SystemExit):
        main(["--batch_size", "4", "--input", "/nonexistent/prompts.jsonl"])
    assert "/nonexistent/prompts.jsonl does not exist" in capsys.readouterr().err


def unused_ports(count: int) -> list[int]:
    """Distinct ports below the kernel's ephemeral range (32768-60999 here): a port from `bind(0)` is closed again
    before Ray binds it, and the session's cluster binds ephemeral ports all the time. A taken port makes `ray start`
    exit ("Failed to bind ... already occupied"); one CI run's head was gone before its dashboard ever answered (its
    output was not kept then; it is now, in the failure message)."""
    ports: list[int] = []
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError("no free ports in 20000-32000")


# Words of a line of `ray start` output that says why the head stopped.
REASON_WORDS = ("error", "exited", "traceback", "failed", "timed out")


def start_head(temp_dir: str, log: Path) -> tuple[subprocess.Popen, int]:
    """`ray start --head --block` on unused ports, returned once the node is up and its job server answers. A head
    that exits before it serves (a port taken meanwhile, a raylet that did not register within Ray's fixed 30 s on a
    loaded machine) is started again, twice at most; then the test fails with the head's output."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    for _attempt in range(3):
        gcs, dashboard, *others = unused_ports(7)
        # Every port named: the defaults (agent 52365, client 10001, ...) belong to the session's cluster.
        names = ("dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export",
                 "ray-client-server")
        with log.open("w") as out:
            head = subprocess.Popen(
                [ray_bin, "start", "--head", "--block", f"--port={gcs}", f"--temp-dir={temp_dir}", "--num-cpus=2",
                 "--include-dashboard=true", f"--dashboard-port={dashboard}", "--disable-usage-stats",
                 *(f"--{name}-port={port}" for name, port in zip(names, others, strict=True))],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                # A job's `python` is the head's, found on its PATH: this interpreter's, as with its virtualenv active.
                env={**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])},
            )
        # A minute past Ray's wait for the dashboard (tests/conftest.py sets it), after which the head exits.
        deadline = time.monotonic() + int(os.environ.get("RAY_DASHBOARD_STARTUP_TIMEOUT_S", 60)) + 60
        while head.poll() is None and time.monotonic() < deadline:
            if "Ray runtime started" not in log.read_text():  # printed once the node has registered
                time.sleep(1)
                continue
            try:  # an HTTP answer (401 without the token) from the live head, not a bare socket
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2).close()
                return head, dashboard
            except urllib.error.HTTPError:
                return head, dashboard
            except OSError:
                time.sleep(1)
        stop_head(head)
    text = log.read_text()  # the reason may lie before the dashboard's last lines: its error lines, then the end
    reasons = [line for line in text.splitlines() if any(word in line.lower() for word in REASON_WORDS)]
    pytest.fail(f"`ray start --head` did not serve its dashboard (exit {head.returncode}); its error lines:\n"
                + "\n".join(reasons[-20:]) + f"\nthe end of its output:\n{text[-1500:]}")


def stop_head(head: subprocess.Popen) -> None:
    """The head's whole session at once (its daemons, a job's driver and workers): `ray start --block`'s own graceful
    stop on SIGTERM takes ~30 s, and nothing of a test's throwaway cluster needs to outlive it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait(timeout=30)


def test_ray_job_submit_on_a_started_head(config, tmp_path):
    """docs/generate.md's recipe: `ray start --head`, then
    `ray job submit --working-dir . -- python -m jobs.generate --config ...`."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="sbjob", dir="/tmp")  # short: Ray's socket paths live under it
    head, dashboard = start_head(temp_dir, tmp_path / "head.log")
    try:
        source = write_jsonl(tmp_path / "in.jsonl", good_rows(5))
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
        submit = [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--working-dir", ".",
                  "--", "python", "-m", "jobs.generate", "--config", str(tmp_path / "config.yaml"),
                  "--input", str(source), "--output", str(tmp_path / "out")]
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the job CLI sends the head's token only when told to
        deadline = time.monotonic() + 120
        while True:  # the job agent answers some seconds after the dashboard
            job = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            not_ready = any(m in job.stdout + job.stderr for m in ("onnect", "No available agent"))
            if job.returncode == 0 or not not_ready or head.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(2)
        head_log = (tmp_path / "head.log").read_text()[-2000:] if head.poll() is not None else ""
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:] + head_log
        assert "specbatch generate: 5 rows (0 errors" in job.stdout
        assert_each_id_once(tmp_path / "out", [row["id"] for row in good_rows(5)])
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)  # the head's sessions and logs, 5 MB a run


def test_cli_output_is_a_few_lines_and_separates_build_from_generation(tiny_dirs, config, tmp_path):
    """``specbatch generate`` as a user runs it: its own cluster, no terminal (plain progress lines), Ray's and
    transformers' logs quiet, and a summary whose generation throughput leaves the engines' build out."""
    source = write_jsonl(tmp_path / "in.jsonl", good_rows(8))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "RAY_ADDRESS": "local"}  # the output of its own start, never another test's cluster
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"  # nothing may be downloaded at run time
    done = subprocess.run(
        [sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / "config.yaml"), "--input", str(source),
         "--output", str(tmp_path / "out"), "--num_cpus", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = output.strip().splitlines()
    assert len(lines) <= 30, output
    assert not [line for line in lines if "Execution plan" in line or "Running Dataset" in line], output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows"] == 8 and summary["build_seconds"] > 0
    assert summary["generation_seconds"] == pytest.approx(summary["wall_seconds"] - summary["build_seconds"])
    assert summary["generation_tokens_per_second"] > summary["tokens_per_second"]
    generation = next(line for line in lines if line.strip().startswith("generation:"))
    assert f"{summary['generation_tokens_per_second']:.1f} tokens/s" in generation
    assert f"{summary['num_spec_steps']} of {summary['num_target_forwards']} target forwards" in generation
    # Ray's news that only --verbose shows: token authentication turned on, progress bars turned off.
    assert "Token authentication" not in output and "Progress bars disabled" not in output, output
    # Nor Ray's error that Ray Data's own map actors have constructor arguments in the object store (harmless).
    assert "constructor arguments in the object store" not in output and "core_worker" not in output, output
    assert any(line.strip().startswith("engine build") for line in lines)


def test_a_full_disk_is_one_line_naming_the_output_and_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ray Data re-raises a write task's ENOSPC wrapped in its own errors (seen on a 400 KB tmpfs: a 267-line
    traceback); the job says it in one line, exit status 1, and the parts written stay for the resume."""
    import errno

    import jobs.generate
    import pipeline.job

    def full_disk(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("Write task failed") from exc

    monkeypatch.setattr(pipeline.job, "run", full_disk)
    with pytest.raises(SystemExit) as exited:
        jobs.generate.main(["--output", str(tmp_path / "out")])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"specbatch generate: error: output {tmp_path / 'out'}: no space left on the device")
    assert "run the same command to resume" in err[-1]
    monkeypatch.setattr(pipeline.job, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other failure keeps its traceback
        jobs.generate.main(["--output", str(tmp_path / "out")])
