"""The online length policy as a pure function of observed steps and a fixed cost table."""

from __future__ import annotations

import pytest

from decoding.costs import CostTable
from decoding.length_policies import OnlinePolicy, StepRecord

ROWS = 16
# Verifying a depth-4 chain for every row costs 1.5x a plain step: drafting pays once about half of the
# drafted tokens are accepted.
COSTS = CostTable([(ROWS, 1.0), (ROWS * 5, 1.5)])


def run_policy(drafted: int, accepted: int, steps: int = 64) -> list[int]:
    policy = OnlinePolicy(4, tree_size=lambda depth: 1 + depth, verify_cost=COSTS, draft_cost=None, draft_tokens=(2, 1))
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
