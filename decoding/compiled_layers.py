"""An int4 Llama draft's layer math compiled ahead of time (AOTInductor), for the lean draft forward on a CPU.

Why: at batch 1 a draft forward of the int4 twin of SmolLM2-135M is mostly small eager ops between the int4
kernels (norms, casts, rotary, residual adds, SiLU): ~240 us of a layer's math where the kernels need ~90. Two
compiled graphs per layer run the same math as fused C++ loops around the same kernels: 82 -> 42 us before the
attention and 159 -> 119 us after it (one row, this project's CPU, hot loop), 15.8 -> ~13 ms per forward.

What: ``before_attention`` is RMSNorm -> fused q|k|v int4 kernel -> rotary on the query and key heads;
``after_attention`` is o_proj + residual -> RMSNorm -> fused gate|up -> SiLU(gate) * up -> down_proj + residual.
The KV cache writes and the attention stay eager between them (they address the cache's rows). Weights are graph
inputs, so one compiled graph serves every layer; rows x tokens is one dynamic dimension.

Compiled once per machine (~25 s for SmolLM2-135M's shapes, logged) into ``cache_dir()/compiled``, keyed by torch
version, CPU capability and the layer shapes; later processes (Ray actors, the next job) load it in milliseconds.
Wherever it cannot be used (not a CPU, a layer that is not plain int4 without bias, ``SPECBATCH_COMPILE=0``, or a
compilation that fails, e.g. no C++ compiler) the eager lean forward runs: same law, only slower.
Numerics: the fused loops may round differently from eager ops in the last bits; verification accepts against the
law the draft actually drafted from, so outputs are unchanged (greedy identity and the chi-square tests hold).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from decoding.models import cache_dir

log = logging.getLogger(__name__)

# Packages compiled from another version of this file are not loaded: its source is part of their key.
_SOURCE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
_lock = threading.Lock()  # engines built on threads of one process compile each shape once
_loaded: dict[str, CompiledLayers | None] = {}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int
    head_dim: int
    query_heads: int
    kv_heads: int
    intermediate: int
    groupsize: int
    eps: float


def _int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, groupsize: int) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scales.dtype), packed, groupsize, scales)


class _BeforeAttention(torch.nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, hidden: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor, qkv_scales: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.shape
        x = torch.nn.functional.rms_norm(hidden, (shape.hidden,), norm, shape.eps)
        heads = _int4(x, qkv, qkv_scales, shape.groupsize).to(hidden.dtype).unflatten(-1, (-1, shape.head_dim))
        rotated = shape.query_heads + shape.kv_heads
        q_and_k = heads[:, :rotated]  # sin: its first half negated, so roll(x) * sin is rotate_half(x) * sin
        q_and_k = q_and_k * cos[:, None] + q_and_k.roll(shape.head_dim // 2, -1) * sin[:, None]
        return q_and_k, heads[:, rotated:]


class _AfterAttention(torch.nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, hidden: torch.Tensor, attended: torch.Tensor, o: torch.Tensor, o_scales: torch.Tensor,
                norm: torch.Tensor, gate_up: torch.Tensor, gate_up_scales: torch.Tensor, down: torch.Tensor,
                down_scales: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        hidden = hidden + _int4(attended, o, o_scales, shape.groupsize)
        x = torch.nn.functional.rms_norm(hidden, (shape.hidden,), norm, shape.eps)
        gate, up = _int4(x, gate_up, gate_up_scales, shape.groupsize).to(hidden.dtype).chunk(2, -1)
        return hidden + _int4(torch.nn.functional.silu(gate) * up, down, down_scales, shape.groupsize)


@dataclasses.dataclass
class CompiledLayers:
    before_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    after_attention: Callable[..., torch.Tensor]


def enabled() -> bool:
    return os.environ.get("SPECBATCH_COMPILE", "1") != "0"


def compiled_layers(shape: LayerShape, examples: tuple[tuple, tuple]) -> CompiledLayers | None:
    """The two graphs for ``shape`` (compiled from ``examples``, one layer's inputs to each, when not on disk
    yet), or None where they cannot be had."""
    key = hashlib.sha256(json.dumps([
        _SOURCE, torch.__version__, torch.backends.cpu.get_cpu_capability(), dataclasses.asdict(shape),
    ]).encode()).hexdigest()[:16]
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = _load_or_compile(shape, examples, cache_dir() / "compiled" / key)
            except Exception as exc:  # a missing compiler, an unsupported kernel: the eager forward still works
                log.warning("could not compile the draft's layers (%s: %s); drafting with the eager forward",
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                _loaded[key] = None
        return _loaded[key]


def _load_or_compile(shape: LayerShape, examples: tuple[tuple, tuple], folder: Path) -> CompiledLayers:
    graphs = {"before_attention": _BeforeAttention(shape), "after_attention": _AfterAttention(shape)}
    paths = {name: folder / f"{name}.pt2" for name in graphs}
    if not all(path.is_file() for path in paths.values()):
        start = time.perf_counter()
        log.info("compiling the draft's layers for this machine (once; cached in %s)", folder)
        folder.mkdir(parents=True, exist_ok=True)
        rows = torch.export.Dim("rows_x_tokens", min=1, max=1 << 20)
        # The row-indexed inputs: hidden states, attention output and rotary tables; weights are static.
        dynamic = {"before_attention": ({0: rows}, None, None, None, {0: rows}, {0: rows}),
                   "after_attention": ({0: rows}, {0: rows}, *[None] * 7)}
        for (name, graph), example in zip(graphs.items(), examples):
            with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=folder) as scratch:
                warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's own pytree internals, on every export
                exported = torch.export.export(graph, example, dynamic_shapes=dynamic[name])
                staged = torch._inductor.aoti_compile_and_package(exported, package_path=f"{scratch}/{name}.pt2")
                os.replace(staged, paths[name])  # atomic: a racing process sees the whole package or none
        log.info("compiled the draft's layers in %.1f s", time.perf_counter() - start)
    return CompiledLayers(**{name: _load_package(path) for name, path in paths.items()})


def _load_package(path: Path) -> Callable[..., Any]:
    """A compiled package. Loading compares the package's vector ISA with this CPU's, and torch finds this CPU's by
    building and running six probe programs with the C++ compiler: 1.0 s of a 3.1 s engine build, paid by every
    actor. The cache key already holds the CPU capability, so the check here trusts /proc/cpuinfo's flags (the
    comparison only ever warns); the probes' result is forgotten again, so a later compilation still probes."""
    from torch._inductor import cpu_vec_isa

    try:
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
            package = torch._inductor.aoti_load_package(str(path))
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    return _direct_call(package)


def _direct_call(package: Any) -> Callable[..., Any]:
    """The package's runner called with the flat tensor list it takes. The package's own ``__call__`` parses its
    input and output specs from JSON and flattens both with pytree on every call: 38 -> 25 us for the graph before
    the attention, 117 -> 102 us for the one after (one row, hot loop), ~0.9 ms of a 60-call draft forward."""
    run = package.loader.run
    single = pytree.treespec_loads(package.loader.get_call_spec()[1]).is_leaf()  # one tensor, not a tuple

    def call(*tensors: torch.Tensor) -> Any:
        outputs = run(list(tensors))
        return outputs[0] if single else tuple(outputs)

    return call
