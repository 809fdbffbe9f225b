"""Per-row state: rows are [0, n) in every holder (the batch, the KV pool's tables, a drafter's caches and lookups),
and a leaving row is replaced by the last one (swap-remove), in every holder the same way."""

from __future__ import annotations

from collections.abc import MutableSequence

import torch


def move_last_row(row: int, last: int, *holders: torch.Tensor | MutableSequence | None) -> None:
    """Row ``last``'s entry takes ``row``'s place in each holder (indexed by row first; None: none kept). A tensor
    with no row ``last`` yet (sized as rows first use it) has nothing to move. What becomes of the last entry (a
    list's pop, a reset) is its holder's."""
    if row == last:
        return
    for holder in holders:
        if holder is not None and (not isinstance(holder, torch.Tensor) or last < holder.shape[0]):
            holder[row] = holder[last]
