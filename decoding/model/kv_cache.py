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

Prefix caching (vLLM's automatic prefix caching): a full block of a prompt is known by a key, a hash of its tokens
and its parent block's key (the chain starts from the pool's ``salt``: the model and the element type), so a key
names the keys and values of a whole prefix. Blocks are reference-counted: once a row's prefill has written its
full prompt blocks they are registered under their keys, a joining row whose prompt starts with the same blocks
takes them (read-only) and prefills only the rest, and a block no row holds stays cached, in least-recently-
released order, until a block is needed and none is free. A row never writes a shared block: it writes positions
at or after its committed length, and only blocks wholly inside its prompt are ever shared. Admission claims the
cached blocks a row will take (``claim``), so nothing evicts them before its prefill.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from decoding.model.attention import AttentionMetadata, pools_zero_filled
from decoding.model.execution import Execution, default_execution
from decoding.model.rows import move_last_row

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


@dataclass
class Claim:
    """What admission promised a joining row in one pool: the cached blocks of its prompt's prefix it holds, and
    room for ``positions`` positions in all."""

    pool: PagedKVCache
    positions: int
    keys: list[bytes] = field(default_factory=list)  # its prompt's full blocks' keys
    blocks: list[int] = field(default_factory=list)  # cached blocks it holds (the first len(blocks) keys)
    cacheable: int = 0  # most blocks it may take from the cache: its prompt's last token is always computed
    prompt_tokens: int = 0  # its prompt's length where caching looked it up

    @property
    def reserved(self) -> int:
        """Blocks the pool promises it beyond the cached ones."""
        return max(0, self.pool.blocks_for(self.positions) - len(self.blocks))


def joining_entries(pool: PagedKVCache, claims: list[list[Claim]], positions: list[int] | None
                    ) -> list[int] | list[Claim]:
    """What ``pool.add_rows`` takes for joining rows: each row's claim in ``pool`` (``claims``: every claim of
    each row), or, where ``positions`` are given, that many positions each."""
    if positions is not None:
        return positions
    return [pool.own_claim(row) for row in claims]


