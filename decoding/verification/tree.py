"""Candidate-tree topology and the topology-aware attention mask (Lu et al.: built once, sliced per step).

Nodes are laid out level by level. Level 0 holds the root-level nodes (the pending token, plus its
target-initialized siblings when ``candidate_init: target``); each deeper level holds one node per candidate
(chains), after the nodes of a static tree where there is one (a recycling tree: ``best_first_tree``). Because
parents always precede children and levels are contiguous, the tree of depth d is the prefix of the largest tree,
so its ancestor matrix is a slice of the largest one: dynamic draft lengths never rebuild it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeTopology:
    num_candidates: int  # chains: candidate continuations per level (after the static tree's nodes)
    max_depth: int  # drafted tokens per candidate
    root_width: int = 1  # 1 (draft-initialized) or num_candidates (target-initialized)
    # A static tree under the pending token, level by level: each of its nodes' parent among its nodes (-1: the
    # pending token), siblings in rank order. Its nodes at a level come before that level's chains.
    tree: tuple[int, ...] = ()
    # Each static tree node's place in the order it was taken, best first (empty: the layout's order). Every
    # parent comes before its children, so the first n nodes taken are a tree: the tree cut to n nodes.
    tree_order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tree and self.root_width != 1:
            raise ValueError("a static tree grows under the pending token: root_width must be 1")
        if self.tree_order and (sorted(self.tree_order) != list(range(len(self.tree))) or any(
                parent >= 0 and self.tree_order[parent] > self.tree_order[node]
                for node, parent in enumerate(self.tree))):
            raise ValueError(f"a static tree's order takes each node once, parents before children: "
                             f"{self.tree_order}")
        if any(parent >= node for node, parent in enumerate(self.tree)) or \
                self._tree_depths != sorted(self._tree_depths):
            raise ValueError(f"a static tree lists parents before children, level by level: {self.tree}")
        if self.tree and self._tree_depths[-1] > self.max_depth:
            raise ValueError(f"the static tree is {self._tree_depths[-1]} deep, deeper than max_depth "
                             f"{self.max_depth}")

    @cached_property
    def _tree_depths(self) -> list[int]:
        depths: list[int] = []
        for parent in self.tree:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @cached_property
    def _level_starts(self) -> list[int]:
        """The first node of each level 0..max_depth, then the largest tree's size."""
        starts = [0, self.root_width]
        for level in range(1, self.max_depth + 1):
            starts.append(starts[-1] + self.tree_width(level) + self.num_candidates)
        return starts

    @cached_property
    def _tree_widths(self) -> list[int]:
        widths = [0] * (self.max_depth + 1)
        for depth in self._tree_depths:
            widths[depth] += 1
        return widths

    def tree_width(self, level: int) -> int:
        """The static tree's nodes at ``level`` (0 at the root level)."""
        return self._tree_widths[level]

    def size(self, depth: int) -> int:
        """Number of nodes in the tree of the given depth."""
        return self._level_starts[depth + 1]

    def level_slice(self, level: int) -> slice:
        return slice(self._level_starts[level], self._level_starts[level + 1])

    def chain_node(self, level: int, candidate: int) -> int:
        """The node of chain ``candidate`` at ``level`` (>= 1)."""
        return self._level_starts[level] + self.tree_width(level) + candidate

    @cached_property
    def tree_nodes(self) -> list[int]:
        """Each static tree node's index in the layout."""
        nodes, seen = [], [0] * (self.max_depth + 1)
        for depth in self._tree_depths:
            nodes.append(self._level_starts[depth] + seen[depth])
            seen[depth] += 1
        return nodes

    @cached_property
    def tree_ranks(self) -> list[int]:
        """Each static tree node's rank among its siblings (0: its parent's first child)."""
        ranks, children = [], {}
        for parent in self.tree:
            ranks.append(children.get(parent, 0))
            children[parent] = ranks[-1] + 1
        return ranks

    @cached_property
    def parents(self) -> list[int]:
        parents = [-1] * self.root_width
        nodes = self.tree_nodes
        for level in range(1, self.max_depth + 1):
            parents += [nodes[parent] if parent >= 0 else 0
                        for parent, depth in zip(self.tree, self._tree_depths) if depth == level]
            for candidate in range(self.num_candidates):
                # Candidates beyond the target-initialized roots (n-gram siblings) branch from the pending token.
                above = (candidate if candidate < self.root_width else 0) if level == 1 else \
                    self.chain_node(level - 1, candidate)
                parents.append(above)
        return parents

    @cached_property
    def depths(self) -> torch.Tensor:
        depth = [0] * len(self.parents)
        for node, parent in enumerate(self.parents):
            depth[node] = 0 if parent < 0 else depth[parent] + 1
        return torch.tensor(depth)

    @cached_property
    def candidate_index(self) -> torch.Tensor:
        """Each node's position among the nodes of its level: for chains, which candidate (0..width-1) it belongs
        to; the shared draft-initialized root is 0."""
        return torch.tensor([node - self._level_starts[depth] for node, depth in enumerate(self.depths.tolist())])

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool, row n marks n and its ancestors: the largest tree's mask."""
        return ancestor_matrix(self.parents)

    def sliced_ancestors(self, depth: int) -> torch.Tensor:
        n = self.size(depth)
        return self.ancestors[:n, :n]

    def model_nodes(self, model_chains: int) -> torch.Tensor:
        """[N] bool: the nodes below the root level a model drafts, the static tree's and the first
        ``model_chains`` chains' at every level; the other chains' are lookup siblings."""
        model = torch.zeros(self.size(self.max_depth), dtype=torch.bool)
        model[self.tree_nodes] = True
        for level in range(1, self.max_depth + 1):
            model[self.chain_node(level, 0) : self.chain_node(level, model_chains)] = True
        return model

    def nested_trees(self, model_chains: int, sizes: Sequence[int]) -> torch.Tensor:
        """[K, N] bool: the largest tree cut to each of ``sizes`` (ascending), the trees a row can be planned with.

        The model's nodes are ranked, a static tree's by the order they were taken (``tree_order``), chain c's
        (with its target-initialized root) by c for the first ``model_chains`` chains, and size s keeps those
        ranked below s: each cut is a tree, and each holds the smaller ones. The pending token and the other
        chains (lookup siblings) stay in every cut."""
        rank = torch.full((self.size(self.max_depth),), -1)
        order = self.tree_order or range(len(self.tree))
        rank[self.tree_nodes] = torch.tensor(order, dtype=torch.long)
        for candidate in range(model_chains):
            if 0 < candidate < self.root_width:
                rank[candidate] = candidate
            for level in range(1, self.max_depth + 1):
                rank[self.chain_node(level, candidate)] = candidate
        return rank[None] < torch.tensor(list(sizes))[:, None]


