"""Counters of one generation, and the conventions behind them.

- drafted: tokens the draft proposed; accepted: drafted tokens the target accepted.
- acceptance_rate = accepted / drafted (0 when nothing was drafted).
- copied_*: the steps, drafted and accepted tokens that prompt lookup drafted inside an EAGLE-3 head's steps (where
  the head was unsure, speculative/eagle3.py); they are counted in drafted and accepted too.
- per-position acceptance: for position i (0-based) of a draft block, accepted_at[i] / drafted_at[i];
  a position counts as drafted whenever the draft proposed at least i+1 tokens that step.
- mean_accepted_len = tokens emitted per target verification step, **including** the one recovered or
  bonus token (vLLM's convention): target-only decoding has 1.0, a perfect K-token draft has K+1.
- call_s: seconds of each target call after the request's first (the prompt's), by the tokens it added (1 + drafts):
  the verify curve as decoding pays it (engines/timing.py `in_decoding_curve`).
- ttft_ms: request start to the first emitted token; tokens_per_s: generated tokens / total wall time
  (prefill included); decode_tokens_per_s excludes the time to first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    target_s: float = 0.0
    copied_steps: int = 0
    copied_drafted: int = 0
    copied_accepted: int = 0
    call_s: dict[int, list[float]] = field(default_factory=dict)

    def time_call(self, tokens: int, seconds: float) -> None:
        self.call_s.setdefault(tokens, []).append(seconds)

    def record(self, num_drafted: int, accepted_len: int, num_emitted: int, copied: bool = False) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += accepted_len
        self.emitted += num_emitted
        if copied:
            self.copied_steps += 1
            self.copied_drafted += num_drafted
            self.copied_accepted += accepted_len
        while len(self.drafted_at) < num_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted_len)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_len": self.mean_accepted_len,
            "per_position_acceptance": self.per_position_acceptance,
            "copied_steps": self.copied_steps,
            "copied_drafted": self.copied_drafted,
            "copied_accepted": self.copied_accepted,
            "draft_ms": self.draft_s * 1e3,
            "target_ms": self.target_s * 1e3,
            "target_calls": calls_summary(self.call_s),
        }


def calls_summary(call_s: dict[int, list[float]]) -> dict[str, list[float]]:
    """{tokens a call added: [calls, median ms]}, keys as strings (JSON's)."""
    from statistics import median

    return {str(n): [len(s), round(median(s) * 1e3, 4)] for n, s in sorted(call_s.items()) if s}
