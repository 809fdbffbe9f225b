"""``specbatch.build_processor`` (docs/reference.md): user rows in, user columns plus the output columns out,
no id needed, no internal columns, token statistics opt-in; Ray Data LLM's row semantics (preprocess merged into
the row, error rows bypassing postprocess, should_continue_on_error) and its config (``ProcessorConfig``, its
documented example ported by changing the import and the class); and the examples of docs/generate.md and the
README, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

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
    expected = [name for name in OUTPUT_SCHEMA.names if name != "id"] + ["question", "topic", "n"]
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



@pytest.mark.real_model
def test_readme_example_runs_as_written(ray_cluster, tmp_path):
    """The README's Python example, unchanged: the default configuration on the embedded model."""
    readme = (REPO / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'text': 'The capital of France is'" in done.stdout
    assert "'finish_reason': 'error'" not in done.stdout and "'generated_text':" in done.stdout

# Ray Data LLM's documented example (python/ray/data/llm.py, vLLMEngineProcessorConfig), with the import and the
# config class changed and the model one this machine has.
RAY_DATA_LLM_EXAMPLE = """
import ray
from specbatch import ProcessorConfig, build_processor

config = ProcessorConfig(
    model_source=MODEL,
    engine_kwargs=dict(
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=4096,
    ),
    concurrency=1,
    batch_size=64,
)
processor = build_processor(
    config,
    preprocess=lambda row: dict(
        messages=[
            {"role": "system", "content": "You are a calculator"},
            {"role": "user", "content": f"{row['id']} ** 3 = ?"},
        ],
        sampling_params=dict(
            temperature=0.3,
            max_tokens=20,
            detokenize=False,
        ),
    ),
    postprocess=lambda row: dict(
        resp=row["generated_text"],
    ),
)
ds = ray.data.range(ROWS)
ds = processor(ds)
rows = ds.take_all()
"""


def test_ray_data_llm_example_ported_by_changing_the_import_and_class(ray_cluster, tiny_dirs):
    scope = {"MODEL": tiny_dirs["target"], "ROWS": 40}
    exec(RAY_DATA_LLM_EXAMPLE, scope)
    rows = scope["rows"]
    assert len(rows) == 40
    assert all(set(row) == {"resp"} for row in rows)  # Ray Data LLM's: postprocess's columns, nothing else
    # detokenize=False in sampling_params; the processor's detokenize (default true) decodes the tokens, as Ray
    # Data LLM's detokenize stage does.
    assert sum(bool(row["resp"]) for row in rows) > 30


def test_preprocess_is_merged_into_the_row_so_user_columns_reach_postprocess(ray_cluster, config):
    seen = specbatch.build_processor(
        specbatch.ProcessorConfig(model_source=config.model, engine_kwargs={
            "speculative_config": config.speculative.model_dump(), "max_num_seqs": 2}, batch_size=3),
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"] or "x"}]},
        postprocess=lambda row: {"k": row["k"], "question": row["question"], "answer": row["generated_text"],
                                 "rendered_from_messages": bool(row["messages"])},
    )(ray.data.from_items([{**q, "k": q["n"] * 10} for q in QUESTIONS])).take_all()
    assert sorted(row["k"] for row in seen) == [10, 20, 30, 40]
    assert {row["question"] for row in seen} == {q["question"] for q in QUESTIONS}
    assert all(row["rendered_from_messages"] and isinstance(row["answer"], str) for row in seen)


def test_error_rows_bypass_postprocess_and_keep_finish_reason_and_error(ray_cluster, config):
    def postprocess(row):  # nested: pickled with the processor (a module-level function is not, by Ray)
        if row["finish_reason"] == "error":
            raise AssertionError(f"postprocess called on an error row: {row}")
        return {"n": row["n"], "ok": True}

    rows = specbatch.build_processor(config, preprocess=lambda row: {"prompt": row["question"]},
                                     postprocess=postprocess)(ray.data.from_items(QUESTIONS)).take_all()
    by_n = {row["n"]: row for row in rows}
    assert all(by_n[n] == {"n": n, "ok": True} for n in (1, 2, 4))
    error = by_n[3]
    assert error["finish_reason"] == "error" and error["error"] == "empty prompt"
    assert error["topic"] == "empty" and error["question"] == "" and "ok" not in error


def _shape(value: object) -> object:
    """A value's type, with a list's length and element types and a dict's keys."""
    if isinstance(value, list):
        return "list", len(value), sorted({type(item).__name__ for item in value})
    if isinstance(value, dict):
        return "dict", sorted(value)
    return type(value).__name__


def test_an_error_row_has_one_shape_whichever_path_made_it(config):
    """A row the actor refuses before the engine sees it and a request the engine refuses make error results with
    the same fields of the same types: the engine's histogram length (max_depth + 1), the time measured, so the
    same statistics whichever path a row's error took."""
    from dataclasses import asdict

    from pipeline.actor import GenerationActor, RowOptions

    actor = GenerationActor(config.model_dump(mode="json"), options=RowOptions(metrics=False))
    try:
        refused = actor._submit({"prompt": "the cat", "sampling_params": {"top_k": -5}}).result(timeout=120)
        empty = actor._submit({"prompt": ""}).result(timeout=120)  # Engine.prepare's error result
        max_depth = actor.runner.engine.topology.max_depth
    finally:
        actor.runner.close()
    assert refused.error.startswith("invalid sampling_params") and empty.error == "empty prompt"
    assert {k: _shape(v) for k, v in asdict(refused).items()} == {k: _shape(v) for k, v in asdict(empty).items()}
    assert len(refused.acceptance_histogram) == max_depth + 1 > 1
    assert refused.spec_decode == empty.spec_decode and refused.time_taken > 0 and empty.time_taken > 0


def test_should_continue_on_error_has_ray_data_llms_meaning(ray_cluster, config):
    def processor(**fields):
        return specbatch.build_processor(
            specbatch.ProcessorConfig(model_source=config.model, engine_kwargs={
                "speculative_config": config.speculative.model_dump(), "max_num_seqs": 2}, **fields),
            preprocess=lambda row: {"prompt": row["question"]}, postprocess=lambda row: {"n": row["n"]},
        )

    with pytest.raises(Exception, match="empty prompt"):  # default false: a failed row fails the dataset
        processor()(ray.data.from_items(QUESTIONS)).take_all()
    rows = {row["n"]: row for row in processor(should_continue_on_error=True)(ray.data.from_items(QUESTIONS))
            .take_all()}
    # Rows of one block share its columns: Ray Data fills those a row lacks with nulls.
    assert all({k: v for k, v in rows[n].items() if v is not None} == {"n": n, "__inference_error__": ""}
               for n in (1, 2, 4))
    assert rows[3]["__inference_error__"] == "empty prompt" and rows[3]["finish_reason"] == "error"


def test_processor_config_takes_ray_data_llms_fields_and_vllms_engine_kwargs(tiny_dirs):
    from pipeline.processor import StageOptions

    config = specbatch.ProcessorConfig(
        model_source=tiny_dirs["target"], batch_size=48, concurrency=3, accelerator_type="H100",
        max_concurrent_batches=6, runtime_env={"env_vars": {"A": "1"}}, chat_template="{{ messages }}",
        engine_kwargs={"max_num_seqs": 24, "dtype": "half", "seed": 7, "enable_prefix_caching": True,
                       "speculative_config": {"model": tiny_dirs["draft"], "num_speculative_tokens": 3}},
    )
    engine = config.engine_config()
    assert (engine.model, engine.batch_size, engine.dtype, engine.sampling.seed) == (
        tiny_dirs["target"], 24, "float16", 7)
    assert (engine.speculative.method, engine.speculative.model, engine.speculative.num_speculative_tokens) == (
        "draft_model", tiny_dirs["draft"], 3)
    assert engine.concurrency_range == (1, 3) and engine.num_gpus == 1 and engine.chat_template == "{{ messages }}"
    options = StageOptions.of(config)
    assert (options.rows_per_batch, options.calls_per_actor, options.accelerator_type) == (48, 6, "H100")
    assert not options.rows.continue_on_error and options.rows.detokenize
    assert specbatch.ProcessorConfig(model_source="m", concurrency=(2, 4)).engine_config().concurrency_range == (2, 4)
    assert engine.enable_prefix_caching and not specbatch.ProcessorConfig(
        model_source="m", engine_kwargs={"enable_prefix_caching": False}).engine_config().enable_prefix_caching
    assert specbatch.ProcessorConfig(model_source="m").engine_config().num_gpus == 0  # no accelerator_type: CPU
    ngram = specbatch.ProcessorConfig(model_source="m", engine_kwargs={"speculative_config": {
        "num_speculative_tokens": 4, "prompt_lookup_max": 3}}).engine_config().speculative
    assert (ngram.method, ngram.prompt_lookup_max) == ("ngram", 3)
    stages = specbatch.ProcessorConfig(model_source="m", chat_template_stage={"chat_template_kwargs": {"x": 1}},
                                       detokenize_stage=False)
    assert stages.engine_config().chat_template_kwargs == {"x": 1} and not stages.detokenize
    paged = specbatch.ProcessorConfig(model_source="m", engine_kwargs={
        "max_model_len": 64, "block_size": 32, "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 512}
    ).engine_config()  # the paged KV cache's vLLM names
    assert (paged.max_model_len, paged.block_size, paged.gpu_memory_utilization, paged.max_num_batched_tokens) == (
        64, 32, 0.5, 512)
    for engine_kwargs, named in (({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"), ({"tensor_parallel_size": 2},
                                 "tensor_parallel_size"), ({"batch_size": 4}, "max_num_seqs"),
                                 ({"speculative_config": {"method": "eagle"}}, "speculative.method")):
        with pytest.raises(ValueError, match=named):
            specbatch.ProcessorConfig(model_source="m", engine_kwargs=engine_kwargs)
    with pytest.raises(ValueError, match="max_pending"):
        specbatch.ProcessorConfig(model_source="m", max_pending=3)


def test_processor_maps_with_the_configs_batches_pool_and_resources(tiny_dirs, monkeypatch):
    import pipeline.processor

    # The mapping is recorded, never run: the check that the cluster can hold the actors (a GPU each, which a
    # session's CPU cluster cannot) is not what this test is about.
    monkeypatch.setattr(pipeline.processor, "check_cluster", lambda config, what: None)
    calls: dict[str, dict] = {}

    class Recorder:
        def map(self, fn, **kwargs):
            calls.setdefault("map", kwargs)
            return self

        def map_batches_internal(self, fn, **kwargs):
            calls["map_batches"] = kwargs
            return self

    specbatch.build_processor(
        specbatch.ProcessorConfig(model_source=tiny_dirs["target"], batch_size=48, concurrency=(2, 3),
                                  accelerator_type="A100", max_concurrent_batches=6,
                                  runtime_env={"env_vars": {"A": "1"}, "pip": ["x"]}),
        preprocess=lambda row: {"prompt": "x"}, preprocess_map_kwargs={"num_cpus": 0.5},
    )(Recorder())
    kwargs = calls["map_batches"]
    assert kwargs["batch_size"] == 48 and kwargs["num_gpus"] == 1 and kwargs["accelerator_type"] == "A100"
    assert (kwargs["compute"].min_size, kwargs["compute"].max_size) == (2, 3)
    assert kwargs["compute"].max_concurrent_calls_per_actor == 6
    assert kwargs["runtime_env"] == {"pip": ["x"], "env_vars": {"RAY_worker_niceness": "0", "A": "1"}}
    assert calls["map"] == {"num_cpus": 0.5}


def test_pipeline_actors_export_vllms_metrics_through_ray(ray_cluster, config):
    from conftest import scrape_ray_metrics

    name = f"metrics-{uuid.uuid4().hex[:8]}"  # this run's series alone
    rows = specbatch.build_processor(config.model_copy(update={"served_model_name": name}),
                                     preprocess=lambda row: {"prompt": row["question"] or "x"},
                                     )(ray.data.from_items(QUESTIONS)).take_all()
    expected = {
        "ray_vllm_prompt_tokens_total": sum(row["num_input_tokens"] for row in rows),
        "ray_vllm_generation_tokens_total": sum(row["num_generated_tokens"] for row in rows),
        "ray_vllm_spec_decode_num_drafts_total": sum(row["spec_decode"]["num_spec_steps"] for row in rows),
        "ray_vllm_spec_decode_num_draft_tokens_total": sum(row["spec_decode"]["num_draft_tokens"] for row in rows),
        "ray_vllm_spec_decode_num_accepted_tokens_total": sum(
            row["spec_decode"]["num_accepted_draft_tokens"] for row in rows),
        "ray_vllm_time_to_first_token_seconds_count": len(rows),
        "ray_vllm_e2e_request_latency_seconds_count": len(rows),
    }
    assert expected["ray_vllm_spec_decode_num_drafts_total"] > 0
    scraped: dict = {}
    for _ in range(60):  # the actors report every second; they may have exited since
        scraped = {key: value for (key, _), value in scrape_ray_metrics(ray_cluster, model_name=name).items()}
        if all(scraped.get(key) == value for key, value in expected.items()):
            break
        time.sleep(1)
    assert {key: scraped.get(key) for key in expected} == expected
