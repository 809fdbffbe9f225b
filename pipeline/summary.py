"""``summary.json``: aggregate metrics of an output directory, in vLLM's vocabulary (docs/reference.md).

Each part's sums are computed by the write task that writes it and stored in its commit marker
(``part_stats``); the summary adds the markers up. So it is computed from what was written, costs the driver
one small file per part, and never reads the outputs themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.config import Config
from decoding.stats import SpecDecodeStats, target_forwards


@dataclass
class RunStats:
    """What this run itself did; a resumed run's directory also holds rows of earlier runs."""

    run_id: str
    wall_seconds: float
    # From the run's start to its first engine built (model loading, conversion, compilation); None: no part.
    build_seconds: float | None = None


def _sum(values: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(values).as_py() or 0)


def _summed_lists(column: pa.ChunkedArray) -> tuple[int, ...]:
    """Element-wise sum of a list<int> column (rows' histograms), in Arrow and numpy: no Python object per row."""
    total = np.zeros(0, dtype=np.int64)
    for chunk in column.chunks:
        lengths = pc.fill_null(pc.list_value_length(chunk), 0).to_numpy()
        values = pc.list_flatten(chunk).to_numpy(zero_copy_only=False)
        positions = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        counts = np.bincount(positions, weights=values).astype(np.int64) if len(values) else total[:0]
        size = max(len(total), len(counts))
        total = np.pad(total, (0, size - len(total))) + np.pad(counts, (0, size - len(counts)))
    return tuple(int(x) for x in total)


def run_totals(outputs: pa.Table) -> SpecDecodeStats:
    """Totals over output rows, counted in Arrow; the ratios come from the one definition (decoding.stats)."""
    spec, generated = outputs["spec_decode"], outputs["num_generated_tokens"]
    return SpecDecodeStats(
        num_spec_steps=_sum(pc.struct_field(spec, "num_spec_steps")),
        num_draft_tokens=_sum(pc.struct_field(spec, "num_draft_tokens")),
        num_accepted_draft_tokens=_sum(pc.struct_field(spec, "num_accepted_draft_tokens")),
        num_generated_tokens=_sum(generated),
        num_target_forwards=target_forwards(
            _sum(pc.list_value_length(outputs["per_step_drafted"])), _sum(pc.greater(generated, 0))
        ),
        acceptance_histogram=_summed_lists(pc.struct_field(spec, "acceptance_histogram")),
        num_grammar_forced_tokens=_sum(pc.struct_field(spec, "num_grammar_forced_tokens")),
    )


_STATS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "num_generated_tokens",
          "num_target_forwards", "num_grammar_forced_tokens", "acceptance_histogram")


def _sums(outputs: pa.Table) -> dict[str, Any]:
    """Rows, errors and the fields of their ``SpecDecodeStats`` (the one definition of the acceptance metrics)."""
    totals = run_totals(outputs)
    return {"rows": outputs.num_rows, "errors": _sum(pc.equal(outputs["finish_reason"], "error")),
            **{field: getattr(totals, field) for field in _STATS}}


def part_stats(outputs: pa.Table, stats: pa.Table) -> dict[str, Any]:
    """The sums one part contributes to the summary (stored in its commit marker), and where some row ran under a
    LoRA adapter the same sums per adapter (``lora``; null: the base model)."""
    del stats  # the per-position counts come from the histogram (vLLM's definition), not from token_stats
    prefilled = pc.greater(outputs["num_generated_tokens"], 0)  # rows that reached the engine's prefill
    sums = {
        **_sums(outputs),
        "prompt_tokens": _sum(pc.filter(outputs["num_input_tokens"], prefilled)),
        "cached_tokens": _sum(outputs["num_cached_tokens"]),
    }
    adapters = outputs["lora"] if "lora" in outputs.column_names else None
    if adapters is not None and adapters.null_count < outputs.num_rows:
        names = pc.unique(adapters).to_pylist()
        sums["adapters"] = [
            {"lora": name, **_sums(outputs.filter(pc.is_null(adapters) if name is None else pc.equal(adapters, name)))}
            for name in names]
    return sums


def _stats(marker: dict[str, Any]) -> SpecDecodeStats:
    return SpecDecodeStats(**{field: marker.get(field) or 0 for field in _STATS[:-1]},
                           acceptance_histogram=tuple(marker.get("acceptance_histogram") or ()))


def _add(parts: list[dict[str, Any]]) -> tuple[int, int, SpecDecodeStats]:
    """(rows, errors, statistics) of these parts."""
    return (sum(p["rows"] for p in parts), sum(p["errors"] for p in parts),
            SpecDecodeStats.total(_stats(p) for p in parts))


