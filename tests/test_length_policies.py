"""The online length policy as a pure function of observed steps and a fixed cost table."""

from __future__ import annotations

import pytest

from decoding.costs import BatchCosts, CostTable
from decoding.length_policies import OnlinePolicy, StepRecord

ROWS = 16
# Verifying a depth-4 chain for every row costs 1.5x a plain step: drafting pays once about half of the
# drafted tokens are accepted.
COSTS = BatchCosts(one_row=CostTable([(1, 0.1), (5, 0.12)]), full=CostTable([(1, 1.0), (5, 1.5)]), full_rows=ROWS)


def run_policy(drafted: int, accepted: int, steps: int = 64, costs: BatchCosts = COSTS) -> list[int]:
    policy = OnlinePolicy(4, tree_size=lambda depth: 1 + depth, verify_cost=costs, draft_cost=None, draft_tokens=(2, 1))
    ids = [str(i) for i in range(ROWS)]
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
