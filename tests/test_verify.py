"""The acceptance rule and sampling transforms on hand-written logits and probabilities."""

import numpy as np
import pytest

from specpipe.contract.generation import SamplingConfig
from specpipe.speculative.sampling import sample, shape_probs
from specpipe.speculative.stats import SpecStats
from specpipe.speculative.verify import verify_greedy, verify_sampled


def onehot_logits(rows: list[int], vocab: int = 10) -> np.ndarray:
    logits = np.zeros((len(rows), vocab), dtype=np.float32)
    logits[np.arange(len(rows)), rows] = 5.0
    return logits


class TestGreedy:
    def test_perfect_match_takes_bonus(self):
        verdict = verify_greedy([3, 4, 5], onehot_logits([3, 4, 5, 6]))
        assert (verdict.accepted_len, verdict.next_token) == (3, 6)
        assert verdict.emitted([3, 4, 5]) == [3, 4, 5, 6]

    def test_early_mismatch_recovers_with_target_token(self):
        verdict = verify_greedy([3, 4, 5], onehot_logits([3, 7, 5, 6]))
        assert (verdict.accepted_len, verdict.next_token) == (1, 7)
        assert verdict.emitted([3, 4, 5]) == [3, 7]

    def test_all_rejected(self):
        verdict = verify_greedy([3, 4, 5], onehot_logits([9, 4, 5, 6]))
        assert verdict.emitted([3, 4, 5]) == [9]

    def test_no_drafts_is_plain_greedy(self):
        assert verify_greedy([], onehot_logits([2])).emitted([]) == [2]


