"""The acceptance rule of speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Notation follows Leviathan et al.: p = target probabilities, q = draft probabilities, x_i = the i-th
drafted token, K = number of drafted tokens. The target scores the last context token and all K drafts
in one call, giving K+1 rows of p: row i is the target's distribution for the position of x_i, and row
K is the distribution after all drafts (the "bonus" position).

Names of the emitted tokens (as in vLLM):
- accepted: drafted tokens that passed the test, in order, up to the first rejection;
- recovered: the token sampled from norm(max(0, p - q)) at the first rejection;
- bonus: the token sampled from p[K] when all K drafts were accepted.
Every step emits `accepted_len` accepted tokens plus exactly one recovered-or-bonus token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from specpipe.speculative.sampling import sample, shape_probs

# Test-only switch: SPECPIPE_TEST_PLANTED_BIAS=always-accept plants the classic wrong rule (accept every
# draft) in verify_sampled, in this process and in a Triton server started from it, so tests can show that
# `specpipe validate` catches a biased decoder (tests/test_gate*.py). Never set it anywhere else.
PLANTED_BIAS_ENV = "SPECPIPE_TEST_PLANTED_BIAS"


@dataclass(frozen=True)
class Verdict:
    accepted_len: int  # how many drafted tokens were accepted (0..K)
    next_token: int  # recovered token (accepted_len < K) or bonus token (accepted_len == K)

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        return list(draft_tokens[: self.accepted_len]) + [self.next_token]


def verify_greedy(draft_tokens: list[int], target_logits: np.ndarray) -> Verdict:
    """Greedy decoding: accept drafts while they equal the target's argmax.

    draft_tokens: [K]; target_logits: [K+1, V].
    Example: drafts [5, 7, 9], target argmax per row [5, 7, 2, 4] -> accept 2 drafts, emit 5, 7, 2.
    """
    target_choice = np.asarray(target_logits).argmax(-1)  # [K+1]
    assert len(target_choice) == len(draft_tokens) + 1, "target must score K+1 positions"
    accepted_len = 0
    while accepted_len < len(draft_tokens) and draft_tokens[accepted_len] == target_choice[accepted_len]:
        accepted_len += 1
    return Verdict(accepted_len, int(target_choice[accepted_len]))


def verify_sampled(
    draft_tokens: list[int],
    q: Optional[np.ndarray],
    p: np.ndarray,
    rng: np.random.Generator,
) -> Verdict:
    """Speculative sampling: the emitted tokens are distributed exactly as the target's p.

    draft_tokens: [K]; q: [K, V] draft probabilities, or None when drafts carry no distribution (prompt
    lookup): then q is a point mass on each x_i, which keeps the rule exact. p: [K+1, V].
    """
    assert p.shape[0] == len(draft_tokens) + 1, "target must score K+1 positions"
    if os.environ.get(PLANTED_BIAS_ENV) == "always-accept":
        return Verdict(len(draft_tokens), sample(p[len(draft_tokens)], rng))
    # One test per draft in a Python loop, not vectorized over K as gpt-fast does: at V 49152 and K 1-8 the
    # vectorized tests (all K uniforms at once, the first rejection by flatnonzero) took 16-25 us a call against
    # the loop's 4-16 us (numpy's per-call overhead; 2-core EPYC Zen 4). The step's cost is elsewhere: shaping p
    # over the vocabulary (~1 ms) and the draw from it.
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if q is None else q[i, x]
        # Accept x_i with probability min(1, p(x)/q(x)).
        if q_x > 0 and rng.random() < min(1.0, p[i, x] / q_x):
            continue
        # Rejected: resample from the residual norm(max(0, p - q)).
        if q is None:
            residual = p[i].copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
            residual = p[i]
        return Verdict(i, sample(residual, rng))
    # All K accepted: the bonus token comes from the target's distribution after the last draft.
    return Verdict(len(draft_tokens), sample(p[len(draft_tokens)], rng))


def judge(draft_tokens: list[int], q: Optional[np.ndarray], target_logits: np.ndarray, sampling, rng: np.random.Generator) -> Verdict:
    """One step's verdict under the request's sampling settings (a SamplingConfig): greedy, or speculative
    sampling on the target's shaped probabilities. target_logits: [K+1, V]."""
    if sampling.greedy:
        return verify_greedy(draft_tokens, target_logits)
    return verify_sampled(draft_tokens, q, shape_probs(target_logits, sampling), rng)
