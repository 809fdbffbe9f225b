"""``specbatch bench --overhead``: what a step costs besides the model's arithmetic.

The model has SmolLM2-135M's depth and structure (30 layers, 9 query and 3 key/value heads, a vocabulary of
49152, tied embeddings) but a hidden size of 64 (heads of 16), with random weights: its forward is nearly free,
so a step's time is the framework's. The engine's ms per decode step is set beside transformers ``generate``'s
ms per token, all contenders taking turns step by step (``harness._interleaved``) for several rounds (one chunk
of prompts each); a row's figure is the minimum over rounds (the round least disturbed by the rest of the
machine), its median is shown too.

Rows: plain decoding (``method: none``) and the default configuration at each batch size, and a speculative step
(n-gram lookup, a static depth) at batch 1. On this model a draft forward costs what the target's does, as on a
GPU where a small model's every forward is launch-bound, so the default's online policy should decode plainly:
its ms per emitted token over plain decoding's is what the policy and the drafter cost there (where it drafts
after all, the tokens its steps emit count). For the n-gram step
to draft at full depth, the random weights are set so that greedy decoding continues a cycle of tokens: the
prompts are the cycle repeated, lookup finds the next tokens one period back, and every draft is accepted
(drafted and accepted tokens per step are reported). With another checkout (``--baseline-tree``) its engine runs
beside this one in the same turns.
"""

from __future__ import annotations

import logging
import statistics
from types import ModuleType
from typing import Any

import torch
from pydantic import BaseModel
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.harness import (
    Contender,
    Models,
    _interleaved,
    _Measurement,
    aligned,
    bandwidth_fraction,
    cell,
    environment,
    megabytes,
    percent,
)
from decoding.config import Config
from decoding.model.execution import default_execution
from decoding.model.lean_forward import lean_view, supports_lean_forward

log = logging.getLogger(__name__)

# The issue's targets: the engine's ms per step over transformers' ms per token at the same batch size.
PLAIN_TARGET_BATCH_1 = 0.35
PLAIN_TARGET = 0.7  # larger batches
SPECULATIVE_TARGET_BATCH_1 = 0.7
CYCLE = 8  # tokens in the cycle the model continues (longer than the speculative depth: lookup drafts it whole)
PROMPT_TOKENS = 64


def overhead_config(hidden_size: int = 64, layers: int = 30, vocab_size: int = 49152) -> LlamaConfig:
    """SmolLM2-135M's structure at ``hidden_size`` (head size 16: the CPU attention kernel wants multiples of 16)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    # SmolLM2's 9 query heads over 3 key/value heads; transformers' check wants hidden_size = heads x head_dim, which
    # the model does not need (the projections are sized by heads x head_dim).
    config.num_attention_heads, config.num_key_value_heads = 9, 3
    return config


def cycle_tokens(vocab_size: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randperm(vocab_size - 3, generator=generator)[:CYCLE] + 3).tolist()


@torch.no_grad()
def overhead_model(config: LlamaConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    """Random weights, except that the first layer's MLP maps each token of ``cycle_tokens`` to the next, so greedy
    decoding continues the cycle: orthonormal directions u_k embed the cycle's tokens (with a shared direction w),
    and the MLP's gate reads w (saturated, so the MLP is linear in the up projection), its up projection reads
    u_k and its down projection writes u_(k+1), outweighing the rest of the residual stream."""
    config = config or overhead_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    hidden = config.hidden_size
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed)))[0]
    directions, shared = basis[:, :CYCLE], basis[:, CYCLE]
    tokens = cycle_tokens(config.vocab_size, seed)
    embedding = model.get_input_embeddings().weight
    embedding[tokens] = (directions + shared[:, None]).T
    mlp = model.model.layers[0].mlp
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        linear.weight.zero_()
    mlp.gate_proj.weight[:CYCLE] = shared
    mlp.up_proj.weight[:CYCLE] = directions.T
    mlp.down_proj.weight[:, :CYCLE] = directions.roll(-1, dims=1)
    return model


def numbered_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose token i is the text ``t<i>`` (0: padding, 1: BOS, 2: EOS): prompts are token ids."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", bos_token="t1", eos_token="t2")


def cycle_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of the cycle repeated, each starting at another point of it."""
    cycle = cycle_tokens(vocab_size, seed)
    return [[cycle[(start + i) % CYCLE] for i in range(PROMPT_TOKENS)] for start in range(count)]