class TestSampled:
    def test_point_mass_draft_equal_to_point_mass_target_is_always_accepted(self):
        p = np.eye(4)[[1, 2, 3]]  # target is certain of 1, 2 then 3
        verdict = verify_sampled([1, 2], None, p, np.random.default_rng(0))
        assert verdict.emitted([1, 2]) == [1, 2, 3]

    def test_token_the_target_never_emits_is_always_rejected(self):
        p = np.array([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
        q = np.array([[1.0, 0.0, 0.0, 0.0]])
        for seed in range(50):
            verdict = verify_sampled([0], q, p, np.random.default_rng(seed))
            assert verdict.accepted_len == 0 and verdict.next_token in (1, 2)

    def test_residual_excludes_overdrafted_tokens(self):
        # p = [.5, .5], q = [.9, .1]: on rejection of token 0 the residual max(0, p - q) is all on token 1.
        p = np.array([[0.5, 0.5], [0.5, 0.5]])
        q = np.array([[0.9, 0.1]])
        rng = np.random.default_rng(0)
        rejected = [verify_sampled([0], q, p, rng) for _ in range(4000)]
        assert all(v.next_token == 1 for v in rejected if v.accepted_len == 0)
        accept_rate = np.mean([v.accepted_len for v in rejected])
        assert abs(accept_rate - 0.5 / 0.9) < 0.04  # 5 sigma at n=4000

    def test_bonus_token_when_all_accepted(self):
        p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        q = np.array([[0.0, 1.0, 0.0]])
        assert verify_sampled([1], q, p, np.random.default_rng(1)).emitted([1]) == [1, 2]


class TestShaping:
    def test_greedy_is_one_hot(self):
        probs = shape_probs(np.array([[0.1, 3.0, 0.2]]), SamplingConfig(temperature=0))
        assert probs.tolist() == [[0.0, 1.0, 0.0]]

    def test_top_k_masks_all_but_k(self):
        probs = shape_probs(np.array([[1.0, 4.0, 3.0, 2.0]]), SamplingConfig(temperature=1.0, top_k=2))
        assert probs[0, 0] == 0 and probs[0, 3] == 0 and probs[0, 1] > probs[0, 2] > 0
        assert probs.sum() == pytest.approx(1.0)

    def test_top_p_keeps_smallest_set_reaching_mass(self):
        # Away from the boundaries: .5 + .3 = .8 holds well over .75 and well under .85.
        logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
        probs = shape_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
        np.testing.assert_allclose(probs[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0])
        probs = shape_probs(logits, SamplingConfig(temperature=1.0, top_p=0.85))
        np.testing.assert_allclose(probs[0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])

    def test_top_p_at_an_exactly_representable_boundary(self):
        # .5 + .25 == .75 exactly in binary; after log/exp the mass may land a hair on either side of it,
        # and the set that reaches .75 must still be {.5, .25} (TopPLogitsWarper's rule, within TOP_P_SLACK).
        logits = np.log(np.array([[0.125, 0.5, 0.25, 0.125]]))
        probs = shape_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
        np.testing.assert_allclose(probs[0], [0, 2 / 3, 1 / 3, 0])
        nudged = shape_probs(logits.astype(np.float32), SamplingConfig(temperature=1.0, top_p=0.75))  # float32 logits
        assert (nudged[0] > 0).tolist() == [False, True, True, False]
        # Not representable, but the same kind of boundary: .5 + .3 sums to 0.7999999999999999 after exp on
        # some CPUs (AVX2 numpy), and the two tokens still reach top_p .8.
        probs = shape_probs(np.log(np.array([[0.5, 0.3, 0.15, 0.05]])), SamplingConfig(temperature=1.0, top_p=0.8))
        assert (probs[0] > 0).tolist() == [True, True, False, False]

    def test_top_p_agrees_with_transformers_top_p_warper_on_random_logits(self):
        torch = pytest.importorskip("torch")
        from transformers.generation.logits_process import TopPLogitsWarper

        rng = np.random.default_rng(0)
        logits = rng.normal(scale=3.0, size=(200, 64)).astype(np.float32)  # ties have probability zero
        for top_p in (0.3, 0.7, 0.9, 0.99):
            ours = shape_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p)) > 0
            warped = TopPLogitsWarper(top_p)(None, torch.from_numpy(logits.copy()))
            assert (ours == torch.isfinite(warped).numpy()).all()

    def test_top_p_keeps_at_least_one_token(self):
        probs = shape_probs(np.array([[5.0, 0.0, 0.0]]), SamplingConfig(temperature=1.0, top_p=0.01))
        assert probs[0].tolist() == [1.0, 0.0, 0.0]

    def test_temperature_sharpens(self):
        logits = np.array([[1.0, 2.0]])
        hot = shape_probs(logits, SamplingConfig(temperature=2.0))[0, 1]
        cold = shape_probs(logits, SamplingConfig(temperature=0.5))[0, 1]
        assert cold > hot > 0.5

    def test_sample_follows_distribution(self):
        rng = np.random.default_rng(0)
        draws = [sample(np.array([0.2, 0.0, 0.8]), rng) for _ in range(2000)]
        assert draws.count(1) == 0 and abs(draws.count(2) / 2000 - 0.8) < 0.03


def test_stats_conventions():
    stats = SpecStats()
    stats.record(num_drafted=4, accepted_len=4, num_emitted=5)  # all accepted + bonus
    stats.record(num_drafted=4, accepted_len=1, num_emitted=2)  # one accepted + recovered
    stats.record(num_drafted=0, accepted_len=0, num_emitted=1)  # nothing drafted
    assert stats.acceptance_rate == 5 / 8
    assert stats.mean_accepted_len == 8 / 3  # includes the recovered/bonus token
    assert stats.per_position_acceptance == [1.0, 0.5, 0.5, 0.5]


def test_config_rejects_out_of_range_values():
    from specpipe.config import make_config
    from specpipe.contract.generation import GenerationConfig
    from specpipe.errors import UsageError

    for bad in ({"num_draft_tokens": 0}, {"max_new_tokens": 0}):
        with pytest.raises(UsageError):
            make_config(GenerationConfig, **bad)
    for bad in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(UsageError, match="--"):
            make_config(SamplingConfig, **bad)
