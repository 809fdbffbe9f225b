"""The online length policy as a pure function of observed steps and a fixed cost table."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from decoding.drafting.costs import BatchCosts, CostTable, LearnedCosts
from decoding.drafting.length_policies import OnlinePolicy, RowMemory, Sources, StepRecord, StepTiming

ROWS = 16
# Verifying a depth-4 chain for every row costs 1.5x a plain step: drafting pays once about half of the
# drafted tokens are accepted.
COSTS = BatchCosts(one_row=CostTable([(1, 0.1), (5, 0.12)]), full=CostTable([(1, 1.0), (5, 1.5)]), full_rows=ROWS)


def run_policy(drafted: int, accepted: int, steps: int = 64, costs: BatchCosts = COSTS) -> list[int]:
    # A one-candidate lookup tree: each level adds one token per row, drafting itself is free.
    policy = OnlinePolicy(4, Sources(root_width=1, lookup_width=1), verify_cost=costs, draft_cost=None)
    ids = [RowMemory() for _ in range(ROWS)]  # each row's memory, as its sequence keeps it
    plans = []
    for _ in range(steps):
        depth = int(policy.plan(ids)[0])
        plans.append(depth)
        policy.observe(StepRecord(ids, [depth] * ROWS, [min(drafted, depth)] * ROWS, [min(accepted, depth)] * ROWS))
    return plans


@pytest.mark.parametrize(("drafted", "accepted", "expected"), [(4, 4, 4), (4, 0, 0), (0, 0, 0), (1, 1, 1)])
def test_online_policy_settles_on_the_depth_that_pays(drafted: int, accepted: int, expected: int) -> None:
    # (0, 0): a lookup that never finds a match pays the batch's verify width for nothing, like a rejection;
    # (1, 1): chains that stop after one token repay one level, not four.
    plans = run_policy(drafted, accepted)
    settled = plans[len(plans) // 2 :]
    assert settled.count(expected) >= 0.8 * len(settled), plans


def test_batch_costs_are_measured_at_one_row_and_the_full_batch_and_linear_between() -> None:
    costs = BatchCosts(one_row=CostTable([(1, 1.0), (4, 2.0)]), full=CostTable([(1, 5.0), (4, 14.0)]), full_rows=9)
    assert costs(1, 1) == 1.0 and costs(1, 4) == 2.0
    assert costs(9, 1) == 5.0 and costs(9, 4) == 14.0
    assert costs(5, 4) == pytest.approx(8.0)  # halfway in rows
    assert costs(9, 2.5) == pytest.approx(9.5)  # halfway in tokens per row


def test_online_policy_does_not_speculate_for_a_gain_within_the_cost_models_error() -> None:
    # Every drafted token is accepted, but one level buys 2 tokens for 1.94x the time (+3%) and four levels
    # 5 tokens for 5x: not worth the risk of being slower than plain decoding.
    marginal = BatchCosts(one_row=COSTS.one_row, full=CostTable([(1, 1.0), (2, 1.94), (5, 5.0)]), full_rows=ROWS)
    plans = run_policy(4, 4, costs=marginal)
    settled = plans[len(plans) // 2 :]
    assert settled.count(0) >= 0.8 * len(settled), plans


def test_learned_costs_price_long_contexts_and_another_device_from_timed_forwards() -> None:
    # The calibration was timed at a short context on a faster machine; here every forward takes 1.5x as long and
    # reading a row's cache adds 40 us per cached token: after a few hundred timed steps the model knows both.
    prior = BatchCosts(one_row=CostTable([(1, 0.02), (8, 0.03)]), full=CostTable([(1, 0.1), (8, 0.2)]), full_rows=8)

    def truth(rows: int, tokens: int, context: int) -> float:
        return 1.5 * prior(rows, tokens) + 4e-5 * rows * context

    learned = LearnedCosts(prior)
    for step in range(400):
        rows, tokens, context = 1 + step % 8, 1 + step % 6, 64 + (step * 37) % 900
        learned.observe([(rows, tokens, context)], truth(rows, tokens, context))
    for rows, tokens, context in [(1, 1, 700), (8, 6, 700), (4, 2, 100)]:
        assert learned(rows, tokens, context) == pytest.approx(truth(rows, tokens, context), rel=0.1)
    assert prior(1, 1) < 0.5 * truth(1, 1, 700)  # what the calibration alone would have said


def test_draft_costs_follow_the_targets_learned_costs_until_a_draft_forward_is_timed() -> None:
    # Long contexts made the target's plain steps 3x their calibration: the first drafting decision must price the
    # draft's forwards as inflated too (at batch 64 on XSum the draft, priced at its 32-token calibration, looked
    # cheap, and one drafting step cost 2.7 s), then the draft's own timings take over.
    verify_prior = BatchCosts(one_row=CostTable([(1, 0.05), (6, 0.06)]), full=CostTable([(1, 0.16), (6, 0.68)]),
                              full_rows=64)
    draft_prior = BatchCosts(one_row=CostTable([(1, 0.012), (2, 0.015)]), full=CostTable([(1, 0.16), (2, 0.32)]),
                             full_rows=64)
    verify = LearnedCosts(verify_prior)
    draft = LearnedCosts(draft_prior, until_timed=verify)
    for _ in range(3):
        verify.observe([(64, 1, 415)], 0.51)
    inflation = verify(64, 1, 415) / verify_prior(64, 1)
    assert inflation > 2.5
    assert draft(64, 1, 415) == pytest.approx(draft_prior(64, 1) * inflation)
    for _ in range(20):
        draft.observe([(64, 1, 415)], 0.3)
    assert draft(64, 1, 415) == pytest.approx(0.3, rel=0.1)  # its own timings, not the target's inflation


def test_online_policy_does_not_draft_where_long_contexts_make_every_forward_slow() -> None:
    # Batch 64 on two CPU cores, rows of 150 to 900 cached tokens (XSum): plain steps take 3x the calibration, and
    # so do the draft's forwards. No option could pay even at full acceptance, so no row drafts or probes (priced
    # at its calibration, the draft looked cheap and 28 long rows drafted at depth 3 on the second step).
    verify_prior = BatchCosts(one_row=CostTable([(1, 0.048), (2, 0.05), (6, 0.05)]),
                              full=CostTable([(1, 0.164), (2, 0.267), (4, 0.472), (6, 0.681)]), full_rows=64)
    draft_prior = BatchCosts(one_row=CostTable([(1, 0.012), (2, 0.015)]), full=CostTable([(1, 0.165), (2, 0.319)]),
                             full_rows=64)
    policy = OnlinePolicy(5, Sources(root_width=1, model_width=1), verify_prior, draft_prior, capacity=64)
    ids = [RowMemory() for _ in range(64)]
    contexts = [150 + 12 * i for i in range(64)]
    for step in range(40):
        depths = policy.plan_rows(ids, [context + step for context in contexts]).depths.tolist()
        assert not any(depths), (step, depths)
        policy.observe(StepRecord(ids, depths, depths, [0] * 64,
                                  timing=StepTiming((64, 1, 415 + step), 0.51, [], 0.0)))


def test_online_policy_picks_the_drafter_that_pays_per_row() -> None:
    # One row is code that lookup continues (its model draft is useless), the other prose the model drafts well.
    verify = BatchCosts(one_row=CostTable([(1, 0.1), (11, 0.13)]), full=CostTable([(1, 0.1), (11, 0.13)]), full_rows=2)
    draft = BatchCosts(one_row=CostTable([(1, 0.02), (2, 0.021)]), full=CostTable([(1, 0.02), (2, 0.021)]),
                       full_rows=2)
    policy = OnlinePolicy(4, Sources(root_width=1, model_width=1, lookup_width=1), verify, draft, capacity=2)
    ids = [RowMemory(), RowMemory()]  # a code row and a prose row
    for _ in range(40):
        planned = policy.plan_rows(ids, [100, 100])
        model_depths, lookup_depths = planned.depths, planned.lookup_depths
        assert lookup_depths is not None
        planned_model, planned_lookup = model_depths.tolist(), lookup_depths.tolist()
        policy.observe(StepRecord(
            ids, planned_model, planned_model, [0, 0], lookup_planned=planned_lookup,
            model_matched=[0, planned_model[1]], lookup_matched=[planned_lookup[0], 0],
        ))
    planned = policy.plan_rows(ids, [100, 100])
    model_depths, lookup_depths = planned.depths, planned.lookup_depths
    assert lookup_depths is not None
    assert lookup_depths[0] >= 3 and model_depths[0] == 0  # code: lookup alone, deep
    assert model_depths[1] >= 3 and lookup_depths[1] == 0  # prose: the model draft alone, deep


def test_a_seeded_sampled_row_decides_from_its_own_past_alone() -> None:
    """Reproducible seeded sampling: a fixed row's depth ignores timings and every other row."""
    verify = BatchCosts(one_row=CostTable([(1, 0.1), (5, 0.12)]), full=CostTable([(1, 0.1), (5, 0.12)]), full_rows=4)

    def plans(noise: float) -> list[int]:
        policy = OnlinePolicy(4, Sources(root_width=1, lookup_width=1), verify, None, capacity=4)
        out = []
        seeded, others = RowMemory(), [RowMemory() for _ in range(3)]
        for step in range(30):
            ids = [seeded, others[step % 3]]
            depths = policy.plan_rows(ids, [50 + step, 10], fixed=[True, False]).depths
            out.append(int(depths[0]))
            planned = depths.tolist()
            # The other row's acceptance and the timings differ between the two runs; the fixed row's own do not.
            policy.observe(StepRecord(
                ids, planned, planned, [min(2, planned[0]), int(noise * planned[1])],
                timing=StepTiming((2, 3, 60.0), 0.1 * (1 + noise * step), [], 0.0), fixed=[True, False],
            ))
        return out

    assert plans(0.0) == plans(1.0)


