"""One model forward over tree nodes of some rows of the paged cache: the call every target and draft forward goes
through (prefill, draft level, verification).

The Llama family runs its lean forward (``lean_forward.py``) over the flat tokens. Any other causal LM, and a
feature draft, runs transformers' own forward with a cache adapter: each layer's new keys and values go into the
pool, and the rows' entries come back gathered into a padded batch, with a 4D mask the metadata describes.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoding.model.attention import (
    AttentionMetadata,
    DenseLayout,
    dense_layout,
    gather_rows,
    pools_zero_filled,
    write_slots,
)
from decoding.model.cuda_graphs import GraphedForward
from decoding.model.kv_cache import PagedKVCache, Rows
from decoding.model.lean_forward import LeanCausalLM
from decoding.model.lora import LoraBatch


class _PoolLayer(CacheLayerMixin):
    """One layer of the pool as transformers' cache layer: writes the new entries, returns the rows' entries."""

    def __init__(self, owner: _PoolAdapter, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        del key_states, value_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache, layout = self.owner.cache, self.owner.layout
        keys, values = cache.keys[self.index], cache.values[self.index]
        write_slots(keys, values, key_states.transpose(1, 2).flatten(0, 1), value_states.transpose(1, 2).flatten(0, 1),
                    layout.write_blocks, layout.write_offsets)
        dense_k, dense_v = gather_rows(keys, values, layout.blocks, layout.keys)
        if layout.seen is not None:  # positions no query of the row sees may never have been written: zeroed
            dense_k, dense_v = torch.where(layout.seen, dense_k, 0), torch.where(layout.seen, dense_v, 0)
        return dense_k.to(key_states.dtype).contiguous(), dense_v.to(value_states.dtype).contiguous()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.meta.max_keys, 0

    def get_seq_length(self) -> int:
        return self.owner.meta.max_keys

    def get_max_cache_shape(self) -> int:
        return self.owner.meta.max_keys

    def get_max_length(self) -> int:
        return self.owner.meta.max_keys


class _PoolAdapter(Cache):
    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, layout: DenseLayout) -> None:
        self.cache, self.meta, self.layout = cache, meta, layout
        super().__init__(layers=[_PoolLayer(self, i) for i in range(cache.shape.num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.meta.max_keys


@torch.no_grad()
def forward_tree(
    model: torch.nn.Module,
    cache: PagedKVCache,
    rows: Rows,
    input_ids: torch.Tensor,
    ancestors: torch.Tensor,
    valid: torch.Tensor,
    start: int = 0,
    logits_at: torch.Tensor | None = None,
    want_hidden: bool = False,
    hidden_at: torch.Tensor | None = None,
    features: torch.Tensor | None = None,
    replay: GraphedForward | None = None,
    lora: LoraBatch | None = None,
    adapter_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over tree nodes [start, start + T) of ``rows``; returns (logits [B, k, V], hidden [B, k', H]).

    ``input_ids`` [B, T] on the model's device; ``ancestors`` [>= end, >= end] and ``valid`` [B, >= end] on the
    host (see ``PagedKVCache.tree_metadata``). ``logits_at`` (host node indices relative to ``start``; default: every
    node) limits the LM head to those nodes: a prefill needs only each row's last prompt position, and the head is
    most of a small model's cost. The last hidden state comes back at ``hidden_at`` (default: the ``logits_at``
    nodes) when ``want_hidden``. ``features`` [B, T, H] is a feature draft's extra input. ``replay``: a lean
    forward's captured graphs (its ``ModelRunner``'s), replayed where this shape was captured. ``lora``: a lean
    forward's adapters (``LoraSlots.batch``), with ``adapter_slots`` (each token's slot, on the device) for a
    replay. The forward runs as the pool's ``execution`` says
    (``execution.py``).
    """
    batch, count = input_ids.shape
    end = start + count
    meta, positions = cache.tree_metadata(rows, ancestors, valid, start, end)
    device = input_ids.device
    at = torch.arange(count) if logits_at is None else logits_at
    hidden_nodes = (at if hidden_at is None else hidden_at) if want_hidden else None
    if isinstance(model, LeanCausalLM):
        replayed = replay(input_ids, positions, meta, cache.keys, cache.values, at, hidden_nodes,
                          adapter_slots) if replay else None
        logits, hidden = replayed or model(input_ids, positions, meta, cache.keys, cache.values, at, hidden_nodes,
                                           execution=cache.execution, lora=lora)
        hidden = hidden.view(batch, len(hidden_nodes), -1) if hidden is not None else None
        return logits.view(batch, len(at), -1), hidden
    layout = dense_layout(meta, cache.block_size, pools_zero_filled(cache.device))
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(layout.allowed.shape, dtype=dtype, device=device).masked_fill(~layout.allowed,
                                                                                    torch.finfo(dtype).min)
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions,
        cache=_PoolAdapter(cache, meta, layout), use_cache=True, output_hidden_states=want_hidden,
        logits_to_keep=at.to(device, non_blocking=True),
        **({"features": features} if features is not None else {}),
    )
    hidden = out.hidden_states[-1] if want_hidden else None
    if hidden is not None:
        hidden = hidden[:, hidden_nodes.to(device, non_blocking=True)]
    return out.logits, hidden
