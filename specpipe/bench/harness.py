"""The benchmark harness: rows x prompts, measured in one run, summarized against the target-only row.

A row is anything with a label that turns prompt ids into a `Measurement`: the deployment's target
alone, its speculative decoder at a fixed or adaptive K, transformers' assisted generation on the
same pair. New axes plug in as rows: a quantized engine (issue 4) or another draft strategy such as
prompt lookup (issue 8) is a `SpecRow` over a SpecGenerator built from those parts.

Conventions (see specpipe.speculative.stats for the decoder's):
- rows run prompt by prompt, each prompt through every row back to back, so slow drift of a shared
  machine hits all rows alike; every row first runs untimed warm-up prompts.
- tokens_per_s: generated tokens / wall time including prefill, median over prompts;
  ttft_ms: median time to the first token; ms_per_token: median decode time per token after the first.
- acceptance_rate = accepted / drafted, and mean_accepted_len = emitted tokens per target step
  (bonus included), both pooled over all prompts.
- speedup = the geometric mean over prompts of each prompt's tokens/s against the target-only row's on the same
  prompt (`paired_speedup`): the two ran back to back, so a spell of the machine's bandwidth or load hits both sides of
  each ratio, and a prompt's own length or rate cancels. speedup_ci95: its 95% interval (Student's t on the log
  ratios, scipy.stats): how far the mean over prompts like these could lie, prompts differing among themselves.
  speedup_of_medians: the estimator before 2026-11-29 (the row's median tokens/s / the target-only row's median,
  unpaired: the median prompt of one row need not be the other's), kept to compare with earlier records; on the
  session-34 benches of one deployment it read 1.51x and 1.40x where the paired one read 1.53x and 1.49x
  (docs/benchmarks.md). The target-only row is the target as deployed without a draft: unpadded. A target that
  pads its 1-token steps to 2 rows so they score like verify rows (engines/onnxruntime.py `min_rows`) runs ~5-10%
  slower alone; that padded run is its own row (PADDED_BASELINE), the reference for matches_target.
- matches_target: runs whose token ids equal the target alone's on the same engine session (the padded row when
  there is one; greedy must give all of them).
- rounds (`bench --rounds R`): every prompt runs through every row R times, round after round, so a row's runs span R
  times the minutes and the machine's spells (this VM's fp32 speedup read 1.83x and 2.06x in two one-round benches of
  the same decoding two minutes apart, docs/eagle3.md 3y). A prompt's ratio is then the geometric mean of its rounds'
  (its rounds are one prompt measured again, not more prompts: the interval stays one over prompts), and
  speedup_by_round gives each round's own speedup, the spread between spells.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Protocol

from specpipe.contract.decoding import DecodingPolicy
from specpipe.contract.generation import GenerationConfig
from specpipe.speculative.generator import SpecGenerator
from specpipe.speculative.stats import calls_summary

BASELINE = "target-only"
PADDED_BASELINE = "target-only, padded"  # the target alone with its 1-token steps padded as the speculative rows'


@dataclass
class Measurement:
    prompt_id: str
    num_generated: int
    total_ms: float
    ttft_ms: float
    drafted: Optional[int] = None  # None: the row cannot say (the peer)
    accepted: Optional[int] = None
    steps: Optional[int] = None
    emitted: Optional[int] = None
    draft_ms: Optional[float] = None
    target_ms: Optional[float] = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    drafted_at: Optional[list[int]] = None  # per draft position: blocks that drafted it (SpecStats)
    accepted_at: Optional[list[int]] = None  # ... and that accepted it
    copied_drafted: int = 0  # drafted tokens prompt lookup copied where the head was unsure (SpecStats.copied_*)
    copied_accepted: int = 0
    call_s: dict[int, list[float]] = field(default_factory=dict, repr=False)  # SpecStats.call_s: decoding's target calls
    round: int = 0  # which pass over the prompts (run_rows' rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    @property
    def ms_per_token(self) -> Optional[float]:
        decode_ms = self.total_ms - self.ttft_ms
        return decode_ms / (self.num_generated - 1) if self.num_generated > 1 else None


class Row(Protocol):
    label: str
    kind: str  # "target-only" | "speculative" | "peer"
    k: Optional[int]  # fixed draft length; None for target-only and adaptive rows
    strategy: str  # what drafts: "target-only" | "draft-model" | "prompt-lookup" | "self-draft"
    peer: Optional[str]  # None for specpipe's own rows; the peer's name (specpipe.bench.peers) otherwise

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement: ...


class SpecRow:
    """One configuration of specpipe's own decoder (the same engines for every SpecRow of a deployment)."""

    peer = None

    def __init__(self, label: str, generator: SpecGenerator, cfg: GenerationConfig, kind: str, k: Optional[int],
                 strategy: str = "draft-model"):
        self.label, self.generator, self.cfg, self.kind, self.k = label, generator, cfg, kind, k
        self.strategy = strategy if kind != "target-only" else "target-only"

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        cfg = self.cfg.model_copy(update={"max_new_tokens": max_new_tokens})
        result = self.generator.generate(list(prompt_ids), cfg)
        stats = result.stats
        return Measurement(
            prompt_id="", num_generated=result.num_generated, total_ms=result.total_ms, ttft_ms=result.ttft_ms,
            drafted=stats.drafted, accepted=stats.accepted, steps=stats.steps, emitted=stats.emitted,
            draft_ms=stats.draft_s * 1e3, target_ms=stats.target_s * 1e3, token_ids=list(result.token_ids),
            drafted_at=list(stats.drafted_at), accepted_at=list(stats.accepted_at),
            copied_drafted=stats.copied_drafted, copied_accepted=stats.copied_accepted,
            call_s={n: list(seconds) for n, seconds in stats.call_s.items()},
        )