def test_drafting_that_does_not_pay_in_measured_time_is_held_back_but_probed() -> None:
    """The cost model says depth 4 pays (every token accepted, 1.5x a plain step), but drafting costs time that
    no cost model sees (a lookup drafter is priced free): the realized goodput holds rows back to plain
    decoding, with rare probes; when drafting gets cheap again, it drafts again."""
    policy = OnlinePolicy(4, Sources(root_width=1, lookup_width=1), verify_cost=COSTS, draft_cost=None)
    ids = [RowMemory() for _ in range(ROWS)]  # each row's memory, as its sequence keeps it

    def run(steps: int, slowdown: float) -> list[int]:
        plans = []
        for _ in range(steps):
            depth = int(policy.plan(ids)[0])
            plans.append(depth)
            verify = COSTS(ROWS, 1 + depth)
            timing = StepTiming((ROWS, 1 + depth, 0.0), verify, [], verify * slowdown if depth else 0.0)
            policy.observe(StepRecord(ids, [depth] * ROWS, [depth] * ROWS, [depth] * ROWS, timing=timing))
        return plans

    assert run(8, 0.0)[-1] == 4  # drafting pays as predicted
    slow = run(256, 3.0)
    assert policy.held_back
    settled = slow[64:]
    assert 0 < sum(1 for d in settled if d) <= 0.05 * len(settled), slow  # plain, but still probed
    recovered = run(1024, 0.0)
    assert not policy.held_back and recovered[-64:].count(4) >= 0.8 * 64, recovered[-64:]


