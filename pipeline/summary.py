"""``summary.json``: aggregate metrics of an output directory, in vLLM's vocabulary (SPEC "Output directory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from decoding.config import Config
from pipeline.store import OutputStore


@dataclass
class RunStats:
    """What this run itself did; a resumed run's directory also holds rows of earlier runs."""

    rows: int
    generated_tokens: int
    wall_seconds: float


def _sum(values: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(values).as_py() or 0)


def per_position_acceptance(store: OutputStore) -> tuple[list[float], list[int], list[int]]:
    """For each draft position (depth 1, 2, ...): the fraction of speculative steps that drafted that
    position whose accepted path reached it; plus those two counts. With one candidate and a fixed
    length this is vLLM's per-position acceptance rate (accepted at position / drafts)."""
    stats = store.read_token_stats(["id", "step", "depth", "accepted"])
    stats = stats.set_column(3, "accepted", pc.cast(stats["accepted"], pa.int32()))
    per_step = stats.group_by(["id", "step", "depth"]).aggregate([("accepted", "max")])
    by_depth = per_step.group_by("depth").aggregate([("accepted_max", "sum"), ("accepted_max", "count")])
    by_depth = by_depth.sort_by("depth")
    drafted = by_depth["accepted_max_count"].to_pylist()
    accepted = by_depth["accepted_max_sum"].to_pylist()
    return [a / d for a, d in zip(accepted, drafted, strict=True)], drafted, accepted


def summarize(store: OutputStore, config: Config, run: RunStats, input_path: str) -> dict[str, Any]:
    outputs = store.read_outputs(["finish_reason", "num_generated_tokens", "spec_decode"])
    spec = outputs["spec_decode"]
    generated = _sum(outputs["num_generated_tokens"])
    forwards = _sum(pc.struct_field(spec, "num_spec_steps"))
    drafted = _sum(pc.struct_field(spec, "num_draft_tokens"))
    accepted = _sum(pc.struct_field(spec, "num_accepted_draft_tokens"))
    rates, drafts_per_pos, accepted_per_pos = per_position_acceptance(store)
    return {
        "rows": outputs.num_rows,
        "errors": _sum(pc.equal(outputs["finish_reason"], "error")),
        "generated_tokens": generated,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": run.generated_tokens / run.wall_seconds if run.wall_seconds else 0.0,
        "rows_this_run": run.rows,
        "generated_tokens_this_run": run.generated_tokens,
        "mean_acceptance_length": generated / forwards if forwards else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position_acceptance_rate": rates,
        "num_spec_steps": forwards,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "num_drafts_per_pos": drafts_per_pos,
        "num_accepted_tokens_per_pos": accepted_per_pos,
        "input": input_path,
        "config": config.model_dump(mode="json"),
    }


def summary_line(summary: dict[str, Any], output_dir: str) -> str:
    return (
        f"specbatch generate: {summary['rows']} rows ({summary['errors']} errors, "
        f"{summary['rows_this_run']} this run), {summary['generated_tokens_this_run']} tokens in "
        f"{summary['wall_seconds']:.1f} s = {summary['tokens_per_second']:.1f} tokens/s, "
        f"mean acceptance length {summary['mean_acceptance_length']:.2f} -> {output_dir}"
    )
