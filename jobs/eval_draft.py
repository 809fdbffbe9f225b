"""``python -m jobs.eval_draft``: how good a trained draft (and its length policies) is, side by side in one run.

On the prompts a draft-training config held out (the rows after each source's ``limit``), at temperature 0 and
batch 1, every method decodes every prompt in turn (so a load change on the machine hits all methods alike):
transformers ``generate``, the engine without speculation, the engine with the draft at several static depths,
and with the ``threshold`` / ``decision`` policies when their artifacts exist. Reports tokens/s, speedup over
``generate``, mean acceptance length, whether every output equals ``generate``'s, and the draft's cost per token
relative to the target's. ``--draft`` several times compares drafts in the same run. Example (after the commands
of docs/training.md):

    python -m jobs.eval_draft --config jobs/configs/smollm2_draft.yaml --output eval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from decoding import Config, Engine, Request
from decoding.drafting.costs import forward_timer
from decoding.drafting.draft_model import DraftModelDrafter
from decoding.model.loading import for_inference, load_model, load_tokenizer, resolve_model_path
from training.data import PromptSource, read_rows, row_prompt_ids


def held_out_prompts(sources: list[PromptSource], tokenizer, per_source: int) -> list[tuple[str, list[int]]]:
    prompts = []
    for source in sources:
        rows = read_rows(source.path)[source.limit :][:per_source]
        name = Path(source.path).stem
        prompts += [(f"{name}-{i}", row_prompt_ids(row, source.model_copy(update={"limit": None}), tokenizer))
                    for i, row in enumerate(rows)]
    return prompts


def method_name(drafts: dict[str, str], label: str, method: str) -> str:
    """A draft's method row, named after the draft when several are compared."""
    return f"{label}: {method}" if len(drafts) > 1 else method


def methods(drafts: dict[str, str], depths: list[int], thresholds: list[float]) -> dict[str, dict[str, Any] | None]:
    """Name -> speculative config (None: transformers generate), for each draft (label -> directory)."""
    table: dict[str, dict[str, Any] | None] = {"transformers generate": None, "engine none": {"method": "none"}}
    deepest = max(depths)
    for label, draft in drafts.items():
        chain = {"method": "draft_model", "model": draft, "num_candidates": 1}
        for depth in depths:
            table[method_name(drafts, label, f"static depth {depth}")] = {
                **chain, "num_speculative_tokens": depth, "length_policy": "static"}
        head, decision = Path(draft) / "acceptance_head", Path(draft) / "decision_model"
        if (head / "head.json").exists():
            for threshold in thresholds:
                table[method_name(drafts, label, f"threshold {threshold} (max {deepest})")] = {
                    **chain, "num_speculative_tokens": deepest, "length_policy": "threshold",
                    "acceptance_head": str(head), "stop_threshold": threshold}
        if (decision / "head.json").exists():
            table[method_name(drafts, label, f"decision (max {deepest})")] = {
                **chain, "num_speculative_tokens": deepest, "length_policy": "decision",
                "decision_model": str(decision)}
    return table


def time_drafting(drafter: DraftModelDrafter) -> dict[str, float]:
    """Wrap ``propose`` to accumulate drafting seconds and draft forwards (the drafter's whole per-level cost)."""
    totals = {"seconds": 0.0, "forwards": 0}
    propose = drafter.propose

    def timed(inputs):
        start = time.perf_counter()
        draft = propose(inputs)
        totals["seconds"] += time.perf_counter() - start
        totals["forwards"] += draft.forwarded_levels
        return draft

    drafter.propose = timed
    return totals