class OverheadRow(BaseModel):
    name: str
    batch_size: int
    ms_per_step: float  # minimum over rounds of the round's decode time / decode steps
    median_ms_per_step: float
    rounds_ms: list[float]
    decode_steps: int
    drafted_per_step: float | None  # engine rows
    accepted_per_step: float | None
    bytes_per_step: float | None
    bandwidth_fraction: float | None
    x_transformers: float | None  # ms_per_step over transformers generate's (its ms per token), at batch 1 for
    # the n-gram row, else at the row's batch size
    tokens_per_step: float | None  # tokens a decode step emitted, all rows (engine rows)
    x_engine_none: float | None  # the default configuration's ms per emitted token over engine none's, same batch
    target: float | None  # the ratio this engine row must not exceed
    meets_target: bool | None


class OverheadResult(BaseModel):
    environment: dict[str, Any]
    model: dict[str, Any]
    rounds: int
    steps: int
    rows: list[OverheadRow]


def _engine_config(batch_size: int, max_tokens: int, method: str | None = "none", depth: int = 1) -> Config:
    """``method`` None: the engine's default speculative configuration."""
    speculative: dict[str, Any] = {} if method is None else {"method": method}
    if method not in (None, "none"):
        speculative.update(num_speculative_tokens=depth, num_candidates=1, length_policy="static")
    return Config(model="overhead", batch_size=batch_size, max_model_len=1024,
                  sampling={"max_tokens": max_tokens}, speculative=speculative)


def overhead_contenders(steps: int, batch_sizes: list[int], depth: int, baseline: bool,
                        default: bool = True) -> list[Contender]:
    """Per batch size: transformers generate, engine none (and the baseline's), and the engine's default
    configuration: on this model a draft forward costs what the target's does, so its policy should decode plainly
    and its row shows what planning and observing cost a step (the regime of a small model on a GPU). At batch 1
    also the depth-``depth`` n-gram step, given enough tokens to take ``steps`` steps when every draft is
    accepted.

    Every round of every contender has decode steps, whatever a policy decides: the step admitting a prompt
    prefills it and runs one step, so it emits up to the deepest draft plus two tokens, and the default
    configuration, whose online policy decides by the forward times it measures, gets that many more tokens."""
    runs = []
    for batch in sorted(batch_sizes):
        plain = _engine_config(batch, steps + 2)  # the step admitting a prompt may emit two tokens
        engines = [plain]
        if default:
            deepest = Config().speculative.num_speculative_tokens  # the default configuration's depth
            engines.append(_engine_config(batch, steps + 2 + deepest, None))
        if batch == 1 and depth:
            engines.append(_engine_config(1, steps * (depth + 1) + 1, "ngram", depth))
        runs.append(Contender("transformers", plain))
        for config in engines:
            runs.append(Contender("engine", config))
            if baseline:
                runs.append(Contender("baseline", config))
    return runs


def _round_ms(m: _Measurement) -> list[float]:
    return [1e3 * seconds / steps for seconds, steps in m.rounds if steps]


