"""What the bench reads off the machine: device time, the bytes a forward moves, the memory bandwidth it is held to.

Time: ``Clock`` spans are host ``perf_counter`` readings on a CPU; on a CUDA device they are events recorded in
the stream and read only when a turn ends (``settle``, one synchronize), so timing adds no waits inside a turn.

Bytes (gpt-fast's accounting of a memory-bound decode step): a forward reads every weight once (an input
embedding only as rows, so it counts only where it is also the output head; a weight-only kernel's packed tensors
instead of the float weight they were made from) and each row's cached keys and values.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Peak memory bandwidth by device name (first match wins; vendors' figures).
KNOWN_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM (HBM3)
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
)


class Clock:
    """Elapsed time of spans on one device; each span's callback gets its seconds at ``settle``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: list[tuple[Any, Any, Callable[[float], None]]] = []

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start: Any, end: Any, on_done: Callable[[float], None]) -> None:
        self._open.append((start, end, on_done))

    @contextmanager
    def span(self, on_done: Callable[[float], None]) -> Iterator[None]:
        start = self.mark()
        try:
            yield
        finally:
            self.add(start, self.mark(), on_done)

    def settle(self) -> None:
        """Wait for the device (CUDA) and hand every open span its seconds."""
        if self.cuda:
            torch.cuda.synchronize()
        spans, self._open = self._open, []
        for start, end, on_done in spans:
            on_done(start.elapsed_time(end) / 1e3 if self.cuda else end - start)


def _bound_tensors(function: Any) -> Iterator[torch.Tensor]:
    """Tensors a weight-only kernel holds: in its partial arguments, nested partials and the object a bound method
    belongs to (fused siblings keep one kernel for the group)."""
    if isinstance(function, functools.partial):
        yield from _bound_tensors(function.func)
        for arg in function.args:
            if isinstance(arg, torch.Tensor):
                yield arg
            else:
                yield from _bound_tensors(arg)
    owner = getattr(function, "__self__", None)
    if owner is not None and not isinstance(owner, torch.nn.Module):
        for value in vars(owner).values():
            if isinstance(value, functools.partial):
                yield from _bound_tensors(value)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward of ``model`` reads (see the module's docstring); a lean view or any wrapper
    with an ``inner`` model counts its model."""
    model = getattr(model, "inner", model)
    parameters = {p.data_ptr() for p in model.parameters()}  # a kernel holds detached views of them
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    read: dict[int, torch.Tensor] = {}
    for module in model.modules():
        kernel = vars(module).get("forward")
        if kernel is not None:  # a weight-only kernel: its packed tensors, not the float weight it shares
            read.update((id(t), t) for t in _bound_tensors(kernel) if t.data_ptr() not in parameters)
            continue
        if module is embedding:
            continue
        read.update((id(p), p) for p in module.parameters(recurse=False))
    return sum(t.numel() * t.element_size() for t in read.values())


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """Key and value bytes of one cached position over all layers."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class ForwardBytes:
    """Bytes one forward of a model moves: its weights, and per cached position read."""

    weights: int
    per_position: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ForwardBytes:
        inner = getattr(model, "inner", model)
        dtype = next(inner.parameters()).dtype
        return cls(weight_bytes(inner), kv_bytes_per_position(inner.config, dtype))

    def __call__(self, positions: int) -> int:
        """A forward over rows whose cached positions add up to ``positions``."""
        return self.weights + self.per_position * positions


@dataclass(frozen=True)
class Bandwidth:
    gbs: float
    source: str  # where the figure comes from: the option, the table (device name), or a copy measured here


def measured_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """GB/s of the best of ``repeats`` copies of a ``megabytes`` buffer (read + write), a STREAM-copy estimate."""
    source = torch.empty(megabytes << 18, dtype=torch.float32, device=device)  # megabytes << 20 bytes
    source.fill_(1.0)
    target = torch.empty_like(source)
    clock = Clock(device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy commits the target's pages
        seconds: list[float] = []
        with clock.span(seconds.append):
            target.copy_(source)
        clock.settle()
        best = min(best, seconds[0])
    return 2 * source.numel() * source.element_size() / best / 1e9


def device_bandwidth(device: torch.device, override_gbs: float | None = None) -> Bandwidth:
    """The memory bandwidth a step is compared with: ``override_gbs``, else the table's figure for a known
    device, else a copy measured on this device."""
    if override_gbs:
        return Bandwidth(override_gbs, "--bandwidth-gbs")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gbs = known_bandwidth(name)
        if gbs is not None:
            return Bandwidth(gbs, f"table: {name}")
    return Bandwidth(round(measured_bandwidth(device), 1), "measured: buffer copy")


def known_bandwidth(device_name: str) -> float | None:
    return next((gbs for key, gbs in KNOWN_BANDWIDTH_GBS if key in device_name), None)


def bandwidth_fraction(bytes_per_step: float | None, ms_per_step: float | None, bandwidth: Bandwidth) -> float | None:
    if not bytes_per_step or not ms_per_step:
        return None
    return bytes_per_step / (ms_per_step / 1e3) / (bandwidth.gbs * 1e9)


def count_launches(run: Callable[[], Any], device: torch.device) -> int:
    """Kernel launches of ``run()``: on CUDA the device kernels the profiler records (Triton's and cuBLAS's
    alike); elsewhere the aten operations dispatched (``TorchDispatchMode``), each a kernel call there."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        run()
    return Counter.count
