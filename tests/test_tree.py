"""The candidate tree (decoding/tree.py): the ancestor mask of a tree of any depth is a slice of
the largest tree's."""

from __future__ import annotations

import torch

from decoding.tree import TreeTopology


def test_sliced_mask_equals_rebuilt_mask() -> None:
    largest = TreeTopology(num_candidates=3, max_depth=5, root_width=3)
    for depth in range(6):
        assert torch.equal(largest.sliced_ancestors(depth), TreeTopology(3, depth, 3).ancestors)