def test_a_single_rows_unlucky_steps_do_not_hold_back_drafting_that_pays() -> None:
    """One row: drafting at depth 4 pays (all accepted, a step costs 1.2x a plain one), then two steps reject
    everything (each realizes 0.83x of plain's goodput). Those steps are too little evidence to hold the row
    back; a sustained loss that only the clock sees (a drafting step 7x its modelled time, 0.6x of plain) is not."""
    policy = OnlinePolicy(4, Sources(root_width=1, lookup_width=1), verify_cost=COSTS, draft_cost=None)

    row = [RowMemory()]

    def step(accepted: int, slowdown: float = 0.0) -> int:
        depth = int(policy.plan(row)[0])
        verify = COSTS(1, 1 + depth)
        timing = StepTiming((1, 1 + depth, 0.0), verify, [], verify * slowdown if depth else 0.0)
        policy.observe(StepRecord(row, [depth], [depth], [min(accepted, depth)], timing=timing))
        return depth

    assert [step(4) for _ in range(30)][-1] == 4
    step(0), step(0)
    assert not policy.held_back and step(4) == 4
    slow = [step(4, slowdown=6.0) for _ in range(60)]
    assert policy.held_back and slow[:8] == [4] * 8 and slow[-8:] == [0] * 8, slow


def test_rows_never_probe_where_no_acceptance_could_make_drafting_pay() -> None:
    """Where even a fully accepted depth-4 chain is slower than plain decoding (its step costs 6x a plain one,
    for at most 5 tokens), rows decode plainly on every step, probe steps included; a cost table where it could
    pay (1.5x for 5 tokens) still has them draft or probe even when nothing is accepted."""
    hopeless = BatchCosts(one_row=CostTable([(1, 0.1), (5, 0.6)]), full=CostTable([(1, 1.0), (5, 6.0)]),
                          full_rows=ROWS)
    assert set(run_policy(4, 4, steps=256, costs=hopeless)) == {0}
    assert set(run_policy(4, 0, steps=256)) != {0}  # probes of drafting that could pay keep coming


