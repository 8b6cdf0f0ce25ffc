"""Statistical checks that speculative sampling emits exactly the target's distribution.

Run the decoder many times from one fixed context with different seeds, keep the first two emitted
tokens, and compare their frequencies with the target's exact probabilities by a chi-square
goodness-of-fit test (scipy.stats). Used by tests with engines whose p is known exactly (BigramEngine).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats

from specpipe.contract.generation import GenerationConfig
from specpipe.speculative.decoder import SpeculativeDecoder
from specpipe.speculative.stats import SpecStats


def first_two_tokens(decoder: SpeculativeDecoder, context: Sequence[int], cfg: GenerationConfig, runs: int) -> np.ndarray:
    """[runs, 2]: the first two tokens emitted after `context`, one seeded request per run (seeds 0..runs-1)."""
    # Room for a whole first draft: the decoder never drafts more than it may emit.
    longest = max(cfg.num_draft_tokens, cfg.max_draft_tokens) + 2
    cfg = cfg.model_copy(update={"max_new_tokens": longest, "stop_on_eos": False})
    out = np.empty((runs, 2), dtype=np.int64)
    for seed in range(runs):
        cfg.seed = seed
        emitted: list[int] = []
        for tokens in decoder.decode(list(context), cfg, SpecStats()):
            emitted += tokens
            if len(emitted) >= 2:
                break
        out[seed] = emitted[:2]
    return out


def chi_square_p(observed: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of `observed` counts [V] against exact `probs` [V].

    Cells expected fewer than `min_expected` times are pooled into one (the chi-square approximation needs
    it); a token observed where p is 0 gives p-value 0 (an impossible token is a sure failure).
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * observed.sum()
    if np.any(observed[expected == 0] > 0):
        return 0.0
    small = expected < min_expected
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return 1.0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
