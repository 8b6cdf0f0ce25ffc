"""The greedy-equivalence rule shared by tests and the gate (speculative/equivalence.py), on hand-made logits."""

import numpy as np
import pytest

from specpipe.speculative.equivalence import NEAR_TIE_TOLERANCE, compare_greedy, near_tie_tolerance
from specpipe.testing.engines import BigramEngine

TOLERANCE = 1e-3


def chain_engine(tie_after: int, margin: float) -> BigramEngine:
    """Greedy text 0 -> 1 -> 2 -> 3 -> 4 -> 0 ...; after token `tie_after` tokens 5 and (tie_after + 1) % 5
    lead by `margin` (5 is the runner-up); every other runner-up trails by 10."""
    table = np.zeros((8, 8), dtype=np.float32)
    for token in range(8):
        table[token, (token + 1) % 5] = 10.0
    table[tie_after, 5] = 10.0 - margin
    return BigramEngine(table)


def test_identical_outputs_have_no_divergence():
    engine = chain_engine(2, 1e-4)
    assert compare_greedy(engine, [0], [1, 2, 3, 4], [1, 2, 3, 4], TOLERANCE) is None


def test_first_divergence_at_a_near_tie_is_allowed_and_later_tokens_are_not_compared():
    engine = chain_engine(2, 1e-4)  # after 0 -> 1 -> 2 the target is torn between 3 and 5
    divergence = compare_greedy(engine, [0], [1, 2, 5, 7, 7], [1, 2, 3, 4, 0], TOLERANCE)
    assert divergence.position == 2 and (divergence.speculative_token, divergence.target_only_token) == (5, 3)
    assert divergence.top2_margin == pytest.approx(1e-4, abs=1e-6) and divergence.near_tie


def test_divergence_with_a_clear_winner_is_a_real_mismatch():
    engine = chain_engine(2, 1e-4)
    divergence = compare_greedy(engine, [0], [1, 6, 3], [1, 2, 3], TOLERANCE)  # after 1, token 2 leads by 10
    assert divergence.position == 1 and divergence.top2_margin == pytest.approx(10.0) and not divergence.near_tie


def test_a_token_outside_the_tie_is_a_real_mismatch():
    engine = chain_engine(2, 1e-4)  # tied between 3 and 5; 6 trails by 10
    divergence = compare_greedy(engine, [0], [1, 2, 6], [1, 2, 3], TOLERANCE)
    assert divergence.top2_margin < TOLERANCE and divergence.speculative_gap == pytest.approx(10.0)
    assert not divergence.near_tie


def test_one_output_ending_early_diverges_where_it_ends():
    engine = chain_engine(2, 1e-4)
    divergence = compare_greedy(engine, [0], [1, 2], [1, 2, 3], TOLERANCE)
    assert divergence.position == 2 and divergence.speculative_token is None and divergence.near_tie


def test_margin_is_replayed_one_token_per_call_as_target_only_decoding_runs():
    engine = chain_engine(2, 1e-4)
    compare_greedy(engine, [0, 4, 0], [1, 2, 5], [1, 2, 3], TOLERANCE)
    assert engine.calls == 1 + 2 and engine.tokens_run == 3 + 2  # the prompt in one call, then one token each


def test_every_quant_mode_has_a_tolerance():
    from typing import get_args

    from specpipe.contract.quant import QuantMode

    assert set(get_args(QuantMode)) <= set(NEAR_TIE_TOLERANCE)
    assert near_tie_tolerance("unknown") == max(NEAR_TIE_TOLERANCE.values())
