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


@pytest.fixture(scope="module")
def plain_run(ray_cluster, config) -> tuple[str, list[dict]]:
    """One job over QUESTIONS with the module's config and no postprocess, under a served model name of its own
    (its metrics series alone): the name, and the rows sorted by ``n``. Starting an engine actor is most of a job's
    cost, so the tests of the plain output rows and of their metrics read the same run."""
    name = f"metrics-{uuid.uuid4().hex[:8]}"
    processor = specbatch.build_processor(
        config.model_copy(update={"served_model_name": name}),
        preprocess=lambda row: {"prompt": row["question"], "topic": row["topic"], "n": row["n"]})
    return name, sorted(processor(ray.data.from_items(QUESTIONS)).take_all(), key=lambda row: row["n"])


def test_user_columns_plus_output_columns_no_id_no_internals(plain_run, config):
    _, rows = plain_run
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


@pytest.fixture(scope="module")
def processor_config_run(ray_cluster, config) -> list[dict]:
    """One job through a ``ProcessorConfig`` (the module's speculative config, no sampling fields in rows or
    engine_kwargs but ignore_eos) over QUESTIONS three times, each row with a user column ``k`` that preprocess
    does not return and chat messages that preprocess makes: what postprocess saw. Starting an engine actor is most
    of a job's cost, so the tests of the row merge and of vLLM's sampling defaults read the same run."""
    return specbatch.build_processor(
        specbatch.ProcessorConfig(model_source=config.model, engine_kwargs={
            "speculative_config": config.speculative.model_dump(), "max_num_seqs": 2,
            "sampling": {"ignore_eos": True}}, batch_size=3),
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"] or "x"}],
                                "sampling_params": {}},
        postprocess=lambda row: {"k": row["k"], "question": row["question"], "answer": row["generated_text"],
                                 "rendered_from_messages": bool(row["messages"]), "prompt": row["prompt"],
                                 "generated_tokens": row["generated_tokens"],
                                 "num_generated_tokens": row["num_generated_tokens"]},
    )(ray.data.from_items([{**q, "k": q["n"] * 10 + copy} for copy in range(3) for q in QUESTIONS])).take_all()


def test_preprocess_is_merged_into_the_row_so_user_columns_reach_postprocess(processor_config_run):
    seen = processor_config_run
    assert sorted(row["k"] for row in seen) == [10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42]
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
        refused = actor._submit({"prompt": "the cat", "sampling_params": {"top_k": -5}})[0].result(timeout=120)
        empty = actor._submit({"prompt": ""})[0].result(timeout=120)  # Engine.prepare's error result
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
    # concurrency=3: a fixed pool of three engine actors.
    assert engine.concurrency_range == (3, 3) and engine.num_gpus == 1 and engine.chat_template == "{{ messages }}"
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
    for engine_kwargs, named in (({"batch_size": 4}, "max_num_seqs"),
                                 ({"speculative_config": {"method": "eagle"}}, "speculative.method"),
                                 ({"tokenizer": "x", "swap_space": 4}, r"\['tokenizer'\]: not an engine argument")):
        with pytest.raises(ValueError, match=named):
            specbatch.ProcessorConfig(model_source="m", engine_kwargs=engine_kwargs)
    with pytest.raises(ValueError, match="max_pending"):
        specbatch.ProcessorConfig(model_source="m", max_pending=3)


