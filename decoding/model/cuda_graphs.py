"""The lean forward replayed as CUDA graphs: on a GPU a small model's step is kernel launches, not arithmetic.

One graph per padded shape: rows padded up to a bucket (1, 2, 4, ..., 1024), the tokens per row (a decode step's
1, a draft level's width, a verification's tree size), the tree-mask words and how many logits and hidden states
per row come back. The reference attention also needs the keys every row may read, padded up to a power of two (at
least 256): one graph per key bucket; the fused Triton kernels read sequence lengths on the device, so one graph
serves every context. Each graph reads persistent input buffers; a call copies its inputs into them (padding rows
write their entries to the cache's scratch block 0 and read its first position only), replays, and copies the
outputs out. Weights and the KV pool never move, so the addresses a graph captured stay valid; a graph is keyed by
the pool it was captured over (that pool object and its shape, never only its address: a later pool may reuse a
freed one's address) and dropped with it. Graphs share one memory pool per model.

With ``execution.graphs`` (the default on CUDA) the engine captures at build the decode and verification shapes
(and a self-draft's levels) for every row bucket up to the batch size, within ``execution.graph_memory_mb`` of
device memory (set aside before the KV pool is sized), progress logged; a shape not captured then runs eagerly, so
nothing is captured mid-run over the engine's pool. A pool of its own (a cost calibration's) is captured when a
forward first meets a shape.

A forward with adapter rows replays a graph of its own shape with adapters: the tokens' adapter slots are one more
input buffer, and the graph adds every token's delta over all the resident slots as they lie (``LoraSlots.resident``:
a slot loaded later is written in place, so the graph computes with it); a forward of base rows only replays the
base's graph and pays nothing for adapters.

Recording is a function (``record_cuda_graph``); ``record_eagerly`` stands in for it where there is no GPU, so the
buffers, padding, bucketing, capture plan and budget are tested on a CPU.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.model.attention import AttentionMetadata
from decoding.model.lora import LoraBatch

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_KEYS = 256


_pool_serials: dict[int, tuple[weakref.ref, int]] = {}
_next_serial = itertools.count(1)


def pool_key(keys: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """The identity of the KV pool whose keys tensor is ``keys``: a serial number given to that tensor object while
    it lives (a new pool at a freed one's address gets a new one), and its shape."""
    entry = _pool_serials.get(id(keys))
    if entry is None or entry[0]() is not keys:
        serial = next(_next_serial)
        address = id(keys)
        entry = _pool_serials[address] = (weakref.ref(keys, lambda _: _pool_serials.pop(address, None)), serial)
    return entry[1], tuple(keys.shape)


def row_bucket(rows: int) -> int:
    return next((bucket for bucket in ROW_BUCKETS if bucket >= rows), rows)


def key_bucket(keys: int, limit: int) -> int:
    """Keys padded up to a power of two (at least MIN_KEYS), at most ``limit`` (the cache's positions per row)."""
    bucket = MIN_KEYS
    while bucket < keys:
        bucket *= 2
    return max(min(bucket, limit), keys)


def key_buckets(limit: int) -> list[int]:
    """Every key bucket a forward over a cache of ``limit`` positions per row can fall in, smallest first."""
    buckets = [key_bucket(1, limit)]
    while buckets[-1] < limit:
        buckets.append(key_bucket(buckets[-1] + 1, limit))
    return buckets


@dataclass(frozen=True)
class GraphShape:
    cache: tuple[int, tuple[int, ...]]  # the KV pool (``pool_key``): a graph writes and reads one pool
    rows: int  # padded
    per_row: int  # tokens per row
    words: int  # tree-mask words
    keys: int  # padded keys per row
    logits_per_row: int
    hidden_per_row: int  # 0: no hidden states
    adapters: bool = False  # each token adds its row's LoRA adapter (``LoraSlots.resident``)


def build_shapes(cache: tuple[int, tuple[int, ...]], max_rows: int, max_positions: int, tokens_per_row: list[int],
                 hidden: bool, keys_bucketed: bool = True, adapters: bool = False) -> list[GraphShape]:
    """The shapes to capture at build for forwards over the pool ``cache`` (``pool_key``): for each of
    ``tokens_per_row`` (1: a decode step; a tree's size: its verification, logits at every node), every row bucket
    up to ``max_rows`` and every key bucket (one, ``max_positions``, where ``keys_bucketed`` is false); smallest keys
    first (short contexts are met first and most), then fewest tokens, then fewest rows. ``hidden``: hidden states
    come back at every node (a drafter reads them). ``adapters``: each shape again with adapter rows, after all the
    base's (within a memory budget the base's come first)."""
    rows = [bucket for bucket in ROW_BUCKETS if bucket <= row_bucket(max_rows)]
    buckets = key_buckets(max_positions) if keys_bucketed else [max_positions]
    return [GraphShape(cache, count, per_row, tree_words(per_row), keys, per_row, per_row if hidden else 0, adapted)
            for adapted in ((False, True) if adapters else (False,))
            for keys in buckets for per_row in sorted(set(tokens_per_row)) for count in rows]


def tree_words(per_row: int) -> int:
    """Tree-mask words of a forward of ``per_row`` tree nodes from node 0 (``PagedKVCache.tree_metadata``)."""
    return max(1, -(-(per_row - 1) // 64))


@dataclass
class PaddedInputs:
    """A forward's inputs with rows padded to a bucket: what the graph's buffers hold."""

    input_ids: torch.Tensor  # [R * T]
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor  # [R, max_blocks]
    row_starts: torch.Tensor
    prefix_len: torch.Tensor
    tree_mask: torch.Tensor  # [R * T, W]
    logits_at: torch.Tensor  # [R * k] flat
    hidden_at: torch.Tensor | None
    adapter_slots: torch.Tensor | None = None  # [R * T]: each token's adapter slot (0: the base)

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return (self.input_ids, self.positions, self.slots, self.block_tables, self.row_starts, self.prefix_len,
                self.tree_mask, self.logits_at, self.hidden_at, self.adapter_slots)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.fields() if t is not None]


def pad_rows_to(rows: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_nodes: torch.Tensor, hidden_nodes: torch.Tensor | None, table_blocks: int | None = None,
                adapter_slots: torch.Tensor | None = None) -> PaddedInputs:
    """``input_ids``/``positions`` [B, T] and their metadata padded to ``rows`` rows: a padding row's tokens write
    slot 0 (the scratch block) and see position 0 only. ``logits_nodes``/``hidden_nodes``: node indices per row.
    ``table_blocks``: the block tables' width a graph holds (the key bucket's blocks; a forward's tables are as
    wide as its longest row): narrower tables are padded with the scratch block, which no query sees.
    ``adapter_slots`` [B * T]: each token's adapter slot; a padding row's are the base's."""
    batch, per_row = input_ids.shape
    extra = rows - batch
    device = input_ids.device

    def pad(tensor: torch.Tensor, value: int) -> torch.Tensor:
        if not extra:
            return tensor
        return torch.cat([tensor, tensor.new_full((extra * per_row, *tensor.shape[1:]), value)])

    flat = torch.arange(rows, device=device)[:, None] * per_row
    tables = meta.block_tables
    width = table_blocks or tables.shape[1]
    tables = torch.nn.functional.pad(tables[:, :width], (0, max(0, width - tables.shape[1]), 0, extra))
    return PaddedInputs(
        input_ids=pad(input_ids.flatten(), 0), positions=pad(positions.flatten(), 0), slots=pad(meta.slots, 0),
        block_tables=tables,
        row_starts=torch.arange(0, rows * per_row + 1, per_row, dtype=torch.int32, device=device),
        prefix_len=pad(meta.prefix_len, 1), tree_mask=pad(meta.tree_mask, 0),
        logits_at=(flat + logits_nodes.to(device, non_blocking=True)[None]).flatten(),
        hidden_at=(flat + hidden_nodes.to(device, non_blocking=True)[None]).flatten()
        if hidden_nodes is not None else None,
        adapter_slots=pad(adapter_slots, 0) if adapter_slots is not None else None,
    )


def example_inputs(shape: GraphShape, block_size: int, device: torch.device) -> PaddedInputs:
    """Inputs of ``shape`` that write the scratch block only (what a graph is captured on; replays copy real
    inputs into the same buffers)."""
    tokens = shape.rows * shape.per_row

    def zeros(*size: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    flat = torch.arange(shape.rows, device=device)[:, None] * shape.per_row
    return PaddedInputs(
        input_ids=zeros(tokens), positions=zeros(tokens), slots=zeros(tokens),
        block_tables=zeros(shape.rows, -(-shape.keys // block_size), dtype=torch.int32),
        row_starts=torch.arange(0, tokens + 1, shape.per_row, dtype=torch.int32, device=device),
        prefix_len=torch.ones(tokens, dtype=torch.int32, device=device), tree_mask=zeros(tokens, shape.words),
        logits_at=(flat + torch.arange(shape.per_row - shape.logits_per_row, shape.per_row, device=device)).flatten(),
        hidden_at=(flat + torch.arange(shape.per_row - shape.hidden_per_row, shape.per_row, device=device)).flatten()
        if shape.hidden_per_row else None,
        adapter_slots=zeros(tokens) if shape.adapters else None,
    )


Forward = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]
Adapters = Callable[[torch.Tensor], LoraBatch]  # tokens' adapter slots -> their adapters (LoraSlots.resident)
Outputs = tuple[torch.Tensor | None, torch.Tensor | None]
Recorder = Callable[[Callable[[], Outputs], object], tuple[Outputs, Callable[[], None]]]


def record_cuda_graph(run: Callable[[], Outputs], pool: object) -> tuple[Outputs, Callable[[], None]]:
    """``run`` captured as a CUDA graph in ``pool`` (None: a pool of its own): its outputs (at fixed addresses)
    and the replay; the graph's pool is the replay's ``pool`` attribute, for the next graph to share."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: kernels' workspaces are allocated outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # No collection during the capture: one could free a CUDA graph (its memory pool: a cudaFree, which
    # invalidates the capture) or other tensors' memory.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
    finally:
        if collecting:
            gc.enable()
    replay = graph.replay
    return outputs, _Replay(replay, graph.pool())


class _Replay:
    """A graph's replay, with the memory pool it was captured in (later graphs share it)."""

    def __init__(self, replay: Callable[[], None], pool: object) -> None:
        self.replay, self.pool = replay, pool

    def __call__(self) -> None:
        self.replay()


def record_eagerly(run: Callable[[], Outputs], pool: object) -> tuple[Outputs, Callable[[], None]]:
    """A stand-in for ``record_cuda_graph`` without a GPU: the replay runs ``run`` again on the same buffers and
    writes its results into the first run's output tensors, as a graph's replay does."""
    del pool
    outputs = run()

    def replay() -> None:
        for kept, new in zip(outputs, run()):
            if kept is not None:
                kept.copy_(new)

    return outputs, replay


class _Graph:
    def __init__(self, forward: Forward, example: PaddedInputs, keys: torch.Tensor, values: torch.Tensor,
                 max_keys: int, pool: object, record: Recorder, adapters: Adapters | None = None) -> None:
        self.buffers = PaddedInputs(*(t.clone() if t is not None else None for t in example.fields()))
        # Until the first real call, every token writes the scratch block.
        self.buffers.slots.zero_()
        self.buffers.block_tables.zero_()

        def run() -> Outputs:
            b = self.buffers
            meta = AttentionMetadata(b.slots, b.block_tables, b.row_starts, b.prefix_len, b.tree_mask, max_keys)
            if b.adapter_slots is None:
                return forward(b.input_ids, b.positions, meta, keys, values, b.logits_at, b.hidden_at)
            # The tokens' one-hot masks over every slot are computed in the graph, from the slots buffer.
            return forward(b.input_ids, b.positions, meta, keys, values, b.logits_at, b.hidden_at,
                           lora=adapters(b.adapter_slots))

        self.outputs, self._replay = record(run, pool)

    def replay(self, inputs: PaddedInputs) -> Outputs:
        for buffer, value in zip(self.buffers.tensors(), inputs.tensors()):
            buffer.copy_(value, non_blocking=True)
        self._replay()
        return self.outputs


class GraphedForward:
    """A lean forward's CUDA graphs, captured per ``GraphShape``: when a run first meets a shape, or at build
    (``capture``), after which a shape not captured runs eagerly."""

    def __init__(self, forward: Forward, max_positions: int, record: Recorder = record_cuda_graph,
                 key_buckets: bool = True, adapters: Adapters | None = None) -> None:
        """``forward``: the lean forward over flat tokens (``LeanCausalLM.flat_forward``); ``max_positions``: the
        cache's positions per row (the largest key bucket); ``record``: how a graph is recorded; ``key_buckets``:
        graphs per key bucket (the reference attention pads keys on the host), else one for every context;
        ``adapters``: the model's resident LoRA adapters (``LoraSlots.resident``), for forwards with adapter rows."""
        self.forward = forward
        self.adapters = adapters
        self.max_positions = max_positions
        self.record = record
        self.key_buckets = key_buckets
        self.graphs: dict[GraphShape, _Graph] = {}
        # The first graph's pool, shared by the later ones (vLLM's pattern: a pool handle made before any graph
        # tripped the caching allocator's pool accounting on torch 2.11); None again once every graph is dropped.
        self.pool: object = None
        self.capture_seconds = 0.0
        self.frozen: set[tuple[int, tuple[int, ...]]] = set()  # pools captured at build: no capture mid-run
        self._dead: list[tuple[int, tuple[int, ...]]] = []  # pools freed, their graphs not dropped yet

    def _capture(self, shape: GraphShape, inputs: PaddedInputs, keys: torch.Tensor, values: torch.Tensor
                 ) -> _Graph:
        started = time.perf_counter()
        if not any(known.cache == shape.cache for known in self.graphs):  # the first over this pool
            weakref.finalize(keys, self._dead.append, shape.cache)
        graph = self.graphs[shape] = _Graph(self.forward, inputs, keys, values, shape.keys, self.pool, self.record,
                                            self.adapters)
        self.pool = getattr(graph._replay, "pool", self.pool)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        log.debug("captured a CUDA graph for %s in %.0f ms", shape, 1e3 * seconds)
        return graph

    def _drop_dead_pools(self) -> None:
        """Pools freed since the last call: their graphs go (they would write where a pool was). Called before a
        capture or replay, never from the pool's finalizer: a collection can run in the middle of a capture, and
        destroying a graph there invalidates it."""
        while self._dead:
            cache = self._dead.pop()
            for shape in [shape for shape in self.graphs if shape.cache == cache]:
                del self.graphs[shape]
            self.frozen.discard(cache)
        if not self.graphs:
            self.pool = None

    def capture(self, shapes: list[GraphShape], keys: torch.Tensor, values: torch.Tensor, budget: int,
                memory: Callable[[], int]) -> int:
        """Capture ``shapes`` (over the pool ``keys``/``values``) in order until the device memory they take
        (``memory()``'s growth: the graphs' pool and outputs) reaches ``budget`` bytes; then freeze the pool:
        shapes over it not captured run eagerly (other pools', e.g. a cost calibration's, are still captured
        when first met). Progress is logged; returns how many were captured."""
        self._drop_dead_pools()
        started = memory()
        block_size = keys.shape[-1]
        step = max(1, len(shapes) // 10)
        log.info("capturing up to %d CUDA graphs within %d MiB", len(shapes), max(budget, 0) >> 20)
        done = 0
        for shape in shapes:
            if memory() - started >= budget:
                log.warning("CUDA graph memory budget (%d MiB) reached after %d of %d shapes: the rest run eagerly",
                            max(budget, 0) >> 20, done, len(shapes))
                break
            if shape not in self.graphs:
                self._capture(shape, example_inputs(shape, block_size, keys.device), keys, values)
            done += 1
            if done % step == 0 or done == len(shapes):
                log.info("captured %d/%d CUDA graphs (%.0f MiB, %.1f s)", done, len(shapes),
                         (memory() - started) / (1 << 20), self.capture_seconds)
        self.frozen.add(pool_key(keys))
        return done

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 keys: torch.Tensor, values: torch.Tensor, logits_nodes: torch.Tensor,
                 hidden_nodes: torch.Tensor | None, adapter_slots: torch.Tensor | None = None) -> Outputs | None:
        """As ``LeanCausalLM.forward``: logits [B * k, V] and hidden [B * k', H] of the real rows; None where the
        shape was not captured at build (the caller runs the forward eagerly). ``adapter_slots`` [B * T] on the
        device: each token's adapter slot, for a forward with adapter rows."""
        self._drop_dead_pools()
        batch, per_row = input_ids.shape
        keys_padded = key_bucket(meta.max_keys, self.max_positions) if self.key_buckets else self.max_positions
        shape = GraphShape(pool_key(keys), row_bucket(batch), per_row, meta.tree_mask.shape[1], keys_padded,
                           len(logits_nodes), len(hidden_nodes) if hidden_nodes is not None else 0,
                           adapter_slots is not None)
        graph = self.graphs.get(shape)
        if graph is None and (shape.cache in self.frozen or (shape.adapters and self.adapters is None)):
            return None
        padded = pad_rows_to(shape.rows, input_ids, positions, meta, logits_nodes, hidden_nodes,
                             table_blocks=-(-shape.keys // keys.shape[-1]), adapter_slots=adapter_slots)
        if graph is None:
            graph = self._capture(shape, padded, keys, values)
        logits, hidden = graph.replay(padded)
        real_logits = logits[: batch * len(logits_nodes)].clone() if logits is not None else None
        real_hidden = hidden[: batch * shape.hidden_per_row].clone() if hidden is not None else None
        return real_logits, real_hidden
