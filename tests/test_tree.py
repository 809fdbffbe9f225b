"""The candidate tree (decoding/verification/tree.py): its layout level by level, each node's parent and depth, and the
ancestor mask a tree forward attends by, on literal expectations."""

from __future__ import annotations

import pytest
import torch

from decoding.verification.tree import (
    TreeTopology,
    best_first_layout,
    best_first_tree,
    chain_ancestors,
    with_prefix_chain,
)


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


def test_a_static_tree_comes_before_each_levels_chains() -> None:
    """A static tree (a, b under the pending token; c, d under a; e under b; f under c) and one chain: each level
    lays out the tree's nodes, siblings together in rank order, then the chain's node."""
    topology = TreeTopology(num_candidates=1, max_depth=3, root_width=1, tree=(-1, -1, 0, 0, 1, 2))
    assert [topology.size(depth) for depth in range(4)] == [1, 4, 8, 10]
    assert [topology.tree_width(level) for level in range(4)] == [0, 2, 3, 1]
    #                          pending  a  b  chain  c  d  e  chain  f  chain
    assert topology.parents == [-1, 0, 0, 0, 1, 1, 2, 3, 4, 7]
    assert topology.tree_nodes == [1, 2, 4, 5, 6, 8]
    assert topology.tree_ranks == [0, 1, 0, 1, 0, 0]
    assert [topology.chain_node(level, 0) for level in (1, 2, 3)] == [3, 7, 9]
    assert topology.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert topology.candidate_index.tolist() == [0, 0, 1, 2, 0, 1, 2, 3, 0, 1]  # the place within the level
    assert topology.ancestors[8].nonzero().flatten().tolist() == [0, 1, 4, 8]
    assert topology.ancestors[9].nonzero().flatten().tolist() == [0, 3, 7, 9]
    assert torch.equal(topology.sliced_ancestors(2), ancestor_rows(topology.parents[:8]))


def ancestor_rows(parents: list[int]) -> torch.Tensor:
    """The ancestor mask by walking each node up to the root (independent of ``ancestor_matrix``)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return mask


def test_a_best_first_tree_takes_the_likeliest_paths_and_keeps_siblings_together() -> None:
    """Priors 0.5 and 0.3 by rank: a (0.5), b (0.3), a's first child (0.25), then b's first child and a's second
    (0.15 each: the earlier taken wins the tie), laid out a, b | a0, a1, b0."""
    assert best_first_tree([0.5, 0.3], depth=3, nodes=5) == (-1, -1, 0, 0, 1)
    assert best_first_tree([0.5, 0.3], depth=3, nodes=4) == (-1, -1, 0, 1)
    assert best_first_tree([0.9], depth=4, nodes=10) == (-1, 0, 1, 2)  # one successor a token: a chain
    assert best_first_tree([0.5, 0.3], depth=1, nodes=10) == (-1, -1)  # as many as the ranks at depth 1
    tree = best_first_tree([0.45, 0.15, 0.08, 0.05], depth=5, nodes=40)
    topology = TreeTopology(0, 5, 1, tree)
    assert len(tree) == 40 and topology.tree_width(1) == 4
    # Every prefix of a level is a set of siblings groups in their parents' order, each group in rank order.
    for node, (parent, rank) in enumerate(zip(tree, topology.tree_ranks)):
        earlier = [other for other in range(node) if tree[other] == parent]
        assert rank == len(earlier) and all(tree[other] <= parent for other in range(node) if
                                            topology.depths[topology.tree_nodes[other]] ==
                                            topology.depths[topology.tree_nodes[node]])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"root_width": 2, "tree": (-1,)}, "root_width"),
    ({"tree": (-1, 2, 0)}, "parents before children"),
    ({"tree": (-1, 0, -1)}, "level by level"),
    ({"tree": (-1, 0, 1, 2)}, "deeper than max_depth"),
    ({"tree": (-1, -1, 0), "tree_order": (0, 1, 1)}, "each node once"),
    ({"tree": (-1, -1, 0), "tree_order": (1, 2, 0)}, "parents before children"),
])
def test_a_static_tree_is_checked_when_made(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        TreeTopology(num_candidates=1, max_depth=3, **kwargs)


def test_a_best_first_tree_is_cut_to_its_first_nodes_taken() -> None:
    """The tree of the priors 0.5, 0.3 above was taken a, b, a0, b0, a1: cut to 1, 3 and 4 nodes it keeps a; a, b,
    a0; a, b, a0, b0. The pending token and a lookup chain (one candidate after the tree) stay in each cut."""
    tree, order = best_first_layout([0.5, 0.3], depth=3, nodes=5)
    assert (tree, order) == ((-1, -1, 0, 0, 1), (0, 1, 2, 4, 3))
    topology = TreeTopology(1, 3, 1, tree, order)
    # Layout: pending | a b lookup1 | a0 a1 b0 lookup2 | lookup3.
    assert topology.parents == [-1, 0, 0, 0, 1, 1, 2, 3, 7]
    cuts = topology.nested_trees(0, [1, 3, 4])
    assert cuts.int().tolist() == [
        [1, 1, 0, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 1, 1, 1],
    ]
    for cut in cuts:  # each cut is a tree: a node's parent is in it too
        assert all(cut[parent] for node, parent in enumerate(topology.parents) if cut[node] and parent >= 0)
    assert topology.model_nodes(0).int().tolist() == [0, 1, 1, 0, 1, 1, 1, 0, 0]  # the tree, not the lookup chain


def test_a_tree_taken_out_of_layout_order_is_cut_by_that_order() -> None:
    """Priors 0.6, 0.1: a (0.6), a0 (0.36), a00 (0.216), then b (0.1): laid out a b | a0 | a00, taken a a0 a00 b."""
    tree, order = best_first_layout([0.6, 0.1], depth=3, nodes=4)
    assert (tree, order) == ((-1, -1, 0, 2), (0, 3, 1, 2))
    cuts = TreeTopology(0, 3, 1, tree, order).nested_trees(0, [3, 4])
    assert cuts.int().tolist() == [[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]


def test_chains_are_cut_to_their_first_candidates_with_their_roots() -> None:
    """Target-initialized chains of width 3, then one lookup chain: cut to width 1 or 2, the later model chains go,
    with their root siblings; the lookup chain stays."""
    topology = TreeTopology(4, 2, 3)
    assert topology.parents == [-1, -1, -1, 0, 1, 2, 0, 3, 4, 5, 6]
    cuts = topology.nested_trees(3, [1, 2, 3])
    assert cuts.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1],
        [1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1],
        [1] * 11,
    ]
    # Below the roots, the model's three chains; the lookup chain's nodes are the rest.
    assert topology.model_nodes(3).int().tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0]
