"""``specbatch bench --lora``: what LoRA adapters cost (``decoding.model.lora``), side by side in one process.

Rows of one batch run under adapters made for the measurement (random rank-R matrices on q/k/v/o, PEFT's format,
in a temporary folder): for each count in the sweep, the batch's rows spread round-robin over that many distinct
adapters; a mixed batch, half its rows on the base model and half on one adapter; and an engine built on weights with
the first adapter merged in (what one job per adapter would run). Contenders take turns, rounds apart, and the
median of each is reported: tokens/s of the whole batch, and of the base rows alone in the mixed batch (per row,
against a base-only batch's per-row rate). Prefix caching is off: the rounds repeat the same prompts.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from pydantic import BaseModel
from safetensors.torch import save_file

from decoding.config import Config, LoraConfig
from decoding.engine import Engine, Request
from decoding.model.loading import load_model, load_tokenizer
from decoding.model.lora import ATTENTION, projection_shapes, read_adapter


class LoraRow(BaseModel):
    contender: str
    adapters: int  # distinct adapters in the batch
    rows: int
    tokens_per_s: float  # the whole batch's
    vs_base: float  # against the base-only batch (per row for the mixed batch's base rows)


def save_random_adapter(folder: Path, model_config, rank: int, seed: int) -> None:
    """A PEFT adapter folder of ``rank`` on q/k/v/o with random weights (small: it changes answers, nothing
    more)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(model_config), {}
    for layer in range(model_config.num_hidden_layers):
        for projection in ATTENTION:
            features_in, features_out = shapes[projection]
            key = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(ATTENTION)}))


def merged(config: Config, adapter: str, rank: int) -> torch.nn.Module:
    """The config's model with ``adapter`` merged into its weights (W + B A, scaling folded in)."""
    model = load_model(config.model, config.dtype)
    read = read_adapter("merged", adapter, model.config, rank)
    with torch.no_grad():
        for (layer, projection), (a, b) in read.weights.items():
            block = model.model.layers[layer]
            module = getattr(block.self_attn if projection in ATTENTION else block.mlp, projection)
            module.weight += (b @ a).to(module.weight)
    return model


def run_lora_bench(config: Config, prompts: list[Request], counts: list[int], rank: int = 16, rounds: int = 3,
                   progress=print) -> list[LoraRow]:
    """The sweep over ``counts`` distinct adapters, the mixed batch and the merged-weights engine, at the config's
    batch size (rows: the first ``batch_size`` prompts, repeated as needed)."""
    # Every round sends the same prompts: with prefix caching on, each contender's prefill would depend on what the
    # rounds before left cached (adapter rows' blocks, salted by adapter, evict base rows' blocks), not on LoRA.
    config = config.model_copy(update={"enable_prefix_caching": False})
    rows = config.batch_size
    batch = [prompts[i % len(prompts)] for i in range(rows)]
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    target = load_model(config.model, config.dtype)
    with tempfile.TemporaryDirectory(prefix="specbatch-lora-bench-") as scratch:
        return _measure(config, tokenizer, target, Path(scratch), batch, counts, rank, rounds, progress)


def _measure(config: Config, tokenizer, target, folder: Path, batch: list[Request], counts: list[int], rank: int,
             rounds: int, progress) -> list[LoraRow]:
    """The sweep with the adapters written under ``folder`` (removed by the caller when it returns)."""
    rows = len(batch)
    names = [f"adapter{i}" for i in range(max(counts))]
    for seed, name in enumerate(names):
        save_random_adapter(folder / name, target.config, rank, seed)
    lora = {"enable": True, "max_loras": max(counts), "max_cpu_loras": max(counts), "max_lora_rank": rank,
            "modules": {name: str(folder / name) for name in names}}
    engine = Engine(config.model_copy(update={"lora": LoraConfig.model_validate(lora)}), target=target,
                    tokenizer=tokenizer)
    merged_engine = Engine(config, target=merged(config, str(folder / names[0]), rank), tokenizer=tokenizer)
    contenders: dict[str, tuple[Engine, list[str | None]]] = {"base": (engine, [None] * rows)}
    for count in counts:
        contenders[f"{count} adapters"] = (engine, [names[i % count] for i in range(rows)])
    contenders["mixed: base rows"] = (engine, [None] * (rows // 2) + [names[0]] * (rows - rows // 2))
    contenders["merged weights"] = (merged_engine, [None] * rows)

    def run(name: str) -> tuple[float, float]:
        engine, layout = contenders[name]
        requests = [Request(id=str(i), prompt=r.prompt, messages=r.messages, prompt_token_ids=r.prompt_token_ids,
                            sampling=r.sampling, lora=adapter) for i, (r, adapter) in enumerate(zip(batch, layout))]
        started = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - started
        base = [len(r.token_ids) for r, adapter in zip(results, layout) if adapter is None]
        return sum(len(r.token_ids) for r in results) / seconds, sum(base) / max(len(base), 1) / seconds

    for name in contenders:  # warm: compiled stacks loaded, caches filled
        run(name)
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for round_ in range(rounds):
        for name in contenders:
            measured[name].append(run(name))
        progress(f"round {round_ + 1}/{rounds}: " + ", ".join(
            f"{name} {measured[name][-1][0]:.1f} tok/s" for name in contenders))
    total = {name: statistics.median(m[0] for m in values) for name, values in measured.items()}
    per_row = {name: statistics.median(m[1] for m in values) for name, values in measured.items()}
    out = []
    for name, (_, layout) in contenders.items():
        distinct = len({adapter for adapter in layout if adapter is not None})
        ratio = per_row[name] / per_row["base"] if name.startswith("mixed") else total[name] / total["base"]
        out.append(LoraRow(contender=name, adapters=distinct, rows=rows, tokens_per_s=round(total[name], 2),
                           vs_base=round(ratio, 3)))
    return out


def format_lora(rows: list[LoraRow]) -> str:
    lines = [f"{'contender':<20} {'adapters':>8} {'rows':>5} {'tok/s':>8} {'vs base':>8}"]
    lines += [f"{r.contender:<20} {r.adapters:>8} {r.rows:>5} {r.tokens_per_s:>8.1f} {r.vs_base:>8.3f}" for r in rows]
    by_name = {r.contender: r for r in rows}
    if "1 adapters" in by_name and "merged weights" in by_name:
        one, merged_weights = by_name["1 adapters"], by_name["merged weights"]
        lines.append(f"one adapter batched / its merged weights: {one.tokens_per_s / merged_weights.tokens_per_s:.3f}")
    return "\n".join(lines)