def forward_seconds(model: torch.nn.Module, context: int = 256, repeats: int = 20) -> float:
    """One decode forward (1 new token after ``context`` cached ones), batch 1, through the engine's forward:
    median seconds."""
    timer = forward_timer(model, torch.device("cpu"), 1, 1, context)
    return statistics.median(timer() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.eval_draft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="jobs/configs/smollm2_draft.yaml", help="the draft-training config")
    parser.add_argument("--draft", action="append",
                        help="draft directory or alias, repeatable to compare drafts (default: the config's output)")
    parser.add_argument("--per-source", type=int, default=16, help="held-out prompts per data source")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depths", default="2,3,4,5,6,8", help="static depths (5 = the acceptance criterion)")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9", help="stop_threshold values for the head")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    training = yaml.safe_load(Path(args.config).read_text())
    target_name = training.get("target", "smollm2-135m-instruct")
    names = args.draft or [training["output"]]
    short = [Path(name).name for name in names]
    labels = short if len(set(short)) == len(short) else names  # directory names unless two are alike
    drafts = {label: resolve_model_path(name) for label, name in zip(labels, names, strict=True)}
    tokenizer = load_tokenizer(target_name)
    target = load_model(target_name, "float32", torch.device("cpu"))
    prompts = held_out_prompts([PromptSource(**s) for s in training["data"]], tokenizer, args.per_source)
    depths = [int(d) for d in args.depths.split(",")]
    table = methods(drafts, depths, [float(t) for t in args.thresholds.split(",")])
    engines = {}
    for name, spec in table.items():
        if spec is not None:
            config = Config.model_validate({"model": target_name, "batch_size": 1, "speculative": spec,
                                            "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens}})
            engines[name] = Engine(config, target=target, tokenizer=tokenizer)  # loads its own draft copy
    stats = {name: {"tokens": 0, "seconds": 0.0, "spec": None, "identical": 0} for name in table}
    # Each draft's drafting time at its deepest static depth, for its cost in the engine.
    timed = {label: engines[method_name(drafts, label, f"static depth {max(depths)}")] for label in drafts}
    drafting = {label: time_drafting(engine.drafter) for label, engine in timed.items()}
    reference: dict[str, list[int]] = {}
    for number, (pid, ids) in enumerate([("warmup", prompts[0][1][:32]), *prompts]):
        for name in table:
            start = time.perf_counter()
            if name in engines:
                result = engines[name].generate([Request(id=pid, prompt_token_ids=ids)])[0]
                tokens, measured = result.token_ids, result.stats
            else:
                input_ids = torch.tensor([ids])
                out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=args.max_tokens, top_p=None, top_k=None, temperature=None)
                tokens, measured = out[0, len(ids):].tolist(), None
                reference[pid] = tokens
            seconds = time.perf_counter() - start
            if number == 0:
                continue  # warm-up: first-call allocations and lazy initialisation
            entry = stats[name]
            entry["tokens"] += len(tokens)
            entry["seconds"] += seconds
            if measured is not None:  # decoding.stats: the one definition of the acceptance metrics
                entry["spec"] = measured if entry["spec"] is None else entry["spec"] + measured
            entry["identical"] += int(tokens == reference[pid])
        print(f"[{number}/{len(prompts)}] {pid} done", file=sys.stderr, flush=True)

    base = stats["transformers generate"]["tokens"] / stats["transformers generate"]["seconds"]
    rows = []
    for name, entry in stats.items():
        speed = entry["tokens"] / entry["seconds"]
        rows.append({"method": name, "tokens_per_s": round(speed, 2), "speedup_vs_generate": round(speed / base, 3),
                     "mean_acceptance_length": round(entry["spec"].mean_acceptance_length, 3) if entry["spec"]
                     else None, "identical_to_generate": f"{entry['identical']}/{len(prompts)}"})
    target_forward = forward_seconds(for_inference(target))
    plain = stats["engine none"]
    costs = {}
    for label, engine in timed.items():
        cost = {"draft_forward_s": forward_seconds(engine.drafter.model), "target_forward_s": target_forward}
        cost["draft_cost_ratio"] = cost["draft_forward_s"] / target_forward
        if drafting[label]["forwards"]:
            # In the engine: drafting seconds per draft forward, against the plain engine's seconds per token.
            cost["engine_draft_level_s"] = drafting[label]["seconds"] / drafting[label]["forwards"]
            cost["engine_step_s"] = plain["seconds"] / plain["tokens"]
            cost["engine_draft_cost_ratio"] = cost["engine_draft_level_s"] / cost["engine_step_s"]
        costs[label] = cost
    print("| method | tokens/s | speedup vs generate | mean acceptance length | identical to generate |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['tokens_per_s']} | {row['speedup_vs_generate']}x | "
              f"{row['mean_acceptance_length'] or '-'} | {row['identical_to_generate']} |")
    for label, cost in costs.items():
        print(f"{label}: draft forward {cost['draft_forward_s'] * 1e3:.1f} ms vs target "
              f"{cost['target_forward_s'] * 1e3:.1f} ms per token: cost ratio {cost['draft_cost_ratio']:.3f}")
        if "engine_draft_cost_ratio" in cost:
            print(f"{label}: in the engine {cost['engine_draft_level_s'] * 1e3:.1f} ms per draft level vs "
                  f"{cost['engine_step_s'] * 1e3:.1f} ms per plain decode step: "
                  f"ratio {cost['engine_draft_cost_ratio']:.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens,
                                                 "threads": args.threads, "rows": rows, "costs": costs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
