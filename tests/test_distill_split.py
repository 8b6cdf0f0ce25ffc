"""The split of a time budget between answers and training, read off a run (distill/split.py)."""

from __future__ import annotations

import pytest

from specpipe.distill.split import BEST_EPOCHS, FLAT_EPOCHS, Split, measured_split


def _session48() -> Split:
    # docs/eagle3.md 3x: 313.5k answer tokens in the answers' 0.38 of 55 minutes, 4.58M training tokens in 2,049 s,
    # 10.7 epochs over the training split (so 428k training tokens)
    return measured_split(0.38, answer_tokens=313_500, answer_s=0.38 * 55 * 60, train_set_tokens=428_000,
                          tokens_seen=4_580_000, train_s=2_049)


def _session49() -> Split:
    # docs/eagle3.md 3y: the same command at --data-fraction 0.5 (455.7k answer tokens in 1,650.8 s, 2,575,059
    # training tokens in 1,653.9 s over 521,270 training tokens: 4.94 epochs)
    return measured_split(0.5, answer_tokens=455_682, answer_s=1650.8, train_set_tokens=521_270, tokens_seen=2_575_059,
                          train_s=1653.9)


def test_the_rates_give_back_the_epochs_a_run_had_and_the_share_for_the_best():
    assert _session49().epochs() == pytest.approx(4.94, abs=0.05)
    assert _session49().advice() is None  # inside the flat band
    split = _session48()
    assert split.epochs() == pytest.approx(10.7, abs=0.05)  # what that run's record said
    better = split.share_for()
    assert split.epochs(better) == pytest.approx(BEST_EPOCHS)
    assert 0.38 < better < 0.6  # more answers, fewer epochs
    # a larger share of answers always gives fewer epochs
    assert split.epochs(0.3) > split.epochs(0.5) > split.epochs(0.7)


def test_the_advice_names_the_better_share_only_outside_the_flat_epochs():
    split = _session48()
    assert split.advice() is None  # 10.7 epochs: as good as 4.9 on that CPU (3x, 3y)

    def at(share: float) -> Split:
        return Split(share, split.answer_tokens_per_s, split.train_tokens_per_s, split.train_tokens_per_answer_token)

    low, high = FLAT_EPOCHS
    for share in (split.share_for(low + 0.01), split.share_for(), split.share_for(high - 0.01)):
        assert at(share).advice() is None
    for epochs in (low - 0.2, high + 0.5):  # too many answers for the training, too few
        line = at(split.share_for(epochs)).advice()
        assert line is not None and f"--data-fraction {split.share_for():.2f}" in line and f"{epochs:.1f} epochs" in line
    record = split.as_dict()
    assert record["epochs"] == pytest.approx(10.7, abs=0.05)
    assert record["share_for_best_epochs"] == round(split.share_for(), 3)


@pytest.mark.parametrize("counts", [dict(answer_s=0.0), dict(train_s=0.0), dict(answer_tokens=0), dict(tokens_seen=0)])
def test_a_phase_with_nothing_measured_gives_no_split(counts):
    values = dict(answer_tokens=1000, answer_s=10.0, train_set_tokens=1300, tokens_seen=8000, train_s=20.0)
    assert measured_split(0.5, **{**values, **counts}) is None
    assert measured_split(0.5, **values) is not None
