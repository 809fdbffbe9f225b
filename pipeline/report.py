"""``specbatch report``: summary table and PNG charts of an output directory (docs/reference.md, "Output directory").

Reads ``outputs/*.parquet`` and ``token_stats/*.parquet`` (plus ``summary.json`` when present) with pyarrow only,
on any filesystem pyarrow knows (a local path, ``s3://``, ``gs://``, ``hdfs://``: wherever the pipeline writes),
so it works on any directory that follows that schema, whoever wrote it. Writes ``report.html`` with the
charts under ``report_files/`` (through the same filesystems); the same summary is returned as text.

Definitions (all over successful rows):
- mean acceptance length, tokens per forward: as in ``spec_decode`` (``decoding.stats``, the one definition):
  1 + accepted / spec steps (vLLM's), and generated tokens / target forwards (prefill included).
- acceptance rate at depth d, per step: of the steps that drafted some candidate to depth d, the share whose
  accepted path reached depth d; per token: the share of drafted tokens at depth d that were accepted.
- tokens per target forward, per prompt: what each verify forward yielded. It is not a speedup: a forward that
  verifies a tree costs more than a plain decoding step, and drafting costs time too.
- wall-clock speedup, per prompt: only given a baseline directory of the same prompts decoded with plain
  decoding (``speculative.method: none``): its seconds per token over this run's, prompt by prompt.
"""

from __future__ import annotations

import html
import io
import json
import posixpath
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from decoding.stats import SpecDecodeStats
from pipeline.io import InputError, resolve

OUTPUT_COLUMNS = [
    "id", "finish_reason", "num_generated_tokens", "time_taken_llm", "per_step_drafted", "per_step_accepted",
    "spec_decode",
]
TOKEN_STATS_COLUMNS = ["id", "step", "depth", "candidate", "accepted"]


@dataclass
class RunData:
    rows: list[dict[str, Any]]  # outputs/, the columns above (+ provenance), one dict per row
    token_stats: dict[str, np.ndarray]  # token_stats/ as arrays; ``id`` dictionary-encoded to int codes
    summary: dict[str, Any] | None  # summary.json, if the directory has one


def _read_parquet_dir(fs: pafs.FileSystem, path: str, columns: list[str]) -> Any:
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return None
    files = sorted(info.path for info in infos if info.is_file and info.path.endswith(".parquet"))
    if not files:
        return None
    table = pq.read_table(files, filesystem=fs)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} lacks column(s) {missing} required by the output schema")
    extra = [c for c in ("target_model", "draft_model", "lora") if c in table.column_names]
    return table.select(columns + extra)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return resolve(str(uri), "directory")
    except InputError as exc:
        raise ValueError(str(exc)) from None


def load_run(directory: str | Path) -> RunData:
    fs, root = _filesystem(str(directory))
    outputs = _read_parquet_dir(fs, posixpath.join(root, "outputs"), OUTPUT_COLUMNS)
    if outputs is None:
        raise ValueError(f"{directory} has no outputs/*.parquet: not a specbatch output directory")
    stats = _read_parquet_dir(fs, posixpath.join(root, "token_stats"), TOKEN_STATS_COLUMNS)
    arrays: dict[str, np.ndarray] = {name: np.zeros(0, dtype=np.int64) for name in TOKEN_STATS_COLUMNS}
    if stats is not None and stats.num_rows:
        ids = pc.dictionary_encode(stats.column("id").combine_chunks())
        arrays = {name: stats.column(name).to_numpy() for name in TOKEN_STATS_COLUMNS[1:]}
        arrays["id"] = ids.indices.to_numpy()
    summary_path = posixpath.join(root, "summary.json")
    summary = None
    if fs.get_file_info(summary_path).is_file:
        with fs.open_input_stream(summary_path) as f:
            summary = json.loads(f.read())
    return RunData(outputs.to_pylist(), arrays, summary)


# ----------------------------------------------------------------------------------------------- statistics
def _ok(data: RunData) -> list[dict[str, Any]]:
    return [r for r in data.rows if r["finish_reason"] != "error"]


