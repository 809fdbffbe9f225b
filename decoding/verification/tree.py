"""Candidate-tree topology and the topology-aware attention mask (Lu et al.: built once, sliced per step).

Nodes are laid out level by level. Level 0 holds the root-level nodes (the pending token, plus its
target-initialized siblings when ``candidate_init: target``); each deeper level holds one node per candidate.
Because parents always precede children and levels are contiguous, the tree of depth d is the prefix of the
largest tree, so its ancestor matrix is a slice of the largest one: dynamic draft lengths never rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeTopology:
    num_candidates: int  # width: candidate continuations per step
    max_depth: int  # drafted tokens per candidate
    root_width: int = 1  # 1 (draft-initialized) or num_candidates (target-initialized)

    def size(self, depth: int) -> int:
        """Number of nodes in the tree of the given depth."""
        return self.root_width + self.num_candidates * depth

    def level_slice(self, level: int) -> slice:
        start = 0 if level == 0 else self.size(level - 1)
        return slice(start, self.size(level))

    @cached_property
    def parents(self) -> list[int]:
        parents = [-1] * self.root_width
        for level in range(1, self.max_depth + 1):
            above = self.level_slice(level - 1)
            width_above = above.stop - above.start
            for candidate in range(self.num_candidates):
                # Candidates beyond the target-initialized roots (n-gram siblings) branch from the pending token.
                parents.append(above.start + (candidate if candidate < width_above else 0))
        return parents

    @cached_property
    def depths(self) -> torch.Tensor:
        depth = [0] * len(self.parents)
        for node, parent in enumerate(self.parents):
            depth[node] = 0 if parent < 0 else depth[parent] + 1
        return torch.tensor(depth)

    @cached_property
    def candidate_index(self) -> torch.Tensor:
        """Which candidate (0..width-1) each node belongs to; the shared draft-initialized root is 0."""
        index = [0] * self.root_width if self.root_width == 1 else list(range(self.root_width))
        return torch.tensor(index + list(range(self.num_candidates)) * self.max_depth)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool, row n marks n and its ancestors: the largest tree's mask."""
        return ancestor_matrix(self.parents)

    def sliced_ancestors(self, depth: int) -> torch.Tensor:
        n = self.size(depth)
        return self.ancestors[:n, :n]


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
