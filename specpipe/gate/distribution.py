"""Check 2, distribution equivalence under sampling: emitted tokens follow the target's exact p.

For each (context, temperature) case, n seeded requests each give the first two emitted tokens. Two
chi-square goodness-of-fit tests (goodness.py) compare them with p computed by the reference target
engine: the first token against p(. | context), and the second token, over the samples whose first token
was x* (the most likely non-EOS first token), against p(. | context, x*). K cycles through
`draft_lengths` so the second token comes from every path: a second draft (K >= 2), the bonus token
(K = 1), and a fresh step after a rejection.

Sample size: in-process, n is the smallest that detects a total-variation error of `tv` with `power`
at the Bonferroni level alpha / (number of tests), found by power analysis (scipy.stats.ncx2) on the
effective bins; the second test needs n * p(x*) samples of its own. Through a server each sample is a
whole request, so the budget is `server_samples` and the report states the error that budget detects.

Each run proves its own power: a planted wrong sampler, off by exactly the claimed tv in the least
detectable direction, is tested the same way `planted_replicates` times and must be rejected in at
least `planted_power_min` of them, or the check fails. (It is drawn from the planted distribution
directly: a planted decoder rule such as "always accept the draft" is wrong by TV(p, q), which is zero
for a self-draft and so proves nothing in general.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from specpipe.contract.generation import SamplingConfig
from specpipe.gate import goodness
from specpipe.gate.config import GateConfig, GateDistributionConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import Subject, Tick
from specpipe.speculative.sampling import shape_probs

NAME = "distribution_equivalence"
HEADROOM = 1.05  # the second test's sample count is random (n * p(x*) on average): plan 5% above it


def cases(cfg: GateDistributionConfig) -> list[tuple[str, float]]:
    return [(context, temperature) for context in cfg.contexts for temperature in cfg.temperatures]


def per_test_alpha(cfg: GateDistributionConfig) -> float:
    """Bonferroni: two tests per case share the family-wise false-alarm rate alpha."""
    return cfg.alpha / (2 * len(cases(cfg)))


def plan_samples(p_first: np.ndarray, p_second: np.ndarray, mode_prob: float, cfg: GateDistributionConfig) -> int:
    """Fewest samples (capped at max_samples) for both tests to detect tv with the configured power.

    Pooling depends on n and the required n on the bins, so iterate to a fixed point (a few rounds)."""
    alpha = per_test_alpha(cfg)
    n = 1000
    for _ in range(8):
        needed = []
        first = goodness.pool_bins(p_first, n, cfg.min_expected, cfg.max_bins)
        second = goodness.pool_bins(p_second, n * mode_prob, cfg.min_expected, cfg.max_bins)
        if first.df >= 1:
            needed.append(goodness.required_samples(first.df, cfg.tv, alpha, cfg.power))
        if second.df >= 1:
            needed.append(math.ceil(HEADROOM * goodness.required_samples(second.df, cfg.tv, alpha, cfg.power) / mode_prob))
        new = max(needed) if needed else n
        if new == n:
            break
        n = new
    return min(n, cfg.max_samples)


@dataclass
class Case:
    context: str
    temperature: float
    sampling: SamplingConfig
    p_first: np.ndarray  # [V] target's p(. | context)
    x_star: int  # the first token the second test conditions on
    p_second: np.ndarray  # [V] target's p(. | context, x_star)
    samples: int


def plan_cases(subject: Subject, gate: GateConfig, budget: int | None = None) -> list[Case]:
    """The target's exact distributions for every case, and n per case: `budget` (server modes) or the
    power analysis (in-process)."""
    cfg = gate.distribution
    target = subject.reference.target
    eos = subject.reference.generator.decoder.eos_token_ids
    out = []
    for context, temperature in cases(cfg):
        sampling = SamplingConfig(temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        context_ids = subject.encode(context)
        p_first = shape_probs(target.new_sequence().append(context_ids, last=1)[-1], sampling)[0]
        x_star = _mode(p_first, eos)
        p_second = shape_probs(target.new_sequence().append(context_ids + [x_star], last=1)[-1], sampling)[0]
        n = budget or plan_samples(p_first, p_second, float(p_first[x_star]), cfg)
        out.append(Case(context, temperature, sampling, p_first, x_star, p_second, n))
    return out


def check_distribution(
    subject: Subject, gate: GateConfig, planned: list[Case], tick: Tick, *, server_budget: bool = False
) -> CheckResult:
    """Sample every planned case, test both tokens, prove the power; `server_budget`: n was not planned."""
    cfg = gate.distribution
    alpha = per_test_alpha(cfg)
    rng = np.random.default_rng(cfg.seed)
    tests, failures, warnings = [], [], []
    started = time.perf_counter()
    total_samples = 0
    for case_index, case in enumerate(planned):
        context, temperature, x_star, n = case.context, case.temperature, case.x_star, case.samples
        p_first, p_second = case.p_first, case.p_second
        samples = subject.first_two(context, case.sampling, n, cfg.draft_lengths, cfg.seed + case_index * 1_000_003, tick)
        total_samples += n
        first = samples[samples[:, 0] >= 0, 0]  # a served request that returned nothing has -1
        second = samples[(samples[:, 0] == x_star) & (samples[:, 1] >= 0), 1]
        label = f"context {context!r} T={temperature:g}"
        for which, observed, p, given in (("first", first, p_first, None), ("second", second, p_second, x_star)):
            bins = goodness.pool_bins(p, len(observed), cfg.min_expected, cfg.max_bins)
            fit = goodness.chisquare_fit(observed, bins)
            detect = goodness.detectable_tv(fit.n, bins.df, alpha, cfg.power)
            planted_tv = max(cfg.tv, detect)  # the claim this run makes, and proves below
            planted = goodness.planted_rejection_rate(bins, fit.n, planted_tv, alpha, cfg.planted_replicates, rng)
            test = {
                "context": context, "temperature": temperature, "token": which, "given_first": given,
                "samples": fit.n, "effective_bins": fit.bins, "chi2": fit.statistic, "p_value": fit.p_value,
                "impossible_tokens": fit.impossible, "detectable_tv": detect, "planted_tv": planted_tv,
                "planted_rejection_rate": planted, "informative": bins.df >= 1 and fit.n > 0,
            }
            tests.append(test)
            name = f"{label} {which} token" + (f" given {given}" if given is not None else "")
            if not test["informative"]:
                why = f"no sample emitted {given} first" if fit.n == 0 else f"one effective bin at {fit.n} samples"
                warnings.append(f"{name}: not tested ({why})")
                continue
            if fit.impossible:
                failures.append(f"{name}: {fit.impossible} of {fit.n} emitted tokens have target probability 0")
            elif fit.rejected(alpha):
                failures.append(
                    f"{name}: emitted tokens do not follow the target's p: chi2 = {fit.statistic:.1f},"
                    f" {fit.bins} bins, {fit.n} samples, p = {fit.p_value:.3g} < alpha {alpha:.2g}"
                )
            if planted < cfg.planted_power_min:
                failures.append(
                    f"{name}: no proof of power: a sampler off by TV {planted_tv:.3f} was caught in only"
                    f" {planted:.0%} of {cfg.planted_replicates} replicates (< {cfg.planted_power_min:.0%})"
                )
            if detect > cfg.tv:
                reason = "server budget" if server_budget else f"max_samples {cfg.max_samples}"
                warnings.append(f"{name}: {fit.n} samples ({reason}) detect TV >= {detect:.3f}, not {cfg.tv:g}")

    informative = [t for t in tests if t["informative"]]
    if not informative:
        failures.append("no informative test: every context/temperature is (near-)deterministic; use other contexts")
    elapsed = time.perf_counter() - started
    worst = max((t["detectable_tv"] for t in informative), default=math.inf)
    min_p = min((t["p_value"] for t in informative), default=1.0)
    metrics = {
        "alpha_family": cfg.alpha,
        "alpha_per_test": alpha,
        "power": cfg.power,
        "tv_target": cfg.tv,
        "detectable_tv_worst": worst,
        "samples_total": total_samples,
        "samples_per_case": [t["samples"] for t in tests if t["token"] == "first"],
        "budget": "server_samples" if server_budget else "power analysis",
        "seconds": elapsed,
        "ms_per_sample": 1e3 * elapsed / max(total_samples, 1),
        "draft_lengths": cfg.draft_lengths,
        "min_expected_per_bin": cfg.min_expected,
        "planted_replicates": cfg.planted_replicates,
        "tests": tests,
    }
    summary = (
        f"{len(informative)} tests on {len(cases(cfg))} cases, {total_samples} samples, min p = {min_p:.3g}"
        f" (alpha/test {alpha:.2g}); detects TV >= {worst:.3f} at power {cfg.power:g}; planted sampler caught in"
        f" {min((t['planted_rejection_rate'] for t in informative), default=0.0):.0%}"
    )
    return CheckResult(NAME, "failed" if failures else "passed", summary, failures, warnings, metrics)


def _mode(p: np.ndarray, eos: set[int]) -> int:
    """Most likely token that does not end the sequence (a server stops at EOS: no second token)."""
    order = np.argsort(-p, kind="stable")
    return int(next((t for t in order if int(t) not in eos), order[0]))
