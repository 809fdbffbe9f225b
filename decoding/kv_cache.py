"""A ragged, slot-addressed KV cache for tree verification, as a transformers ``Cache``.

Row b holds ``lengths[b]`` committed entries in slots [0, lengths[b]). A forward writes its new tokens at
``lengths[b] + offset + t`` (tentative), the 4D mask decides what each query sees, and ``commit`` then
*gathers* the accepted path into place right after the committed prefix: rejected branches are never cropped
or recomputed, and sequences of different lengths share one rectangular buffer without re-padding.
Rows [0, active) are live; a finished row is replaced by the last one (swap-remove) so the live rows stay a
contiguous, view-sliceable prefix. When the last row leaves, the buffers are released: an idle engine (a Serve
replica between bursts, one of several engines in a benchmark) holds no KV memory, which at 64 rows of 2048 slots
is 6 GB for SmolLM2-135M.

The host keeps its own copy of the committed lengths (``host_lengths``): it knows every commit's counts, so
sizing a forward (the longest row) never reads a device tensor back, which on a GPU would wait for the queue.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoding.tree import attention_inputs

# Which rows a forward runs: the live prefix or a part of it (a slice, a view), or some rows (a host index
# tensor, e.g. the rows of a batch that draft this step: their entries are gathered for the attention).
Rows = slice | torch.Tensor


class _SlotLayer(CacheLayerMixin):
    def __init__(self, owner: SlotKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (self.owner.capacity, key_states.shape[1], self.owner.max_slots, key_states.shape[-1])
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
        self.is_initialized = True

    def grow(self, slots: int) -> None:
        if self.is_initialized and self.keys.shape[2] < slots:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], slots, old.shape[3]))
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, kv_length = self.owner.rows, self.owner.kv_length
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            if isinstance(rows, slice):
                buffer[rows].scatter_(2, self.owner.write_index(new.shape), new.to(buffer.dtype))
            else:  # some rows: buffer[rows[i], :, write[i, t]] = new[i, :, t]
                buffer[rows[:, None], :, self.owner.write_slots] = new.transpose(1, 2).to(buffer.dtype)
        if isinstance(rows, slice):
            return self.keys[rows, :, :kv_length], self.values[rows, :, :kv_length]
        # Some rows: their entries gathered (a copy of what the attention reads anyway). ``index_select`` copies
        # whole row blocks; advanced indexing (``keys[rows]``) went element by element: 53 of 64 rows at ~450
        # cached tokens, 4.8 vs 1.1 ms a layer's keys, and up to 17 ms at longer padded contexts (2-core CPU).
        return (self.keys[:, :, :kv_length].index_select(0, rows),
                self.values[:, :, :kv_length].index_select(0, rows))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_length, 0

    def get_seq_length(self) -> int:
        return self.owner.longest(slice(0, self.owner.active))

    def get_max_cache_shape(self) -> int:
        return self.owner.max_slots

    def get_max_length(self) -> int:
        return self.owner.max_slots


class SlotKVCache(Cache):
    def __init__(self, num_layers: int, capacity: int, max_slots: int = 512, device: torch.device | None = None):
        self.capacity = capacity
        self.initial_slots = self.max_slots = max_slots
        self.device = device or torch.device("cpu")
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.host_lengths = [0] * capacity  # mirror of ``lengths``, kept from the commit counts
        self.active = 0
        self.rows: slice | torch.Tensor = slice(0, 0)  # of the forward being run (``prepare``)
        self.write_slots = torch.zeros(0, 0, dtype=torch.long)
        self._write_indices: dict[torch.Size, torch.Tensor] = {}  # of the forward being run
        self.kv_length = 0
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def longest(self, rows: Rows) -> int:
        """Longest committed length among ``rows``, from the host mirror (no device read)."""
        if isinstance(rows, slice):
            return max(self.host_lengths[rows], default=0)
        return max((self.host_lengths[row] for row in rows.tolist()), default=0)

    def prepare(self, rows: Rows, offset: int, num_new: int) -> None:
        """Aim the next forward: rows ``rows`` write ``num_new`` tokens after ``offset`` tentative slots."""
        self.kv_length = self.longest(rows) + offset + num_new  # from the host index, before it moves
        if not isinstance(rows, slice):
            rows = rows.to(self.device, non_blocking=True)
        lengths = self.lengths[rows]
        self.rows = rows
        self.write_slots = lengths[:, None] + offset + torch.arange(num_new, device=self.device)[None]
        self._write_indices = {}
        if self.kv_length > self.max_slots:
            self.reserve(max(self.kv_length, 2 * self.max_slots))

    def write_index(self, shape: torch.Size) -> torch.Tensor:
        """``write_slots`` expanded to a [rows, heads, tokens, dim] scatter index; built once per forward, not
        once per layer and tensor (a self-draft forward writes 60 of them)."""
        if shape not in self._write_indices:
            self._write_indices[shape] = self.write_slots[:, None, :, None].expand(-1, shape[1], -1, shape[-1])
        return self._write_indices[shape]

    def reserve(self, slots: int) -> None:
        """Room for ``slots`` entries per row, in one allocation. Each growth allocates and copies the whole
        cache: growing 64 rows of XSum prompts by doubling, one prefill group after another, took 3% of a
        batch-64 run; the engine reserves what a batch of prompts will need when it admits them."""
        if slots > self.max_slots:
            self.max_slots = slots
            for layer in self.layers:
                layer.grow(slots)  # an uninitialized layer allocates max_slots when first written

    def commit(self, rows: slice, keep: torch.Tensor, counts: torch.Tensor | list[int]) -> None:
        """Keep tentative slots ``lengths + keep[b, :counts[b]]`` as the next committed entries of each row.

        ``counts`` should come from the host (a list or a CPU tensor): counts on the device are read back.
        ``keep`` may come from the host too: where every row keeps the slots right after its committed entries in
        order (a chain's accepted prefix: every step at batch 1 without siblings), nothing moves. Gathering and
        scattering 60 buffers for nothing took 1.6 ms of a ~100 ms batch-1 step.
        """
        if keep.shape[1] == 0:
            return
        host_counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        for row, count in zip(range(rows.start, rows.stop), host_counts):
            self.host_lengths[row] += count
        counts = torch.as_tensor(counts).to(self.device, non_blocking=True)
        if keep.device.type == "cpu":  # read without waiting for the device
            in_place = torch.arange(keep.shape[1])[None]
            if bool(((keep == in_place) | (in_place >= torch.as_tensor(host_counts)[:, None])).all()):
                self.lengths[rows] += counts
                return
        keep = keep.to(self.device, non_blocking=True)
        lengths = self.lengths[rows]
        source = lengths[:, None] + keep
        target = lengths[:, None] + torch.arange(keep.shape[1], device=self.device)[None]
        # Entries past counts[b] copy onto themselves-or-garbage beyond the new length: harmless.
        source = torch.where(torch.arange(keep.shape[1], device=self.device)[None] < counts[:, None], source, target)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for buffer in (layer.keys, layer.values):
                view = buffer[rows]
                gather_index = source[:, None, :, None].expand(-1, view.shape[1], -1, view.shape[3])
                moved = view.gather(2, gather_index)
                view.scatter_(2, target[:, None, :, None].expand_as(moved), moved)
        self.lengths[rows] += counts

    def add_rows(self, count: int) -> slice:
        """Reserve ``count`` fresh rows after the live ones; returns their slice."""
        if self.active + count > self.capacity:
            raise ValueError(f"cache holds at most {self.capacity} rows")
        rows = slice(self.active, self.active + count)
        self.lengths[rows] = 0
        self.host_lengths[rows] = [0] * count
        self.active += count
        return rows

    def remove_row(self, row: int) -> None:
        """Swap-remove: the last live row moves into ``row``."""
        last = self.active - 1
        if row != last:
            used = self.host_lengths[last]
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[row, :, :used] = layer.keys[last, :, :used]
                    layer.values[row, :, :used] = layer.values[last, :, :used]
            self.lengths[row] = self.lengths[last]
            self.host_lengths[row] = used
        self.lengths[last] = 0
        self.host_lengths[last] = 0
        self.active = last
        if self.active == 0:
            self.max_slots = self.initial_slots
            for layer in self.layers:
                layer.keys = layer.values = None
                layer.is_initialized = False  # allocated again, lazily, by the next forward

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].get_seq_length()


@torch.no_grad()
def forward_tree(
    model: torch.nn.Module,
    cache: SlotKVCache,
    rows: Rows,
    input_ids: torch.Tensor,
    ancestors: torch.Tensor,
    valid: torch.Tensor,
    start: int = 0,
    logits_at: torch.Tensor | None = None,
    want_hidden: bool = False,
    hidden_at: torch.Tensor | None = None,
    features: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One model forward over tree nodes [start, start + T) of rows ``rows``; returns (logits, last hidden).

    ``logits_at`` (1D node indices, relative to ``start``) limits the LM head to those nodes: a prefill only
    needs the last prompt position of each row, and the head is most of a small model's cost. The last hidden
    state comes back at ``hidden_at`` (default: the ``logits_at`` nodes). ``features`` [B, T, H] is the extra
    input of a feature draft.
    """
    end = start + input_ids.shape[1]
    dtype = next(model.parameters()).dtype
    cache.prepare(rows, start, input_ids.shape[1])
    mask, positions, _ = attention_inputs(  # kv_length = the rows' longest committed length + end
        ancestors, valid, cache.lengths[cache.rows], start, end, dtype, max_length=cache.kv_length - end
    )
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,  # transformers >= 5.24 (past_key_values is removed in 5.40)
        use_cache=True,
        output_hidden_states=want_hidden,
        logits_to_keep=logits_at if logits_at is not None else 0,
        **({"features": features} if features is not None else {}),
    )
    hidden = out.hidden_states[-1] if want_hidden else None
    hidden_at = hidden_at if hidden_at is not None else logits_at
    if hidden is not None and hidden_at is not None:
        hidden = hidden[:, hidden_at]
    return out.logits, hidden
