"""``specbatch bench --shape-costs SHAPE``: what the engine's forwards cost on a model of a given shape.

A model of the shape (``SHAPES``: Llama-3-8B, or a tiny one for tests) gets random weights created directly on
the device in its dtype (bf16 on a GPU: an 8B model never exists in float32 on the host); throughput does not
depend on the weights. The engine's own pieces run: its lean forward (``lean_view``) through ``forward_tree``
over a ``PagedKVCache`` whose rows hold ``context`` cached positions each. Timed, at each batch size: the
target's plain decode forward (one token a row), its verification forward over a chain of ``depth`` drafted
tokens, and the int4 self-draft twin's decode forward (``quantized(model, "int4")``, as ``speculative.model:
target`` drafts). Each is reported in ms, bytes moved (weights read, and every row's cached keys and values) and
the share of the device's memory bandwidth, with the draft's cost over the target's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import BaseModel
from transformers import LlamaConfig, LlamaForCausalLM

from bench.harness import aligned, cell, megabytes, percent
from bench.measure import Bandwidth, Clock, ForwardBytes, bandwidth_fraction, device_bandwidth
from decoding.model.execution import default_execution
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import lean_view
from decoding.model.quantize import quantized
from decoding.verification.tree import chain_ancestors

log = logging.getLogger(__name__)

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
}
BLOCK_SIZE = 16


class ShapeCostRow(BaseModel):
    forward: str  # "target decode", "target verify d<D>", "int4 self-draft decode"
    batch_size: int
    tokens_per_row: int
    context: int
    ms: float
    bytes_per_step: float
    bandwidth_fraction: float
    x_target_decode: float | None  # ms over the target's decode forward at the same batch size


class ShapeCostResult(BaseModel):
    shape: str
    config: dict[str, Any]
    device: str
    dtype: str
    bandwidth_gbs: float
    bandwidth_source: str
    weight_bytes: dict[str, int]
    rows: list[ShapeCostRow]


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A model of ``shape`` with random weights, created on ``device`` in ``dtype``."""
    config = LlamaConfig(**SHAPES[shape])
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def _cache(config: LlamaConfig, rows: int, context: int, extra: int, dtype: torch.dtype, device: torch.device
           ) -> PagedKVCache:
    """A pool with ``rows`` rows of ``context`` cached positions (zeros) and room for ``extra`` more each."""
    positions = context + extra
    blocks = rows * -(-positions // BLOCK_SIZE)
    cache = PagedKVCache(CacheShape.of(config), blocks, rows, positions, block_size=BLOCK_SIZE, dtype=dtype,
                         device=device)
    cache.keys.zero_()
    cache.values.zero_()
    every = cache.add_rows([positions] * rows)
    cache.ensure(every, [positions] * rows)
    for row in range(rows):
        cache.host_lengths[row] = context
    return cache


@torch.no_grad()
def time_forward(model: torch.nn.Module, cache: PagedKVCache, batch: int, tokens: int, clock: Clock,
                 repeats: int, warm_up: int = 3) -> float:
    """Mean ms of the engine's forward over ``tokens`` chained nodes of rows [0, batch) (written at each row's
    committed length and never committed, so every repeat sees the same context)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=cache.device)
    ancestors, valid = chain_ancestors(tokens), torch.ones(batch, tokens, dtype=torch.bool)
    rows = slice(0, batch)
    for _ in range(warm_up):
        forward_tree(model, cache, rows, ids, ancestors, valid)
    clock.settle()
    seconds: list[float] = []
    with clock.span(seconds.append):
        for _ in range(repeats):
            forward_tree(model, cache, rows, ids, ancestors, valid)
    clock.settle()
    return 1e3 * seconds[0] / repeats


def run_shape_costs(
    shape: str, device: torch.device | None = None, dtype: torch.dtype | None = None,
    batch_sizes: list[int] | None = None, context: int = 512, depth: int = 5, repeats: int = 20,
    bandwidth_gbs: float | None = None,
) -> ShapeCostResult:
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    batch_sizes = sorted(batch_sizes or [1, 8, 64])
    log.info("building a %s-shaped model with random weights on %s (%s)", shape, device, dtype)
    model = random_model(shape, device, dtype)
    target = lean_view(model)
    draft = lean_view(quantized(model, "int4"))
    for view in (target, draft):
        view.prepare(default_execution(device))  # compiled where it compiles (a CPU), before any timing
    cache = _cache(model.config, max(batch_sizes), context, depth + 1, dtype, device)
    bandwidth: Bandwidth = device_bandwidth(device, bandwidth_gbs)
    clock = Clock(device)
    costs = {"target": ForwardBytes.of(target), "draft": ForwardBytes.of(draft)}
    forwards = [("target decode", target, 1, "target"), (f"target verify d{depth}", target, depth + 1, "target"),
                ("int4 self-draft decode", draft, 1, "draft")]
    rows: list[ShapeCostRow] = []
    for batch in batch_sizes:
        decode_ms = None
        for name, view, tokens, weights in forwards:
            ms = time_forward(view, cache, batch, tokens, clock, repeats)
            decode_ms = decode_ms or ms
            moved = float(costs[weights](batch * context))
            rows.append(ShapeCostRow(
                forward=name, batch_size=batch, tokens_per_row=tokens, context=context, ms=ms, bytes_per_step=moved,
                bandwidth_fraction=bandwidth_fraction(moved, ms, bandwidth) or 0.0,
                x_target_decode=ms / decode_ms,
            ))
            log.info("%s batch %d: %.3f ms", name, batch, ms)
    return ShapeCostResult(
        shape=shape, config=SHAPES[shape], device=torch.cuda.get_device_name(device) if device.type == "cuda"
        else "CPU", dtype=str(dtype).removeprefix("torch."), bandwidth_gbs=bandwidth.gbs,
        bandwidth_source=bandwidth.source, weight_bytes={k: v.weights for k, v in costs.items()}, rows=rows,
    )


_COLUMNS = [  # header, field, format
    ("forward", "forward", "{}"), ("batch", "batch_size", "{}"), ("tokens/row", "tokens_per_row", "{}"),
    ("context", "context", "{}"), ("ms", "ms", "{:.3f}"), ("MB/step", "bytes_per_step", megabytes),
    ("bw %", "bandwidth_fraction", percent), ("x target decode", "x_target_decode", "{:.3f}"),
]


def format_shape_costs(result: ShapeCostResult) -> str:
    lines = [[header for header, _, _ in _COLUMNS]]
    lines += [[cell(getattr(row, name), fmt) for _, name, fmt in _COLUMNS] for row in result.rows]
    return aligned(lines)