def test_a_static_tree_is_priced_by_its_nodes_at_each_depth() -> None:
    """A recycling tree's levels widen (4, 8, 16 nodes): depth d costs the forward over all of its nodes."""
    seconds_per_token = CostTable([(1, 1.0), (101, 101.0)])
    verify = BatchCosts(one_row=seconds_per_token, full=seconds_per_token, full_rows=1)
    policy = OnlinePolicy(3, Sources(root_width=1, model_width=4, model_sizes=((4, 8, 16),)), verify, None)
    assert [policy.step_seconds(depth, 0, rows=1) for depth in range(4)] == pytest.approx([1, 5, 13, 29])
    chains = OnlinePolicy(3, Sources(root_width=1, model_width=4), verify, None)
    assert [chains.step_seconds(depth, 0, rows=1) for depth in range(4)] == pytest.approx([1, 5, 9, 13])


def run_cut_trees(seconds_per_token: float, steps: int = 200, full_depth: bool = False) -> list[tuple[int, int]]:
    """Two rows on a tree that can be cut to a chain, to 2-3 nodes a level or to its whole 4, 8, 16: each level
    agrees with probability 0.6, 0.75 or 0.9 in those cuts (a cut's nodes are in the larger ones: nested draws).
    Returns the (depth, size) planned for the rows over the last 32 steps."""
    rng = np.random.default_rng(0)
    verify = CostTable([(1, 1.0), (101, 1.0 + 100 * seconds_per_token)])
    sources = Sources(root_width=1, model_width=4, model_sizes=((1, 1, 1), (2, 3, 3), (4, 8, 16)),
                      cuts_at_full_depth=full_depth)
    policy = OnlinePolicy(3, sources, BatchCosts(verify, verify, full_rows=2), None, capacity=2)
    ids, agree = [RowMemory(), RowMemory()], [0.6, 0.75, 0.9]
    planned = []
    for step in range(steps):
        plan = policy.plan_rows(ids, [100, 100])
        assert plan.sizes is not None and plan.lookup_depths is None
        depths, sizes = plan.depths.tolist(), plan.sizes.tolist()
        draws = rng.random((2, 3))
        by_size = [[min(depth, next((j for j in range(3) if draw[j] >= p), 3)) for depth, draw in zip(depths, draws)]
                   for p in agree]
        own = [by_size[size][row] for row, size in enumerate(sizes)]
        policy.observe(StepRecord(ids, depths, depths, own, planned_size=sizes, size_matched=by_size))
        if full_depth:
            assert all(size == 2 or depth in (0, 3) for depth, size in zip(depths, sizes)), (depths, sizes)
        if step >= steps - 32:
            planned += list(zip(depths, sizes))
    return planned


def test_the_online_policy_cuts_a_tree_to_the_size_that_pays() -> None:
    """Where verifying more tokens costs nothing (a GPU at batch 1) the whole tree, 3 deep, pays best (3.44 tokens a
    step); where each token costs a fifth of a step, the chain does (2 deep: 1.96 tokens for 1.4 steps' time, against
    1.75 for 1.4 with the middle cut and 1.9 for 1.8 with the whole tree, each at its best depth)."""
    flat = run_cut_trees(0.0)
    assert Counter(flat).most_common(1)[0] == ((3, 2), pytest.approx(64, abs=8))
    steep = Counter(size for _, size in run_cut_trees(0.2))
    assert steep[0] >= 48 and steep[2] == 0, steep
    # Where only the deepest trees can be cut (graphs captured per cut, at the full depth), at 0.15 a token: the
    # chain 3 deep (2.18 tokens for 1.45 steps' time; the whole tree 1 deep, 1.9 for 1.6).
    full_depth = Counter(run_cut_trees(0.15, full_depth=True))
    assert full_depth[3, 0] >= 44, full_depth


def test_a_cut_larger_than_the_rows_own_learns_nothing_from_its_step() -> None:
    sources = Sources(root_width=1, model_width=2, model_sizes=((1, 1), (2, 2)))
    policy = OnlinePolicy(2, sources, COSTS, None, capacity=ROWS)
    before = [policy.batch_rates["model", size].accepted.copy() for size in range(2)]
    policy.observe(StepRecord([RowMemory()], [2], [2], [0], planned_size=[0], size_matched=[[0], [2]]))
    assert policy.batch_rates["model", 0].accepted[1:].sum() < before[0][1:].sum()  # a rejection at level 1, aged
    assert (policy.batch_rates["model", 1].accepted == before[1]).all()
