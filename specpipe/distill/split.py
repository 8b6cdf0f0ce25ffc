"""How a time budget split between the target's answers and training (--data-fraction), read off the finished run.

Few answers trained for many epochs are overfit; many answers seen once or twice are under-learned. Both budget
scales of the session-23 sweep peaked near BEST_EPOCHS (docs/eagle3.md 3k). The rates that set the epochs differ by
CPU and by release (session 47 made head training 1.5x faster on one CPU and moved the hour from ~6 to 10.7
epochs), so a run reports what its own rates say the share should have been. Notation, all measured by the run:

    a  answer tokens per second of the teacher phase
    t  training tokens per second of the training phase (its held-out evaluations included: they spend the budget)
    c  training tokens per answer token (prompt positions train too; held-out prompts do not)

A share f of a budget T gives a f T answer tokens, c a f T training tokens per epoch and t (1 - f) T tokens seen:

    epochs = t (1 - f) / (c a f)        so the share for E epochs is        f = t / (t + E c a)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

BEST_EPOCHS = 6.0
# Epochs inside which the measured optimum is flat, so no advice: 3k's points lost 0.013-0.022 at position 1 at 2.2-2.3
# epochs at both scales and 0.007-0.009 at 3.6-3.7; at 10.6 the demo's scale lost 0.017, but the hour on one CPU
# scored as well at 10.7 epochs as at 4.9 (3x, 3y: 0.650 and 0.657 held out, K=1 on code 0.707 and 0.687).
FLAT_EPOCHS = (3.5, 12.0)


@dataclass(frozen=True)
class Split:
    data_fraction: float  # the share of --minutes the answers had
    answer_tokens_per_s: float  # a
    train_tokens_per_s: float  # t
    train_tokens_per_answer_token: float  # c

    def epochs(self, data_fraction: Optional[float] = None) -> float:
        """Epochs a share gives at these rates (the run's own share by default)."""
        f = self.data_fraction if data_fraction is None else data_fraction
        return self.train_tokens_per_s * (1 - f) / (self.train_tokens_per_answer_token * self.answer_tokens_per_s * f)

    def share_for(self, epochs: float = BEST_EPOCHS) -> float:
        t, c, a = self.train_tokens_per_s, self.train_tokens_per_answer_token, self.answer_tokens_per_s
        return t / (t + epochs * c * a)

    def advice(self) -> Optional[str]:
        """One line when the run's epochs fell outside FLAT_EPOCHS, naming the share that gives BEST_EPOCHS here."""
        low, high = FLAT_EPOCHS
        if low <= self.epochs() <= high:
            return None
        better = self.share_for()
        return (f"split: {self.epochs():.1f} epochs at --data-fraction {self.data_fraction:g}; at this run's rates "
                f"(answers {self.answer_tokens_per_s:,.0f} tokens/s, training {self.train_tokens_per_s:,.0f}) "
                f"--data-fraction {better:.2f} gives ~{BEST_EPOCHS:g}, where both budget scales peaked "
                "for heads (docs/eagle3.md 3k)")

    def as_dict(self) -> dict:
        return {**{k: round(v, 4) for k, v in asdict(self).items()}, "epochs": round(self.epochs(), 2),
                "best_epochs": BEST_EPOCHS, "share_for_best_epochs": round(self.share_for(), 3)}


def measured_split(data_fraction: float, answer_tokens: int, answer_s: float, train_set_tokens: int,
                   tokens_seen: int, train_s: float) -> Optional[Split]:
    """The run's split from its counts, or None where a phase has nothing to measure (no answers generated or no
    training time: cached answers with no seconds recorded, a run stopped early)."""
    if min(answer_tokens, answer_s, train_set_tokens, tokens_seen, train_s) <= 0 or not 0 < data_fraction < 1:
        return None
    return Split(data_fraction, answer_tokens / answer_s, tokens_seen / train_s, train_set_tokens / answer_tokens)
