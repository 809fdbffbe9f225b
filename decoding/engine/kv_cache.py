"""The paged KV cache: fixed-size blocks from one pool, a block table per row, memory by use.

Each layer's keys and values live in one pool of ``num_blocks`` blocks of ``block_size`` positions (keys
[blocks, kv_heads, head_dim, block_size], values [blocks, kv_heads, block_size, head_dim]: see ``attention.py``).
Row r of the batch owns the blocks of its block table: position p sits at offset p % block_size of block
``table[r][p // block_size]``. A row is admitted only while the pool can promise it the blocks its prompt, its
``max_tokens`` and one draft tree need (its reservation); blocks are handed out as the row grows and all return to
the pool when it leaves, so memory in use is the tokens cached plus at most one partial block per row, and a row
never waits for a block once admitted (no preemption).

A forward writes its tree's nodes at the row's committed length + node index (tentative entries), and ``commit``
then moves the accepted path right after the committed prefix: entries already in place are not touched, rejected
branches are simply overwritten later. Live rows are [0, active); a leaving row is replaced by the last (swap-remove
of table rows: no key or value moves). The host keeps the committed lengths and the tables (the device's copy of
the tables is refreshed when they change), so sizing and describing a forward never reads the device.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from decoding.model.attention import AttentionMetadata, pools_zero_filled
from decoding.model.execution import Execution, default_execution

# Which rows a forward runs: the live prefix or a part of it (a slice), or some rows (a host index tensor).
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes of one position over all layers, per byte of the element type."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim

    @classmethod
    def of(cls, config) -> CacheShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim)


class PagedKVCache:
    def __init__(
        self, shape: CacheShape, num_blocks: int, max_rows: int, max_positions: int, *, block_size: int = 16,
        dtype: torch.dtype = torch.float32, device: torch.device | None = None, execution: Execution | None = None,
    ) -> None:
        """``execution``: how forwards over this pool run (default: the default configuration's on ``device``)."""
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.execution = execution or default_execution(self.device)
        self.max_blocks_per_row = math.ceil(max_positions / block_size)
        # On a CPU torch.empty: pages are committed when first written, and blocks are handed out lowest first,
        # so resident memory follows the peak of blocks in use rather than the pool's size. Elsewhere zeros (one
        # memset): every slot then holds a finite value, so attention over gathered blocks needs no zeroing of
        # positions a row never wrote (``attention.dense_layout``).
        # One tensor for all layers: a compiled forward takes two inputs, not two per layer. Block 0 is scratch,
        # never handed out: the padding rows of a CUDA graph write there.
        allocate = torch.zeros if pools_zero_filled(self.device) else torch.empty
        self.keys = allocate(shape.num_layers, num_blocks + 1, shape.kv_heads, shape.head_dim, block_size,
                             dtype=dtype, device=self.device)
        self.values = allocate(shape.num_layers, num_blocks + 1, shape.kv_heads, block_size, shape.head_dim,
                               dtype=dtype, device=self.device)
        self._free = list(range(1, num_blocks + 1))  # a heap: lowest block first
        self.tables = torch.zeros(max_rows, self.max_blocks_per_row, dtype=torch.int32)  # host
        self._device_tables = self.tables.to(self.device) if self.device.type != "cpu" else self.tables
        self._tables_stale = False
        self.row_blocks: list[list[int]] = [[] for _ in range(max_rows)]
        self.host_lengths = [0] * max_rows  # committed positions per row
        self.reserved = [0] * max_rows  # blocks each row may still take
        self.active = 0
        self.peak_blocks = 0

    # ---------------------------------------------------------------------------------------------- blocks
    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def blocks_promised(self) -> int:
        return self.blocks_in_use + sum(self.reserved[: self.active])

    def usage(self) -> float:
        """Fraction of the pool's blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.blocks_in_use / self.num_blocks

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def can_admit(self, positions: int) -> bool:
        """Whether a row needing ``positions`` positions fits beside the blocks promised to the live rows."""
        return self.active < self.max_rows and self.blocks_promised + self.blocks_for(positions) <= self.num_blocks

    def add_rows(self, positions: list[int]) -> slice:
        """Admit rows after the live ones, each promised the blocks for its ``positions``; returns their slice."""
        if self.active + len(positions) > self.max_rows:
            raise ValueError(f"cache holds at most {self.max_rows} rows")
        rows = slice(self.active, self.active + len(positions))
        for row, need in zip(range(rows.start, rows.stop), positions):
            self.row_blocks[row] = []
            self.host_lengths[row] = 0
            self.reserved[row] = self.blocks_for(need)
        self.active = rows.stop
        return rows

    def ensure(self, rows: Rows, positions: list[int]) -> None:
        """Give each row of ``rows`` blocks for its positions [0, positions[i])."""
        for row, need in zip(self._row_ids(rows), positions):
            blocks = self.row_blocks[row]
            missing = self.blocks_for(need) - len(blocks)
            if missing <= 0:
                continue
            if missing > len(self._free) or len(blocks) + missing > self.max_blocks_per_row:
                raise RuntimeError(f"KV cache pool exhausted ({self.num_blocks} blocks of {self.block_size})")
            new = [heapq.heappop(self._free) for _ in range(missing)]
            self.tables[row, len(blocks) : len(blocks) + missing] = torch.tensor(new, dtype=torch.int32)
            blocks += new
            self.reserved[row] = max(0, self.reserved[row] - missing)
            self._tables_stale = True
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)

    def remove_row(self, row: int) -> None:
        """Return the row's blocks to the pool; the last live row takes its place (its table row moves)."""
        for block in self.row_blocks[row]:
            heapq.heappush(self._free, block)
        last = self.active - 1
        if row != last:
            self.row_blocks[row] = self.row_blocks[last]
            self.host_lengths[row] = self.host_lengths[last]
            self.reserved[row] = self.reserved[last]
            self.tables[row] = self.tables[last]
            self._tables_stale = True
        self.row_blocks[last], self.host_lengths[last], self.reserved[last] = [], 0, 0
        self.active = last

    def device_tables(self) -> torch.Tensor:
        """The block tables on the cache's device (copied without waiting when they changed)."""
        if self._tables_stale and self._device_tables is not self.tables:
            self._device_tables.copy_(self.tables, non_blocking=True)
        self._tables_stale = False
        return self._device_tables

    # --------------------------------------------------------------------------------------------- lengths
    def _row_ids(self, rows: Rows) -> list[int]:
        return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()

    def longest(self, rows: Rows) -> int:
        """Longest committed length among ``rows`` (host)."""
        return max((self.host_lengths[row] for row in self._row_ids(rows)), default=0)

    def lengths(self, rows: Rows) -> torch.Tensor:
        return torch.tensor([self.host_lengths[row] for row in self._row_ids(rows)], dtype=torch.long)

    def slot_of(self, row: int, position: int) -> int:
        return int(self.tables[row, position // self.block_size]) * self.block_size + position % self.block_size

    # ---------------------------------------------------------------------------------------------- forward
    def tree_metadata(
        self, rows: Rows, ancestors: torch.Tensor, valid: torch.Tensor, start: int, end: int
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata and positions [B, end - start] for a forward over tree nodes [start, end) of ``rows``,
        node n of row b sitting at position ``length_b + n``.

        ``ancestors`` [>= end, >= end] (host bool): row n marks n's ancestors and n. ``valid`` [B, >= end] (bool,
        on the host or the cache's device): which nodes each row has. A node a row lacks is a padding query: its
        entries are written (where the row's real nodes never look) and it sees only the row's first position,
        which keeps its output finite. Everything is computed with tensor operations where ``valid`` lives, so
        describing a forward never waits for the device. Blocks for positions [0, length_b + end) are given to
        every row first.
        """
        row_ids = self._row_ids(rows)
        host_lengths = [self.host_lengths[row] for row in row_ids]
        self.ensure(rows, [length + end for length in host_lengths])
        device = self.device
        valid = valid.to(device, non_blocking=True)
        batch, count = len(row_ids), end - start
        lengths = torch.tensor(host_lengths, dtype=torch.long).to(device, non_blocking=True)
        tree = ancestors[start:end, :end]
        # Words of tree bits: beyond the nodes every query sees in a chain from node 0 (a prefill sees them all).
        static_chain = int(tree.long().cumprod(-1).sum(-1).min()) if count else 0
        words = max(1, -(-(end - static_chain) // 64))
        real = valid[:, start:end]  # [B, T]
        visible = tree.to(device, non_blocking=True)[None] & valid[:, None, :end]  # [B, T, end]
        positions = lengths[:, None] + (visible.sum(-1) - 1).clamp(min=0)  # depth: strict ancestors
        chain = visible.long().cumprod(-1).sum(-1)  # [B, T]: leading nodes all visible
        if end > 1:
            offsets = torch.arange(end, device=device)[None, None] - chain[..., None]  # [B, T, end]
            in_tree = visible & (offsets >= 0) & real[..., None]
            bit = torch.where(in_tree, torch.ones_like(offsets) << (offsets.clamp(min=0) % 64), 0)
            word_of = offsets.clamp(min=0) // 64
            bits = torch.stack([torch.where(word_of == w, bit, 0).sum(-1) for w in range(words)], -1)  # [B, T, W]
        else:  # one node a row (a decode step): it sees its row's prefix and itself, no tree bit
            bits = torch.zeros(batch, count, 1, dtype=torch.long, device=device)
        prefix = torch.where(real, lengths[:, None] + chain, 1)
        picked = rows if isinstance(rows, slice) else torch.tensor(row_ids).to(self.device, non_blocking=True)
        tables = self.device_tables()[picked]  # [B, max_blocks]: a view where rows are a slice
        node_positions = lengths[:, None] + torch.arange(start, end, device=device)[None]
        slots = tables.gather(1, node_positions // self.block_size).long() * self.block_size + (
            node_positions % self.block_size)
        meta = AttentionMetadata(
            slots=slots.flatten(), block_tables=tables,
            row_starts=torch.arange(0, batch * count + 1, count, dtype=torch.int32, device=device),
            prefix_len=prefix.flatten().to(torch.int32), tree_mask=bits.view(batch * count, words),
            max_keys=max(host_lengths, default=0) + end,
        )
        return meta, positions

    def commit(self, rows: slice, keep: torch.Tensor, counts: torch.Tensor | list[int]) -> None:
        """Keep the tentative entries at nodes ``keep[b, :counts[b]]`` as the next committed positions of each row.

        ``keep`` and ``counts`` come from the host. Entries already in place (a chain's accepted prefix: every step
        of one row without siblings) are not moved.
        """
        host_counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        sources, targets = [], []
        for row, nodes, count in zip(range(rows.start, rows.stop), keep.tolist(), host_counts):
            length = self.host_lengths[row]
            for index, node in enumerate(nodes[:count]):
                if node != index:
                    sources.append(self.slot_of(row, length + node))
                    targets.append(self.slot_of(row, length + index))
            self.host_lengths[row] = length + count
        if not sources:
            return
        source = torch.tensor(sources).to(self.device, non_blocking=True)
        target = torch.tensor(targets).to(self.device, non_blocking=True)
        size = self.block_size
        blocks, offsets = target // size, target % size
        self.keys[:, blocks, :, :, offsets] = self.keys[:, source // size, :, :, source % size]
        self.values[:, blocks, :, offsets] = self.values[:, source // size, :, source % size]

    def advance(self, rows: slice, counts: list[int]) -> None:
        """Commit ``counts`` positions written in order after each row's committed ones (a prefill, a chain)."""
        for row, count in zip(range(rows.start, rows.stop), counts):
            self.host_lengths[row] += count
