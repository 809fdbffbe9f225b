"""specbatch report on output directories written exactly per the output schema from real engine results."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.image import imread

from decoding.config import Config
from decoding.engine import Engine, GenerationResult, Request
from jobs import report as report_cli
from pipeline.report import CHARTS, load_run, per_prompt_speedups, summarize

PROMPTS = ["the cat sat on the mat. the cat sat", "abc abc abc abc", "hello world, hello world", "a b a b a b a"]

SPEC_DECODE = pa.struct([
    ("num_spec_steps", pa.int32()), ("num_draft_tokens", pa.int32()), ("num_accepted_draft_tokens", pa.int32()),
    ("mean_acceptance_length", pa.float64()), ("tokens_per_forward", pa.float64()),
    ("draft_acceptance_rate", pa.float64()),
    ("acceptance_histogram", pa.list_(pa.int32())),
])
OUTPUTS = pa.schema([
    ("id", pa.string()), ("prompt", pa.string()), ("generated_text", pa.string()),
    ("generated_tokens", pa.list_(pa.int32())), ("num_input_tokens", pa.int32()), ("num_generated_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("error", pa.string()), ("time_taken_llm", pa.float64()),
    ("token_accepted", pa.list_(pa.bool_())), ("per_step_drafted", pa.list_(pa.int32())),
    ("per_step_accepted", pa.list_(pa.int32())), ("spec_decode", SPEC_DECODE),
    ("target_model", pa.string()), ("draft_model", pa.string()),
])
TOKEN_STATS = pa.schema([
    ("id", pa.string()), ("step", pa.int32()), ("depth", pa.int32()), ("candidate", pa.int32()),
    ("token_id", pa.int32()), ("draft_prob", pa.float32()), ("target_prob", pa.float32()), ("accepted", pa.bool_()),
])
STAT_FIELDS = ["step", "depth", "candidate", "token_id", "draft_prob", "target_prob", "accepted"]


def write_output_dir(directory: Path, results: list[GenerationResult], config: Config, wall: float) -> None:
    """An output directory as docs/reference.md describes it, two files per folder (as several actors would write)."""
    for folder in ("outputs", "token_stats"):
        (directory / folder).mkdir(parents=True)
    half = (len(results) + 1) // 2
    for part, chunk in enumerate((results[:half], results[half:])):
        rows = [{
            "id": r.id, "prompt": r.prompt, "generated_text": r.text, "generated_tokens": r.token_ids,
            "num_input_tokens": len(r.prompt_token_ids), "num_generated_tokens": len(r.token_ids),
            "finish_reason": r.finish_reason, "error": r.error, "time_taken_llm": r.time_taken,
            "token_accepted": r.token_accepted, "per_step_drafted": r.per_step_drafted,
            "per_step_accepted": r.per_step_accepted, "spec_decode": r.spec_decode,
            "target_model": config.model, "draft_model": config.speculative.model,
        } for r in chunk]
        pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUTS), directory / "outputs" / f"part-{part:05d}.parquet")
        stats = [{"id": r.id, **dict(zip(STAT_FIELDS, s, strict=True))} for r in chunk for s in r.token_stats]
        pq.write_table(pa.Table.from_pylist(stats, schema=TOKEN_STATS),
                       directory / "token_stats" / f"part-{part:05d}.parquet")
    tokens = sum(len(r.token_ids) for r in results)
    (directory / "summary.json").write_text(json.dumps({
        "rows": len(results), "errors": sum(r.finish_reason == "error" for r in results), "generated_tokens": tokens,
        "wall_seconds": wall, "tokens_per_s": tokens / wall, "config": config.model_dump(),
    }))


def _run(tmp_path_factory, target, tokenizer, draft, draft_path: str, **speculative) -> tuple[Path, list]:
    config = Config(model="tiny-target", batch_size=2, sampling={"max_tokens": 24},
                    speculative={"model": draft_path, **speculative})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    requests = [Request(f"r{i}", prompt=p) for i, p in enumerate(PROMPTS)] + [Request("bad", prompt="")]
    results = engine.generate(requests)
    directory = tmp_path_factory.mktemp(speculative["method"])
    write_output_dir(directory, results, config, wall=sum(r.time_taken for r in results))
    return directory, results


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, target, tokenizer, draft, tiny_dirs):
    return _run(tmp_path_factory, target, tokenizer, draft, tiny_dirs["draft"], method="draft_model",
                num_candidates=2, num_speculative_tokens=3, candidate_init="target", length_policy="static")


@pytest.fixture(scope="module")
def none_run(tmp_path_factory, target, tokenizer, draft, tiny_dirs):
    return _run(tmp_path_factory, target, tokenizer, None, None, method="none")


def _check_page(page: Path) -> None:
    """Every chart is referenced by the page, and every reference is a non-empty PNG that loads."""
    sources = re.findall(r'<img src="([^"]+)"', page.read_text())
    assert sorted(Path(s).stem for s in sources) == sorted(CHARTS)
    for source in sources:
        png = page.parent / source
        assert png.suffix == ".png" and png.stat().st_size > 0
        image = imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_report_page_charts_and_summary(spec_run, capsys):
    directory, results = spec_run
    assert report_cli.main([str(directory)]) == 0
    printed = capsys.readouterr().out
    page = directory / "report.html"
    _check_page(page)

    ok = [r for r in results if r.finish_reason != "error"]
    tokens = sum(len(r.token_ids) for r in ok)
    forwards = sum(r.num_target_forwards for r in ok)
    drafted = sum(sum(r.per_step_drafted) for r in ok)
    accepted = sum(sum(r.per_step_accepted) for r in ok)
    table = summarize(load_run(directory))
    assert table["rows"] == 5 and table["errors"] == 1 and table["generated tokens"] == tokens
    steps = sum(sum(1 for d in r.per_step_drafted if d) for r in ok)
    assert table["mean acceptance length"] == round(1 + accepted / steps, 3)  # vLLM's
    assert table["tokens per forward"] == round(tokens / forwards, 3)
    assert table["spec steps"] == steps and table["target forwards"] == forwards
    assert table["draft acceptance rate"] == round(accepted / drafted, 3)
    assert table["summary.json: wall_seconds"] > 0
    assert table["target model"] == "tiny-target"
    # Without a baseline of plain decoding, no figure is called a speedup but the chart that says it was not
    # measured; tokens per forward is named as what it is.
    assert not [label for label in table if "speedup" in label and "not a speedup" not in label]
    assert table["tokens per target forward per prompt (not a speedup), median"] > 1

    # Per-step acceptance by depth, recomputed plainly from the engine's token statistics.
    steps: dict[tuple[str, int], tuple[int, int]] = {}
    for r in ok:
        for step, depth, _, _, _, _, was_accepted in r.token_stats:
            deepest, reached = steps.get((r.id, step), (0, 0))
            steps[r.id, step] = (max(deepest, depth), max(reached, depth if was_accepted else 0))
    max_depth = max(d for d, _ in steps.values())
    expected = {
        d: round(sum(a >= d for _, a in steps.values()) / sum(dd >= d for dd, _ in steps.values()), 3)
        for d in range(1, max_depth + 1)
    }
    assert table["acceptance rate by depth (per step)"] == expected

    html_text = page.read_text()
    for label, value in table.items():
        assert label in printed and label in html_text
        assert str(value) in printed.split(label, 1)[1].splitlines()[0]


def test_report_without_drafting_still_draws_every_chart(none_run, tmp_path, capsys):
    directory, _ = none_run
    out = tmp_path / "elsewhere"
    assert report_cli.main([str(directory), "--output", str(out)]) == 0
    _check_page(out / "report.html")
    table = summarize(load_run(directory))
    assert table["mean acceptance length"] == 1.0 and table["draft acceptance rate"] is None
    assert table["acceptance rate by depth (per step)"] == {}
    assert not (directory / "report.html").exists()  # --output leaves the output directory untouched


def test_report_speedup_against_a_baseline_directory(spec_run, none_run, tmp_path):
    (directory, results), (baseline, base_results) = spec_run, none_run
    speedups = per_prompt_speedups(load_run(directory), load_run(baseline))
    base = {r.id: r.time_taken / len(r.token_ids) for r in base_results if r.token_ids}
    assert speedups == pytest.approx({
        r.id: base[r.id] / (r.time_taken / len(r.token_ids)) for r in results if r.token_ids
    })
    assert report_cli.main([str(directory), "--baseline", str(baseline), "--output", str(tmp_path)]) == 0
    _check_page(tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "wall-clock speedup vs the plain-decoding baseline, per prompt, median" in page
    assert "Wall-clock speedup over plain decoding, per prompt" in page


def test_report_rejects_a_directory_without_outputs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report_cli.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "outputs" in capsys.readouterr().err


def test_the_summary_line_says_what_speculation_did() -> None:
    """One step of 1,032 drafting under the online policy reads as the policy decoding plainly, not as a mean
    acceptance length of 2.00 alone; plain decoding and a run that drafted throughout say so."""
    from pipeline.summary import summary_line

    def line(method: str, policy: str, drafted: int) -> str:
        summary = {"rows": 6, "errors": 0, "rows_this_run": 6, "wall_seconds": 12.0, "build_seconds": 2.0,
                   "generation_seconds": 10.0, "generation_tokens_per_second": 103.3, "generated_tokens_this_run": 1033,
                   "tokens_per_second": 86.1, "mean_acceptance_length": 2.0 if drafted else 1.0,
                   "num_spec_steps": drafted, "num_target_forwards": 1032,
                   "config": {"speculative": {"method": method, "length_policy": policy}}}
        return summary_line(summary, "out").splitlines()[1]

    assert line("draft_model", "online", 1).endswith(
        "1 of 1032 target forwards verified drafts, mean acceptance length 2.00; the online policy decoded plainly "
        "where drafting did not pay at this batch on this device")
    assert line("draft_model", "online", 0).endswith("no target forward verified a draft; the online policy decoded "
                                                     "plainly where drafting did not pay at this batch on this device")
    assert line("draft_model", "online", 900).endswith("900 of 1032 target forwards verified drafts, mean acceptance "
                                                       "length 2.00")
    assert line("none", "static", 0).endswith("103.3 tokens/s; plain decoding (speculative.method: none)")
