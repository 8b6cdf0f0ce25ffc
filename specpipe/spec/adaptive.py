"""How many tokens to draft each step: a fixed K, or a K that adapts to each request.

Adaptive drafting (the default) combines the two rules the peers use:
- K follows recent acceptance, as transformers' `num_assistant_tokens_schedule="heuristic"` does:
  +2 after a step whose drafts were all accepted, -1 otherwise, kept within [1, max_draft_tokens].
- A model draft stops early when it is unsure (transformers' `assistant_confidence_threshold`,
  default 0.4; llama.cpp's `p_min`): see `ModelDraftSession`. That only needs `draft_confidence_floor`.

Neither rule looks at the target's distribution before verification, so the acceptance rule stays exact:
they change how many tokens are drafted, never how a drafted token is accepted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from specpipe.config import GenerationConfig


class DraftLengthPolicy(ABC):
    """Owned by the decoder, one per request: `k` is how many tokens to ask the draft for next."""

    k: int

    @abstractmethod
    def observe(self, num_drafted: int, accepted_len: int) -> None:
        """Told after each verification how many drafted tokens there were and how many were accepted."""


class FixedDraftLength(DraftLengthPolicy):
    def __init__(self, k: int):
        self.k = k

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        pass


class AdaptiveDraftLength(DraftLengthPolicy):
    """transformers' heuristic: grow K by 2 after a fully accepted draft, shrink it by 1 after a rejection.

    A step that drafted nothing (prompt lookup found no match) says nothing about K and leaves it alone.
    Example, start 4, max 8, (drafted, accepted): (4,4) -> 6, (6,6) -> 8, (8,8) -> 8, (8,3) -> 7, (0,0) -> 7.
    """

    GROW, SHRINK = 2, 1

    def __init__(self, start: int, max_len: int, min_len: int = 1):
        if not 1 <= min_len <= start <= max_len:
            raise ValueError(f"need 1 <= min_len {min_len} <= start {start} <= max_len {max_len}")
        self.k, self.min_len, self.max_len = start, min_len, max_len

    def observe(self, num_drafted: int, accepted_len: int) -> None:
        if num_drafted == 0:
            return
        if accepted_len == num_drafted:
            self.k = min(self.k + self.GROW, self.max_len)
        else:
            self.k = max(self.k - self.SHRINK, self.min_len)


def draft_length_policy(cfg: GenerationConfig) -> DraftLengthPolicy:
    if cfg.draft_length == "fixed":
        return FixedDraftLength(cfg.num_draft_tokens)
    return AdaptiveDraftLength(start=cfg.num_draft_tokens, max_len=cfg.max_draft_tokens)


def draft_confidence_floor(cfg: GenerationConfig) -> float:
    """The top draft probability under which a model draft stops early; 0 (never stop) when K is fixed,
    so a fixed K drafts exactly K tokens (benchmarks sweep K)."""
    return cfg.min_draft_confidence if cfg.draft_length == "adaptive" else 0.0
