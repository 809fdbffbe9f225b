"""The lean forward's layer stack compiled ahead of time (AOTInductor), once per machine, for CPUs.

Why: a decode step of a small model is mostly Python and dispatch between small kernels. On a model of SmolLM2's
depth with hidden size 64, one row: the eager stack ~4 ms a step, the compiled stack 0.5 ms per call (2-core CPU).
Ahead of time rather than torch.compile: the whole 30-layer model under torch.compile took 60-100 s to compile and
30 s again in every later process (tracing it anew), and compiled per layer it paid Python's call path 30 times a
step; the exported stack compiles in ~45 s once and loads in milliseconds.

What is compiled: ``LayerStack`` (the decoder layers with the paged attention kernel as an opaque op, and the final
norm) with every weight an input, so the package holds code only, and the engine's own tensors are used in place.
Dimensions that vary (tokens, rows, tree-mask words, pool blocks, block-table width) are dynamic: one package serves
every batch. Packages live in ``cache_dir()/compiled``, keyed by the sources, torch, the CPU and the stack's shapes.
Wherever one cannot be had (``SPECBATCH_COMPILE=0``, no C++ compiler, a failed export) the eager stack runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from decoding.model.lora import GROUPS, LoraBatch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = ("lean_forward.py", "attention.py", "compiled_forward.py", "quantize.py", "lora.py", "gguf_blocks.py",
            "csrc/paged_attention.cpp", "csrc/quantized_linear.cpp", "csrc/compiled_calls.cpp")
_lock = threading.Lock()  # engines built on threads of one process compile each stack once
_loaded: dict[str, Callable[[list[torch.Tensor]], torch.Tensor] | None] = {}
EXAMPLE_BLOCK_SIZE = 16


def _key(stack: torch.nn.Module, weights: list[torch.Tensor], config: Any) -> str:
    sources = [(_HERE / name).read_bytes() for name in _SOURCES]
    described = json.dumps([
        [hashlib.sha256(s).hexdigest() for s in sources], torch.__version__, torch.backends.cpu.get_cpu_capability(),
        repr(stack.specs), stack.counts, stack.layers, stack.final_eps, getattr(stack, "groups", ()),
        getattr(stack, "rank", 0),
        [(list(w.shape), str(w.dtype)) for w in weights], getattr(config, "model_type", ""), EXAMPLE_BLOCK_SIZE,
    ])
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _examples(stack: torch.nn.Module, weights: list[torch.Tensor], pool_layers: int,
              lora: LoraBatch | None = None) -> tuple[tuple, tuple]:
    """Example inputs with every dynamic dimension at least 2 (a size of 1 would be traced as a constant), and
    their dynamic shapes; the pool has ``pool_layers`` layers (a layer-skipping stack runs some of them). ``lora``:
    an adapted stack's adapters (their shapes; ``lean_forward.AdaptedStack``), whose rows vary with the adapters a
    forward holds."""
    spec = stack.specs[0]
    dtype, tokens, rows, words, blocks, width = weights[0].dtype, 4, 2, 2, 4, 2
    block_size = EXAMPLE_BLOCK_SIZE
    layers = pool_layers
    hidden_size = weights[0].shape[0]
    examples = (
        torch.zeros(tokens, hidden_size, dtype=dtype), torch.ones(tokens, 1, spec.head_dim, dtype=dtype),
        torch.zeros(tokens, 1, spec.head_dim, dtype=dtype), torch.arange(tokens, dtype=torch.long),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32),
        torch.tensor([1, 2, 1, 2], dtype=torch.int32), torch.zeros(tokens, words, dtype=torch.int64),
        torch.zeros(layers, blocks, spec.kv_heads, spec.head_dim, block_size, dtype=dtype),
        torch.zeros(layers, blocks, spec.kv_heads, block_size, spec.head_dim, dtype=dtype), list(weights),
    )
    n = torch.export.Dim("tokens", min=1, max=1 << 20)
    r = torch.export.Dim("rows", min=1, max=1 << 16)
    w = torch.export.Dim("words", min=1, max=1 << 10)
    b = torch.export.Dim("blocks", min=1, max=1 << 30)
    t = torch.export.Dim("table_width", min=1, max=1 << 20)
    dynamic = ({0: n}, {0: n}, {0: n}, {0: n}, {0: r, 1: t}, {0: r + 1}, {0: n}, {0: n, 1: w}, {1: b}, {1: b},
               [None] * len(weights))
    del rows, width
    if lora is not None:
        adapters = torch.export.Dim("adapters", min=1, max=1 << 16)
        present = 2  # example adapters (U), each of the stack's rank R
        rows = present * lora.rank
        groups = [group for group in GROUPS if group in lora.a]  # AdaptedStack.inputs' order
        examples += (torch.tensor([-1, 0, 1, 0][:tokens], dtype=torch.long),
                     [lora.a[g].new_zeros(lora.a[g].shape[0], len(lora.b[g]) * rows, lora.a[g].shape[2])
                      for g in groups],
                     [b.new_zeros(b.shape[0], rows, b.shape[2]) for g in groups for b in lora.b[g]])
        dynamic += ({0: n}, [{1: len(lora.b[g]) * lora.rank * adapters} for g in groups],
                    [{1: lora.rank * adapters} for g in groups for _ in lora.b[g]])
    return examples, dynamic


def compiled_stack(stack: torch.nn.Module, weights: list[torch.Tensor], config: Any,
                   lora: LoraBatch | None = None) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
    """``stack`` compiled for this machine as a function of its flat inputs (weights, then an adapted stack's
    adapter index and tensors, last); None where it cannot be had (a warning says why). ``lora``: a forward's
    adapters, whose shapes an adapted stack is compiled for."""
    key = _key(stack, weights, config)
    with _lock:
        if key not in _loaded:
            from decoding.paths import cache_dir

            try:
                pool_layers = int(getattr(config, "num_hidden_layers", 0) or max(stack.layers) + 1)
                _loaded[key] = _load_or_compile(stack, weights, cache_dir() / "compiled" / key, pool_layers, lora)
            except Exception as exc:  # no compiler, an unsupported operation: the eager stack computes the same
                log.warning("could not compile the forward (%s: %s); running the eager forward",
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                _loaded[key] = None
        return _loaded[key]


def _load_or_compile(stack: torch.nn.Module, weights: list[torch.Tensor], folder: Path, pool_layers: int,
                     lora: LoraBatch | None = None) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    path = folder / "stack.pt2"
    if not path.is_file():
        started = time.perf_counter()
        log.info("compiling the %d-layer forward for this machine (once; cached in %s)", len(stack.specs), folder)
        folder.mkdir(parents=True, exist_ok=True)
        examples, dynamic = _examples(stack, weights, pool_layers, lora)
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=folder) as scratch, torch.no_grad():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree internals, on every export
            exported = torch.export.export(stack, examples, dynamic_shapes=dynamic)
            with torch._inductor.config.patch({"aot_inductor.custom_ops_to_c_shims": _kernel_entry_points()}):
                staged = torch._inductor.aoti_compile_and_package(exported, package_path=f"{scratch}/stack.pt2")
            os.replace(staged, path)  # atomic: a racing process sees the whole package or none
        log.info("compiled the forward in %.1f s", time.perf_counter() - started)
    return _load_package(path)


def _kernel_entry_points() -> dict[Any, list[str]]:
    """The kernels the package calls through their C entry points (``csrc/compiled_calls.cpp``) rather than
    AOTInductor's proxy executor, which boxes every call's arguments and dispatches by schema: a decode step of
    SmolLM2-135M makes ~150 such calls."""
    from decoding.model.attention import cpu_kernel

    if not cpu_kernel():
        return {}
    ops = torch.ops.specbatch
    return {
        ops.paged_attention.default: [
            "AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle k_cache, AtenTensorHandle v_cache, "
            "AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle slots, "
            "AtenTensorHandle block_tables, AtenTensorHandle row_starts, AtenTensorHandle prefix_len, "
            "AtenTensorHandle tree_mask, double scale, AtenTensorHandle* out)"],
        ops.packed_linear.default: [
            "AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle weight, "
            "AtenTensorHandle* bias, AtenTensorHandle* out)"],
        ops.block_linear.default: [
            "AOTITorchError aoti_torch_cpu_block_linear(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle d, "
            "AtenTensorHandle* m, int64_t bits, AtenTensorHandle* out)"],
    }


@contextmanager
def _extracted_beside(path: Path) -> Iterator[None]:
    """torch extracts a package into a new folder under TMPDIR and removes it only when its loader is destroyed
    (6 MB a load, held for an engine's life; a killed process leaves it): extract beside the package instead, into
    a folder removed once the library is loaded (a loaded library and its constants need no file). Callers hold
    ``_lock``: no other load reads TMPDIR meanwhile."""
    previous = os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        os.environ["TMPDIR"] = scratch
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = previous


def _load_package(path: Path) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """A compiled package, called with its flat input list. Loading compares the package's vector ISA with this
    CPU's, and torch finds this CPU's by building and running probe programs with the C++ compiler (a second of
    every engine build); the cache key already holds the CPU capability, so the check trusts /proc/cpuinfo here.
    The package's own ``__call__`` parses specs and flattens with pytree on every call; its runner takes the list."""
    from torch._inductor import cpu_vec_isa

    from decoding.model.attention import cpu_kernel

    cpu_kernel()  # the kernels' C entry points, which the package's library links to, loaded first
    try:
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}), _extracted_beside(path):
            package = torch._inductor.aoti_load_package(str(path))
    finally:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
    run = package.loader.run
    single = pytree.treespec_loads(package.loader.get_call_spec()[1]).is_leaf()
    if not single:
        raise RuntimeError("the compiled stack should return one tensor")

    def call(inputs: list[torch.Tensor]) -> torch.Tensor:
        return run(inputs)[0]

    return call
