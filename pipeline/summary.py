"""``summary.json``: aggregate metrics of an output directory, in vLLM's vocabulary (SPEC "Output directory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from decoding.config import Config
from decoding.stats import SpecDecodeStats
from pipeline.store import OutputStore


@dataclass
class RunStats:
    """What this run itself did; a resumed run's directory also holds rows of earlier runs."""

    rows: int
    generated_tokens: int
    wall_seconds: float


def _sum(values: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(values).as_py() or 0)


def summarize(store: OutputStore, config: Config, run: RunStats, input_path: str) -> dict[str, Any]:
    outputs = store.read_outputs(["finish_reason", "num_generated_tokens", "per_step_drafted", "spec_decode"])
    rows = outputs.select(["num_generated_tokens", "per_step_drafted", "spec_decode"]).to_pylist()
    total = SpecDecodeStats.total(SpecDecodeStats.from_row(row) for row in rows)  # the one definition
    per_pos = total.accepted_per_pos
    return {
        "rows": outputs.num_rows,
        "errors": _sum(pc.equal(outputs["finish_reason"], "error")),
        "generated_tokens": total.num_generated_tokens,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": run.generated_tokens / run.wall_seconds if run.wall_seconds else 0.0,
        "rows_this_run": run.rows,
        "generated_tokens_this_run": run.generated_tokens,
        "mean_acceptance_length": total.mean_acceptance_length,
        "tokens_per_forward": total.tokens_per_forward,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        # vLLM's: steps whose accepted run reached position i, over all spec steps.
        "per_position_acceptance_rate": [a / total.num_spec_steps if total.num_spec_steps else 0.0 for a in per_pos],
        "num_spec_steps": total.num_spec_steps,
        "num_target_forwards": total.num_target_forwards,
        "num_draft_tokens": total.num_draft_tokens,
        "num_accepted_draft_tokens": total.num_accepted_draft_tokens,
        "num_accepted_tokens_per_pos": per_pos,
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
