"""The one definition of the acceptance metrics (decoding.stats) and its Prometheus counters."""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest
from conftest import scrape_ray_metrics
from engine_cases import PROMPTS, make_config, run

from decoding.config import Config
from decoding.engine import Engine, Request
from decoding.stats import SpecDecodeStats
from frontend.metrics import EngineMetrics
from pipeline.actor import GenerationActor
from pipeline.summary import run_totals


def test_spec_decode_definitions_on_hand_made_steps() -> None:
    # Three verification steps after the prefill; the middle one drafted nothing.
    stats = SpecDecodeStats.from_steps([4, 0, 4], [2, 0, 4], generated=10, max_depth=4)
    assert stats.num_spec_steps == 2  # vLLM's num_drafts: steps that drafted
    assert stats.num_target_forwards == 4  # prefill + three steps
    assert stats.mean_acceptance_length == 1 + 6 / 2
    assert stats.tokens_per_forward == 10 / 4
    assert stats.draft_acceptance_rate == 6 / 8
    assert stats.acceptance_histogram == (0, 0, 1, 0, 1) and sum(stats.acceptance_histogram) == 2
    assert stats.accepted_per_pos == [2, 2, 1, 1]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_draft_tokens
    # Totals add counts and re-derive the ratios, histograms of different depths included.
    total = stats + SpecDecodeStats.from_steps([1], [1], generated=3, max_depth=1)
    assert total.acceptance_histogram == (0, 1, 1, 0, 1)
    assert total.mean_acceptance_length == 1 + 7 / 3 and total.tokens_per_forward == 13 / 6
    assert SpecDecodeStats.from_steps([], [], generated=1).mean_acceptance_length == 1.0  # nothing drafted
    assert SpecDecodeStats().struct()["mean_acceptance_length"] == 0.0  # nothing generated (error rows)


def test_counters_total_the_per_result_statistics(tokenizer, target, draft) -> None:
    from test_metrics import Memory

    config = make_config(method="draft_model", num_candidates=2, length_policy="static")
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    memory = Memory("tiny")
    metrics = EngineMetrics([memory], "tiny")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(str(i), prompt=prompt))
    results = []
    while engine.has_unfinished():
        output = engine.step()
        metrics.stepped(output)  # as the runner does: every step
        results += output.finished
    structs = [r.spec_decode for r in results]
    assert memory.total("vllm:spec_decode_num_drafts") == sum(s["num_spec_steps"] for s in structs) > 0
    assert memory.total("vllm:spec_decode_num_draft_tokens") == sum(s["num_draft_tokens"] for s in structs)
    assert memory.total("vllm:spec_decode_num_accepted_tokens") == sum(s["num_accepted_draft_tokens"] for s in structs)
    assert memory.total("vllm:spec_decode_num_accepted_tokens_per_pos") == sum(
        s["num_accepted_draft_tokens"] for s in structs)
    for result in results:  # engine result -> output row -> the same statistics
        row = {"num_generated_tokens": len(result.token_ids), "per_step_drafted": result.per_step_drafted,
               "spec_decode": result.spec_decode}
        assert SpecDecodeStats.from_row(row) == result.stats
        assert sum(result.acceptance_histogram) == result.spec_decode["num_spec_steps"]


def test_summary_totals_in_arrow_equal_the_per_row_definition(tokenizer, target, draft) -> None:
    config = make_config(method="draft_model", num_candidates=3, candidate_init="target", length_policy="static")
    results = run(config, tokenizer, target, draft)
    rows = [{"num_generated_tokens": len(r.token_ids), "per_step_drafted": r.per_step_drafted,
             "spec_decode": r.spec_decode} for r in results]
    rows.append({"num_generated_tokens": 0, "per_step_drafted": [],  # an error row
                 "spec_decode": {**SpecDecodeStats().struct(), "acceptance_histogram": []}})
    table = pa.Table.from_pylist(rows)
    table = pa.concat_tables([table.slice(0, 3), table.slice(3)])  # several chunks, one of them sliced
    assert run_totals(table) == SpecDecodeStats.total(r.stats for r in results)


def test_pipeline_actor_exports_what_its_rows_report(ray_cluster, tiny_dirs) -> None:
    name = f"stats-{uuid.uuid4().hex[:8]}"  # this actor's series alone
    config = Config.model_validate({
        "model": tiny_dirs["target"], "batch_size": 4, "served_model_name": name,
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "length_policy": "static"},
        "sampling": {"max_tokens": 10},
    })
    actor = GenerationActor(config.model_dump())
    # Ray Data LLM's own example sampling_params, as a JSON string column, must not make error rows.
    ray_example = '{"temperature": 0.3, "max_tokens": 20, "detokenize": false}'
    params = [ray_example if i % 2 else None for i in range(len(PROMPTS))]
    params[0] = '{"logprobs": 2}'
    batch = pa.table({"id": [f"r{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS, "sampling_params": params})
    block = actor(batch)
    assert block["finish_reason"].to_pylist().count("error") == 0
    assert all(text == "" for text in block["generated_text"].to_pylist()[1::2])  # detokenize: false
    logprobs = block["logprobs"].to_pylist(maps_as_pydicts="strict")  # the column, filled for the row that asked
    assert len(logprobs[0]) == block["num_generated_tokens"][0].as_py()
    assert all(2 <= len(position) <= 3 for position in logprobs[0])  # the chosen token and the top 2
    assert logprobs[1:] == [None] * (len(PROMPTS) - 1)
    rows = block.select(["num_generated_tokens", "per_step_drafted", "spec_decode"]).to_pylist()
    totals = SpecDecodeStats.total(SpecDecodeStats.from_row(row) for row in rows)
    expected = {"ray_vllm_spec_decode_num_drafts_total": totals.num_spec_steps,
                "ray_vllm_spec_decode_num_draft_tokens_total": totals.num_draft_tokens,
                "ray_vllm_spec_decode_num_accepted_tokens_total": totals.num_accepted_draft_tokens,
                "ray_vllm_generation_tokens_total": totals.num_generated_tokens}
    assert totals.num_spec_steps > 0
    scraped: dict = {}
    for _ in range(60):  # Ray's export: reported every second
        scraped = {key: value for (key, _), value in scrape_ray_metrics(ray_cluster, model_name=name).items()}
        if all(scraped.get(key) == value for key, value in expected.items()):
            break
        time.sleep(1)
    assert {key: scraped.get(key) for key in expected} == expected


def test_two_gpus_on_one_actor_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_gpus is 2.*concurrency: 2"):
        Config(num_gpus=2)
    assert Config(num_gpus=0.5).num_gpus == 0.5