def test_processor_config_has_every_field_of_ray_data_llms_config_and_stage_configs():
    """Every field of the installed Ray Data LLM's vLLMEngineProcessorConfig and stage configs is a field here, and
    its stage config objects are taken as they are."""
    import ray.data.llm as ray_llm

    assert set(ray_llm.vLLMEngineProcessorConfig.model_fields) <= set(specbatch.ProcessorConfig.model_fields)
    for name in ("ChatTemplateStageConfig", "TokenizerStageConfig", "DetokenizeStageConfig",
                 "PrepareMultimodalStageConfig"):
        assert set(getattr(ray_llm, name).model_fields) <= set(getattr(specbatch, name).model_fields), name
    assert specbatch.vLLMEngineProcessorConfig is specbatch.ProcessorConfig
    assert specbatch.build_llm_processor is specbatch.build_processor
    theirs = specbatch.ProcessorConfig(model_source="m", chat_template_stage=ray_llm.ChatTemplateStageConfig(
        chat_template_kwargs={"enable_thinking": False}, batch_size=8), detokenize_stage=ray_llm.DetokenizeStageConfig(
        enabled=False))
    assert theirs.chat_template_kwargs == {"enable_thinking": False} and theirs.apply_chat_template
    assert not theirs.detokenize and theirs.engine_config().chat_template_kwargs == {"enable_thinking": False}


def test_stage_configs_and_the_older_flags_mean_what_they_mean_in_ray_data_llm():
    per_stage = specbatch.ProcessorConfig(  # Ray Data LLM's documented per-stage configuration
        model_source="m",
        chat_template_stage={"enabled": True, "batch_size": 256, "concurrency": 4},
        tokenize_stage={"enabled": True, "batch_size": 512, "num_cpus": 0.5},
        detokenize_stage={"enabled": True, "concurrency": (2, 8)},
    )
    assert per_stage.apply_chat_template and per_stage.detokenize and per_stage.tokenize_stage.num_cpus == 0.5
    off = specbatch.ProcessorConfig(model_source="m", chat_template_stage=False, detokenize_stage={"enabled": False},
                                    tokenize_stage=specbatch.TokenizerStageConfig(enabled=False))
    assert not off.apply_chat_template and not off.detokenize and not off.tokenize_stage.enabled
    older = specbatch.ProcessorConfig(model_source="m", apply_chat_template=False, detokenize=False, tokenize=False,
                                      chat_template="{{ x }}")
    assert (older.chat_template_stage.enabled, older.detokenize_stage.enabled, older.tokenize_stage.enabled) == (
        False, False, False)
    assert older.chat_template_stage.chat_template == "{{ x }}" == older.engine_config().chat_template
    template = specbatch.ProcessorConfig(model_source="m", chat_template_stage={"chat_template": "{{ y }}"})
    assert template.engine_config().chat_template == "{{ y }}"
    for stage, match in (({"bogus": 1}, "chat_template_stage.bogus"), ({"model_source": "other"}, "model_source"),
                         ({"concurrency": (3, 1)}, "concurrency"), ("yes", "expected a bool, a dict")):
        with pytest.raises(ValueError, match=match):
            specbatch.ProcessorConfig(model_source="m", chat_template_stage=stage)
    queued = specbatch.ProcessorConfig(model_source="m", experimental={"max_tasks_in_flight_per_actor": 5},
                                       max_pending_requests=7)
    assert queued.max_tasks_in_flight_per_actor == 5 and queued.max_pending_requests == 7
    with pytest.raises(ValueError, match=r"experimental: \['other'\]"):
        specbatch.ProcessorConfig(model_source="m", experimental={"other": 1})


@pytest.mark.parametrize(("fields", "named", "instead"), [
    ({"has_image": True}, "has_image", "text only"),
    ({"prepare_multimodal_stage": {"enabled": True}}, "prepare_multimodal_stage", "text only"),
    ({"prepare_image_stage": True}, "prepare_image_stage", "text only"),
    ({"task_type": "embed"}, "task_type='embed'", "generates text"),
    ({"engine_kwargs": {"tensor_parallel_size": 2}}, "tensor_parallel_size=2", "use concurrency"),
    ({"engine_kwargs": {"pipeline_parallel_size": 2}}, "pipeline_parallel_size=2", "use concurrency"),
    ({"placement_group_config": {"bundle_per_worker": {"GPU": 2}}}, "2 GPUs", "use concurrency"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}] * 2}}, "2 bundles", "use concurrency"),
    ({"engine_kwargs": {"quantization": "fp8"}}, "quantization='fp8'", "full-precision model"),
    ({"engine_kwargs": {"load_format": "gguf"}}, "load_format='gguf'", "safetensors"),
    ({"engine_kwargs": {"kv_cache_dtype": "fp8"}}, "kv_cache_dtype='fp8'", "model's dtype"),
])
def test_what_specbatch_does_not_do_is_refused_naming_the_field_and_the_alternative(fields, named, instead):
    with pytest.raises(ValueError, match=re.escape(named)) as refused:
        specbatch.ProcessorConfig(model_source="m", **fields)
    assert instead in str(refused.value)


