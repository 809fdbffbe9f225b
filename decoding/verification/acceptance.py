"""The acceptance rule: which drafted tree nodes the target keeps, and the token it adds after them.

A tree is given by per-node ``tokens`` and ``parents`` (-1 = child of the last verified position) in an order
where parents precede children. Distributions are "at" a node: the law of the token that follows it.

Temperature 0: walk down, keeping the first child equal to the target's argmax; then emit the argmax.
Temperature > 0: exact recursive rejection sampling over siblings (Yang et al. 2024; Jeon et al. 2024).
For each child x_i in order, accept with probability min(1, p(x_i) / q_i(x_i)); after a rejection the target
law becomes the residual norm(max(0, p - q_i)), and without replacement the rejected token also leaves q.
If every child is rejected, the next token is drawn from the residual; at an accepted leaf, from p. The output
then follows the warped target law exactly, whatever the proposals were, so long as each proposal was drawn
from the ``q`` it is verified against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted node indices, top-down
    next_token: int  # the token the target adds after the path (bonus or correction)
    next_probs: torch.Tensor | None  # the law next_token was drawn from (None when greedy)


def _children(parents: Sequence[int], valid: Sequence[bool]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if valid[node]:
            kids.setdefault(parent, []).append(node)
    return kids


def _walk(parents: Sequence[int], valid: Sequence[bool], choose: Callable[[int, list[int]], int | None]) -> list[int]:
    kids = _children(parents, valid)
    path: list[int] = []
    node = -1
    while node in kids and (chosen := choose(node, kids[node])) is not None:
        path.append(chosen)
        node = chosen
    return path


def verify_greedy(
    tokens: Sequence[int], parents: Sequence[int], valid: Sequence[bool], target_argmax: Sequence[int], root_argmax: int
) -> Verdict:
    """Greedy verification; ``target_argmax[n]`` is the target's argmax at node n, ``root_argmax`` at the root."""

    def best(node: int) -> int:
        return root_argmax if node < 0 else target_argmax[node]

    def choose(parent: int, kids: list[int]) -> int | None:
        return next((kid for kid in kids if tokens[kid] == best(parent)), None)

    path = _walk(parents, valid, choose)
    return Verdict(path, best(path[-1] if path else -1), None)


def _normalized(weights: torch.Tensor) -> torch.Tensor | None:
    total = weights.sum()
    return weights / total if total > 0 else None


def sibling_acceptance(
    p: torch.Tensor, proposals: Sequence[torch.Tensor], tokens: Sequence[int], replacement: bool
) -> tuple[list[float], torch.Tensor]:
    """The recursive rule for one set of siblings, as pure math.

    Returns, for each candidate in order, the probability that it is accepted given that every earlier one
    was rejected, and the residual target law left after all of them were rejected.
    ``proposals[i]`` is the law candidate i was drawn from (before removals).
    """
    p = p.float()
    removed = torch.zeros_like(p, dtype=torch.bool)
    accept: list[float] = []
    for x, proposal in zip(tokens, proposals):
        q = _normalized(proposal.float().masked_fill(removed, 0.0)) if not replacement else proposal.float()
        if q is None or q[x] <= 0:
            accept.append(0.0)  # a repeat of a rejected token: the residual already gives it probability 0
            continue
        accept.append(min(1.0, float(p[x] / q[x])))
        if accept[-1] >= 1.0:
            break  # accepted for sure: later siblings are never tried
        shrunk = _normalized((p - q).clamp(min=0.0))
        p = shrunk if shrunk is not None else p.masked_fill(torch.arange(len(p)) == x, 0.0)
        removed[x] = True
    accept += [0.0] * (len(tokens) - len(accept))
    return accept, p


def verify_sampled(
    tokens: Sequence[int],
    parents: Sequence[int],
    valid: Sequence[bool],
    target_probs: torch.Tensor,
    root_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    replacement: bool,
    generator: torch.Generator | None,
    point_mass: Sequence[bool] | None = None,
) -> Verdict:
    """Recursive rejection sampling over a candidate tree.

    target_probs [N, V]: warped target law at each node. root_probs [V]: the target-side law at the last verified
    position, which is also the proposal of root-level nodes (they were drawn from it). draft_probs [N, V]: the
    drafter's warped law at each node, the proposal of that node's children; None means deterministic proposals
    (n-gram lookup), i.e. q = one-hot of the proposed token. ``point_mass[n]``: node n alone was proposed
    deterministically (an n-gram sibling in a model's tree), so its q is one-hot: siblings of different drafters
    are each checked against their own proposal, residuals updated in turn.
    """
    residual: dict[int, torch.Tensor] = {}

    def proposal(node: int) -> torch.Tensor:
        parent = parents[node]
        if parent < 0:
            return root_probs
        if draft_probs is None or (point_mass is not None and point_mass[node]):
            return torch.nn.functional.one_hot(torch.tensor(tokens[node]), root_probs.shape[-1]).to(root_probs)
        return draft_probs[parent]

    def choose(parent: int, kids: list[int]) -> int | None:
        p = root_probs if parent < 0 else target_probs[parent]
        accept, residual[parent] = sibling_acceptance(
            p, [proposal(kid) for kid in kids], [tokens[kid] for kid in kids], replacement
        )
        for kid, probability in zip(kids, accept):
            if float(torch.rand((), generator=generator)) < probability:
                return kid
        return None

    path = _walk(parents, valid, choose)
    last = path[-1] if path else -1
    law = residual.get(last)  # set only where every child was rejected; an accepted leaf has none
    if law is None:
        law = (root_probs if last < 0 else target_probs[last]).float()
    next_token = int(torch.multinomial(law, 1, generator=generator))
    return Verdict(path, next_token, law)
