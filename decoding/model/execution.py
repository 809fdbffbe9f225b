"""How an engine's forwards run on its device, decided once when the engine is built and passed down.

The config's ``execution`` block (``decoding.config.ExecutionConfig``) says what is wanted; ``Execution.resolve``
turns it into what runs on this device and logs it. Every forward reads the resolved object (it travels with the
KV pool the forward runs over: ``PagedKVCache.execution``); nothing reads the environment per forward.

Environment variables override the config for development (read once, at resolution):

| variable | values | overrides |
| --- | --- | --- |
| ``SPECBATCH_KERNELS`` | ``auto``, ``reference`` (or ``0``), ``triton`` | ``execution.kernels`` |
| ``SPECBATCH_CUDA_GRAPHS`` | ``auto``, ``off`` (or ``0``) | ``execution.graphs`` |
| ``SPECBATCH_COMPILE`` | ``auto`` (or ``1``), ``off`` (or ``0``) | ``execution.compile`` |
| ``SPECBATCH_CUDA_GRAPH_MEMORY_MB`` | megabytes | ``execution.graph_memory_mb`` |
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import platform
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from decoding.config import ExecutionConfig

log = logging.getLogger(__name__)

# False runs an accelerator's paths on a CPU's tensors: a test's way to check them for host reads without a GPU.
CPU_READS_FREE = True


def host_reads_free(device: torch.device) -> bool:
    """Whether the step may read a value on ``device`` back to Python to prune its work by it: on a CPU the device
    is the host, so a read costs nothing; on an accelerator each read waits for the device and cannot be captured
    in a graph, so the step keeps its static shapes instead."""
    return CPU_READS_FREE and device.type == "cpu"

Kernels = Literal["cpu", "triton", "reference"]
_ALIASES = {"0": "off", "1": "auto", "": None}


def _override(name: str, allowed: tuple[str, ...]) -> str | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = _ALIASES.get(raw.strip().lower(), raw.strip().lower())
    if value is not None and value not in allowed:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Execution:
    """The resolved execution mode of one engine's forwards."""

    device_type: str
    kernels: Kernels  # cpu: the C++ attention kernel (and packed weights); triton: the fused Triton layer
    graphs: bool  # the target's forwards (and a self-draft's levels) replayed as CUDA graphs captured at build
    compile: bool  # the layer stack compiled ahead of time (CPU, with the C++ kernel)
    graph_memory_bytes: int
    interpret: bool = False  # Triton kernels run under Triton's interpreter (a CPU)

    @classmethod
    def resolve(cls, config: ExecutionConfig | None, device: torch.device, lean: bool = True,
                quiet: bool = False) -> Execution:
        """``config`` on ``device`` (environment overrides applied). ``lean``: the target runs the lean forward
        (graphs and the fused kernels need it)."""
        config = config or ExecutionConfig()
        kernels = _override("SPECBATCH_KERNELS", ("auto", "reference", "triton")) or config.kernels
        graphs = (_override("SPECBATCH_CUDA_GRAPHS", ("auto", "off")) or config.graphs) != "off"
        compile_ = (_override("SPECBATCH_COMPILE", ("auto", "off")) or config.compile) != "off"
        memory_mb = float(os.environ.get("SPECBATCH_CUDA_GRAPH_MEMORY_MB", config.graph_memory_mb))
        cuda = device.type == "cuda"
        interpret = False
        if kernels == "triton":
            if not cuda:
                interpret = _interpreted_triton()
        elif kernels == "auto":
            kernels = ("triton" if _triton_available() else "reference") if cuda else _cpu_or_reference()
        resolved: Kernels = "cpu" if kernels == "auto" else kernels  # type: ignore[assignment]
        execution = cls(
            device_type=device.type, kernels=resolved, graphs=graphs and cuda and lean,
            compile=compile_ and device.type == "cpu" and resolved == "cpu" and lean,
            graph_memory_bytes=int(memory_mb * (1 << 20)), interpret=interpret,
        )
        if device.type == "cpu":
            keep_freed_heap_memory()
        if not quiet:
            log.info("execution on %s: %s", device, execution.describe())
        return execution

    def describe(self) -> str:
        kernels = {"cpu": "C++ attention kernel", "triton": "fused Triton kernels", "reference": "reference torch"}
        parts = [kernels[self.kernels] + (" (interpreted)" if self.interpret else "")]
        if self.device_type == "cuda":
            parts.append(f"CUDA graphs captured at build within {self.graph_memory_bytes >> 20} MiB"
                         if self.graphs else "no CUDA graphs")
        elif self.kernels == "cpu":
            parts.append("layer stack compiled ahead of time" if self.compile else "eager layer stack")
        return ", ".join(parts)

    @property
    def cpu_kernel(self) -> bool:
        return self.kernels == "cpu"


def _cpu_or_reference() -> Kernels:
    from decoding.model.attention import cpu_kernel

    return "cpu" if cpu_kernel() else "reference"


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreted_triton() -> bool:
    """Triton kernels on a CPU run interpreted; Triton decides that when it is imported, so the interpreter must be
    on before the first import."""
    if not _triton_available():
        raise ValueError("execution.kernels is triton, but triton is not installed")
    if "triton" in sys.modules:
        import triton

        if not triton.knobs.runtime.interpret:
            raise ValueError("execution.kernels is triton on a CPU: set TRITON_INTERPRET=1 before triton is imported "
                             "(Triton's interpreter runs the kernels on CPU tensors)")
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def default_execution(device: torch.device) -> Execution:
    """The default configuration's execution on ``device``, quietly (a pool made outside an engine)."""
    return Execution.resolve(None, device, quiet=True)


@functools.cache
def keep_freed_heap_memory() -> bool:
    """Make glibc keep freed memory for reuse (once per process; False where the C library is not glibc).

    By default glibc returns the top of its heap to the system once 128 KB of it is free and serves large requests
    with fresh mappings, so a forward whose shapes changed (a batch of other rows, other adapters) faults its
    temporaries' pages in again: 8,400 page faults per 64-step run of 16 rows on SmolLM2-135M when base-only and
    adapter batches alternated, 4-5% of the run. Kept instead: the heap is trimmed only past 1 GiB free, and only
    requests above 256 MiB are mapped apart."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
    return bool(mallopt(trim_threshold, 1 << 30)) and bool(mallopt(mmap_threshold, 256 << 20))