def test_everyday_engine_kwargs_are_honoured():
    config = specbatch.ProcessorConfig(model_source="m", engine_kwargs={
        "trust_remote_code": True, "max_model_len": 4096, "enable_prefix_caching": False, "seed": 11,
        "enable_chunked_prefill": True, "kv_cache_dtype": "auto", "max_num_batched_tokens": 4096,
        "gpu_memory_utilization": 0.85, "block_size": 16, "enforce_eager": True, "generation_config": "auto",
        "load_format": "runai_streamer", "served_model_name": ["a", "b"]}).engine_config()
    assert config.trust_remote_code and config.max_model_len == 4096 and not config.enable_prefix_caching
    assert (config.sampling.seed, config.max_num_batched_tokens, config.served_model_name) == (11, 4096, "a")
    # vLLM's defaults for what a row's sampling_params omit, and vLLM's engine seed 0; a Config keeps its own.
    defaults = specbatch.ProcessorConfig(model_source="m").engine_config().sampling
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p, defaults.top_k, defaults.seed) == (
        1.0, 16, 1.0, 0, 0)
    assert (specbatch.Config().sampling.temperature, specbatch.Config().sampling.max_tokens) == (0.0, 256)
    own = specbatch.ProcessorConfig(model_source="m", engine_kwargs={"sampling": {"max_tokens": 64}})
    assert own.engine_config().sampling.max_tokens == 64 and own.engine_config().sampling.temperature == 1.0


def test_processor_logs_its_input_columns_and_closes_as_a_context_manager(config, caplog):
    with specbatch.build_processor(config) as processor:
        assert processor.list_stage_names() == ["vLLMEngineStage"]
        with caplog.at_level("INFO", logger="pipeline.processor"):
            message = processor.log_input_column_names()
        assert message in caplog.text and "first stage of the processor is vLLMEngineStage" in message
        assert "Required input columns:\n\tprompt or messages" in message and "\ttools:" in message
    with pytest.raises(RuntimeError, match="closed"):
        processor(object())  # refused before the dataset is touched
    staged = specbatch.build_processor(config, preprocess=lambda row: row, postprocess=lambda row: row)
    assert staged.list_stage_names() == ["Preprocess", "vLLMEngineStage", "Postprocess"]
    assert staged.log_input_column_names().startswith("The first stage of the processor is Preprocess.")
    staged.close()
    with pytest.raises(RuntimeError, match="closed"):
        staged(object())


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
    # An int concurrency is a fixed pool; a placement group's one bundle is what each engine actor reserves.
    specbatch.build_processor(specbatch.ProcessorConfig(
        model_source=tiny_dirs["target"], concurrency=2, placement_group_config={
            "bundle_per_worker": {"CPU": 3, "GPU": 1, "accelerator_x": 1}, "strategy": "SPREAD"}))(Recorder())
    kwargs = calls["map_batches"]
    assert (kwargs["compute"].min_size, kwargs["compute"].max_size) == (2, 2)
    assert (kwargs["num_cpus"], kwargs["num_gpus"], kwargs["resources"]) == (3, 1, {"accelerator_x": 1})


