"""The GPU check: what speculation buys on one lent GPU, within one call (see tools/gpu/README.md).

1. The embedded SmolLM2-135M in bf16, greedy, on chat prompts and on code (HumanEval) at batch 1, 8 and 64: plain
   decoding captured (CUDA graphs) and eager, the default configuration, n-gram lookup, token recycling (width 2),
   the default with ``layer_skip: auto``; at batch 1 and temperature 1
   the int4 self-draft at widths 1, 2 and 4 (static depth 4), and at batch 1 static recycling trees of 16, 64 and
   256 nodes greedy and at temperature 1, against plain decoding. Contenders take turns, the first one rotating
   each round; every engine runs a batch once untimed first (graph capture, warm-up), each run on prompts of its
   own where the set has enough.
2. Step costs of a Llama-3-8B-shaped target (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336) with random
   bf16 weights, the vocabulary of SmolLM2's tokenizer: one forward of 1 token per row after 512 cached, at batch
   1 / 8 / 64, its bytes (weights + keys and values read) over its time against the card's memory bandwidth; the
   int4 self-draft's forward against it, whole and skipping the layer sets ``layer_skip: auto`` tries; trees'
   verification costs; and the speedups those costs give with the
   acceptance measured on the real model in part 1 (a projection: random weights accept nothing).

Writes gpu_check.json and gpu_check.md to --output after each batch, so a run cut short keeps what it measured;
a contender or part that fails is recorded and the rest go on. The parts can run in separate calls (``--skip``) and
their reports be merged afterwards (``--merge``): the projections need both.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from decoding.config import Config, ExecutionConfig
from decoding.drafting.costs import forward_timer
from decoding.drafting.draft_model import model_view
from decoding.drafting.layer_skip import candidate_skips, kept_layers
from decoding.engine import Engine, Request
from decoding.model.execution import Execution
from decoding.model.loading import load_model, load_tokenizer
from decoding.model.quantize import quantized
from decoding.verification.tree import TreeTopology

log = logging.getLogger("gpu-check")
CHAT = Path(__file__).resolve().parents[2] / "jobs" / "data" / "chat_prompts.jsonl"
# Peak memory bandwidth by card (bytes/s, the vendors' sheets): what a decode step at batch 1 can approach.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100": 3.35e12, "A100": 2.0e12}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


@dataclass
class Contender:
    name: str
    speculative: dict[str, Any]
    execution: dict[str, Any] = field(default_factory=dict)  # the config's ``execution`` (empty: the default)
    temperature: float = 0.0


@dataclass
class Tally:
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def requests(prompts: list[dict[str, Any]], max_tokens: int, temperature: float, tag: str) -> list[Request]:
    sampling = {"temperature": temperature, "max_tokens": max_tokens, "seed": 0 if temperature else None}
    return [Request(f"{tag}-{i}", prompt=p.get("prompt"), messages=p.get("messages"), sampling=sampling)
            for i, p in enumerate(prompts)]


def run_once(engine: Engine, batch: list[Request], tally: Tally | None, fresh_table: bool = False) -> None:
    """One timed ``generate``; ``fresh_table``: a recycling drafter starts from an empty table."""
    table = getattr(engine.drafter, "table", None)
    if fresh_table and table is not None:
        table.fill_(-1)
    device = engine.device
    steps = engine.steps
    sync(device)
    started = time.perf_counter()
    results = engine.generate(batch)
    sync(device)
    seconds = time.perf_counter() - started
    errors = [r.error for r in results if r.finish_reason == "error"]
    if errors:
        raise RuntimeError(errors[0])
    if tally is not None:
        tally.seconds += seconds
        tally.steps += engine.steps - steps
        tally.tokens += sum(len(r.token_ids) for r in results)
        for r in results:
            tally.drafted += list(r.per_step_drafted)
            tally.accepted += list(r.per_step_accepted)


def build(contender: Contender, batch: int, target: torch.nn.Module, tokenizer: Any, max_positions: int) -> Engine:
    config = Config.model_validate({
        "speculative": contender.speculative, "batch_size": batch, "max_model_len": max_positions,
        # A pool of its own per engine, sized to the work (the default takes most of the card).
        "num_kv_blocks": batch * (max_positions // 16 + 4), "execution": contender.execution,
    })
    return Engine(config, target=target, tokenizer=tokenizer)


def compare(engines: dict[str, Engine], contenders: list[Contender], batches: dict[str, list[list[Request]]],
            rounds: int, failures: dict[str, str], fresh_tables: bool = False) -> dict[str, Tally]:
    """Tallies of the contenders that ran every round; a contender that fails is dropped, its error in
    ``failures``, and the others go on. ``batches[name][run]``: the requests of the warm-up (run 0) and of each
    round; ``fresh_tables``: recycling contenders start every run with an empty table."""
    tallies = {c.name: Tally() for c in contenders}
    live = list(contenders)

    def attempt(c: Contender, tally: Tally | None, run: int) -> None:
        try:
            run_once(engines[c.name], batches[c.name][run], tally, fresh_tables)
        except Exception as exc:
            log.error("%s failed: %s", c.name, traceback.format_exc())
            failures[c.name] = f"{type(exc).__name__}: {exc}"
            live.remove(c)

    for c in list(live):  # untimed: captures, warm-up
        attempt(c, None, 0)
    for r in range(rounds):
        order = live[r % max(len(live), 1):] + live[: r % max(len(live), 1)]
        for c in order:
            attempt(c, tallies[c.name], r + 1)
    return {c.name: tallies[c.name] for c in live}


def tokens_per_step_by_depth(tally: Tally, depth: int) -> dict[int, float]:
    """Greedy chains: a chain cut at depth d accepts min(a, d) of the a a depth-``depth`` chain accepted."""
    steps = [a for d, a in zip(tally.drafted, tally.accepted) if d >= depth] or [0]
    return {d: 1 + sum(min(a, d) for a in steps) / len(steps) for d in range(1, depth + 1)}


def smollm2_contenders(batch: int) -> list[Contender]:
    plain = {"method": "none"}
    reference = {"kernels": "reference"}
    greedy = [Contender("plain", plain), Contender("plain-eager", plain, execution={"graphs": "off"}),
              Contender("plain-reference", plain, execution=reference), Contender("default", {}),
              Contender("default-reference", {}, execution=reference), Contender("ngram", {"method": "ngram"}),
              Contender("recycle", {"method": "recycle", "num_candidates": 2}),
              # Up to 8 successors a node: a tree of 256 // batch nodes, cut per row by the online policy.
              Contender("recycle-w8", {"method": "recycle", "num_candidates": 8}),
              Contender("layer-skip-auto", {"layer_skip": "auto"})]
    if batch != 1:
        return greedy
    self_draft = {"method": "draft_model", "model": "target", "num_speculative_tokens": 4, "length_policy": "static"}
    sampled = [Contender("plain-t1", plain, temperature=1.0)] + [
        Contender(f"width{w}-t1", {**self_draft, "num_candidates": w}, temperature=1.0) for w in (1, 2, 4)]
    # Static recycling trees of several sizes (width 8: up to 8 children a node), greedy and sampled.
    recycling = {"method": "recycle", "num_candidates": 8, "num_speculative_tokens": 6, "length_policy": "static"}
    trees = [Contender(f"recycle{n}{suffix}", {**recycling, "tree_nodes": n}, temperature=temperature)
             for n in (16, 64, 256) for suffix, temperature in (("", 0.0), ("-t1", 1.0))]
    return greedy + sampled + trees + [Contender("chain5", {**self_draft, "num_speculative_tokens": 5})]


def part_smollm2(args: argparse.Namespace, device: torch.device, report: dict[str, Any], save: Any) -> None:
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = load_model("smollm2-135m-instruct", "auto", device)
    chat = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()]
    code = [{"prompt": json.loads(line)["prompt"]} for line in Path(args.code).read_text().splitlines()
            if line.strip()] if args.code else []
    prompt_sets = {"chat": chat, **({"code": code} if code else {})}
    rows = report.setdefault("smollm2", [])
    for batch in args.batches:
        if time.monotonic() > args.deadline:
            log.warning("out of time before batch %d", batch)
            report.setdefault("errors", []).append(f"smollm2: out of time before batch {batch}")
            break
        contenders = [c for c in smollm2_contenders(batch) if not args.contenders or c.name in args.contenders]
        engines: dict[str, Engine] = {}
        for c in contenders:
            try:
                engines[c.name] = build(c, batch, target, tokenizer, args.max_positions)
            except Exception as exc:  # recorded; the others still run
                log.error("%s at batch %d did not build: %s", c.name, batch, traceback.format_exc())
                rows.append({"batch": batch, "contender": c.name, "error": f"build: {type(exc).__name__}: {exc}"})
        contenders = [c for c in contenders if c.name in engines]
        for set_name, prompts in prompt_sets.items():
            # Each run (the warm-up, then every round) decodes prompts of its own as far as the set has them: a
            # recycling table learns the text it decodes, and a prompt decoded twice would find its continuation
            # there. Where the set is too small, the rounds wrap around it, and recycling contenders start each run
            # with an empty table.
            take = batch * args.prompt_batches
            runs = args.rounds + 1
            chosen = (prompts * (runs * take // len(prompts) + 1))[: runs * take]
            wraps = runs * take > len(prompts)
            batches = {c.name: [requests(chosen[run * take : (run + 1) * take], args.max_tokens, c.temperature,
                                         f"{set_name}{batch}-{run}") for run in range(runs)] for c in contenders}
            failures: dict[str, str] = {}
            tallies = compare(engines, contenders, batches, args.rounds, failures, wraps)
            rows += [{"batch": batch, "prompts": set_name, "contender": name, "error": error}
                     for name, error in failures.items()]
            for c in contenders:
                base = tallies.get("plain-t1" if c.temperature else "plain")
                if c.name not in tallies or base is None:
                    continue
                t = tallies[c.name]
                rows.append({
                    "batch": batch, "prompts": set_name, "contender": c.name, "temperature": c.temperature,
                    "execution": c.execution or "default",
                    "tokens": t.tokens, "steps": t.steps, "seconds": round(t.seconds, 4),
                    "tok_per_s": round(t.tokens / t.seconds, 1), "ms_per_step": round(1e3 * t.seconds / t.steps, 3),
                    "tokens_per_step": round(t.tokens / t.steps / batch, 3),
                    "vs_plain": round((t.tokens / t.seconds) / (base.tokens / base.seconds), 3),
                })
                log.info("batch %d %s %s: %s", batch, set_name, c.name, rows[-1])
            if batch == 1 and set_name == "chat":
                if "chain5" in tallies:
                    report["chain_tokens_per_step"] = tokens_per_step_by_depth(tallies["chain5"], 5)
                for name, t in tallies.items():
                    if name.startswith(("width", "recycle")):
                        report.setdefault("width_tokens_per_step", {})[name] = t.tokens / t.steps
            save()
        del engines
        torch.cuda.empty_cache() if device.type == "cuda" else None


def part_shape_costs(args: argparse.Namespace, device: torch.device, report: dict[str, Any], save: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = args.vocab or len(load_tokenizer("smollm2-135m-instruct"))
    shape = dict(LLAMA3_8B) if not args.tiny_shape else dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=500000.0)
    config = LlamaConfig(vocab_size=vocab, **shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("built the %s-shaped model in %.1f s", "tiny" if args.tiny_shape else "Llama-3-8B",
             time.perf_counter() - started)
    target = model_view(model)
    draft = model_view(quantized(model, "int4"))
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if "embed_tokens" not in name)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * torch.finfo(dtype).bits // 8
    peak = peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    cached = args.cached
    costs: dict[str, Any] = {"weights_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                             "peak_bandwidth": peak, "cached": cached, "rows": []}
    report["shape_costs"] = costs

    def timed(model: torch.nn.Module, batch: int, tokens: int, graphs: bool = False) -> float:
        execution = Execution.resolve(ExecutionConfig(graphs="auto" if graphs else "off"), device, quiet=True)
        timer = forward_timer(model, device, batch, tokens, cached, captured=graphs, execution=execution)
        return min(timer() for _ in range(args.repeats))

    def replayed(model: torch.nn.Module, batch: int, tokens: int) -> float:
        """As the engine runs it: replayed from a graph captured at build (its target's decode and verification
        forwards, a self-draft's levels); eager where the capture fails, which the report names."""
        try:
            return timed(model, batch, tokens, graphs=True)
        except Exception as exc:
            log.error("captured forward failed: %s", traceback.format_exc())
            report.setdefault("errors", []).append(
                f"shape: captured forward of {tokens} tokens at batch {batch}: {type(exc).__name__}: {exc}")
            return timed(model, batch, tokens)

    topologies = {w: TreeTopology(w, 4) for w in (1, 2, 4)}
    for batch in args.batches:
        if time.monotonic() > args.deadline:
            report.setdefault("errors", []).append(f"shape: out of time before batch {batch}")
            break
        plain = timed(target, batch, 1)
        moved = weight_bytes + batch * (cached + 1) * kv_per_token
        row: dict[str, Any] = {"batch": batch, "target_eager_ms": round(plain * 1e3, 3), "bytes_per_step": moved}
        costs["rows"].append(row)
        captured = replayed(target, batch, 1)
        row.update({"target_ms": round(captured * 1e3, 3), "bandwidth": round(moved / captured / 1e9, 1)})
        if peak:
            row["bandwidth_fraction"] = round(moved / captured / peak, 3)
        # Priced as the engine runs them: the self-draft's levels and the verifications replayed (eager beside them).
        row["draft_ms"] = {w: round(replayed(draft, batch, w) * 1e3, 3) for w in (1, 2, 4)}
        row["draft_eager_ms"] = round(timed(draft, batch, 1) * 1e3, 3)
        row["draft_over_target"] = round(row["draft_ms"][1] / row["target_ms"], 3)
        # The layer-skipping draft's candidate sets (``layer_skip: auto``): each one's forward against the target's.
        row["skip_draft_over_target"] = {
            len(skipped): round(replayed(draft.with_layers(kept_layers(draft.num_layers, skipped)), batch, 1)
                                / captured, 3)
            for skipped in candidate_skips(draft.num_layers)[1:]}
        row["verify_ms"] = {d: round(replayed(target, batch, d + 1) * 1e3, 3) for d in range(1, 6)}
        row["tree_verify_ms"] = {w: round(replayed(target, batch, t.size(4)) * 1e3, 3) for w, t in topologies.items()}
        log.info("shape costs at batch %d: %s", batch, row)
        save()


def project(report: dict[str, Any]) -> None:
    """The speedups the shape's step costs give with the real model's acceptance: tokens per step over the
    step's forwards (draft levels and verification replayed, as the engine runs them) against replayed plain
    decoding."""
    chain = report.get("chain_tokens_per_step", {})
    widths = report.get("width_tokens_per_step", {})
    for row in report.get("shape_costs", {}).get("rows", []):
        if "verify_ms" not in row:
            continue
        plain, draft = row.get("target_ms", row["target_eager_ms"]), {int(w): v for w, v in row["draft_ms"].items()}
        verify = {int(d): v for d, v in row["verify_ms"].items()}
        trees = {int(w): v for w, v in row["tree_verify_ms"].items()}
        row["projected_chain"] = {int(d): round(tau * plain / (int(d) * draft[1] + verify[int(d)]), 3)
                                  for d, tau in chain.items()}
        row["projected_width_t1"] = {
            name: round(tau * plain / (4 * draft[w] + trees[w]), 3)
            for w in (1, 2, 4) if (name := f"width{w}-t1") in widths for tau in [widths[name]]}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# GPU check: {env.get('device')}", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, {env.get('python')}; "
             f"{report.get('seconds', 0):.0f} s", ""]
    rows = [r for r in report.get("smollm2", []) if "tok_per_s" in r]
    if rows:
        lines += ["## SmolLM2-135M-Instruct, bf16", "",
                  "| batch | prompts | contender | T | execution | tok/s | ms/step | tokens/step/row | vs plain |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['prompts']} | {r['contender']} | {r['temperature']:g} | "
                  f"{r.get('execution', '-')} | {r['tok_per_s']} | {r['ms_per_step']} | {r['tokens_per_step']} | "
                  f"{r['vs_plain']}x |" for r in rows]
        lines.append("")
    errors = [f"{r.get('batch')} {r.get('prompts', '')} {r.get('contender', '')}: {r['error']}"
              for r in report.get("smollm2", []) if "error" in r] + report.get("errors", [])
    costs = report.get("shape_costs")
    if costs and costs.get("rows"):
        lines += ["## Llama-3-8B shape, random bf16 weights: one forward after "
                  f"{costs['cached']} cached tokens", "",
                  "| batch | target ms (graph) | eager | GB/s | of peak | int4 draft ms (graph / eager) | "
                  "draft / target (graph) | skipping k layers: draft / target | projected depth 1..5 | "
                  "projected widths 1/2/4, T=1 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in costs["rows"]:
            chain = " / ".join(f"{v}x" for v in r.get("projected_chain", {}).values()) or "-"
            widths = " / ".join(f"{v}x" for v in r.get("projected_width_t1", {}).values()) or "-"
            draft = r.get("draft_ms", {})
            draft_1 = draft.get(1, draft.get("1", "-"))
            skips = ", ".join(f"{k}: {v}" for k, v in r.get("skip_draft_over_target", {}).items()) or "-"
            lines.append(f"| {r['batch']} | {r.get('target_ms', '-')} | {r['target_eager_ms']} | "
                         f"{r.get('bandwidth', '-')} | {r.get('bandwidth_fraction', '-')} | "
                         f"{draft_1} / {r.get('draft_eager_ms', '-')} | {r.get('draft_over_target', '-')} | "
                         f"{skips} | {chain} | {widths} |")
        lines.append("")
    if errors:
        lines += ["## Failures", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(lines)


def write(report: dict[str, Any], output: Path) -> None:
    project(report)
    (output / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (output / "gpu_check.md").write_text(markdown(report))


def merge(paths: list[str]) -> dict[str, Any]:
    """Reports of separate calls (each ran some parts) as one: later files add to and override earlier ones."""
    report: dict[str, Any] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        report["errors"] = report.get("errors", []) + part.pop("errors", [])
        report["smollm2"] = report.get("smollm2", []) + part.pop("smollm2", [])
        report.update(part)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--code", help="HumanEval JSONL (prompt fields)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--prompt-batches", type=int, default=1, help="batches of prompts per timed run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cached", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; parts stop starting work after it")
    parser.add_argument("--tiny-shape", action="store_true", help="a small stand-in for the 8B shape (CPU tests)")
    parser.add_argument("--vocab", type=int, help="the shape's vocabulary (default: SmolLM2's tokenizer's)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["smollm2", "shape"])
    parser.add_argument("--contenders", nargs="*", help="only these SmolLM2 contenders (plain, default, ngram, ...)")
    parser.add_argument("--merge", nargs="+", help="merge these gpu_check.json files into --output and stop")
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    if args.merge:
        report = merge(args.merge)
        write(report, output)
        print(markdown(report))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    device = torch.device(args.device)
    import transformers

    report: dict[str, Any] = {"environment": {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
    }}

    def save() -> None:
        report["seconds"] = time.monotonic() - started
        write(report, output)

    parts = [(name, part) for name, part in (("smollm2", part_smollm2), ("shape", part_shape_costs))
             if name not in args.skip]
    for index, (name, part) in enumerate(parts):
        # Each part may use its share of what is left of the budget.
        args.deadline = time.monotonic() + (started + args.budget - time.monotonic()) / (len(parts) - index) * 0.8
        try:
            part(args, device, report, save)
        except Exception as exc:
            log.error("%s failed: %s", name, traceback.format_exc())
            report.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
        save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
