"""``summary.json``: aggregate metrics of an output directory, in vLLM's vocabulary (SPEC "Output directory").

Each part's sums are computed by the write task that writes it and stored in its commit marker
(``part_stats``); the summary adds the markers up. So it is computed from what was written, costs the driver
one small file per part, and never reads the outputs themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from decoding.config import Config

_SUMS = ("rows", "errors", "generated_tokens", "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")


@dataclass
class RunStats:
    """What this run itself did; a resumed run's directory also holds rows of earlier runs."""

    run_id: str
    wall_seconds: float


def _sum(values: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(values).as_py() or 0)


def per_position_counts(stats: pa.Table) -> tuple[list[int], list[int]]:
    """For each draft position (depth 1, 2, ...): the speculative steps that drafted that position, and those
    whose accepted path reached it. With one candidate and a fixed length, accepted / drafted is vLLM's
    per-position acceptance rate."""
    if not stats.num_rows:
        return [], []
    stats = stats.select(["id", "step", "depth", "accepted"])
    stats = stats.set_column(3, "accepted", pc.cast(stats["accepted"], pa.int32()))
    per_step = stats.group_by(["id", "step", "depth"]).aggregate([("accepted", "max")])
    by_depth = per_step.group_by("depth").aggregate([("accepted_max", "sum"), ("accepted_max", "count")])
    by_depth = by_depth.sort_by("depth")
    drafted, accepted = [0] * by_depth["depth"][-1].as_py(), [0] * by_depth["depth"][-1].as_py()
    for depth, count, hits in zip(by_depth["depth"].to_pylist(), by_depth["accepted_max_count"].to_pylist(),
                                  by_depth["accepted_max_sum"].to_pylist()):
        drafted[depth - 1], accepted[depth - 1] = count, hits
    return drafted, accepted


def part_stats(outputs: pa.Table, stats: pa.Table) -> dict[str, Any]:
    """The sums one part contributes to the summary (stored in its commit marker)."""
    spec = outputs["spec_decode"]
    drafted, accepted = per_position_counts(stats)
    return {
        "rows": outputs.num_rows,
        "errors": _sum(pc.equal(outputs["finish_reason"], "error")),
        "generated_tokens": _sum(outputs["num_generated_tokens"]),
        "num_spec_steps": _sum(pc.struct_field(spec, "num_spec_steps")),
        "num_draft_tokens": _sum(pc.struct_field(spec, "num_draft_tokens")),
        "num_accepted_draft_tokens": _sum(pc.struct_field(spec, "num_accepted_draft_tokens")),
        "num_drafts_per_pos": drafted,
        "num_accepted_tokens_per_pos": accepted,
    }


def _add(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {key: sum(part[key] for part in parts) for key in _SUMS}
    for key in ("num_drafts_per_pos", "num_accepted_tokens_per_pos"):
        width = max((len(part[key]) for part in parts), default=0)
        total[key] = [sum(part[key][i] for part in parts if i < len(part[key])) for i in range(width)]
    return total


def summarize(markers: list[dict[str, Any]], runs: list[dict[str, Any]], config: Config, run: RunStats,
              input_path: str) -> dict[str, Any]:
    """The summary of the parts ``markers`` (all committed parts), ``run`` being the run that just ended."""
    total = _add(markers)
    this_run = _add([m for m in markers if m.get("run") == run.run_id])
    per_run = {r["run"]: _add([m for m in markers if m.get("run") == r["run"]]) for r in runs}
    generated, forwards = total["generated_tokens"], total["num_spec_steps"]
    drafted, accepted = total["num_draft_tokens"], total["num_accepted_draft_tokens"]
    per_pos_drafted, per_pos_accepted = total["num_drafts_per_pos"], total["num_accepted_tokens_per_pos"]
    return {
        "rows": total["rows"],
        "errors": total["errors"],
        "generated_tokens": generated,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": this_run["generated_tokens"] / run.wall_seconds if run.wall_seconds else 0.0,
        "rows_this_run": this_run["rows"],
        "generated_tokens_this_run": this_run["generated_tokens"],
        "mean_acceptance_length": generated / forwards if forwards else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position_acceptance_rate": [a / d if d else 0.0 for a, d in zip(per_pos_accepted, per_pos_drafted)],
        "num_spec_steps": forwards,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "num_drafts_per_pos": per_pos_drafted,
        "num_accepted_tokens_per_pos": per_pos_accepted,
        "input": input_path,
        "config": config.model_dump(mode="json"),
        # Every run that wrote into this directory, with its own configuration: a directory resumed under
        # another configuration holds rows of both.
        "runs": [{**r, "rows": per_run[r["run"]]["rows"], "generated_tokens": per_run[r["run"]]["generated_tokens"]}
                 for r in runs],
    }


def summary_line(summary: dict[str, Any], output_dir: str) -> str:
    return (
        f"specbatch generate: {summary['rows']} rows ({summary['errors']} errors, "
        f"{summary['rows_this_run']} this run), {summary['generated_tokens_this_run']} tokens in "
        f"{summary['wall_seconds']:.1f} s = {summary['tokens_per_second']:.1f} tokens/s, "
        f"mean acceptance length {summary['mean_acceptance_length']:.2f} -> {output_dir}"
    )
