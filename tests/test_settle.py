"""The settle step the decoder and the batching scheduler share (speculative/settle.py), on hand-written cases:
accepted drafts, the recovered token, EOS and max-token cuts, the statistics and the cache rollback; and a planted
off-by-one in the rollback that these cases catch."""

import numpy as np
import pytest

import specpipe.speculative.settle as settle_module
from specpipe.contract.costs import StepCosts
from specpipe.contract.generation import GenerationConfig
from specpipe.engines.base import EngineSequence
from specpipe.speculative.drafters import Proposal
from specpipe.speculative.settle import RequestState, cut_at_eos, settle
from specpipe.speculative.stats import SpecStats


class Row(EngineSequence):
    """A cache that only counts tokens: settle's rollback is what is under test."""

    def _forward(self, token_ids):
        return np.zeros((len(token_ids), 16), np.float32)

    def _truncate_cache(self, length):
        pass


def onehot_logits(rows, vocab=16):
    logits = np.zeros((len(rows), vocab), np.float32)
    logits[np.arange(len(rows)), rows] = 5.0
    return logits


def request_after_a_verify_call(drafts, *, eos=(), max_new_tokens=64, produced=0):
    """A greedy request whose context is [1, 2, 3] and whose row just ran [3, *drafts] (a verify call)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop_on_eos=bool(eos), speculative=False)
    request = RequestState([1, 2, 3], cfg, SpecStats(), set(eos))
    request.start(Row(), None, StepCosts(0.0, 0.0), max_seq_len=100)
    request.produced = produced
    request.row.append([1, 2, 3, *drafts])
    return request


def settled(drafts, target_choice, **kw):
    request = request_after_a_verify_call(drafts, **kw)
    emitted = settle(request, Proposal(list(drafts), None), onehot_logits(target_choice), draft_s=0.5, target_s=1.5)
    return request, emitted


def assert_settles_as_algorithm_1():
    # Early mismatch: drafts [5, 7, 9], the target's argmax per row [5, 7, 2, 4] -> emit 5, 7 and the target's 2.
    request, emitted = settled([5, 7, 9], [5, 7, 2, 4])
    assert emitted == [5, 7, 2] and request.context == [1, 2, 3, 5, 7, 2] and request.produced == 3
    assert len(request.row) == 5  # the context but its newest token, which the next call feeds
    assert (request.stats.drafted, request.stats.accepted, request.stats.emitted) == (3, 2, 3)
    assert (request.stats.draft_s, request.stats.target_s) == (0.5, 1.5)
    assert not request.finished
    # All accepted: the bonus token.
    request, emitted = settled([5, 7], [5, 7, 4])
    assert emitted == [5, 7, 4] and len(request.row) == 5
    # All rejected.
    request, emitted = settled([5, 7], [6, 7, 4])
    assert emitted == [6] and len(request.row) == 3
    # EOS (7) among the accepted drafts: the tokens after it are dropped, and the request is finished.
    request, emitted = settled([5, 7, 9], [5, 7, 9, 4], eos=(7,))
    assert emitted == [5, 7] and request.finished and request.stats.emitted == 2
    # max_new_tokens: 62 produced of 64 -> 2 more, then finished.
    request, emitted = settled([5, 7, 9], [5, 7, 9, 4], max_new_tokens=64, produced=62)
    assert emitted == [5, 7] and request.produced == 64 and request.finished


def test_settle_follows_algorithm_1_on_hand_written_steps():
    assert_settles_as_algorithm_1()


def test_a_planted_off_by_one_in_the_rollback_is_caught(monkeypatch):
    """Rolling the cache back to context + accepted_len + 1 (keeping the recovered token's slot) must fail."""
    monkeypatch.setattr(Row, "truncate", lambda self, length: EngineSequence.truncate(self, min(length + 1, len(self))))
    with pytest.raises(AssertionError):
        assert_settles_as_algorithm_1()


def test_a_planted_eos_cut_that_drops_the_eos_is_caught(monkeypatch):
    monkeypatch.setattr(settle_module, "cut_at_eos", lambda tokens, eos: next(
        (tokens[:i] or tokens[:1] for i, t in enumerate(tokens) if t in eos), tokens))
    with pytest.raises(AssertionError):
        assert_settles_as_algorithm_1()


def test_cut_at_eos():
    assert cut_at_eos([4, 2, 9, 2], {2}) == [4, 2]
    assert cut_at_eos([4, 9], {2}) == [4, 9]
