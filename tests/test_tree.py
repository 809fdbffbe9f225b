"""The candidate tree (decoding/verification/tree.py): its layout level by level, each node's parent and depth, and the
ancestor mask a tree forward attends by, on literal expectations."""

from __future__ import annotations

import torch

from decoding.verification.tree import TreeTopology, chain_ancestors, with_prefix_chain


def test_sliced_mask_equals_rebuilt_mask() -> None:
    largest = TreeTopology(num_candidates=3, max_depth=5, root_width=3)
    for depth in range(6):
        assert torch.equal(largest.sliced_ancestors(depth), TreeTopology(3, depth, 3).ancestors)


def test_a_draft_initialized_tree_grows_one_node_per_candidate_and_level() -> None:
    topology = TreeTopology(num_candidates=2, max_depth=2, root_width=1)
    assert [topology.size(depth) for depth in range(3)] == [1, 3, 5]
    assert [topology.level_slice(level) for level in range(3)] == [slice(0, 1), slice(1, 3), slice(3, 5)]
    assert topology.parents == [-1, 0, 0, 1, 2]  # both candidates branch from the one root
    assert topology.depths.tolist() == [0, 1, 1, 2, 2]
    assert topology.candidate_index.tolist() == [0, 0, 1, 0, 1]
    assert topology.ancestors.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    assert topology.sliced_ancestors(1).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    assert topology.sliced_ancestors(0).int().tolist() == [[1]]


def test_a_target_initialized_tree_is_one_chain_per_root() -> None:
    topology = TreeTopology(num_candidates=2, max_depth=2, root_width=2)
    assert [topology.size(depth) for depth in range(3)] == [2, 4, 6]
    assert [topology.level_slice(level) for level in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert topology.parents == [-1, -1, 0, 1, 2, 3]
    assert topology.depths.tolist() == [0, 0, 1, 1, 2, 2]
    assert topology.candidate_index.tolist() == [0, 1, 0, 1, 0, 1]
    assert topology.ancestors.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [0, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [0, 1, 0, 1, 0, 1],
    ]


def test_candidates_beyond_the_roots_branch_from_the_pending_token() -> None:
    """Two target-initialized roots and a third candidate (an n-gram sibling): its chain starts below node 0."""
    topology = TreeTopology(num_candidates=3, max_depth=2, root_width=2)
    assert [topology.size(depth) for depth in range(3)] == [2, 5, 8]
    assert topology.parents == [-1, -1, 0, 1, 0, 2, 3, 4]
    assert topology.depths.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert topology.candidate_index.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert topology.ancestors[7].int().tolist() == [1, 0, 0, 0, 1, 0, 0, 1]
    assert topology.ancestors[6].int().tolist() == [0, 1, 0, 1, 0, 0, 1, 0]


def test_a_prefix_chain_precedes_every_tree_node() -> None:
    """Catch-up tokens before the tree: a causal chain that every tree node sees, and that sees no tree node."""
    assert chain_ancestors(3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    tree = TreeTopology(num_candidates=2, max_depth=1, root_width=1).ancestors
    assert with_prefix_chain(tree, 2).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    assert torch.equal(with_prefix_chain(tree, 0), tree)
