"""Ragged rows of token ids as one padded tensor: the engine and the drafters pad prompts, waiting tokens and
accepted paths the same way, in one tensor construction instead of a tensor per row."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch


def pad_rows(
    rows: Sequence[Sequence[int]], width: int | None = None, fill: int = 0, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` left-aligned in a [len(rows), width] host tensor (default width: the longest row), padded with
    ``fill``; also each row's length [len(rows)] (long). Rows longer than ``width`` are refused."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    longest = int(lengths.max()) if len(rows) else 0
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a row of {longest} items does not fit in width {width}")
    padded = torch.full((len(rows), width), fill, dtype=dtype)
    # Boolean-mask assignment fills row-major, i.e. in the order chain() lists the items.
    padded[torch.arange(width)[None] < lengths[:, None]] = torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
    return padded, lengths
