"""``python -m jobs.eval_self_draft``: how well a quantized copy of the target drafts for it, per scheme.

For each scheme (``int4:32:int8`` = int4 groupsize 32 with an int8 LM head; a head left empty stays float;
``int4:32:int4:8`` = an int4 head whose 8 largest logits are recomputed in float, the default self-draft), on
prompt sets of your choice: the greedy top-1 agreement with the float target over the target's own greedy
continuations (teacher-forced, the rate a depth-1 draft is accepted at temperature 0), and the cost of one decode
forward relative to the target's (one row, one token, ``--context`` cached tokens; both through the engine's
inference views, timed interleaved, medians). Example:

    python -m jobs.eval_self_draft --input jobs/data/chat_prompts.jsonl \\
        --input ../shared/datasets/humaneval.jsonl --input ../shared/datasets/xsum_200.jsonl --max-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from decoding import Config, Engine
from decoding.drafting.costs import forward_timer
from decoding.model.loading import for_inference, load_model, load_tokenizer, use_torch_threads
from decoding.model.quantize import quantized
from jobs.bench import read_prompt_set


def parse_scheme(text: str) -> tuple[str, int, str | None, int]:
    """``scheme:groupsize:head:exact_top`` -> (scheme, groupsize, head scheme or None for float, exact top)."""
    scheme, _, rest = text.partition(":")
    groupsize, _, rest = rest.partition(":")
    head, _, exact_top = rest.partition(":")
    if scheme not in ("int4", "int8"):
        raise ValueError(f"unknown scheme {scheme!r} in {text!r}: int4 or int8")
    if head not in ("", "int4", "int8"):
        raise ValueError(f"unknown head scheme {head!r} in {text!r}: int4, int8 or empty (float)")
    return scheme, int(groupsize or 32), head or None, int(exact_top or 0)


def agreement(target: torch.nn.Module, draft: torch.nn.Module, sequences: list[tuple[int, list[int]]]) -> float:
    hits = total = 0
    with torch.no_grad():
        for prompt_length, tokens in sequences:
            ids = torch.tensor([tokens])
            want = target(ids).logits[0, prompt_length - 1 : -1].argmax(-1)
            got = draft(ids).logits[0, prompt_length - 1 : -1].argmax(-1)
            hits += int((want == got).sum())
            total += len(want)
    return hits / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input", action="append", required=True, help="a prompt set (repeatable)")
    parser.add_argument("--max-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--scheme", action="append", help="scheme:groupsize:head (repeatable)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    use_torch_threads(args.threads)
    schemes = [parse_scheme(s) for s in (args.scheme or ["int4:32:int4:8", "int4:32:int8", "int4:32:int4",
                                                          "int8::int8"])]

    device = torch.device("cpu")
    tokenizer = load_tokenizer(args.model)
    loaded = load_model(args.model, "float32", device)
    target = for_inference(loaded)
    config = Config.model_validate({
        "model": args.model, "speculative": {"method": "none"}, "batch_size": 1,
        "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens},
    })
    engine = Engine(config, target=loaded, tokenizer=tokenizer)
    sets: dict[str, list[tuple[int, list[int]]]] = {}
    for path in args.input:
        requests = read_prompt_set(path, args.max_prompts, from_end=True)
        results = engine.generate(requests)
        sets[path] = [(len(r.prompt_token_ids), r.prompt_token_ids + r.token_ids) for r in results]

    drafts = {f"{s}:{g}:{h or 'float'}" + (f":top{top}" if top else ""): for_inference(quantized(loaded, s, g, h, top))
              for s, g, h, top in schemes}
    timers = {"target": forward_timer(target, device, 1, 1, args.context)}
    timers.update({name: forward_timer(model, device, 1, 1, args.context) for name, model in drafts.items()})
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.repeats):
        for name, timer in timers.items():
            samples[name].append(timer())
    base = statistics.median(samples["target"])
    rows: list[dict[str, Any]] = []
    for name, model in drafts.items():
        row = {"scheme": name, "cost_vs_target": statistics.median(samples[name]) / base,
               "forward_ms": statistics.median(samples[name]) * 1e3}
        for path, sequences in sets.items():
            row[f"agreement {path.rsplit('/', 1)[-1]}"] = agreement(target, model, sequences)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"target_forward_ms": base * 1e3, "context": args.context, "threads": torch.get_num_threads()}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"rows": rows, "target_forward_ms": base * 1e3}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