def spec_rows(generator: SpecGenerator, draft_lengths: list[int], adaptive: bool, label_prefix: str = "",
              decoding: DecodingPolicy = DecodingPolicy(max_draft_len=64),
              strategy: str = "draft-model", alone: Optional[SpecGenerator] = None) -> list[SpecRow]:
    """Target-only, fixed K for each K, and the adaptive default, all on one generator. `decoding` is the
    deployment's, so every row asks for its K as a served request does (the adaptive row within the build's
    max_draft_len). `strategy` names what the generator's drafter is (a peer row is compared with the row of its
    strategy). `alone`: the target-only row's generator when it is not `generator` (Deployment.target_alone: the
    unpadded target); `generator`'s own target-only run then follows as PADDED_BASELINE."""
    greedy = dict(stop_on_eos=True)
    request = decoding.request(0, **greedy)
    rows = [SpecRow(label_prefix + BASELINE, alone or generator, request, "target-only", None)]
    if alone is not None and alone is not generator:
        rows.append(SpecRow(label_prefix + PADDED_BASELINE, generator, request, "target-only", None))
    for k in draft_lengths:
        rows.append(SpecRow(f"{label_prefix}K={k}", generator, decoding.request(k, **greedy), "speculative", k, strategy))
    if adaptive:
        cfg = decoding.request(None, draft_length="adaptive", **greedy)
        rows.append(SpecRow(f"{label_prefix}adaptive", generator, cfg, "speculative", None, strategy))
    return rows


def summarize(label: str, kind: str, k: Optional[int], runs: list[Measurement], baseline: Optional[list[Measurement]],
              reference: Optional[list[Measurement]] = None) -> dict:
    """One row of the results table (conventions in the module docstring): speedup against `baseline`,
    matches_target against `reference` (the padded target alone, when there is one) or else `baseline`."""
    tps = [m.tokens_per_s for m in runs]
    per_token = [m.ms_per_token for m in runs if m.ms_per_token is not None]
    drafted = sum(m.drafted or 0 for m in runs)
    has_stats = all(m.drafted is not None for m in runs)
    steps = sum(m.steps or 0 for m in runs)
    row = {
        "label": label,
        "kind": kind,
        "k": k,
        "prompts": sum(m.round == 0 for m in runs),
        "runs": len(runs),
        "rounds": 1 + max((m.round for m in runs), default=0),
        "tokens_generated": sum(m.num_generated for m in runs),
        "tokens_per_s": statistics.median(tps) if tps else 0.0,
        "ttft_ms": statistics.median(m.ttft_ms for m in runs) if runs else 0.0,
        "ms_per_token": statistics.median(per_token) if per_token else None,
        "acceptance_rate": (sum(m.accepted or 0 for m in runs) / drafted if drafted else (0.0 if has_stats else None)),
        "mean_accepted_len": (sum(m.emitted or 0 for m in runs) / steps if steps else None) if has_stats else None,
        "draft_ms_share": _share(runs),
        "acceptance_by_position": _by_position(runs),
        # of the drafted tokens, those prompt lookup copied inside a head's steps, and their acceptance
        "copied_share": sum(m.copied_drafted for m in runs) / drafted if drafted else None,
        "copied_acceptance": (sum(m.copied_accepted for m in runs) / sum(m.copied_drafted for m in runs)
                              if any(m.copied_drafted for m in runs) else None),
        "speedup": None,
        "speedup_ci95": None,
        "speedup_of_medians": None,
        "speedup_per_prompt_median": None,
        "speedup_by_round": None,
        "matches_target": None,
    }
    if baseline:
        base_tps = statistics.median(m.tokens_per_s for m in baseline)
        row["speedup_of_medians"] = row["tokens_per_s"] / base_tps if base_tps else None
        ratios = prompt_ratios(runs, baseline)
        row["speedup_per_prompt_median"] = statistics.median(ratios) if ratios else None
        row["speedup"], row["speedup_ci95"] = paired_speedup(ratios)
        if row["rounds"] > 1:
            row["speedup_by_round"] = [paired_speedup(prompt_ratios([m for m in runs if m.round == r], baseline))[0]
                                       for r in range(row["rounds"])]
        row["matches_target"] = sum(m.token_ids == b.token_ids for m, b in zip(runs, reference or baseline) if m.token_ids)
    return row


