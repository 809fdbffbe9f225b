"""The lean forward replayed as CUDA graphs: on a GPU a small model's step is kernel launches, not arithmetic.

One graph per padded shape: rows padded up to a bucket (1, 2, 4, ..., 1024), the tokens per row (a decode step's
1, a draft level's width, a verification's tree size), the tree-mask words, the keys every row may read padded up to
a power of two (at least 256), and how many logits and hidden states per row come back. Each graph reads persistent
input buffers; a call copies its inputs into them (padding rows write their entries to the cache's scratch block 0
and read its first position only), replays, and copies the outputs out. Weights and the KV pool never move, so the
addresses a graph captured stay valid. Graphs share one memory pool per model.

Which forwards replay as graphs (``SPECBATCH_CUDA_GRAPHS``): ``decode`` (the default) the target's forwards of one
token per row (a plain decoding step, a speculative step at depth 0), the shape the CUDA tests have passed with
graphs, each captured the first time a run meets it (milliseconds); ``all`` every forward its caller allows (tree
verifications, a self-draft's levels), captured at build: the decode and verification shapes (and draft levels)
for every row bucket up to the batch size and every key bucket, smallest keys first, until
``SPECBATCH_CUDA_GRAPH_MEMORY_MB`` (default 1024) of device memory is taken (the KV pool is sized without it); a
shape not captured then runs eagerly, so nothing is captured mid-run. ``0`` none, the same function launch by
launch.

Recording is a function (``record_cuda_graph``); ``record_eagerly`` stands in for it where there is no GPU, so the
buffers, padding, bucketing, capture plan and budget are tested on a CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_KEYS = 256


def graph_mode() -> str:
    """``SPECBATCH_CUDA_GRAPHS``: decode (default), all, or 0 / off."""
    return os.environ.get("SPECBATCH_CUDA_GRAPHS", "decode")


def captures_at_build() -> bool:
    """Whether graphs are captured at build (mode ``all``) rather than when a run first meets a shape."""
    return graph_mode() == "all"


def graph_memory_budget() -> int:
    """Bytes of device memory the graphs captured at build may take (``SPECBATCH_CUDA_GRAPH_MEMORY_MB``)."""
    return int(float(os.environ.get("SPECBATCH_CUDA_GRAPH_MEMORY_MB", "1024")) * (1 << 20))


def graphs_enabled(per_row: int = 1) -> bool:
    """Whether a forward of ``per_row`` tokens per row (that its caller allows to be graphed) replays a graph."""
    mode = graph_mode()
    if mode in ("0", "off"):
        return False
    return per_row == 1 if mode == "decode" else True


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
    cache: int  # the KV pool's address: a graph writes and reads one pool
    rows: int  # padded
    per_row: int  # tokens per row
    words: int  # tree-mask words
    keys: int  # padded keys per row
    logits_per_row: int
    hidden_per_row: int  # 0: no hidden states


def build_shapes(cache: int, max_rows: int, max_positions: int, tokens_per_row: list[int], hidden: bool,
                 ) -> list[GraphShape]:
    """The shapes to capture at build for forwards over the pool at address ``cache``: for each of
    ``tokens_per_row`` (1: a decode step; a tree's size: its verification, logits at every node), every row bucket
    up to ``max_rows`` and every key bucket; smallest keys first (short contexts are met first and most), then
    fewest tokens, then fewest rows. ``hidden``: hidden states come back at every node (a drafter reads them)."""
    rows = [bucket for bucket in ROW_BUCKETS if bucket <= row_bucket(max_rows)]
    return [GraphShape(cache, count, per_row, tree_words(per_row), keys, per_row, per_row if hidden else 0)
            for keys in key_buckets(max_positions) for per_row in sorted(set(tokens_per_row)) for count in rows]


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

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_ids, self.positions, self.slots, self.block_tables, self.row_starts,
                            self.prefix_len, self.tree_mask, self.logits_at, self.hidden_at) if t is not None]


def pad_rows_to(rows: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_nodes: torch.Tensor, hidden_nodes: torch.Tensor | None, table_blocks: int | None = None,
                ) -> PaddedInputs:
    """``input_ids``/``positions`` [B, T] and their metadata padded to ``rows`` rows: a padding row's tokens write
    slot 0 (the scratch block) and see position 0 only. ``logits_nodes``/``hidden_nodes``: node indices per row.
    ``table_blocks``: the block tables' width a graph holds (the key bucket's blocks; a forward's tables are as
    wide as its longest row): narrower tables are padded with the scratch block, which no query sees."""
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
    )


Forward = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]
Outputs = tuple[torch.Tensor | None, torch.Tensor | None]
Recorder = Callable[[Callable[[], Outputs], object], tuple[Outputs, Callable[[], None]]]


def record_cuda_graph(run: Callable[[], Outputs], pool: object) -> tuple[Outputs, Callable[[], None]]:
    """``run`` captured as a CUDA graph in ``pool``: its outputs (at fixed addresses) and the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: kernels' workspaces are allocated outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return outputs, graph.replay


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
                 max_keys: int, pool: object, record: Recorder) -> None:
        self.buffers = PaddedInputs(*(t.clone() if t is not None else None for t in (
            example.input_ids, example.positions, example.slots, example.block_tables, example.row_starts,
            example.prefix_len, example.tree_mask, example.logits_at, example.hidden_at)))
        # Until the first real call, every token writes the scratch block.
        self.buffers.slots.zero_()
        self.buffers.block_tables.zero_()

        def run() -> Outputs:
            b = self.buffers
            meta = AttentionMetadata(b.slots, b.block_tables, b.row_starts, b.prefix_len, b.tree_mask, max_keys)
            return forward(b.input_ids, b.positions, meta, keys, values, b.logits_at, b.hidden_at)

        self.outputs, self._replay = record(run, pool)

    def replay(self, inputs: PaddedInputs) -> Outputs:
        for buffer, value in zip(self.buffers.tensors(), inputs.tensors()):
            buffer.copy_(value, non_blocking=True)
        self._replay()
        return self.outputs