def best_first_tree(rank_prior: Sequence[float], depth: int, nodes: int) -> tuple[int, ...]:
    """The static tree (``TreeTopology.tree``) of the ``nodes`` nodes, at most ``depth`` deep, most likely to be
    accepted when a node of rank r is accepted with probability ``rank_prior[r]`` given its parent was (Sequoia's
    and token recycling's static trees): taken best first, a node's score is the product of its path's priors, so
    every parent is taken before its children and every rank before the next. Ties go to the earlier node."""
    return best_first_layout(rank_prior, depth, nodes)[0]


def best_first_layout(rank_prior: Sequence[float], depth: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``best_first_tree`` and its ``TreeTopology.tree_order``: each node's place in the order it was taken."""
    taken: list[tuple[int, int]] = []  # (parent, depth) in the order taken
    order = 0
    frontier = [(-rank_prior[0], order, 1.0, -1, 0, 1)]  # (-score, tie, parent's score, parent, rank, depth)
    while frontier and len(taken) < nodes:
        negative, _, parent_score, parent, rank, level = heapq.heappop(frontier)
        node = len(taken)
        taken.append((parent, level))
        if rank + 1 < len(rank_prior):  # the next sibling
            order += 1
            heapq.heappush(frontier, (-parent_score * rank_prior[rank + 1], order, parent_score, parent, rank + 1,
                                      level))
        if level < depth:  # the first child
            order += 1
            heapq.heappush(frontier, (negative * rank_prior[0], order, -negative, node, 0, level + 1))
    # Level by level, children grouped under their parents in the parents' order, in rank order (taken order).
    layout = sorted(range(len(taken)), key=lambda n: (taken[n][1], _position(taken, n)))
    index = {node: i for i, node in enumerate(layout)}
    return tuple(index[taken[n][0]] if taken[n][0] >= 0 else -1 for n in layout), tuple(layout)


def _position(taken: list[tuple[int, int]], node: int) -> tuple[int, ...]:
    """The ranks along ``node``'s path, each rank's order among its siblings: its place in a level-by-level layout
    that keeps siblings together and in rank order."""
    path = []
    while node >= 0:
        parent = taken[node][0]
        path.append(sum(1 for other in range(node) if taken[other][0] == parent))
        node = parent
    return tuple(reversed(path))


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    matrix = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            matrix[node] |= matrix[parent]
    return matrix


def chain_ancestors(length: int) -> torch.Tensor:
    """A causal chain (prompt prefill, catch-up tokens) as a tree."""
    return torch.ones(length, length, dtype=torch.bool).tril()


def with_prefix_chain(ancestors: torch.Tensor, prefix: int) -> torch.Tensor:
    """Prepend a causal chain of ``prefix`` nodes that every tree node descends from."""
    n = ancestors.shape[0]
    out = torch.zeros(prefix + n, prefix + n, dtype=torch.bool)
    out[:prefix, :prefix] = chain_ancestors(prefix)
    out[prefix:, :prefix] = True
    out[prefix:, prefix:] = ancestors
    return out


def attention_inputs(
    ancestors: torch.Tensor,
    valid: torch.Tensor,
    lengths: torch.Tensor,
    start: int,
    end: int,
    dtype: torch.dtype,
    max_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """4D additive mask, position ids and KV length for a forward over tree nodes [start, end).

    ancestors [N, N]: the tree; valid [B, N]: which nodes each row really has (padding nodes are invisible);
    lengths [B]: committed cache length per row, the tree's nodes sit in slots lengths + node index.
    Nodes [0, start) were written by earlier forwards of this step and are still tentative.
    ``max_length``: ``lengths.max()`` when the caller knows it on the host (reading it from a device waits).
    """
    batch = valid.shape[0]
    device = lengths.device
    visible = ancestors[start:end, :end].to(device, non_blocking=True)[None] & valid[:, None, :end]  # [B, T, end]
    own = torch.arange(start, end, device=device)
    visible[:, torch.arange(end - start, device=device), own] = True  # padding nodes see themselves: no NaN rows
    strict = ancestors[start:end, :end].to(device, non_blocking=True)[None] & valid[:, None, :end]
    strict[:, torch.arange(end - start, device=device), own] = False
    positions = lengths[:, None] + strict.sum(-1)
    kv_length = (int(lengths.max()) if max_length is None else max_length) + end
    relative = torch.arange(kv_length, device=device)[None, :] - lengths[:, None]  # [B, L]
    in_tree = (relative >= 0) & (relative < end)
    from_tree = visible.gather(2, relative.clamp(0, end - 1)[:, None, :].expand(batch, end - start, kv_length))
    allowed = (relative < 0)[:, None, :] | (in_tree[:, None, :] & from_tree)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None], positions, kv_length