def acceptance_by_depth(data: RunData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(depths 1..D, per-step rate, per-token rate); see the module docstring."""
    stats = data.token_stats
    if not len(stats["depth"]):
        return np.zeros(0, dtype=int), np.zeros(0), np.zeros(0)
    depth, accepted = stats["depth"].astype(np.int64), stats["accepted"].astype(bool)
    # One group per (sequence, step): the deepest drafted and the deepest accepted level.
    keys = stats["id"].astype(np.int64) * (int(stats["step"].max()) + 1) + stats["step"].astype(np.int64)
    _, group = np.unique(keys, return_inverse=True)
    drafted_to = np.zeros(group.max() + 1, dtype=np.int64)
    accepted_to = np.zeros_like(drafted_to)
    np.maximum.at(drafted_to, group, depth)
    np.maximum.at(accepted_to, group, np.where(accepted, depth, 0))
    depths = np.arange(1, int(depth.max()) + 1)
    reached = np.array([(drafted_to >= d).sum() for d in depths])
    per_step = np.array([(accepted_to >= d).sum() for d in depths]) / np.maximum(reached, 1)
    per_token = np.array([accepted[depth == d].mean() if (depth == d).any() else 0.0 for d in depths])
    return depths, per_step, per_token


def acceptance_by_candidate(data: RunData) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ranks, share of that rank's drafted tokens accepted)."""
    candidate, accepted = data.token_stats["candidate"].astype(np.int64), data.token_stats["accepted"].astype(bool)
    ranks = np.unique(candidate)
    return ranks, np.array([accepted[candidate == r].mean() for r in ranks])


def accepted_lengths(data: RunData) -> np.ndarray:
    """Accepted drafted tokens of every speculative step, rows in file order."""
    return np.array([a for r in _ok(data) for a in r["per_step_accepted"] or []], dtype=np.int64)


def _seconds_per_token(data: RunData) -> dict[str, float]:
    return {
        r["id"]: r["time_taken_llm"] / r["num_generated_tokens"]
        for r in _ok(data) if r["num_generated_tokens"] and r["time_taken_llm"] > 0
    }


def tokens_per_forward_by_prompt(data: RunData) -> dict[str, float]:
    """Generated tokens over target forwards, prompt by prompt (not a speedup: see the module docstring)."""
    return {r["id"]: SpecDecodeStats.from_row(r).tokens_per_forward for r in _ok(data) if r["num_generated_tokens"]}


def per_prompt_speedups(data: RunData, baseline: RunData) -> dict[str, float]:
    """Wall-clock speedup over ``baseline`` (plain decoding of the same prompts): its seconds per token over this
    run's, for the prompts both have."""
    base, this = _seconds_per_token(baseline), _seconds_per_token(data)
    return {i: base[i] / seconds for i, seconds in this.items() if i in base}


def _mean_median(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return round(statistics.fmean(values), 3), round(statistics.median(values), 3)


def summarize(data: RunData, baseline: RunData | None = None) -> dict[str, Any]:
    """The summary table: label -> value, in display order."""
    ok = _ok(data)
    total = SpecDecodeStats.total(SpecDecodeStats.from_row(r) for r in ok)
    tokens, drafted, accepted = total.num_generated_tokens, total.num_draft_tokens, total.num_accepted_draft_tokens
    llm_seconds = sum(r["time_taken_llm"] for r in ok)
    depths, per_step, _ = acceptance_by_depth(data)
    per_forward = _mean_median(list(tokens_per_forward_by_prompt(data).values()))
    table: dict[str, Any] = {
        "rows": len(data.rows),
        "errors": len(data.rows) - len(ok),
        "generated tokens": tokens,
        "target forwards": total.num_target_forwards,
        "spec steps": total.num_spec_steps,
        "mean acceptance length": round(total.mean_acceptance_length, 3) if tokens else None,
        "tokens per forward": round(total.tokens_per_forward, 3) if total.num_target_forwards else None,
        "draft tokens": drafted,
        "accepted draft tokens": accepted,
        "draft acceptance rate": round(total.draft_acceptance_rate, 3) if drafted else None,
        "grammar-forced draft tokens (structured outputs)": total.num_grammar_forced_tokens,
        "grammar-forced share of generated tokens": round(total.grammar_forced_share, 3) if tokens else None,
        "acceptance rate by depth (per step)": dict(zip(depths.tolist(), per_step.round(3).tolist(), strict=True)),
        # time_taken_llm may include a row's wait in the engine's queue: a per-row latency, not throughput.
        "mean time_taken_llm per row (s)": round(llm_seconds / len(ok), 3) if ok else None,
        "tokens per row-second": round(tokens / llm_seconds, 2) if llm_seconds else None,
        "tokens per target forward per prompt (not a speedup), mean": per_forward[0],
        "tokens per target forward per prompt (not a speedup), median": per_forward[1],
    }
    if baseline is not None:  # a speedup only where plain decoding was measured beside this run
        speedup = _mean_median(list(per_prompt_speedups(data, baseline).values()))
        table["wall-clock speedup vs the plain-decoding baseline, per prompt, mean"] = speedup[0]
        table["wall-clock speedup vs the plain-decoding baseline, per prompt, median"] = speedup[1]
    for name in ("target_model", "draft_model"):
        values = sorted({str(r[name]) for r in data.rows if r.get(name)})
        if values:
            table[name.replace("_", " ")] = ", ".join(values)
    table.update(_per_adapter(ok))
    if data.summary:  # the job's own totals (wall-clock throughput across actors), as it recorded them
        notes = {"tokens_per_second": " (over the wall time, engine build included)",
                 "generation_tokens_per_second": " (from the first engine built)"}
        table.update({f"summary.json: {k}{notes.get(k, '')}": v for k, v in data.summary.items()
                      if isinstance(v, int | float | str)})
    return table


def _per_adapter(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance per LoRA adapter (and the base model's rows), where some row ran under one."""
    names = sorted({r.get("lora") for r in ok}, key=lambda name: (name is not None, name or ""))
    if names in ([], [None]):
        return {}
    table = {}
    for name in names:
        rows = [r for r in ok if r.get("lora") == name]
        total = SpecDecodeStats.total(SpecDecodeStats.from_row(r) for r in rows)
        label = f"adapter {name}" if name is not None else "base model (no adapter)"
        table[f"{label}: rows, mean acceptance length, draft acceptance rate"] = (
            f"{len(rows)}, {total.mean_acceptance_length:.3f}, "
            f"{total.draft_acceptance_rate:.3f}" if total.num_draft_tokens else f"{len(rows)}, -, -")
    return table


def format_summary(table: dict[str, Any]) -> str:
    width = max(len(label) for label in table)
    return "\n".join(f"{label.ljust(width)}  {'-' if value is None else value}" for label, value in table.items())


# ------------------------------------------------------------------------------------------------- charts
def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)


def _chart_depth(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    depths, per_step, per_token = acceptance_by_depth(data)
    if not len(depths):
        return _empty(ax, "no drafted tokens")
    ax.bar(depths - 0.2, per_step, 0.4, label="per step (any candidate reaches depth d)")
    ax.bar(depths + 0.2, per_token, 0.4, label="per drafted token at depth d")
    ax.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1), xticks=depths)
    ax.legend(fontsize=8)


def _chart_candidate(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    ranks, rates = acceptance_by_candidate(data)
    if not len(ranks):
        return _empty(ax, "no drafted tokens")
    ax.bar(ranks, rates)
    ax.set(xlabel="candidate rank (0 = first)", ylabel="share of its drafted tokens accepted", ylim=(0, 1),
           xticks=ranks)


def _chart_lengths(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    lengths = accepted_lengths(data)
    if not len(lengths):
        return _empty(ax, "no speculative steps")
    counts = np.bincount(lengths)
    ax.bar(np.arange(len(counts)), counts)
    ax.set(xlabel="accepted draft tokens in a step", ylabel="steps", xticks=np.arange(len(counts)))


def _chart_timeline(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    per_forward = accepted_lengths(data) + 1  # a verify forward emits the accepted tokens plus one
    if not len(per_forward):
        return _empty(ax, "no speculative steps")
    window = min(100, max(1, len(per_forward) // 20))
    smooth = np.convolve(per_forward, np.ones(window) / window, mode="valid")
    ax.plot(np.arange(window, len(per_forward) + 1), smooth, label=f"rolling mean over {window} forwards")
    ax.axhline(per_forward.mean(), color="gray", linestyle="--", label=f"run mean {per_forward.mean():.2f}")
    ax.set(xlabel="verify forwards, rows in output order", ylabel="tokens per verify forward")
    ax.legend(fontsize=8)


def _chart_per_forward(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    values = np.array(list(tokens_per_forward_by_prompt(data).values()))
    if not len(values):
        return _empty(ax, "no prompts")
    ax.hist(values, bins=min(30, max(5, len(values) // 3)))
    ax.axvline(float(np.median(values)), color="tab:orange", linestyle="--", label=f"median {np.median(values):.2f}")
    ax.set(xlabel="generated tokens / target forwards (prefill included); not a time speedup", ylabel="prompts")
    ax.legend(fontsize=8)


def _chart_speedup(ax: Axes, data: RunData, baseline: RunData | None) -> None:
    if baseline is None:
        return _empty(ax, "not measured: pass --baseline, an output directory of the same\n"
                          "prompts decoded with speculative.method: none")
    speedups = np.array(list(per_prompt_speedups(data, baseline).values()))
    if not len(speedups):
        return _empty(ax, "no prompts shared with the baseline")
    ax.hist(speedups, bins=min(30, max(5, len(speedups) // 3)))
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvline(float(np.median(speedups)), color="tab:orange", linestyle="--",
               label=f"median {np.median(speedups):.2f}x")
    ax.set(xlabel="baseline seconds per token / this run's", ylabel="prompts")
    ax.legend(fontsize=8)


CHARTS = {  # file stem -> (title, drawing function)
    "acceptance_by_depth": ("Acceptance rate by draft depth", _chart_depth),
    "acceptance_by_candidate": ("Acceptance rate by candidate rank", _chart_candidate),
    "accepted_length_histogram": ("Accepted length per step", _chart_lengths),
    "tokens_per_forward": ("Tokens per target forward over the run", _chart_timeline),
    "tokens_per_forward_by_prompt": ("Tokens per target forward, per prompt", _chart_per_forward),
    "per_prompt_speedup": ("Wall-clock speedup over plain decoding, per prompt", _chart_speedup),
}


# ------------------------------------------------------------------------------------------------- output
@dataclass
class Report:
    html: str  # where it was written: a local path or a URI
    charts: list[str]
    text: str


def _html(title: str, table: dict[str, Any], charts: list[tuple[str, str]]) -> str:
    rows = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape('-' if value is None else str(value))}</td></tr>"
        for label, value in table.items()
    )
    figures = "\n".join(
        f'<h2>{html.escape(caption)}</h2>\n<img src="{html.escape(src)}" alt="{html.escape(caption)}">'
        for caption, src in charts
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}} th{{text-align:left;padding-right:2em}}
img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<h2>Summary</h2>
<table>
{rows}
</table>
{figures}
</body></html>
"""


def write_report(directory: str | Path, output: str | Path | None = None, baseline: str | Path | None = None) -> Report:
    """Write ``report.html`` and its PNGs to ``output`` (default: the output directory itself), a local path or
    a URI."""
    data = load_run(directory)
    base = load_run(baseline) if baseline is not None else None
    out = str(output or directory)
    fs, root = _filesystem(out)
    fs.create_dir(posixpath.join(root, "report_files"), recursive=True)
    charts = []
    for stem, (title, draw) in CHARTS.items():
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        draw(ax, data, base)
        ax.set_title(title)
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        charts.append(f"report_files/{stem}.png")
        with fs.open_output_stream(posixpath.join(root, charts[-1])) as f:
            f.write(image.getvalue())
    table = summarize(data, base)
    captions = [(CHARTS[Path(chart).stem][0], chart) for chart in charts]
    name = str(directory).rstrip("/").rsplit("/", 1)[-1]
    with fs.open_output_stream(posixpath.join(root, "report.html")) as f:
        f.write(_html(f"specbatch report: {name}", table, captions).encode())
    return Report(_join(out, "report.html"), [_join(out, chart) for chart in charts], format_summary(table))


def _join(base: str, relative: str) -> str:
    return f"{base.rstrip('/')}/{relative}"
