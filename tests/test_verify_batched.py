"""The batched, device-side rule (verify_batched.py) against the readable reference (acceptance.py), exactly.

The reference's random draws are replaced by the same uniforms the batched rule reads (node n's acceptance draw
at column n, the next token's at the last column, drawn by inverting the CDF), so both must give the same path
and next token for every row, and the same law for the next token.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

import decoding.verification.acceptance as acceptance
from decoding.model.attention import cpu_kernel
from decoding.model.execution import default_execution
from decoding.verification.sampling import WarpParams, argmax_logsumexp, warp_probs
from decoding.verification.tree import TreeTopology
from decoding.verification.verify_batched import sample_from, sample_siblings, sample_tokens, verify_batch

VOCAB = 5


class _ScriptedTorch(types.SimpleNamespace):
    """``torch`` as acceptance.py sees it, with rand/multinomial reading scripted uniforms: rand gives the uniform
    of the child being tried (the walk's order is followed from the sibling_acceptance calls), multinomial inverts
    the CDF at the last uniform, as the batched rule does."""

    def __init__(self, uniforms: list[float], parents: list[int], valid: list[bool]) -> None:
        super().__init__()
        self.uniforms, self.parents, self.valid = uniforms, parents, valid
        self.parent, self.tried = -1, []

    def __getattr__(self, name):
        return getattr(torch, name)

    def next_level(self) -> None:  # called when sibling_acceptance starts a new sibling set
        if self.tried:
            self.parent = self.tried[-1]  # the walk went on below the last child it tried (it was accepted)
        self.tried = []

    def rand(self, *args, generator=None):
        kids = [n for n, p in enumerate(self.parents) if p == self.parent and self.valid[n]]
        kid = kids[len(self.tried)]
        self.tried.append(kid)
        return torch.tensor(self.uniforms[kid])

    def multinomial(self, law, num, generator=None):
        return sample_from(law[None], torch.tensor([self.uniforms[-1]]))


def reference(monkeypatch, tokens, parents, valid, target_probs, root_probs, draft_probs, replacement, uniforms):
    scripted = _ScriptedTorch(uniforms, parents, valid)
    original = acceptance.sibling_acceptance

    def tracking(*args, **kwargs):
        scripted.next_level()
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(acceptance, "torch", scripted)
        patch.setattr(acceptance, "sibling_acceptance", tracking)
        return acceptance.verify_sampled(tokens, parents, valid, target_probs, root_probs, draft_probs,
                                         replacement, None)


TOPOLOGIES = [TreeTopology(2, 2, 1), TreeTopology(2, 2, 2), TreeTopology(3, 1, 1), TreeTopology(1, 3, 1),
              # static (recycling) trees: nodes with several children below the root level, alone or with a chain
              TreeTopology(0, 3, 1, (-1, -1, 0, 0, 1, 2)), TreeTopology(1, 3, 1, (-1, -1, -1, 0, 0, 1, 3, 3))]


def _case(topology: TreeTopology, seed: int, deterministic: bool):
    """A hand-made batch: random logits over a small vocabulary, tokens that often repeat (exercising the
    removal of rejected tokens), some padding nodes; the pending token drawn from the root law."""
    generator = torch.Generator().manual_seed(seed)
    size, batch = topology.size(topology.max_depth), 64
    logits = torch.randn(batch, size, VOCAB, generator=generator) * 2
    logits[:, :, 4] = -torch.inf if seed % 2 else logits[:, :, 4]  # a token outside the support, sometimes
    root_law = torch.softmax(torch.randn(batch, VOCAB, generator=generator) * 2, -1)
    tokens = torch.randint(0, VOCAB, (batch, size), generator=generator)
    tokens[:, 0] = torch.multinomial(root_law, 1, generator=generator).squeeze(-1)
    valid = torch.rand(batch, size, generator=generator) < 0.85
    valid[:, 0] = True
    draft = None if deterministic else torch.softmax(torch.randn(batch, size, VOCAB, generator=generator), -1)
    if draft is not None:
        draft[:, :, 3] = 0  # tokens the draft cannot propose: q(x) = 0 must mean "accept with probability 0"
        draft = draft / draft.sum(-1, keepdim=True)
    uniforms = torch.rand(batch, size + 1, generator=generator)
    return logits, root_law, tokens, valid, draft, uniforms


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-laws", "one-hot"])
@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_sampled_rows_match_the_reference_exactly(monkeypatch, topology, replacement, deterministic) -> None:
    seed = len(str(topology))
    logits, root_law, tokens, valid, draft, uniforms = _case(topology, seed, deterministic)
    batch = logits.shape[0]
    # Per-row warps, including top-k and top-p, identical on both sides.
    warp = WarpParams(
        temperature=torch.tensor([1.0, 0.7, 1.3, 1.0] * (batch // 4)),
        top_k=torch.tensor([0, 3, 0, 0] * (batch // 4)),
        top_p=torch.tensor([1.0, 1.0, 0.8, 1.0] * (batch // 4)),
    )
    verdict = verify_batch(logits, tokens, valid, topology, warp, root_law, draft, replacement, uniforms)
    parents = topology.parents[: logits.shape[1]]
    target = warp_probs(logits, warp)
    for row in range(batch):
        expected = reference(
            monkeypatch, tokens[row].tolist(), parents, valid[row].tolist(), target[row], root_law[row],
            draft[row] if draft is not None else None, replacement, uniforms[row].tolist(),
        )
        length = int(verdict.path_length[row])
        assert verdict.path[row, :length].tolist() == expected.path, row
        assert (verdict.path[row, length:] == -1).all()
        assert int(verdict.next_token[row]) == expected.next_token, row
        assert torch.allclose(verdict.next_law[row], expected.next_probs.float(), atol=1e-6), row
        parent_index = torch.tensor([max(p, 0) for p in parents])
        node_probs = target[row, parent_index, tokens[row]]
        assert torch.allclose(verdict.token_probs[row], node_probs, atol=1e-6)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_greedy_rows_match_the_reference_exactly(topology) -> None:
    """Greedy rows alone (no uniforms at all) and mixed with sampled rows in one batch."""
    logits, root_law, tokens, valid, draft, uniforms = _case(topology, seed=7, deterministic=False)
    argmax = logits.argmax(-1)
    # Make the drafts agree with the target often, so paths go deep.
    agree = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) < 0.7
    parent_index = torch.tensor([max(p, 0) for p in topology.parents[: logits.shape[1]]])
    tokens = torch.where(agree, argmax[:, parent_index], tokens)
    batch = logits.shape[0]
    for mixed in (False, True):
        temperature = torch.tensor([0.0, 1.0] * (batch // 2)) if mixed else torch.zeros(batch)
        warp = WarpParams(temperature, torch.zeros(batch, dtype=torch.long), torch.ones(batch))
        root_scores = torch.where((temperature == 0)[:, None], torch.randn(batch, VOCAB), root_law)
        verdict = verify_batch(logits, tokens, valid, topology, warp, root_scores, draft, False,
                               uniforms if mixed else None)
        for row in range(0, batch, 2 if mixed else 1):
            expected = acceptance.verify_greedy(tokens[row].tolist(), topology.parents[: logits.shape[1]],
                                                valid[row].tolist(), argmax[row].tolist(), int(tokens[row, 0]))
            length = int(verdict.path_length[row])
            assert verdict.path[row, :length].tolist() == expected.path
            assert int(verdict.next_token[row]) == expected.next_token
            assert torch.equal(verdict.next_law[row], logits[row, expected.path[-1]])
            expected_probs = torch.softmax(logits[row], -1)[parent_index, tokens[row]]
            assert torch.allclose(verdict.token_probs[row], expected_probs, atol=1e-6)
    assert int(verdict.path_length.max()) == topology.max_depth + 1  # some rows walked to the bottom


@pytest.mark.parametrize("vocab", [5, 49152])
def test_the_cpu_kernel_gives_torchs_argmax_and_logsumexp(vocab) -> None:
    """First index of the largest value (ties, NaN as largest, a row of -inf) and the log-sum-exp, as torch's."""
    if default_execution(torch.device("cpu")).kernels != "cpu":
        pytest.skip("SPECBATCH_KERNELS=reference: the reference path runs, without the kernels")
    assert cpu_kernel()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, vocab, generator=generator) * 4
    logits[0, 1, 1:4] = logits[0, 1].max() + 1  # a tie: the first index wins
    logits[0, 2] = float("-inf")
    logits[0, 3, 2] = float("nan")
    logits[1, 0, 0] = float("-inf")
    logits[1, 1] = logits[1, 1].round()  # many ties
    execution = default_execution(torch.device("cpu"))
    index, lse = argmax_logsumexp(logits, execution=execution)
    assert torch.equal(index, logits.argmax(-1))
    torch.testing.assert_close(lse, logits.logsumexp(-1), equal_nan=True, atol=1e-5, rtol=1e-6)
    alone, none = argmax_logsumexp(logits[1], with_logsumexp=False, execution=execution)
    assert none is None and torch.equal(alone, logits[1].argmax(-1))


