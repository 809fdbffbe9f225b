"""The lean forward replayed as CUDA graphs: on a GPU a small model's step is kernel launches, not arithmetic.

One graph per padded shape: rows padded up to a bucket (1, 2, 4, ..., 1024), the tokens per row (a decode step's
1, a draft level's width, a verification's tree size), the tree-mask words, the keys every row may read padded up to
a power of two (at least 256), and how many logits and hidden states per row come back. Each graph reads persistent
input buffers; a call copies its inputs into them (padding rows write their entries to the cache's scratch block 0
and read its first position only), replays, and copies the outputs out. Weights and the KV pool never move, so the
addresses a graph captured stay valid. Graphs share one memory pool; a shape is captured the first time a run meets
it (milliseconds).

Which forwards replay as graphs (``SPECBATCH_CUDA_GRAPHS``): ``decode`` (the default) the target's forwards of one
token per row (a plain decoding step, a speculative step at depth 0), the shape the CUDA tests have passed with
graphs; ``all`` every forward its caller allows (tree verifications and draft levels too); ``0`` none, the same
function launch by launch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.attention import AttentionMetadata

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_KEYS = 256


def graph_mode() -> str:
    """``SPECBATCH_CUDA_GRAPHS``: decode (default), all, or 0 / off."""
    return os.environ.get("SPECBATCH_CUDA_GRAPHS", "decode")


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


@dataclass(frozen=True)
class GraphShape:
    cache: int  # the KV pool's address: a graph writes and reads one pool
    rows: int  # padded
    per_row: int  # tokens per row
    words: int  # tree-mask words
    keys: int  # padded keys per row
    logits_per_row: int
    hidden_per_row: int  # 0: no hidden states


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


Forward = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


class _Graph:
    def __init__(self, forward: Forward, example: PaddedInputs, keys: torch.Tensor, values: torch.Tensor,
                 max_keys: int, pool) -> None:
        self.buffers = PaddedInputs(*(t.clone() if t is not None else None for t in (
            example.input_ids, example.positions, example.slots, example.block_tables, example.row_starts,
            example.prefix_len, example.tree_mask, example.logits_at, example.hidden_at)))
        # Until the first real call, every token writes the scratch block.
        self.buffers.slots.zero_()
        self.buffers.block_tables.zero_()

        def run() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            b = self.buffers
            meta = AttentionMetadata(b.slots, b.block_tables, b.row_starts, b.prefix_len, b.tree_mask, max_keys)
            return forward(b.input_ids, b.positions, meta, keys, values, b.logits_at, b.hidden_at)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up: kernels' workspaces are allocated outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = run()

    def replay(self, inputs: PaddedInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for buffer, value in zip(self.buffers.tensors(), inputs.tensors()):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


class GraphedForward:
    """A lean forward's CUDA graphs, captured per ``GraphShape``."""

    def __init__(self, forward: Forward, max_positions: int) -> None:
        """``forward``: the lean forward over flat tokens (``LeanCausalLM.flat_forward``); ``max_positions``: the
        cache's positions per row (the largest key bucket)."""
        self.forward = forward
        self.max_positions = max_positions
        self.graphs: dict[GraphShape, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 keys: torch.Tensor, values: torch.Tensor, logits_nodes: torch.Tensor,
                 hidden_nodes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``LeanCausalLM.forward_rows``: logits [B * k, V] and hidden [B * k', H] of the real rows."""
        batch, per_row = input_ids.shape
        shape = GraphShape(keys.data_ptr(), row_bucket(batch), per_row, meta.tree_mask.shape[1],
                           key_bucket(meta.max_keys, self.max_positions), len(logits_nodes),
                           len(hidden_nodes) if hidden_nodes is not None else 0)
        padded = pad_rows_to(shape.rows, input_ids, positions, meta, logits_nodes, hidden_nodes,
                             table_blocks=-(-shape.keys // keys.shape[-1]))
        graph = self.graphs.get(shape)
        if graph is None:
            started = time.perf_counter()
            graph = self.graphs[shape] = _Graph(self.forward, padded, keys, values, shape.keys, self.pool)
            self.capture_seconds += time.perf_counter() - started
            log.debug("captured a CUDA graph for %s in %.0f ms", shape, 1e3 * (time.perf_counter() - started))
        logits, hidden = graph.replay(padded)
        real_logits = logits[: batch * len(logits_nodes)].clone() if logits is not None else None
        real_hidden = hidden[: batch * shape.hidden_per_row].clone() if hidden is not None else None
        return real_logits, real_hidden