def run_overhead(
    rounds: int = 3, steps: int = 32, batch_sizes: list[int] | None = None, depth: int = 5,
    baseline: ModuleType | None = None, device: torch.device | None = None, bandwidth_gbs: float | None = None,
    config: LlamaConfig | None = None,
) -> OverheadResult:
    """Measure every contender of ``overhead_contenders`` for ``rounds`` rounds of ``steps`` decode steps."""
    batch_sizes = batch_sizes or [1, 64]
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    model = overhead_model(config)
    model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    models = Models(model, numbered_tokenizer(model.config.vocab_size), baseline=baseline,
                    bandwidth_gbs=bandwidth_gbs)
    execution = default_execution(device)  # the engines' own (the default configuration's)
    compiled = (supports_lean_forward(model) and execution.compile
                and lean_view(model).compiled() is not None)  # compiled now, untimed
    runs = overhead_contenders(steps, batch_sizes, depth, baseline is not None)
    bandwidth = models.bandwidth()
    rows: list[OverheadRow] = []
    for batch in sorted(batch_sizes):
        group = [c for c in runs if c.batch_size == batch]
        prompts = cycle_prompts(model.config.vocab_size, rounds * batch)
        by_id = {f"r{i // batch}-{i % batch}": p for i, p in enumerate(prompts)}

        def round_done(done: int, total: int, batch: int = batch) -> None:
            log.info("batch %d: round %d/%d done by every contender", batch, done, total)

        measured = _interleaved(models, group, by_id, round_done, "step", warm_up=prompts[0])
        for contender, m in zip(group, measured, strict=True):
            per_round = _round_ms(m)
            bytes_per_step = m.bytes_moved / m.decode_steps if m.decode_steps else None
            best = min(per_round)
            spec_steps = m.stats.num_spec_steps if m.stats is not None else 0
            rows.append(OverheadRow(
                name=contender.name, batch_size=batch, ms_per_step=best,
                median_ms_per_step=statistics.median(per_round),
                rounds_ms=per_round, decode_steps=m.decode_steps,
                drafted_per_step=m.drafted / m.decode_steps if contender.is_engine else None,
                tokens_per_step=m.decode_tokens / m.decode_steps if contender.is_engine else None,
                accepted_per_step=(m.stats.num_accepted_draft_tokens / spec_steps if spec_steps else 0.0)
                if contender.speculative else None,
                bytes_per_step=bytes_per_step,
                bandwidth_fraction=bandwidth_fraction(bytes_per_step, best, bandwidth),
                x_transformers=None, x_engine_none=None, target=None, meets_target=None,
            ))
    _compare_to_transformers(rows)
    env = environment(models) | {"compile_enabled": execution.compile, "compiled_forward": compiled}
    described = {"hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers,
                 "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
                 "head_dim": model.config.head_dim, "vocab_size": model.config.vocab_size,
                 "tied_embeddings": model.config.tie_word_embeddings, "prompt_tokens": PROMPT_TOKENS}
    return OverheadResult(environment=env, model=described, rounds=rounds, steps=steps, rows=rows)


def _compare_to_transformers(rows: list[OverheadRow]) -> None:
    transformers = {r.batch_size: r.ms_per_step for r in rows if r.name == "transformers generate"}
    plain = {r.batch_size: r.ms_per_step / r.tokens_per_step for r in rows if r.name == "engine none"
             and r.tokens_per_step}
    for row in rows:
        if row.name == "transformers generate":
            continue
        speculative = row.name.startswith("engine ngram")
        reference = transformers.get(1 if speculative else row.batch_size)
        if reference:
            row.x_transformers = row.ms_per_step / reference
        if row.name.startswith("engine draft_model") and row.batch_size in plain and row.tokens_per_step:
            row.x_engine_none = row.ms_per_step / row.tokens_per_step / plain[row.batch_size]
            continue
        if row.name.startswith("engine ") and row.x_transformers is not None:
            row.target = (SPECULATIVE_TARGET_BATCH_1 if speculative
                          else PLAIN_TARGET_BATCH_1 if row.batch_size == 1 else PLAIN_TARGET)
            row.meets_target = row.x_transformers <= row.target


_COLUMNS = [  # header, field, format
    ("contender", "name", "{}"), ("batch", "batch_size", "{}"), ("ms/step", "ms_per_step", "{:.2f}"),
    ("median", "median_ms_per_step", "{:.2f}"), ("x transformers", "x_transformers", "{:.2f}"),
    ("x engine none", "x_engine_none", "{:.2f}"), ("tokens/step", "tokens_per_step", "{:.2f}"),
    ("target", "target", "<= {:.2f}"), ("met", "meets_target", "{}"), ("drafted/step", "drafted_per_step", "{:.2f}"),
    ("accepted/step", "accepted_per_step", "{:.2f}"), ("MB/step", "bytes_per_step", megabytes),
    ("bw %", "bandwidth_fraction", percent), ("rounds ms", "rounds_ms", lambda v: " ".join(f"{x:.2f}" for x in v)),
]


def format_overhead(result: OverheadResult) -> str:
    lines = [[header for header, _, _ in _COLUMNS]]
    lines += [[cell(getattr(row, name), fmt) for _, name, fmt in _COLUMNS] for row in result.rows]
    return aligned(lines)
