"""``specbatch bench``: side-by-side throughput of transformers and the engine's configurations (see docs/bench.md).

    specbatch bench --config jobs/configs/bench_cpu.yaml --input prompts.jsonl [--input more.jsonl]
        [--max-prompts N] [--output DIR] [--grid grid.yaml] [--batch-sizes 1 16] [--widths 1 2 4] ...
        [--baseline-tree PATH]
    specbatch bench --overhead [--rounds 3] [--steps 32] [--batch-sizes 1 64] [--baseline-tree PATH]
    specbatch bench --shape-costs llama3-8b [--context 512] [--batch-sizes 1 8 64]
    specbatch bench --lora 1 4 16 --input prompts.jsonl [--lora-rank 16] [--rounds 3] [--batch-sizes 16]

Each ``--input`` is one prompt set (JSONL, Parquet or CSV with a ``prompt`` or ``messages`` column, or an
XSum-style ``document`` column that becomes a one-sentence summarization request). Writes ``bench.csv``,
``bench.json`` and ``bench.png`` to the output directory and prints the table. ``--overhead`` measures the
framework's cost per step on a model too small to cost anything (``bench/overhead.py``, writes
``overhead.json``); ``--shape-costs`` times the engine's forwards on a model of a given shape with random weights
(``bench/shape_costs.py``, writes ``shape_costs.json``); ``--lora`` the cost of LoRA adapters: a batch's rows over
that many distinct adapters, base rows beside adapter rows, and one adapter against its merged weights
(``bench/lora.py``, writes ``lora.json``).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import logging
import sys
from pathlib import Path
from typing import Any, get_args

import pyarrow.parquet as pq
import torch
import yaml

from bench.baseline import load_baseline
from bench.harness import BenchGrid, BenchRow, LengthPolicyName, format_table, plot, run_bench
from bench.lora import format_lora, run_lora_bench
from bench.overhead import format_overhead, run_overhead
from bench.shape_costs import SHAPES, format_shape_costs, run_shape_costs
from decoding.engine import Request
from jobs.common import parse_with_config, setup_logging

log = logging.getLogger("specbatch.bench")

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# The template jobs/configs/smollm2_draft.yaml trains the default draft with, so the draft sees what it learnt.
SUMMARIZE = "Summarize the following article in one sentence: {document}"


def _files(path: str) -> list[Path]:
    if Path(path).is_dir():
        return sorted(p for p in Path(path).iterdir() if p.suffix in SUFFIXES)
    return [Path(p) for p in sorted(glob.glob(path))] or [Path(path)]


def _records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with path.open(newline="") as f:
        if path.suffix == ".csv":
            return list(csv.DictReader(f))
        return [json.loads(line) for line in f if line.strip()]


def _request(record: dict[str, Any], default_id: str) -> Request:
    request_id = str(record.get("id") or default_id)
    if record.get("messages") is not None:
        messages = record["messages"]
        return Request(request_id, messages=json.loads(messages) if isinstance(messages, str) else messages)
    if record.get("prompt") is not None:
        return Request(request_id, prompt=record["prompt"])
    if record.get("document") is not None:
        content = SUMMARIZE.format(document=record["document"])
        return Request(request_id, messages=[{"role": "user", "content": content}])
    raise ValueError(f"row {request_id} has no 'prompt', 'messages' or 'document' column")


def read_prompt_set(path: str, max_prompts: int | None, from_end: bool = False) -> list[Request]:
    """One prompt set from a file, directory or glob; ids default to ``<file stem>-<row>``."""
    requests = []
    for file in _files(path):
        requests += [_request(r, f"{file.stem}-{i}") for i, r in enumerate(_records(file))]
    if not requests:
        raise ValueError(f"no prompts in {path}")
    if max_prompts is None:
        return requests
    return requests[-max_prompts:] if from_end else requests[:max_prompts]


def _set_names(paths: list[str]) -> list[str]:
    stems = [Path(p.rstrip("/")).stem.replace("*", "") or f"set{i}" for i, p in enumerate(paths)]
    return [stem if stems.count(stem) == 1 else f"{stem}-{i}" for i, stem in enumerate(stems)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbatch bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", action="append", help="a prompt set (repeat for several; not with --overhead "
                        "or --shape-costs)")
    parser.add_argument("--max-prompts", type=int, help="use the first N prompts of each set")
    parser.add_argument("--from-end", action="store_true",
                        help="take the last N prompts instead (the rows a trained draft held out)")
    parser.add_argument("--output", default="specbatch-bench", help="directory for bench.csv/json/png")
    parser.add_argument("--grid", help="YAML grid file (see docs/bench.md); flags below override its sweeps")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--methods", nargs="+", choices=["ngram", "draft_model"])
    parser.add_argument("--widths", type=int, nargs="+", help="speculative.num_candidates values")
    parser.add_argument("--depths", type=int, nargs="+", help="speculative.num_speculative_tokens values")
    parser.add_argument("--candidate-inits", nargs="+", choices=["target", "draft"])
    parser.add_argument("--length-policies", nargs="+", choices=list(get_args(LengthPolicyName)))
    parser.add_argument("--quantizations", nargs="+", choices=["none", "auto", "gguf"],
                        help="the target's quantization values (auto, the default: a GGUF's blocks on a CPU; gguf: "
                             "the blocks; none: the float weights)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers generate")
    parser.add_argument("--no-assisted", action="store_true", help="skip transformers assisted generation")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (where llama-cpp-python is "
                        "installed and the model is a GGUF)")
    parser.add_argument("--turns", choices=["step", "chunk"],
                        help="contenders alternate every engine step (default) or every chunk of prompts")
    parser.add_argument("--baseline-tree", metavar="PATH",
                        help="another checkout (e.g. a worktree of an earlier commit) whose engine runs beside this "
                        "one: 'baseline engine ...' rows")
    parser.add_argument("--bandwidth-gbs", type=float,
                        help="the device's memory bandwidth in GB/s (default: a table of known GPUs, else a copy "
                        "measured here)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--overhead", action="store_true",
                       help="ms per step on a SmolLM2-shaped model of hidden size 64, against transformers")
    modes.add_argument("--shape-costs", choices=sorted(SHAPES),
                       help="time the engine's forwards on a model of this shape with random weights")
    modes.add_argument("--lora", type=int, nargs="+", metavar="COUNT",
                       help="LoRA adapters: a batch over each COUNT of distinct adapters, base rows beside adapter "
                            "rows, one adapter against merged weights (with --input; bench/lora.py)")
    parser.add_argument("--lora-rank", type=int, default=16, help="--lora: the adapters' rank (on q, k, v, o)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--overhead: rounds (the minimum is reported); --lora: rounds (the median)")
    parser.add_argument("--steps", type=int, default=32, help="--overhead: decode steps per round")
    parser.add_argument("--context", type=int, default=512, help="--shape-costs: cached positions per row")
    parser.add_argument("--repeats", type=int, default=20, help="--shape-costs: timed forwards per figure")
    parser.add_argument("--device", help="--overhead, --shape-costs: torch device (default: cuda if present)")
    return parser


def load_grid(args: argparse.Namespace) -> BenchGrid:
    grid = BenchGrid.model_validate(yaml.safe_load(Path(args.grid).read_text()) or {}) if args.grid else BenchGrid()
    quantization = [None if name == "none" else name for name in args.quantizations] if args.quantizations else None
    grid = grid.override(
        batch_sizes=args.batch_sizes, methods=args.methods, num_candidates=args.widths,
        num_speculative_tokens=args.depths, candidate_init=args.candidate_inits, length_policy=args.length_policies,
        quantization=quantization,
    )
    return grid.model_copy(update={
        "transformers": grid.transformers and not args.no_transformers,
        "assisted": grid.assisted and not args.no_assisted,
        "llama_cpp": grid.llama_cpp and not args.no_llama_cpp,
        "turns": args.turns or grid.turns,
    })


def write_outputs(rows: list[BenchRow], result_json: str, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    with (output / "bench.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(BenchRow.model_fields))
        writer.writeheader()
        writer.writerows(row.model_dump() for row in rows)
    (output / "bench.json").write_text(result_json)
    plot(rows, str(output / "bench.png"))


def _write_json(output: Path, name: str, text: str) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / name).write_text(text)
    print(f"wrote {output / name}")


def overhead_main(args: argparse.Namespace, baseline: Any) -> int:
    depth = args.depths[0] if args.depths else 5
    result = run_overhead(args.rounds, args.steps, args.batch_sizes, depth, baseline,
                          torch.device(args.device) if args.device else None, args.bandwidth_gbs)
    env = result.environment
    print(f"{env['device']} ({env['cpu_capability']}), {env['torch_threads']} threads, {env['dtype']}, "
          f"{env['timer']}, compiled forward: {env['compiled_forward']}; bandwidth {env['bandwidth_gbs']} GB/s "
          f"({env['bandwidth_source']}); {result.rounds} rounds of {result.steps} decode steps, minimum over rounds")
    print(format_overhead(result))
    _write_json(Path(args.output), "overhead.json", result.model_dump_json(indent=2))
    return 0


def shape_costs_main(args: argparse.Namespace) -> int:
    depth = args.depths[0] if args.depths else 5
    result = run_shape_costs(args.shape_costs, torch.device(args.device) if args.device else None, None,
                             args.batch_sizes, args.context, depth, args.repeats, args.bandwidth_gbs)
    print(f"{result.shape} on {result.device} ({result.dtype}); bandwidth {result.bandwidth_gbs} GB/s "
          f"({result.bandwidth_source}); weights: target {result.weight_bytes['target'] / 1e9:.2f} GB, "
          f"int4 self-draft {result.weight_bytes['draft'] / 1e9:.2f} GB")
    print(format_shape_costs(result))
    _write_json(Path(args.output), "shape_costs.json", result.model_dump_json(indent=2))
    return 0


def lora_main(args: argparse.Namespace, config: Any) -> int:
    if args.batch_sizes:
        config = config.model_copy(update={"batch_size": args.batch_sizes[0]})
    prompts = [request for path in args.input for request in read_prompt_set(path, args.max_prompts, args.from_end)]
    rows = run_lora_bench(config, prompts, args.lora, args.lora_rank, args.rounds, progress=log.info)
    print(f"LoRA rank {args.lora_rank} on q/k/v/o, batch {config.batch_size}, max_tokens {config.sampling.max_tokens}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(format_lora(rows))
    _write_json(Path(args.output), "lora.json", json.dumps([row.model_dump() for row in rows], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = build_parser()
    args, config = parse_with_config(parser, sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        baseline = load_baseline(args.baseline_tree) if args.baseline_tree else None
    except (OSError, ValueError, ImportError) as exc:
        parser.exit(2, f"{parser.prog}: error: --baseline-tree: {exc}\n")
    if args.shape_costs:
        return shape_costs_main(args)
    if args.overhead:
        return overhead_main(args, baseline)
    if not args.input:
        parser.error("--input is required (or --overhead, or --shape-costs)")
    if args.lora:
        return lora_main(args, config)
    try:
        grid = load_grid(args)
        paths = dict(zip(_set_names(args.input), args.input, strict=True))
        prompt_sets = {name: read_prompt_set(path, args.max_prompts, args.from_end) for name, path in paths.items()}
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        parser.exit(2, f"{parser.prog}: error: {exc}\n")

    def progress(row: BenchRow) -> None:
        log.info("%s | %s batch %d: %.1f tok/s", row.prompt_set, row.name, row.batch_size, row.tokens_per_s)

    try:
        result = run_bench(config, prompt_sets, grid, progress=progress, baseline=baseline,
                           bandwidth_gbs=args.bandwidth_gbs)
    except FileNotFoundError as exc:  # e.g. the draft alias before `specbatch train-draft` ran
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    write_outputs(result.rows, result.model_dump_json(indent=2), Path(args.output))
    env = result.environment
    print(f"{env['device']}, {env['torch_threads']} threads, {env['dtype']}, {env['timer']}; bandwidth "
          f"{env['bandwidth_gbs']} GB/s ({env['bandwidth_source']}); prompts per set: {result.prompt_sets}; "
          f"max_tokens {config.sampling.max_tokens}")
    print(format_table(result.rows))
    slower = sum(row.slower_than_none for row in result.rows)
    if slower:
        print(f"{slower} configuration(s) slower than engine none (flagged '<<').")
    print(f"wrote {args.output}/bench.csv, bench.json, bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
