"""Turn logits into the distribution a request samples from: temperature, then top-k, then top-p.

The same function shapes the target's p and the draft's q, so the acceptance test compares like with
like (Leviathan et al. 2023 require both to be the *sampled* distributions).
"""

from __future__ import annotations

import numpy as np

from specpipe.contract.generation import SamplingConfig


def shape_probs(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """logits [n, V] -> probabilities [n, V] (float64). Greedy (temperature 0) gives one-hot rows."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 1:
        logits = logits[None, :]
    if sampling.greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(len(logits)), logits.argmax(-1)] = 1.0
        return probs
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        # [n, 1]: the k-th largest logit of each row; everything below it is masked.
        kth = np.partition(scaled, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(-1, keepdims=True)
    if sampling.top_p < 1.0:
        probs = _nucleus(probs, sampling.top_p)
    return probs


# Masses computed in float64 from float32 logits carry rounding of ~1e-16 per term (exp, normalise,
# cumsum over up to ~1e5 tokens: well under 1e-10). A cumulative mass within TOP_P_SLACK below top_p counts
# as reaching it, so a boundary that is exact in real numbers (0.5 + 0.3 == 0.8) does not flip with the
# CPU's exp/log rounding; 1e-9 of probability mass changes no sample anyone could measure.
TOP_P_SLACK = 1e-9


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one).

    The semantics of transformers' TopPLogitsWarper: a token is kept iff the tokens ranked above it hold
    less than top_p (within TOP_P_SLACK); the token whose addition reaches top_p is kept, the next is not.
    Example: probs [.5, .3, .15, .05], top_p .8 -> keep .5 and .3 (their mass reaches .8 exactly);
    top_p .81 -> keep .5, .3 and .15. Equal probabilities are ranked by token id (stable sort).
    """
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, -1)
    mass_before = np.cumsum(sorted_probs, -1)  # [n, V]: mass of the tokens ranked above each one
    mass_before = np.concatenate([np.zeros_like(mass_before[..., :1]), mass_before[..., :-1]], -1)
    keep_sorted = mass_before < top_p - TOP_P_SLACK
    keep_sorted[..., 0] = True
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(-1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a 1-D distribution by inverse CDF (one uniform per draw: reproducible per seed)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))