class PagedKVCache:
    def __init__(
        self, shape: CacheShape, num_blocks: int, max_rows: int, max_positions: int, *, block_size: int = 16,
        dtype: torch.dtype = torch.float32, device: torch.device | None = None, execution: Execution | None = None,
        prefix_caching: bool = False, salt: str = "",
    ) -> None:
        """``execution``: how forwards over this pool run (default: the default configuration's on ``device``).
        ``prefix_caching``: full prompt blocks are shared by content (the module's doc); ``salt`` names what else
        decides an entry's value (the model, the element type)."""
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.execution = execution or default_execution(self.device)
        self.max_blocks_per_row = math.ceil(max_positions / block_size)
        self.max_positions_per_row = self.max_blocks_per_row * block_size  # what a row's block table can address
        # On a CPU torch.empty: pages are committed when first written, and blocks are handed out lowest first,
        # so resident memory follows the peak of blocks in use rather than the pool's size. Elsewhere zeros (one
        # memset): every slot then holds a finite value, so attention over gathered blocks needs no zeroing of
        # positions a row never wrote (``attention.dense_layout``).
        # One tensor for all layers: a compiled forward takes two inputs, not two per layer. Block 0 is scratch,
        # never handed out: the padding rows of a CUDA graph write there.
        self.lazy_pages = not pools_zero_filled(self.device)
        allocate = torch.empty if self.lazy_pages else torch.zeros
        self.keys = allocate(shape.num_layers, num_blocks + 1, shape.kv_heads, shape.head_dim, block_size,
                             dtype=dtype, device=self.device)
        self.values = allocate(shape.num_layers, num_blocks + 1, shape.kv_heads, block_size, shape.head_dim,
                               dtype=dtype, device=self.device)
        self._free = list(range(1, num_blocks + 1))  # a heap: lowest block first
        self.refs = [0] * (num_blocks + 1)  # rows holding each block
        self.prefix_caching = prefix_caching
        self._root_key = hashlib.blake2b(f"{salt}|{dtype}".encode(), digest_size=16).digest()
        self._cached: dict[bytes, int] = {}  # key -> block
        self._key_of: dict[int, bytes] = {}  # block -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no row holds, least recent first
        self._touched = 0  # highest block handed out so far (a CPU pool's pages are committed up to there)
        self._pending = 0  # blocks promised to claims whose rows are not added yet
        self.prefix_queries = 0  # prompt tokens of joining rows (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of those, tokens found cached (vLLM's prefix_cache_hits)
        self.tables = torch.zeros(max_rows, self.max_blocks_per_row, dtype=torch.int32)  # host
        self._device_tables = self.tables.to(self.device) if self.device.type != "cpu" else self.tables
        self._tables_stale = False
        self.row_blocks: list[list[int]] = [[] for _ in range(max_rows)]
        self.row_keys: list[list[bytes]] = [[] for _ in range(max_rows)]  # keys of each row's full prompt blocks
        self.host_lengths = [0] * max_rows  # committed positions per row
        self.reserved = [0] * max_rows  # blocks each row may still take
        # Each row's LoRA slot (0: the base), set as rows join (``decoding.model.lora``): its entries are the adapted
        # model's, and the forwards of runners that apply adapters read it.
        self.row_adapters = torch.zeros(max_rows, dtype=torch.long)
        self.active = 0
        self.peak_blocks = 0

    # ---------------------------------------------------------------------------------------------- blocks
    @property
    def blocks_in_use(self) -> int:
        """Blocks some row holds (cached blocks no row holds count as free: they are evicted on demand)."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def blocks_promised(self) -> int:
        return self.blocks_in_use + sum(self.reserved[: self.active]) + self._pending

    @property
    def blocks_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of the pool's blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.blocks_in_use / self.num_blocks

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def can_admit(self, positions: int) -> bool:
        """Whether a row needing ``positions`` positions fits beside the blocks promised to the live rows."""
        return self.active < self.max_rows and self.blocks_promised + self.blocks_for(positions) <= self.num_blocks

    # ------------------------------------------------------------------------------------------- prefixes
    def prefix_keys(self, prompt: list[int], salt: str = "") -> list[bytes]:
        """The keys of ``prompt``'s full blocks: each hashes the block's tokens with its parent's key, the first
        with the pool's root key and the row's ``salt`` (rows of different salts share no block)."""
        if not self.prefix_caching:
            return []
        keys, parent, size = [], self._root_key, self.block_size
        if salt:
            parent = hashlib.blake2b(parent + salt.encode(), digest_size=16).digest()
        for start in range(0, len(prompt) - size + 1, size):
            parent = hashlib.blake2b(parent + array("q", prompt[start : start + size]).tobytes(),
                                     digest_size=16).digest()
            keys.append(parent)
        return keys

    def _cached_run(self, keys: list[bytes], start: int, limit: int) -> list[int]:
        """The cached blocks of ``keys[start:limit]``, up to the first that is not cached."""
        blocks = []
        for key in keys[start:limit]:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _hold(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refs[block] == 0:
                del self._evictable[block]
            self.refs[block] += 1

    def _release(self, blocks: list[int]) -> None:
        # Tail blocks first: the least recently released is evicted first, so a prefix outlives its extensions.
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    heapq.heappush(self._free, block)

    def claim(self, prompt: list[int], positions: int, read_cache: bool = True, salt: str = "") -> Claim | None:
        """Admission of a row whose prompt is ``prompt`` and which may reach ``positions`` positions: the cached
        blocks of its prompt's prefix, held from now on, and the promise of the rest; None if the pool cannot
        promise it (nothing is held then). Without ``read_cache`` the row takes no cached block and prefills its
        whole prompt (vLLM's skip_reading_prefix_cache: a row asking for prompt logprobs needs the logits at every
        prompt position); its full blocks are still registered for later rows, and it counts no prefix query.
        ``salt``: the row's cache salt (``prefix_keys``)."""
        keys = self.prefix_keys(prompt, salt)
        cacheable = min(len(keys), (len(prompt) - 1) // self.block_size) if read_cache else 0
        blocks = self._cached_run(keys, 0, cacheable)
        queried = len(prompt) if self.prefix_caching and read_cache else 0
        claim = Claim(self, positions, keys, blocks, cacheable, queried)
        taken = sum(self.refs[block] == 0 for block in blocks)  # cached blocks it takes off the free side
        if self.blocks_promised + taken + claim.reserved > self.num_blocks:
            return None
        self._hold(blocks)
        self._pending += claim.reserved
        return claim

    def release_claim(self, claim: Claim) -> None:
        """Give back what ``claim`` held (a row that will not be added after all)."""
        self._pending -= claim.reserved
        self._release(claim.blocks)

    def own_claim(self, claims: list[Claim]) -> Claim:
        """This pool's claim among a row's claims."""
        return next(claim for claim in claims if claim.pool is self)

    def cached_blocks(self, claim: Claim) -> int:
        """Blocks of the claim's prompt that its row would take from the cache now."""
        return len(claim.blocks) + len(self._cached_run(claim.keys, len(claim.blocks), claim.cacheable))

    def register(self, rows: slice) -> None:
        """The prefill of ``rows`` has written their prompts: their full prompt blocks become cached (a block whose
        key another block already has stays the row's own)."""
        for row in range(rows.start, rows.stop):
            for key, block in zip(self.row_keys[row], self.row_blocks[row]):
                if key not in self._cached and block not in self._key_of:
                    self._cached[key], self._key_of[block] = block, key
            self.row_keys[row] = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache): blocks no row holds become free, the others
        stay their rows' own."""
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        self._cached.clear()
        self._key_of.clear()

    # ---------------------------------------------------------------------------------------------- rows
    def add_rows(self, joining: list[int] | list[Claim]) -> slice:
        """Admit rows after the live ones, each with what admission claimed for it (``claim``) or promised the
        blocks for a number of positions; returns their slice. A claimed row starts with its cached blocks
        committed: its prefill runs the rest of its prompt."""
        if self.active + len(joining) > self.max_rows:
            raise ValueError(f"cache holds at most {self.max_rows} rows")
        rows = slice(self.active, self.active + len(joining))
        for row, entry in zip(range(rows.start, rows.stop), joining):
            if isinstance(entry, Claim):
                assert entry.pool is self, "a claim is added to the pool that made it"
                self._pending -= entry.reserved
                # Rows prefilled since the claim may have cached more of its prompt (rows of one step sharing it).
                more = self._cached_run(entry.keys, len(entry.blocks), entry.cacheable)
                self._hold(more)
                blocks = entry.blocks + more
                claim = entry
            else:
                blocks, claim = [], Claim(self, entry)
            self.row_blocks[row] = list(blocks)
            self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self.row_keys[row] = claim.keys
            self.host_lengths[row] = len(blocks) * self.block_size
            self.reserved[row] = max(0, self.blocks_for(claim.positions) - len(blocks))
            self.prefix_queries += claim.prompt_tokens
            self.prefix_hits += len(blocks) * self.block_size
            if blocks:
                self._tables_stale = True
        self.active = rows.stop
        return rows

    def _take_block(self) -> int:
        """A block for a row: a free one, else the least recently released cached one. A CPU pool's pages are
        committed when first written, so there a cached block is reused before a never-touched one: resident
        memory stays the peak of blocks in use."""
        if self._evictable and (not self._free or (self.lazy_pages and self._free[0] > self._touched)):
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._key_of.pop(block)]
        else:
            block = heapq.heappop(self._free)
        self._touched = max(self._touched, block)
        self.refs[block] = 1
        return block

    def ensure(self, rows: Rows, positions: list[int]) -> None:
        """Give each row of ``rows`` blocks for its positions [0, positions[i])."""
        for row, need in zip(self._row_ids(rows), positions):
            blocks = self.row_blocks[row]
            missing = self.blocks_for(need) - len(blocks)
            if missing <= 0:
                continue
            if missing > len(self._free) + len(self._evictable) or len(blocks) + missing > self.max_blocks_per_row:
                raise RuntimeError(f"KV cache pool exhausted ({self.num_blocks} blocks of {self.block_size})")
            new = [self._take_block() for _ in range(missing)]
            self.tables[row, len(blocks) : len(blocks) + missing] = torch.tensor(new, dtype=torch.int32)
            blocks += new
            self.reserved[row] = max(0, self.reserved[row] - missing)
            self._tables_stale = True
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)

    def remove_row(self, row: int) -> None:
        """Return the row's blocks to the pool; the last live row takes its place (its table row moves)."""
        self._release(self.row_blocks[row])
        last = self.active - 1
        move_last_row(row, last, self.row_blocks, self.row_keys, self.host_lengths, self.reserved, self.tables,
                      self.row_adapters)
        self._tables_stale |= row != last
        self.row_blocks[last], self.row_keys[last], self.host_lengths[last], self.reserved[last] = [], [], 0, 0
        self.row_adapters[last] = 0
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

    def paddable(self, rows: Rows) -> list[int]:
        """Positions past its committed length each row may write without taking more blocks than it was promised
        (a padded forward writes every row up to the longest one's length)."""
        return [(len(self.row_blocks[row]) + self.reserved[row]) * self.block_size - self.host_lengths[row]
                for row in self._row_ids(rows)]

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
