"""Chi-square goodness of fit with a stated power, and the planted wrong sampler that proves it.

Effect size. An error of total variation `tv` between the sampled distribution p' and the target's p
gives the test a noncentrality lambda = n * sum((p'_i - p_i)^2 / p_i) (Cohen's w^2 times n). By
Cauchy-Schwarz, (sum |p'_i - p_i|)^2 <= sum((p'_i - p_i)^2 / p_i) * sum(p_i), so lambda >= 4 * n * tv^2:
the least detectable error of size tv moves mass in proportion to p from one half of the bins (by mass)
to the other. Sample sizes are chosen for that worst case with scipy.stats.ncx2, so any error of at least
tv on the effective bins is detected with at least the stated power.

Bins. Tokens expecting fewer than `min_expected` samples share one pooled bin (the chi-square
approximation needs expected counts of about 5), and at most `max_bins` bins are kept (the most likely
tokens; a flat distribution would otherwise need many more samples for the same power). An error that
stays inside the pooled bin is invisible, which is why the report names the number of effective bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Bins:
    """Effective bins of a distribution over token ids. Bin b < len(tokens) is token tokens[b]; when
    `pooled`, the last bin holds every other token with p > 0."""

    tokens: np.ndarray  # [B_own] token ids with a bin of their own, most likely first
    probs: np.ndarray  # [B] expected share of each bin (sums to 1)
    support: np.ndarray  # [V] bool: p > 0 (a sample outside it is impossible under the target)
    pooled: bool

    @property
    def df(self) -> int:
        return len(self.probs) - 1

    def counts(self, samples: np.ndarray) -> tuple[np.ndarray, int]:
        """samples [n] token ids -> (counts per bin [B], number of samples the target gives p = 0)."""
        samples = np.asarray(samples, dtype=np.int64)
        impossible = int((~self.support[samples]).sum())
        possible = samples[self.support[samples]]
        index = np.full(len(self.support), len(self.probs) - 1 if self.pooled else -1, dtype=np.int64)
        index[self.tokens] = np.arange(len(self.tokens))
        return np.bincount(index[possible], minlength=len(self.probs)), impossible


def pool_bins(p: np.ndarray, n: float, min_expected: float, max_bins: int = 0) -> Bins:
    """Give each token expecting >= min_expected of n samples its own bin, pool the rest; if the pooled bin
    itself expects too few, the least likely named tokens join it until it does (or none are left).
    max_bins > 0 caps the bins (most likely tokens first): fewer degrees of freedom, more power per sample."""
    p = np.asarray(p, dtype=np.float64)
    support = p > 0
    order = np.argsort(-p, kind="stable")
    order = order[p[order] > 0]
    own = int((n * p[order] >= min_expected).sum())
    if 0 < max_bins < len(order):
        own = min(own, max_bins - 1)  # and one bin for the rest
    while True:
        rest = float(p[order[own:]].sum())
        if rest == 0.0 or n * rest >= min_expected or own == 0:
            break
        own -= 1
    tokens = order[:own]
    probs = p[tokens]
    pooled = own < len(order)
    if pooled:
        probs = np.append(probs, p[order[own:]].sum())
    return Bins(tokens=tokens, probs=probs / probs.sum(), support=support, pooled=pooled)


def critical_value(df: int, alpha: float) -> float:
    return float(stats.chi2.isf(alpha, df))


def power_at(n: float, df: int, tv: float, alpha: float) -> float:
    """Power of the test with n samples against the least detectable error of size tv."""
    if df < 1 or n <= 0:
        return 0.0
    return float(stats.ncx2.sf(critical_value(df, alpha), df, 4.0 * n * tv * tv))


def required_samples(df: int, tv: float, alpha: float, power: float) -> int:
    """Fewest samples that detect any total-variation error >= tv with the given power (df >= 1)."""
    if df < 1:
        raise ValueError("a test with a single bin has no power")
    lo, hi = 1, 1
    while power_at(hi, df, tv, alpha) < power:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if power_at(mid, df, tv, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo


def detectable_tv(n: float, df: int, alpha: float, power: float) -> float:
    """The smallest total-variation error that n samples detect with the given power (inf if none)."""
    if df < 1 or n <= 0:
        return math.inf
    crit = critical_value(df, alpha)
    hi = 1.0
    while stats.ncx2.sf(crit, df, hi) < power:
        hi *= 2
    from scipy.optimize import brentq

    lam = brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - power, 1e-9, hi)
    return math.sqrt(lam / (4.0 * n))


@dataclass(frozen=True)
class FitResult:
    n: int  # samples tested
    bins: int  # effective bins (df + 1)
    statistic: float
    p_value: float
    impossible: int  # samples of tokens the target gives probability 0

    def rejected(self, alpha: float) -> bool:
        return self.impossible > 0 or self.p_value < alpha


def chisquare_fit(samples: np.ndarray, bins: Bins) -> FitResult:
    """Pearson's chi-square test of samples against the bins' expected shares (scipy.stats.chisquare)."""
    counts, impossible = bins.counts(samples)
    n, possible = len(samples), int(counts.sum())
    if impossible:  # a token the target never emits: no statistic needed
        return FitResult(n, len(bins.probs), math.inf, 0.0, impossible)
    if bins.df < 1 or possible == 0:
        return FitResult(n, len(bins.probs), 0.0, 1.0, impossible)
    statistic, p_value = stats.chisquare(counts, possible * bins.probs)
    return FitResult(n, len(bins.probs), float(statistic), float(p_value), impossible)


def planted_probs(probs: np.ndarray, tv: float) -> np.ndarray:
    """The least detectable wrong distribution at total variation tv from `probs` (over bins).

    Bins are split into two halves of near-equal mass (largest first, each to the lighter half); the
    heavier half loses tv in proportion to p, the lighter one gains it. Example: probs [.5, .3, .2],
    tv .05 -> halves {.5} and {.3, .2} -> [.45, .33, .22].
    """
    probs = np.asarray(probs, dtype=np.float64)
    in_heavy = np.zeros(len(probs), dtype=bool)
    heavy_mass = light_mass = 0.0
    for b in np.argsort(-probs, kind="stable"):
        if heavy_mass <= light_mass:
            in_heavy[b], heavy_mass = True, heavy_mass + probs[b]
        else:
            light_mass += probs[b]
    if light_mass <= 0:
        raise ValueError("a single bin cannot carry a planted error")
    tv = min(tv, heavy_mass)  # a tiny budget may claim more than the heavy half holds: move all of it
    scale = np.where(in_heavy, 1.0 - tv / heavy_mass, 1.0 + tv / light_mass)
    return probs * scale


def planted_rejection_rate(
    bins: Bins, n: int, tv: float, alpha: float, replicates: int, rng: np.random.Generator
) -> float:
    """Share of `replicates` runs of n samples from the planted sampler that the test rejects."""
    if bins.df < 1 or n == 0:
        return 0.0
    counts = rng.multinomial(n, planted_probs(bins.probs, tv), size=replicates)  # [R, B]
    expected = n * bins.probs  # [B]
    statistic = ((counts - expected) ** 2 / expected).sum(-1)  # [R]
    return float((stats.chi2.sf(statistic, bins.df) < alpha).mean())