def test_pipeline_actors_export_vllms_metrics_through_ray(ray_cluster, plain_run):
    from conftest import scrape_ray_metrics

    name, all_rows = plain_run
    # The empty prompt's error row never reaches the engine's batch: it records none of these metrics.
    rows = [row for row in all_rows if row["finish_reason"] != "error"]
    assert len(rows) == len(all_rows) - 1
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


# Ray Data LLM's documented examples (Ray 2.60: the quickstart, the per-stage configuration, and the quickstart's
# sampling with vLLM's min_p, logit_bias and n), with the import changed and the model one this machine has.
RAY_DATA_LLM_QUICKSTART = """
from specbatch import vLLMEngineProcessorConfig, build_processor

ds = ray.data.from_items([
    {"prompt": "What is machine learning?"},
    {"prompt": "Explain neural networks in one sentence."},
])
config = vLLMEngineProcessorConfig(
    model_source=MODEL,
    concurrency=1,  # 1 vLLM engine replica
    batch_size=32,  # 32 samples per batch
    engine_kwargs=ENGINE_KWARGS,
    **STAGES,
)
processor = build_processor(
    config,
    preprocess=lambda row: {
        "messages": [{"role": "user", "content": row["prompt"]}],
        "sampling_params": SAMPLING,
    },
    postprocess=lambda row: dict(**row),
)
rows = processor(ds).take_all()
"""
PER_STAGE = {"chat_template_stage": {"enabled": True, "batch_size": 256, "concurrency": 4},
             "tokenize_stage": {"enabled": True, "batch_size": 512, "num_cpus": 0.5},
             "detokenize_stage": {"enabled": True, "concurrency": (2, 8)}}


def _as_list(value: object) -> list:
    return value.tolist() if hasattr(value, "tolist") else value


def _check_vllm_output_columns(row: dict, logprobs: int | None = None, prompt_logprobs: int | None = None) -> None:
    """A row's engine columns as Ray Data LLM's vLLMOutputData holds them."""
    prompt_ids, generated = _as_list(row["prompt_token_ids"]), _as_list(row["generated_tokens"])
    assert isinstance(row["prompt"], str) and isinstance(row["generated_text"], str)
    assert prompt_ids and all(isinstance(t, int) for t in prompt_ids) and len(prompt_ids) == row["num_input_tokens"]
    assert all(isinstance(t, int) for t in generated) and len(generated) == row["num_generated_tokens"]
    assert isinstance(row["time_taken_llm"], float)
    if logprobs is None:
        assert row["logprobs"] is None
    else:  # per generated token {token_id: {logprob, rank, decoded_token}}, the chosen token first
        assert len(row["logprobs"]) == len(generated)
        for token, position in zip(generated, row["logprobs"], strict=True):
            assert next(iter(position)) == token and logprobs <= len(position) <= logprobs + 1
            for token_id, entry in position.items():
                assert isinstance(token_id, int) and set(entry) == {"logprob", "rank", "decoded_token"}
                assert entry["logprob"] <= 0 and entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
    if prompt_logprobs is None:
        assert row["prompt_logprobs"] is None
    else:
        assert len(row["prompt_logprobs"]) == len(prompt_ids) and row["prompt_logprobs"][0] is None
        assert all(next(iter(position)) == token for token, position in zip(prompt_ids[1:],
                                                                             row["prompt_logprobs"][1:]))


