"""Prompt lookup (n-gram) drafting: no draft model, the context drafts itself.

Propose the tokens that followed the most recent earlier occurrence of the context's last n tokens
(prompt + tokens generated so far), trying n from ngram_max down to ngram_min; propose nothing when no
n-gram matches. Peers: transformers' `prompt_lookup_num_tokens`, vLLM's `ngram` method. Drafts carry no
distribution (Proposal.probs is None): they are point masses, which keeps speculative sampling exact.
Strong when the answer copies from its input: editing code, summarizing, extracting, rewriting.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from specpipe.config import field_default
from specpipe.contract.costs import DEFAULT_VERIFY_PER_TOKEN, StepCosts
from specpipe.contract.drafts import NgramConfig
from specpipe.contract.generation import GenerationConfig, SamplingConfig
from specpipe.speculative.drafters import Drafter, DraftSession, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(
        self,
        ngram_max: int = field_default(NgramConfig, "ngram_max"),
        ngram_min: int = field_default(NgramConfig, "ngram_min"),
    ):
        self.config = NgramConfig(ngram_max=ngram_max, ngram_min=ngram_min)  # validates: 1 <= min <= max

    @classmethod
    def from_config(cls, cfg: NgramConfig) -> "NgramDrafter":
        return cls(ngram_max=cfg.ngram_max, ngram_min=cfg.ngram_min)

    def new_request(self, cfg: Optional[GenerationConfig] = None) -> "NgramDraftSession":
        return NgramDraftSession(self.config.ngram_min, self.config.ngram_max)

    def default_costs(self) -> StepCosts:
        return StepCosts(draft=0.0, verify_per_token=DEFAULT_VERIFY_PER_TOKEN)


class NgramDraftSession(DraftSession):
    """One request's n-gram index, extended as the context grows (O(new tokens) per step, not O(context)).

    `follows[ngram]` is the position just after the n-gram's most recent occurrence among those indexed.
    An occurrence is indexed only once the token after it exists, so the context's own last n tokens are
    never their own match. Worked example, context [7, 8, 9, 7, 8] with n in 1..2:
        indexed: (7,)->1  (8,)->2 (7,8)->2  (9,)->3 (8,9)->3  (7,)->4 (9,7)->4   [(8,), (7,8) at 4: not yet]
        last 2-gram (7, 8) follows at 2 -> propose context[2:] = [9, 7, 8, ...]
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.indexed: list[int] = []  # the context `follows` describes
        self.follows: dict[tuple[int, ...], int] = {}

    def propose(self, context: Sequence[int], k: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal:
        context = list(context)
        self._index(context)
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            start = self.follows.get(tuple(context[-n:]))
            if start is not None:
                return Proposal(_copy_from(context, start, k), None)
        return Proposal.empty()

    def _index(self, context: list[int]) -> None:
        # The decoder only ever extends the context; anything else (a caller reusing the session for a
        # different or rolled-back context) rebuilds the index rather than proposing from stale positions.
        if len(context) < len(self.indexed) or context[: len(self.indexed)] != self.indexed:
            self.indexed, self.follows = [], {}
        # Occurrences ending at position `end` are indexed once context[end + 1] exists.
        for end in range(max(len(self.indexed) - 1, 0), len(context) - 1):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self.follows[tuple(context[end - n + 1 : end + 1])] = end + 1
        self.indexed = context


def _copy_from(context: list[int], start: int, k: int) -> list[int]:
    """Up to k tokens copied from context[start:].

    A match may overlap the suffix it matched (a repeated line, "a b a b a"); past the end of the context
    the copy continues from the tokens it has just drafted, i.e. the repetition is assumed to go on.
    Example: context [1, 2, 1, 2, 1], last 3-gram (1, 2, 1) follows at 3 -> context[3:] = [2, 1], then
    the draft's own tokens -> [2, 1, 2, 1] for k = 4.
    """
    draft: list[int] = []
    for i in range(k):
        source = start + i
        draft.append(context[source] if source < len(context) else draft[source - len(context)])
    return draft


def copy_ceiling(prompt: Sequence[int], output: Sequence[int]) -> float:
    """Tokens per target call that the best possible prompt-lookup drafter would reach on this output.

    Prompt lookup copies what followed an earlier occurrence of the context's last token(s). At every step
    an oracle drafts, among all spans that follow an earlier occurrence of the context's last token, the
    one agreeing longest with the true continuation; verification accepts that much and adds one token.
    No drafter that matches n >= 1 last tokens, whatever its n-gram rule or K, emits more per target call
    (and jumping farthest each step is optimal: how far a step can reach never decreases along the output),
    so this bounds its speedup even if verification were free.
    Worked example: prompt [5, 6, 7], output [5, 6, 7, 9]: 7 never occurred before, so step 1 emits 5;
    then 5 occurred at 0 and [6, 7] follows it: step 2 copies [6, 7] and adds 9 -> 4 tokens in 2 calls.
    """
    full, pos, calls = list(prompt) + list(output), len(prompt), 0
    while pos < len(full):
        longest = 0
        for start in range(1, pos):
            if full[start - 1] != full[pos - 1]:
                continue
            length = 0
            while pos + length < len(full) and full[start + length] == full[pos + length]:
                length += 1
            longest = max(longest, length)
        pos += min(longest + 1, len(full) - pos)
        calls += 1
    return len(output) / calls if calls else 0.0