class GraphedForward:
    """A lean forward's CUDA graphs, captured per ``GraphShape``: when a run first meets a shape, or at build
    (``capture``), after which a shape not captured runs eagerly."""

    def __init__(self, forward: Forward, max_positions: int, record: Recorder = record_cuda_graph) -> None:
        """``forward``: the lean forward over flat tokens (``LeanCausalLM.flat_forward``); ``max_positions``: the
        cache's positions per row (the largest key bucket); ``record``: how a graph is recorded."""
        self.forward = forward
        self.max_positions = max_positions
        self.record = record
        self.graphs: dict[GraphShape, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if record is record_cuda_graph else None
        self.capture_seconds = 0.0
        self.frozen: set[int] = set()  # pools whose graphs were captured at build: no capture mid-run over them

    def _capture(self, shape: GraphShape, inputs: PaddedInputs, keys: torch.Tensor, values: torch.Tensor
                 ) -> _Graph:
        started = time.perf_counter()
        graph = self.graphs[shape] = _Graph(self.forward, inputs, keys, values, shape.keys, self.pool, self.record)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        log.debug("captured a CUDA graph for %s in %.0f ms", shape, 1e3 * seconds)
        return graph

    def capture(self, shapes: list[GraphShape], keys: torch.Tensor, values: torch.Tensor, budget: int,
                memory: Callable[[], int]) -> int:
        """Capture ``shapes`` (over the pool ``keys``/``values``) in order until the device memory they take
        (``memory()``'s growth: the graphs' pool and outputs) reaches ``budget`` bytes; then freeze the pool:
        shapes over it not captured run eagerly (other pools', e.g. a cost calibration's, are still captured
        when first met). Progress is logged; returns how many were captured."""
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
        self.frozen.add(keys.data_ptr())
        return done

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 keys: torch.Tensor, values: torch.Tensor, logits_nodes: torch.Tensor,
                 hidden_nodes: torch.Tensor | None) -> Outputs | None:
        """As ``LeanCausalLM.forward``: logits [B * k, V] and hidden [B * k', H] of the real rows; None where the
        shape was not captured at build (the caller runs the forward eagerly)."""
        batch, per_row = input_ids.shape
        shape = GraphShape(keys.data_ptr(), row_bucket(batch), per_row, meta.tree_mask.shape[1],
                           key_bucket(meta.max_keys, self.max_positions), len(logits_nodes),
                           len(hidden_nodes) if hidden_nodes is not None else 0)
        graph = self.graphs.get(shape)
        if graph is None and shape.cache in self.frozen:
            return None
        padded = pad_rows_to(shape.rows, input_ids, positions, meta, logits_nodes, hidden_nodes,
                             table_blocks=-(-shape.keys // keys.shape[-1]))
        if graph is None:
            graph = self._capture(shape, padded, keys, values)
        logits, hidden = graph.replay(padded)
        real_logits = logits[: batch * len(logits_nodes)].clone() if logits is not None else None
        real_hidden = hidden[: batch * shape.hidden_per_row].clone() if hidden is not None else None
        return real_logits, real_hidden