def _per_adapter(markers: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The acceptance statistics of each LoRA adapter's rows (``lora`` null: the base model's), where some part ran
    rows under one."""
    by_name: dict[str | None, list[dict[str, Any]]] = {}
    for marker in markers:
        if "adapters" not in marker:  # a part of base rows only
            by_name.setdefault(None, []).append(marker)
            continue
        for part in marker["adapters"]:
            by_name.setdefault(part["lora"], []).append(part)
    if set(by_name) <= {None}:
        return None
    breakdown = []
    for name, parts in sorted(by_name.items(), key=lambda item: (item[0] is not None, item[0] or "")):
        rows, errors, total = _add(parts)
        breakdown.append({"lora": name, "rows": rows, "errors": errors, "generated_tokens": total.num_generated_tokens,
                          "mean_acceptance_length": total.mean_acceptance_length,
                          "draft_acceptance_rate": total.draft_acceptance_rate,
                          "tokens_per_forward": total.tokens_per_forward, "num_spec_steps": total.num_spec_steps,
                          "num_draft_tokens": total.num_draft_tokens,
                          "num_accepted_draft_tokens": total.num_accepted_draft_tokens})
    return breakdown


def summarize(markers: list[dict[str, Any]], runs: list[dict[str, Any]], config: Config, run: RunStats,
              input_path: str) -> dict[str, Any]:
    """The summary of the parts ``markers`` (all committed parts), ``run`` being the run that just ended."""
    rows, errors, total = _add(markers)
    queries, hits = (sum(m.get(name) or 0 for m in markers) for name in ("prompt_tokens", "cached_tokens"))
    this_rows, _, this_run = _add([m for m in markers if m.get("run") == run.run_id])
    per_run = {r["run"]: _add([m for m in markers if m.get("run") == r["run"]]) for r in runs}
    per_pos = total.accepted_per_pos
    generation = run.wall_seconds - run.build_seconds if run.build_seconds is not None else None
    return {
        "rows": rows,
        "errors": errors,
        "generated_tokens": total.num_generated_tokens,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": this_run.num_generated_tokens / run.wall_seconds if run.wall_seconds else 0.0,
        # The generation alone: from the first engine built to the end (engines built later count in).
        "build_seconds": run.build_seconds,
        "generation_seconds": generation,
        "generation_tokens_per_second": this_run.num_generated_tokens / generation if generation else None,
        "rows_this_run": this_rows,
        "generated_tokens_this_run": this_run.num_generated_tokens,
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
        # Accepted draft tokens that a constraint allowed alone (structured outputs), and their share of the output.
        "num_grammar_forced_tokens": total.num_grammar_forced_tokens,
        "grammar_forced_share": total.grammar_forced_share,
        # vLLM's prefix-cache counters: prompt tokens prefilled or found cached, and those found cached.
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        # Per LoRA adapter (null: the base model), where some row ran under one.
        "adapters": _per_adapter(markers),
        "input": input_path,
        "config": config.model_dump(mode="json"),
        # Every run that wrote into this directory, with its own configuration: a directory resumed under
        # another configuration holds rows of both.
        "runs": [{**r, "rows": per_run[r["run"]][0], "generated_tokens": per_run[r["run"]][2].num_generated_tokens}
                 for r in runs],
    }


def speculation_phrase(summary: dict[str, Any]) -> str:
    """What speculation did over the run, in words: how many target forwards verified a draft, and why the others
    did not (the mean acceptance length alone, over the one step of a thousand that drafted, read as a success)."""
    speculative = (summary.get("config") or {}).get("speculative") or {}
    if speculative.get("method", "none") == "none":
        return "plain decoding (speculative.method: none)"
    drafted, forwards = summary["num_spec_steps"], summary["num_target_forwards"]
    policy = speculative.get("length_policy", "")
    why = (f"; the {policy} policy decoded plainly where drafting did not pay at this batch on this device"
           if policy == "online" and 2 * drafted < forwards else "")
    if drafted == 0:
        return f"no target forward verified a draft{why}"
    return (f"{drafted} of {forwards} target forwards verified drafts, mean acceptance length "
            f"{summary['mean_acceptance_length']:.2f}{why}")


def summary_line(summary: dict[str, Any], output_dir: str) -> str:
    """Generation throughput apart from the time to build the engines (loading, converting and compiling the
    models: a first run on a machine pays most of it, later runs read caches)."""
    head = (f"specbatch generate: {summary['rows']} rows ({summary['errors']} errors, "
            f"{summary['rows_this_run']} this run) -> {output_dir}")
    if summary.get("generation_tokens_per_second") is None:
        return f"{head}\n  {summary['wall_seconds']:.1f} s, nothing generated"
    return (
        f"{head}\n"
        f"  generation: {summary['generated_tokens_this_run']} tokens in {summary['generation_seconds']:.1f} s = "
        f"{summary['generation_tokens_per_second']:.1f} tokens/s; {speculation_phrase(summary)}\n"
        f"  engine build (model load, conversion, compilation) {summary['build_seconds']:.1f} s; "
        f"wall {summary['wall_seconds']:.1f} s = {summary['tokens_per_second']:.1f} tokens/s overall"
    )
