"""Check 4, latency and speed SLOs, measured at the configured concurrency.

Two runs on the same subject, same prompts, same settings: speculative as deployed (the deployment's own
draft length: adaptive K, and under load the batch plan, which may turn speculation off) and target-only
(num_draft_tokens = 0, the same engines). The SLO is the deployment's as users get it; the exactness checks
use a fixed K = num_draft_tokens instead. Warm-up requests are not measured. `concurrency` users
each send their next request when the last one ends; through a server each run is one level of
`specpipe loadtest` (specpipe.triton.load.run_level), so an SLO stated here holds at that load.

Conventions (genai-perf's): TTFT = request sent -> first token received; ITL = (request latency - TTFT) /
(output tokens - 1), one value per request; percentiles over requests. tokens_per_s = all output tokens /
wall time of the measured run (throughput at that concurrency). speedup = speculative tokens_per_s /
target-only tokens_per_s. acceptance_rate = accepted / drafted over all speculative requests, and
per-position acceptance as in specpipe.speculative.stats; acceptance_rate_min fails only when the drafts show
it (`acceptance_below`), since the batch plan may draft only a few tokens at the SLO's load.
"""

from __future__ import annotations

import numpy as np

from specpipe.gate.config import GateConfig
from specpipe.gate.report import CheckResult
from specpipe.gate.subjects import Subject, Tick, TimedRun

NAME = "latency_slo"

# threshold key -> (metric, "max" | "min")
THRESHOLDS = {
    "ttft_ms_p50_max": ("ttft_ms_p50", "max"),
    "ttft_ms_p95_max": ("ttft_ms_p95", "max"),
    "itl_ms_p50_max": ("itl_ms_p50", "max"),
    "itl_ms_p95_max": ("itl_ms_p95", "max"),
    "tokens_per_s_min": ("tokens_per_s", "min"),
    "speedup_min": ("speedup", "min"),
    "acceptance_rate_min": ("acceptance_rate", "min"),
}
# Thresholds on what a draft adds: a deployment without one (build measured every candidate draft slower than
# the target alone) has nothing to accept and runs at the target's speed by construction.
DRAFT_THRESHOLDS = ("speedup_min", "acceptance_rate_min")


def summarize(run: TimedRun) -> dict:
    ttft = [r.ttft_ms for r in run.requests]
    itl = [r.itl_ms for r in run.requests if r.itl_ms is not None]
    tokens = sum(r.num_tokens for r in run.requests)
    drafted = sum(r.drafted for r in run.requests)
    accepted = sum(r.accepted for r in run.requests)
    width = max((len(r.drafted_at) for r in run.requests), default=0)
    drafted_at = np.zeros(width)
    accepted_at = np.zeros(width)
    for r in run.requests:
        drafted_at[: len(r.drafted_at)] += r.drafted_at
        accepted_at[: len(r.accepted_at)] += r.accepted_at
    return {
        "requests": len(run.requests),
        "output_tokens": tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p95": _pct(ttft, 95),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p95": _pct(itl, 95),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position_acceptance": [float(a / d) if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
        "samples": {"ttft_ms": ttft, "itl_ms": itl},
    }


def check_latency(subject: Subject, gate: GateConfig, tick: Tick) -> CheckResult:
    cfg = gate.latency
    runs = {}
    for name, k in (("speculative", None), ("target_only", 0)):
        # None: the subject cannot run that side (an endpoint without a reference endpoint has no target-only run)
        run = subject.timed_run(gate.prompts, cfg.max_new_tokens, k, cfg.concurrency, cfg.requests, cfg.warmup_requests, tick)
        if run is not None:
            runs[name] = summarize(run)
    spec, base = runs["speculative"], runs.get("target_only")
    measured = {
        key: spec[key] for key in ("ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95", "tokens_per_s", "acceptance_rate")
    }
    measured["speedup"] = (spec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else 0.0) if base else None

    failures, warnings, enforced = [], [], {}
    alone = subject.without_draft()  # build deployed the target alone (no draft)
    for key, (metric, kind) in THRESHOLDS.items():
        limit = getattr(cfg, key)
        if limit is None:
            continue  # report only
        if alone and key in DRAFT_THRESHOLDS:
            warnings.append(f"{key} not applied: the deployment has no draft (build chose the target alone)")
            continue
        if measured[metric] is None:
            warnings.append(f"{key} not applied: no target-only run to compare with through this subject")
            continue
        if key == "acceptance_rate_min" and spec["drafted"] == 0 and subject.mode == "endpoint":
            warnings.append(f"{key} not applied: the endpoint reports no drafted tokens")
            continue
        enforced[key] = limit
        value = measured[metric]
        if key == "acceptance_rate_min" and value < limit and not acceptance_below(spec["accepted"], spec["drafted"], limit):
            warnings.append(f"acceptance {spec['accepted']}/{spec['drafted']} drafted tokens is below {key} {limit:g}, but "
                            f"too few drafts at concurrency {cfg.concurrency} to tell (the batch plan drafts where it pays)")
            continue
        if (kind == "max" and not value <= limit) or (kind == "min" and not value >= limit):
            failures.append(f"{metric} = {value:.4g} {'>' if kind == 'max' else '<'} {key} {limit:g}")
    metrics = {
        **measured,
        "thresholds": enforced,
        "report_only": [k for k in THRESHOLDS if k not in enforced],
        "concurrency": cfg.concurrency,
        "num_draft_tokens": None,  # as deployed
        "max_new_tokens": cfg.max_new_tokens,
        "where": subject.mode,
        "runs": runs,
    }
    m = measured
    summary = (
        f"concurrency {cfg.concurrency} ({subject.mode}): TTFT p50/p95 {m['ttft_ms_p50']:.1f}/{m['ttft_ms_p95']:.1f} ms,"
        f" ITL p50/p95 {m['itl_ms_p50']:.2f}/{m['itl_ms_p95']:.2f} ms, {m['tokens_per_s']:.1f} tok/s,"
        f" speedup {'n/a' if m['speedup'] is None else format(m['speedup'], '.2f') + 'x'}, acceptance {m['acceptance_rate']:.2f}; {len(enforced)} thresholds enforced"
    )
    return CheckResult(NAME, "failed" if failures else "passed", summary, failures, warnings, metrics)


def acceptance_below(accepted: int, drafted: int, minimum: float, alpha: float = 0.01) -> bool:
    """True when `accepted` of `drafted` draft tokens shows an acceptance rate below `minimum` (one-sided binomial
    test at `alpha`). Under load the batch plan drafts little (at 2 users a few tokens in a short run), and 0 of 2
    says nothing about a draft; a broken one shows at once: 0 of 100 at a 5% minimum has p = 0.006."""
    from scipy.stats import binomtest

    return drafted > 0 and binomtest(accepted, drafted, minimum, alternative="less").pvalue < alpha


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