def prompt_ratios(runs: list[Measurement], baseline: list[Measurement]) -> list[float]:
    """Each prompt's tokens/s in `runs` over its own in `baseline`, paired by prompt id and round where both carry ids
    (else by position: run_rows keeps one prompt order for every row); prompts either side could not time are left
    out. A prompt run in several rounds gives one ratio, the geometric mean of its rounds' (in the order prompts
    first appear in `runs`)."""
    if all(m.prompt_id for m in [*runs, *baseline]):
        by_key = {(b.prompt_id, b.round): b for b in baseline}
        pairs = [(m.prompt_id, m, by_key[(m.prompt_id, m.round)]) for m in runs if (m.prompt_id, m.round) in by_key]
    else:
        pairs = [(index, m, b) for index, (m, b) in enumerate(zip(runs, baseline))]
    logs: dict = {}
    for key, m, b in pairs:
        if m.tokens_per_s > 0 and b.tokens_per_s > 0:
            logs.setdefault(key, []).append(math.log(m.tokens_per_s / b.tokens_per_s))
    return [math.exp(sum(values) / len(values)) for values in logs.values()]


def paired_speedup(ratios: list[float], confidence: float = 0.95) -> tuple[Optional[float], Optional[list[float]]]:
    """(geometric mean of per-prompt ratios, its `confidence` interval), Student's t on the log ratios; the interval
    is None under two prompts, a point when every prompt's ratio is the same. (None, None) without ratios."""
    import numpy as np
    from scipy import stats

    if not ratios:
        return None, None
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    mean = float(np.exp(logs.mean()))
    if len(logs) < 2:
        return mean, None
    spread = float(stats.sem(logs))
    if spread == 0.0:
        return mean, [mean, mean]
    low, high = stats.t.interval(confidence, len(logs) - 1, loc=logs.mean(), scale=spread)
    return mean, [float(np.exp(low)), float(np.exp(high))]


def _by_position(runs: list[Measurement]) -> Optional[list[float]]:
    """Share of draft blocks that accepted position i (1-based i+1), over every prompt: chain acceptance, so
    position i counts only blocks whose positions before it were accepted too (SpecStats.accepted_at)."""
    if not any(m.drafted_at for m in runs):
        return None
    width = max(len(m.drafted_at or []) for m in runs)
    drafted, accepted = [0] * width, [0] * width
    for m in runs:
        for i, (d, a) in enumerate(zip(m.drafted_at or [], m.accepted_at or [])):
            drafted[i] += d
            accepted[i] += a
    return [a / d if d else None for a, d in zip(accepted, drafted)]


def _share(runs: list[Measurement]) -> Optional[float]:
    """Share of decode time spent drafting (None for rows that do not time their parts)."""
    draft = sum(m.draft_ms or 0 for m in runs)
    target = sum(m.target_ms or 0 for m in runs)
    return draft / (draft + target) if (draft + target) > 0 and any(m.draft_ms for m in runs) else None


def run_rows(rows: list[Row], prompts: list[tuple[str, list[int]]], *, max_new_tokens: int, warmup: list[list[int]],
             on_run: Callable[[str, str], None] = lambda label, prompt_id: None,
             rounds: int = 1) -> dict[str, list[Measurement]]:
    """Warm every row up, then run every prompt through every row, `rounds` times over (round after round). Returns
    measurements by row label, in (round, prompt) order. Each turn (a prompt in a round) starts with the next row in
    turn: a row that leaves the machine busy or its caches cold (a peer whose threads still spin) weighs on each of
    the others alike, not always on the one after it, and a prompt's rounds do not start with the same row."""
    for row in rows:
        for prompt_ids in warmup:
            row.run(prompt_ids, min(max_new_tokens, 32))
            on_run(row.label, "warm-up")
    results: dict[str, list[Measurement]] = {row.label: [] for row in rows}
    turn = 0
    for round_ in range(rounds):
        for prompt_id, prompt_ids in prompts:
            first = turn % len(rows) if rows else 0
            turn += 1
            for row in rows[first:] + rows[:first]:
                measurement = row.run(prompt_ids, max_new_tokens)
                measurement.prompt_id, measurement.round = prompt_id, round_
                results[row.label].append(measurement)
                on_run(row.label, prompt_id)
    return results


def measurement_dict(m: Measurement) -> dict:
    out = asdict(m)
    out.pop("token_ids")
    out["target_calls"] = calls_summary(out.pop("call_s"))
    out["tokens_per_s"] = m.tokens_per_s
    out["ms_per_token"] = m.ms_per_token
    return out
