"""The acceptance rule on hand-made distributions: exact output laws by enumerating every draw."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.verification.acceptance import sibling_acceptance, verify_greedy, verify_sampled

VOCAB = 4


def _law(values: list[float]) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.float64)
    return tensor / tensor.sum()


P = _law([0.5, 0.25, 0.15, 0.10])
Q = _law([0.1, 0.2, 0.3, 0.4])
Q_PEAKED = _law([0.01, 0.01, 0.9, 0.08])


def _draw_probability(draws: tuple[int, ...], q: torch.Tensor, replacement: bool) -> float:
    """Probability of drawing ``draws`` in this order from q, with or without replacement."""
    remaining = q.clone()
    probability = 1.0
    for x in draws:
        if remaining.sum() <= 0 or remaining[x] <= 0:
            return 0.0
        probability *= float(remaining[x] / remaining.sum())
        if not replacement:
            remaining[x] = 0
    return probability


def _output_law(p, proposals, tokens, replacement) -> torch.Tensor:
    """Law of the emitted token for fixed candidates: accepted sibling, else a draw from the residual."""
    accept, residual = sibling_acceptance(p, proposals, tokens, replacement)
    law = torch.zeros(VOCAB, dtype=torch.float64)
    still_rejected = 1.0
    for x, probability in zip(tokens, accept):
        law[x] += still_rejected * probability
        still_rejected *= 1 - probability
    return law + still_rejected * residual.double()


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("q", [Q, Q_PEAKED, P], ids=["q", "q-peaked", "q=p"])
def test_sampled_siblings_reproduce_target_law_exactly(replacement: bool, width: int, q: torch.Tensor) -> None:
    total = torch.zeros(VOCAB, dtype=torch.float64)
    for draws in itertools.product(range(VOCAB), repeat=width):
        weight = _draw_probability(draws, q, replacement)
        if weight:
            total += weight * _output_law(P, [q] * width, list(draws), replacement)
    assert torch.allclose(total, P, atol=1e-6), (total, P)


@pytest.mark.parametrize("candidates", [[2], [2, 0], [3, 2, 1], [0, 1, 2, 3]])
def test_deterministic_candidates_reproduce_target_law_exactly(candidates: list[int]) -> None:
    """n-gram proposals: each candidate's law is a point mass on itself."""
    one_hot = [torch.nn.functional.one_hot(torch.tensor(x), VOCAB).double() for x in candidates]
    for replacement in (True, False):
        assert torch.allclose(_output_law(P, one_hot, candidates, replacement), P, atol=1e-6)


def test_rule_rejects_more_when_draft_disagrees() -> None:
    # The rule must depend on q: a candidate the target likes less than the draft is sometimes rejected.
    accept, residual = sibling_acceptance(P, [Q], [3], replacement=True)
    assert accept == [pytest.approx(0.10 / 0.4)]
    assert residual[3] == 0  # q over-proposed token 3, so the residual gives it nothing


def test_greedy_walks_the_argmax_path() -> None:
    # Root 5 -> children 7 (node 1) and 8 (node 2); node 1 -> child 9 (node 3).
    tokens, parents, valid = [5, 7, 8, 9], [-1, 0, 0, 1], [True] * 4
    argmax = [8, 0, 4, 6]  # target argmax at each node
    verdict = verify_greedy(tokens, parents, valid, argmax, root_argmax=5)
    assert verdict.path == [0, 2] and verdict.next_token == 4
    verdict = verify_greedy(tokens, parents, valid, [7, 9, 0, 6], root_argmax=5)
    assert verdict.path == [0, 1, 3] and verdict.next_token == 6
    # An invalid (padding) node is never accepted even if it matches.
    verdict = verify_greedy(tokens, parents, [True, False, True, True], [7, 9, 0, 6], root_argmax=5)
    assert verdict.path == [0] and verdict.next_token == 7


def test_sampled_tree_law_of_first_token_matches_target() -> None:
    """verify_sampled itself (random draws) on a one-level tree: empirical law of the first emitted token."""
    generator = torch.Generator().manual_seed(0)
    root = _law([0, 0, 0, 1]).float()  # the root-level token 3 is certain
    target_at_root = P.float()[None].repeat(3, 1)
    draft_at_root = Q.float()[None].repeat(3, 1)
    counts = torch.zeros(VOCAB)
    # The fewest draws that keep the test's power: faults in the rule for siblings drawn without replacement move
    # this law little (exactly, through the rule's own code: the residual updated after the first rejection only,
    # chi-square divergence D = 0.0054 from P; the rejected token left in q, D = 0.0052; no residual, D = 0.20). At
    # N draws the statistic is noncentral chi-square with lambda = N * D at 3 degrees of freedom, so N = 8,000 fails
    # each of them (p < 0.001) with probability >= 0.995 (scipy ``ncx2``); 1,200 would catch them 11-12% of the time.
    trials = 8000
    for _ in range(trials):
        draws = torch.multinomial(Q.float(), 2, replacement=False, generator=generator).tolist()
        verdict = verify_sampled([3, *draws], [-1, 0, 0], [True] * 3, target_at_root, root, draft_at_root,
                                 replacement=False, generator=generator)
        first = draws[verdict.path[1] - 1] if len(verdict.path) > 1 else verdict.next_token
        counts[first] += 1
    expected = P.float() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)  # 3 degrees of freedom, p = 0.001
