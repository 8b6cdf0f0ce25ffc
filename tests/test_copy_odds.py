"""An EAGLE-3 head's prompt-lookup copies under adaptive K (speculative/eagle3.py `CopyOdds`): each request learns
how its copies fare, and copies only as many tokens as pay (the choice against the head: tests/test_eagle3_decoding.py)."""

from __future__ import annotations

import pytest

from specpipe.contract.costs import StepCosts
from specpipe.speculative.adaptive import ExpectedSpeedupDraftLength
from specpipe.speculative.eagle3 import COPY_DECAY, COPY_FIRST_PRIOR, COPY_PRIOR_WEIGHT, COPY_STAY_PRIOR, CopyOdds

INT8_CPU = StepCosts(draft=0.12, verify_per_token=0.128, verify=(1.02, 1.19, 1.30, 1.46))  # the demo's, rounded
FP32_CPU = StepCosts(draft=0.05, verify_per_token=0.035)


def test_odds_start_from_the_priors_and_follow_the_judged_tokens():
    odds = CopyOdds()
    assert odds.first == pytest.approx(COPY_FIRST_PRIOR) and odds.stay == pytest.approx(COPY_STAY_PRIOR)
    w, d = COPY_PRIOR_WEIGHT, COPY_DECAY
    odds.observe(4, 0)  # only the first token was judged: the run-stay estimate learns nothing
    assert odds.first == pytest.approx(COPY_FIRST_PRIOR * w * d / (w * d + 1))
    assert odds.stay == pytest.approx(COPY_STAY_PRIOR)
    odds.observe(4, 2)  # tokens 1-3 judged: 1 and 2 accepted, 3 rejected; token 4 never judged
    assert odds.first == pytest.approx((COPY_FIRST_PRIOR * w * d * d + 1) / (w * d * d + d + 1))
    assert odds.stay == pytest.approx((COPY_STAY_PRIOR * w * d * d + 1) / (w * d * d + 2))
    odds.observe(3, 3)  # all judged and accepted: tokens 2 and 3 stayed
    assert odds.stay == pytest.approx((COPY_STAY_PRIOR * w * d ** 3 + d + 2) / (w * d ** 3 + 2 * d + 2))
    before = (odds.first, odds.stay)
    odds.observe(0, 0)  # nothing copied: nothing learned
    assert (odds.first, odds.stay) == before


def test_a_request_whose_copies_fail_learns_it_within_a_few_copies():
    odds = CopyOdds()
    for _ in range(3):
        odds.observe(4, 0)
    assert odds.first == pytest.approx(0.2053, abs=1e-4)  # the class docstring's example
    for _ in range(10):
        odds.observe(2, 2)
    assert odds.first > 0.85 and odds.stay > 0.85


@pytest.mark.parametrize("costs, first, stay, expected", [
    (INT8_CPU, COPY_FIRST_PRIOR, COPY_STAY_PRIOR, 3),  # 1.27, 1.33, 1.36, 1.30 tokens a step for 1..4 copied
    (FP32_CPU, COPY_FIRST_PRIOR, COPY_STAY_PRIOR, 4),  # nearly free verification: the whole match
    (INT8_CPU, 0.2, 0.3, 1),  # copies that seldom hold: one token
    (INT8_CPU, 0.9, 0.9, 4),  # copies that hold: the whole match
])
def test_the_copy_is_as_long_as_the_cost_rule_pays_for(costs, first, stay, expected):
    odds = CopyOdds()
    odds._first, odds._stay = [first, 1.0], [stay, 1.0]
    policy = ExpectedSpeedupDraftLength(costs, start=1, max_len=16)
    assert odds.length(4, policy.tokens_per_cost) == expected
    assert odds.length(2, policy.tokens_per_cost) == min(expected, 2)  # never more than the match holds
    assert odds.chances(3) == [first, stay, stay] and odds.chances(0) == []