def test_the_kernel_choice_of_argmax_logsumexp_is_the_execution_s(monkeypatch) -> None:
    """With reference kernels (or none said) torch's operations run, whether the C++ kernel is loaded or not."""
    import dataclasses

    from decoding.verification import sampling

    monkeypatch.setattr(sampling, "kernel_loaded", lambda: pytest.fail("the kernel was considered"))
    reference = dataclasses.replace(default_execution(torch.device("cpu")), kernels="reference")
    logits = torch.randn(3, 7)
    for execution in (reference, None):
        index, lse = argmax_logsumexp(logits, execution=execution)
        assert torch.equal(index, logits.argmax(-1)) and torch.equal(lse, logits.logsumexp(-1))


def test_inverse_cdf_sampling_is_exact_on_a_grid() -> None:
    law = torch.tensor([[0.5, 0.0, 0.25, 0.15, 0.10]])
    grid = 100_000
    u = (torch.arange(grid) + 0.5) / grid
    tokens = sample_from(law.expand(grid, -1), u)
    counts = torch.bincount(tokens, minlength=5).double() / grid
    assert counts[1] == 0  # probability 0 is never drawn
    assert torch.allclose(counts, law[0].double(), atol=2 / grid)
    assert int(sample_from(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([0.0]))) == 1  # unnormalized weights


