"""`build` with several --draft candidates: measure each on the engines just built, deploy the fastest or none.

Measurement: greedy, adaptive K with the step costs measured for each candidate at build, on the first few
packaged bench prompts (chat template applied). The target alone runs in the same loop, each prompt
through every row back to back (bench/harness.py `run_rows`), so load on a shared machine slows every row
alike and the ratios hold. speedup = the candidate's median tokens/s / the target alone's, as in `bench`.

Choice (`choose`, a pure function of the measurements): the fastest candidate when it is at least
`min_speedup` times as fast as the target alone, else "none": the target alone is deployed, and every
request decodes target-only. A draft that makes decoding slower is never deployed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from specpipe.bench.harness import SpecRow, run_rows, summarize
from specpipe.bench.prompts import load_prompt_sets
from specpipe.config import DraftChoiceConfig, DraftKind
from specpipe.deployment import bounded_generation_config
from specpipe.engines.base import Engine
from specpipe.manifest import CandidateMeasurement
from specpipe.speculative.adaptive import StepCosts, predicted_speedup
from specpipe.speculative.drafters import Drafter
from specpipe.speculative.generator import SpecGenerator

NONE = "none"  # the candidate that is always there: the target alone
MODEL_KINDS = ("model", "self")  # drafts with an engine of their own: they cost a step, so they can slow decoding


@dataclass
class Candidate:
    spec: str  # the --draft value
    kind: DraftKind
    drafter: Optional[Drafter]  # None for "none"
    costs: StepCosts  # measured on this machine for this candidate's engines
    # what was built, recorded with the measurement
    source: str
    weights_sha256: Optional[str] = None  # a draft checkpoint's
    build_timings_s: dict[str, float] = field(default_factory=dict)


def measure(target: Engine, candidates: Sequence[Candidate], tokenizer, eos_token_ids: Sequence[int],
            cfg: DraftChoiceConfig, *, max_draft_len: int,
            progress: Callable[[str], None] = lambda msg: None) -> list[CandidateMeasurement]:
    """One measurement per candidate, "none" (the target alone) first."""
    baseline = Candidate(NONE, "none", None, StepCosts(0.0, 0.0), source=NONE)
    rows = [_row(baseline, target, tokenizer, eos_token_ids, max_draft_len)]
    rows += [_row(c, target, tokenizer, eos_token_ids, max_draft_len) for c in candidates if c.kind != "none"]
    sets = load_prompt_sets([], list(cfg.choice_sets), cfg.choice_prompts)
    encode = rows[0].generator.encode
    prompts = [(p.id, encode(p.prompt, chat=_has_chat_template(tokenizer))) for s in sets for p in s.prompts]
    warmup = [prompts[i % len(prompts)][1] for i in range(cfg.warmup_prompts)]
    total, done = len(rows) * (len(prompts) + len(warmup)), 0
    progress(f"measuring {len(rows) - 1} candidates and the target alone on {len(prompts)} prompts, "
             f"{cfg.choice_tokens} new tokens each")

    def on_run(label: str, prompt_id: str) -> None:
        nonlocal done
        done += 1
        if label == rows[-1].label:  # a prompt went through every row
            progress(f"measuring the candidates: {done}/{total} runs")

    results = run_rows(rows, prompts, max_new_tokens=cfg.choice_tokens, warmup=warmup, on_run=on_run)
    by_spec = {c.spec: c for c in [baseline, *candidates]}
    records = []
    for row in rows:
        summary = summarize(row.label, row.kind, None, results[row.label], results[NONE])
        records.append(_record(by_spec[row.label], summary, max_draft_len))
    return records


def choose(measurements: Sequence[CandidateMeasurement], min_speedup: float) -> tuple[str, str]:
    """(the --draft value to deploy, why). "none" when no draft is at least `min_speedup` times as fast as the
    target alone. Ties go to the candidate given first."""
    drafts = [m for m in measurements if m.kind != "none" and m.speedup is not None]
    if not drafts:
        return NONE, "no draft candidate was measured: deploying the target alone"
    best = max(drafts, key=lambda m: m.speedup)
    if best.speedup >= min_speedup:
        return best.draft, (f"{best.draft} was the fastest candidate, {best.speedup:.2f}x the target alone "
                            f"(a draft is deployed from {min_speedup:.2f}x)")
    return NONE, (f"no draft was {min_speedup:.2f}x as fast as the target alone (best: {best.draft} at "
                  f"{best.speedup:.2f}x): deploying the target alone")


def _row(candidate: Candidate, target: Engine, tokenizer, eos_token_ids, max_draft_len: int) -> SpecRow:
    generator = SpecGenerator(target, candidate.drafter, tokenizer, eos_token_ids, candidate.costs)
    alone = candidate.drafter is None
    cfg = bounded_generation_config(max_draft_len, speculative=not alone)  # greedy, adaptive K: as served
    return SpecRow(candidate.spec, generator, cfg, "target-only" if alone else "speculative", None)


def _record(candidate: Candidate, summary: dict, max_draft_len: int) -> CandidateMeasurement:
    alone = candidate.kind == "none"
    acceptance = None if alone else summary["acceptance_rate"]
    predicted = None
    if candidate.kind in MODEL_KINDS and acceptance is not None:
        predicted = predicted_speedup(acceptance, candidate.costs, adaptive_ceiling(max_draft_len))
    return CandidateMeasurement(
        draft=candidate.spec, kind=candidate.kind, prompts=summary["prompts"], tokens_generated=summary["tokens_generated"],
        tokens_per_s=summary["tokens_per_s"], speedup=summary["speedup"], acceptance_rate=acceptance,
        mean_accepted_len=None if alone else summary["mean_accepted_len"], matches_target=summary["matches_target"],
        step_costs=None if alone else candidate.costs, predicted_speedup=predicted, source=candidate.source,
        weights_sha256=candidate.weights_sha256, build_timings_s=candidate.build_timings_s,
    )  # fmt: skip


def adaptive_ceiling(max_draft_len: int) -> int:
    """The largest K adaptive drafting tries on a deployment built for max_draft_len (as served)."""
    return bounded_generation_config(max_draft_len).max_draft_tokens


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))