@pytest.mark.parametrize(("stages", "sampling", "logprobs", "prompt_logprobs"), [
    ({}, {"temperature": 0.7, "max_tokens": 100}, None, None),
    (PER_STAGE, {"temperature": 0.7, "max_tokens": 100}, None, None),
    ({}, {"temperature": 0.8, "min_p": 0.05, "logit_bias": {"0": -100, 5: 2.5}, "n": 2, "max_tokens": 12,
          "logprobs": 2, "prompt_logprobs": 1}, 2, 1),
])
def test_ray_data_llms_documented_examples_run_with_only_the_import_changed(
        ray_cluster, config, stages, sampling, logprobs, prompt_logprobs):
    scope = {"ray": ray, "MODEL": config.model, "STAGES": stages, "SAMPLING": sampling,
             "ENGINE_KWARGS": {"speculative_config": config.speculative.model_dump(), "max_num_seqs": 2}}
    exec(RAY_DATA_LLM_QUICKSTART, scope)
    rows = scope["rows"]
    assert len(rows) == 2
    for row in rows:
        _check_vllm_output_columns(row, logprobs, prompt_logprobs)
        assert "What is machine learning?" in row["prompt"] or "neural networks" in row["prompt"]
        assert 0 < row["num_generated_tokens"] <= sampling["max_tokens"]
    if sampling.get("n", 1) > 1:  # n: Ray Data LLM's row holds the first completion
        assert all(isinstance(row["generated_text"], str) for row in rows)


def test_rows_through_processor_config_take_vllms_sampling_defaults(processor_config_run):
    """No temperature or max_tokens in a row: vLLM's 1.0 and 16, not the Config's greedy 256."""
    rows = processor_config_run
    assert len(rows) == 3 * len(QUESTIONS)
    assert all(row["num_generated_tokens"] == 16 for row in rows)
    by_prompt: dict[str, set] = {}
    for row in rows:  # temperature 1: equal prompts sample apart
        by_prompt.setdefault(row["prompt"], set()).add(tuple(_as_list(row["generated_tokens"])))
    assert any(len(outputs) > 1 for outputs in by_prompt.values())


@pytest.mark.real_model
def test_the_ray_data_llm_quickstart_example_file_runs(ray_cluster, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "ray_data_llm_quickstart.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Q: ") == 2 and done.stdout.count("A: ") == 2
    assert "What is machine learning?" in done.stdout


def test_max_pending_requests_bounds_the_rows_an_actor_keeps_in_its_engine(config):
    import threading

    import pyarrow as pa

    from decoding.engine import GenerationResult
    from pipeline.actor import GenerationActor, RowOptions

    actor = GenerationActor(config.model_dump(mode="json"), options=RowOptions(metrics=False, max_pending=2))
    lock, counts = threading.Lock(), {"now": 0, "peak": 0}
    submit = actor.runner.submit

    def counting(request, prepared, sink):
        with lock:
            counts["now"] += 1
            counts["peak"] = max(counts["peak"], counts["now"])

        def counted(event):
            if isinstance(event, GenerationResult | BaseException):
                with lock:
                    counts["now"] -= 1
            sink(event)

        submit(request, prepared, counted)

    actor.runner.submit = counting
    try:
        block = actor(pa.table({"prompt": ["the cat sat", "dogs run", "on a mat", "a b c", "x y", "the mat"]}))
    finally:
        actor.runner.close()
    assert block.num_rows == 6 and set(block["finish_reason"].to_pylist()) <= {"stop", "length"}
    assert counts["peak"] == 2  # unbounded, all six rows would queue at once


def test_max_model_len_bounds_prompt_and_output_with_a_per_row_error(config):
    import pyarrow as pa

    from pipeline.actor import GenerationActor, RowOptions

    bounded = config.model_copy(update={"max_model_len": 16, "sampling": config.sampling.model_copy(
        update={"max_tokens": 50, "ignore_eos": True})})
    actor = GenerationActor(bounded.model_dump(mode="json"), options=RowOptions(metrics=False))
    try:
        rows = actor(pa.table({"prompt": ["the cat sat", "the cat sat on the mat, dogs run", "x" * 200]}))
    finally:
        actor.runner.close()
    short, long, longer = rows.to_pylist()
    assert short["finish_reason"] == "length" and short["num_input_tokens"] + short["num_generated_tokens"] == 16
    assert long["finish_reason"] == "error" and "max_model_len is 16 tokens" in long["error"]
    assert longer["finish_reason"] == "error" and "longer than max_model_len of 16 tokens" in longer["error"]