def test_successive_draws_have_the_law_of_sampling_without_replacement() -> None:
    """The drafter's distinct children: P(x, y) = p(x) p(y) / (1 - p(x)), which is ``torch.multinomial``'s law
    without replacement, exactly on a grid of uniform pairs; past the support the first draw repeats."""
    law = torch.tensor([0.5, 0.0, 0.3, 0.2])
    grid = 400
    u = (torch.arange(grid) + 0.5) / grid
    pairs = torch.cartesian_prod(u, u)
    drawn = sample_tokens(law[None].expand(len(pairs), -1), pairs, replacement=False)
    frequency = torch.zeros(4, 4, dtype=torch.float64)
    frequency.index_put_((drawn[:, 0], drawn[:, 1]), torch.ones(len(pairs), dtype=torch.float64), accumulate=True)
    frequency /= len(pairs)
    exact = (law[:, None] * law[None] / (1 - law[:, None])).double().fill_diagonal_(0)
    assert torch.allclose(frequency, exact, atol=3 / grid)
    one_token = sample_tokens(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.3, 0.7, 0.9]]), False)
    assert one_token.tolist() == [[1, 1, 1]]
    with_replacement = sample_tokens(law[None].expand(len(pairs), -1), pairs, replacement=True)
    assert torch.equal(with_replacement, sample_from(law[None].expand(2 * len(pairs), -1), pairs.reshape(-1))
                       .view(-1, 2))


def test_siblings_follow_the_draw_semantics_of_sample_tokens() -> None:
    root = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.3, 0.3], [5.0, 1.0, 3.0, 2.0]])
    pending = torch.tensor([1, 1, 3, 0])
    greedy = torch.tensor([False, False, False, True])
    grid = [(a, b) for a, b in itertools.product([0.05, 0.5, 0.95], repeat=2)]
    for a, b in grid:
        uniforms = torch.tensor([[a, b]] * 4)
        distinct = sample_siblings(root, pending, greedy, 2, False, uniforms)
        # Without replacement: never the pending token, distinct while the support allows, then the first repeats.
        assert set(distinct[0].tolist()) == {0, 2}
        assert distinct[1].tolist() == [-1, -1]  # nothing left once the pending token is removed
        assert len(set(distinct[2].tolist())) == 2 and 3 not in distinct[2].tolist()
        assert distinct[3].tolist() == [2, 3]  # greedy: best scores other than the pending token
        drawn = sample_siblings(root, pending, greedy, 2, True, uniforms)
        assert drawn[0].tolist() == sample_from(root[:1].expand(2, -1), torch.tensor([a, b])).tolist()
        assert drawn[1].tolist() == [1, 1]


def _warp_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A row's warped law the plain way: temperature, then its top-k, then the smallest prefix reaching top_p."""
    x = logits.double() / (temperature if temperature > 0 else 1.0)
    if top_k > 0:
        x[x < x.sort(descending=True).values[min(top_k, len(x)) - 1]] = -torch.inf
    probs, kept, mass = x.softmax(-1), torch.zeros(len(x), dtype=torch.bool), 0.0
    for token in probs.argsort(descending=True).tolist():
        if top_p < 1 and mass >= top_p:
            break
        kept[token], mass = True, mass + float(probs[token])
    return x.masked_fill(~kept, -torch.inf).softmax(-1).float()


def test_warp_filters_each_row_by_its_own_parameters() -> None:
    """warp_probs over a batch, each row with its own temperature / top-k / top-p: every row equals the plain
    computation, whether the host facts are exact, loose upper bounds, or carried through a row selection."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3, 40, generator=generator) * 3
    params = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 0, 1.0), (0.9, 12, 0.6), (0.0, 0, 1.0)]
    warp = WarpParams(*(torch.tensor(column) for column in zip(*params)))
    assert warp.max_top_k == 12 and warp.nucleus_rows == (2, 4)
    expected = torch.stack([torch.stack([_warp_one(logits[row, node], *params[row]) for node in range(3)])
                            for row in range(6)])
    assert torch.allclose(warp_probs(logits, warp), expected, atol=1e-5)
    loose = WarpParams(warp.temperature, warp.top_k, warp.top_p, max_top_k=40, nucleus_rows=tuple(range(6)))
    assert torch.allclose(warp_probs(logits, loose), expected, atol=1e-5)
    picked = torch.tensor([4, 0, 2])
    assert warp[picked].nucleus_rows == (0, 2) and warp[1:4].nucleus_rows == (1,)
    assert torch.allclose(warp_probs(logits[picked], warp[picked]), expected[picked], atol=1e-5)
    assert torch.allclose(warp_probs(logits[1:4], warp[1:4]), expected[1:4], atol=1e-5)
